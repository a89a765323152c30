"""Writing the files megatron-ext produces without losing anything: an output path must be a
regular file (or absent) before it is replaced, and a record is written beside its final name
and renamed over it, so a full disk or a kill leaves the previous version whole, never a
truncated one.

Renaming over a path replaces whatever is there: run as root, ``convert-checkpoint IN
/dev/full`` replaced the device node with a regular file (issue 34, item 6). So every output
is checked with ``lstat`` first (:func:`output_problem`): a link, a device, a FIFO, a socket
or a directory where a file is expected is refused, named.

Reading is bounded the same way (issue 40, items 6 and 15): :func:`open_regular` opens only a
regular file, with ``O_NONBLOCK`` so that a FIFO named as a tracker, ``.metadata`` or recipe can
never block the opener, and checks what it opened (``fstat``, no race with a rename);
:func:`read_bounded` then reads at most a limit and one byte more, so ``/dev/zero`` or a
``/proc`` file that claims 0 bytes is refused by what was read, not by the size it claims.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from pathlib import Path
from typing import IO, Any

from megatron_ext.errors import MegatronExtError


def kind_of(mode: int) -> str:
    """What a file of this ``st_mode`` is, in words ("a FIFO", "a device", ...)."""
    if stat.S_ISREG(mode):
        return "a regular file"
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def irregular_kind(path: str | os.PathLike, directory_ok: bool = False) -> str | None:
    """What ``path`` is, in words, when it exists but is not a regular file (nor, with
    ``directory_ok``, a directory): a FIFO, socket or device a reader must not open. None when
    it is one, or cannot be examined (absent: the caller's own "no such file")."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode) or (directory_ok and stat.S_ISDIR(mode)):
        return None
    return kind_of(mode)


class NotRegularFile(MegatronExtError, OSError):
    """An input that is a FIFO, socket, device or directory where a file is read (one line).
    An OSError too, so every caller that reports a failed read reports this one."""

    kind = "not a regular file"


class InputTooLarge(MegatronExtError, OSError):
    """An input that holds more than the reader's bound (one line); an OSError too."""


def not_regular(path: str | os.PathLike, mode: int) -> NotRegularFile:
    exc = NotRegularFile(
        errno.EINVAL,
        f"{path} is {kind_of(mode)}, not a regular file; give a regular file",
        str(path),
    )
    exc.kind = kind_of(mode)
    return exc


def open_regular(path: str | os.PathLike, mode: str = "rb", **kwargs: Any) -> IO[Any]:
    """``open(path, mode)`` for reading, refused with :class:`NotRegularFile` unless ``path``
    (links followed) is a regular file. Never blocks: a FIFO is opened non-blocking and refused
    by ``fstat`` of what was opened; a socket is refused by ``stat`` before (it cannot be
    opened)."""
    if any(c in mode for c in "wax+"):
        raise ValueError(f"open_regular reads only, not mode {mode!r}")
    try:
        before = os.stat(path).st_mode
    except OSError as exc:
        raise type(exc)(exc.errno, exc.strerror, str(path)) from None
    if stat.S_ISDIR(before):  # the ordinary error every reader already names
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    if not stat.S_ISREG(before):
        raise not_regular(path, before)
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        now = os.fstat(descriptor).st_mode
        if not stat.S_ISREG(now):  # replaced between stat and open
            raise not_regular(path, now)
        os.set_blocking(descriptor, True)
        return os.fdopen(descriptor, mode, **kwargs)
    except BaseException:
        os.close(descriptor)
        raise


def read_bounded(path: str | os.PathLike, limit: int, what: str = "input") -> bytes:
    """At most ``limit`` bytes of the regular file ``path``; :class:`InputTooLarge` when it holds
    more (judged by what was read: a size the file claims is not trusted)."""
    with open_regular(path) as stream:
        data = stream.read(limit + 1)
    if len(data) > limit:
        raise InputTooLarge(
            errno.EFBIG,
            f"{path} holds more than {_size_words(limit)}, more than any {what}; "
            "is this the right file?",
            str(path),
        )
    return data


def read_text_bounded(path: str | os.PathLike, limit: int, what: str = "input") -> str:
    """:func:`read_bounded` decoded as UTF-8 (``UnicodeDecodeError`` on other bytes)."""
    return read_bounded(path, limit, what).decode("utf-8")


RECORD_LIMIT = 64 << 20
"""The JSON, YAML and tracker records beside a run or checkpoint (run.json, summary.json,
recipe.yaml, traces, latest_checkpointed_iteration.txt) hold kilobytes: a file far beyond this
is not one, and a directory given to ``--resume``, ``runs`` or ``checkpoint.load`` may be
anyone's."""


def read_record(path: str | os.PathLike, what: str = "record") -> str:
    """A run's or checkpoint's small text record: a regular file, read within
    :data:`RECORD_LIMIT` (OSError, or UnicodeDecodeError, otherwise)."""
    return read_text_bounded(path, RECORD_LIMIT, what)


def _size_words(limit: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if limit >= size and limit % size == 0:
            return f"{limit // size} {unit}"
    return f"{limit} bytes"


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
    return f"output {path} exists and is {kind_of(mode)}; give the name of a new or regular file"


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


def save_figure(figure: Any, path: str | os.PathLike, **savefig_kwargs: Any) -> Path:
    """``figure.savefig`` written beside ``path`` and renamed over it, so a full or read-only
    disk leaves neither a truncated image nor a temporary file; raises :class:`OSError`
    naming ``path`` (callers print :func:`cannot_write`)."""
    problem = output_problem(path)
    if problem is not None:
        raise OSError(errno.EEXIST, problem, str(path))
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(
        dir=target.parent, prefix=f".{target.name}.", suffix=target.suffix
    )
    try:
        with os.fdopen(handle, "wb") as stream:
            figure.savefig(stream, format=target.suffix.lstrip(".") or "png", **savefig_kwargs)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, target)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise OSError(exc.errno, failure_reason(exc), str(target)) from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    return target


def failure_reason(exc: OSError) -> str:
    """Why a write failed, in words: the system's text for its errno (ENOSPC: "No space left
    on device"), never a bare "OSError" when the error carries no message of its own."""
    if exc.strerror:
        return exc.strerror
    if exc.errno:
        return os.strerror(exc.errno)
    text = " ".join(str(exc).split())
    return text or f"{type(exc).__name__} without a reason"


# The errors that say the disk (not the input) is the problem: full, over quota, too large a
# file, read-only, not permitted.
WRITE_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM}
)


# Of those, the ones only a disk (never an input's permissions) gives.
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})


def is_write_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it was raised from) is a disk refusing a write."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in WRITE_ERRNOS:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def write_errno(exc: BaseException) -> OSError | None:
    """The first :func:`is_write_failure` error in ``exc``'s chain (None: none)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in WRITE_ERRNOS:
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def cannot_write(path: str | os.PathLike, exc: OSError) -> str:
    """The one line for a write that failed: ``cannot write PATH: No space left on device``."""
    return f"cannot write {path}: {failure_reason(exc)}"


def inside(root: Path, path: Path) -> bool:
    """Whether ``path`` resolves to ``root`` or below it (symlinks and '..' followed)."""
    root, path = Path(root).resolve(), Path(path).resolve()
    return path == root or root in path.parents
