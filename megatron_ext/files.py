"""Writing the files megatron-ext produces without losing anything: an output path must be a
regular file (or absent) before it is replaced, and a record is written beside its final name
and renamed over it, so a full disk or a kill leaves the previous version whole, never a
truncated one.

Renaming over a path replaces whatever is there: run as root, ``convert-checkpoint IN
/dev/full`` replaced the device node with a regular file (issue 34, item 6). So every output
is checked with ``lstat`` first (:func:`output_problem`): a link, a device, a FIFO, a socket
or a directory where a file is expected is refused, named.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from pathlib import Path


def output_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` may not be (re)written as a regular file (None: it is absent or one)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"output {path} cannot be examined: {exc.strerror}"
    if stat.S_ISREG(mode):
        return None
    kind = (
        "a symbolic link"
        if stat.S_ISLNK(mode)
        else "a directory"
        if stat.S_ISDIR(mode)
        else "a device"
        if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
        else "a FIFO"
        if stat.S_ISFIFO(mode)
        else "a socket"
        if stat.S_ISSOCK(mode)
        else "not a regular file"
    )
    return f"output {path} exists and is {kind}; give the name of a new or regular file"


def write_text_atomically(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, fsync it and rename it over ``path``
    (refused with :class:`OSError` when ``path`` is not a regular file; see
    :func:`output_problem`). On failure ``path`` keeps its previous content: a full disk
    leaves the old ``summary.json``, never a 0-byte one (issue 34, item 15)."""
    problem = output_problem(path)
    if problem is not None:
        raise OSError(errno.EEXIST, problem, str(path))
    target = Path(path)
    handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    os.close(handle)
    try:
        Path(temporary).write_text(text)
        descriptor = os.open(temporary, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def failure_reason(exc: OSError) -> str:
    """Why a write failed, in words: the system's text for its errno (ENOSPC: "No space left
    on device"), never a bare "OSError" when the error carries no message of its own."""
    if exc.strerror:
        return exc.strerror
    if exc.errno:
        return os.strerror(exc.errno)
    text = " ".join(str(exc).split())
    return text or f"{type(exc).__name__} without a reason"


def inside(root: Path, path: Path) -> bool:
    """Whether ``path`` resolves to ``root`` or below it (symlinks and '..' followed)."""
    root, path = Path(root).resolve(), Path(path).resolve()
    return path == root or root in path.parents
