"""``latest_checkpointed_iteration.txt`` written atomically.

megatron.training 0.19.2 records the newest checkpoint by rewriting the tracker file in place
(``open(tracker, 'w')``, then ``write``). A process killed between the two, or a reader that
looks in between, finds an empty tracker, which megatron refuses to load from
(``read_metadata``: "Invalid metadata file"). The save itself is safe (the tracker is written
only after every rank finished), so only this one write needs care: :class:`AtomicTrackerStorage`
stands in for ``megatron.training.checkpointing.maybe_msc`` (through which that module does its
file I/O), writes the tracker to a temporary file beside it, fsyncs and renames it over the old
one (atomic on POSIX file systems), and hands every other call to the original unchanged.
With Multi-Storage Client enabled (object stores) nothing changes.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from megatron_ext.errors import MegatronExtError

TRACKER_NAME = "latest_checkpointed_iteration.txt"


@contextlib.contextmanager
def atomic_text_file(path: str) -> Iterator[Any]:
    """``open(path, 'w')`` whose content replaces ``path`` in one rename when the block ends."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _msc_enabled() -> bool:
    from megatron.core.msc_utils import MultiStorageClientFeature

    return MultiStorageClientFeature.is_enabled()


class AtomicTrackerStorage:
    """``maybe_msc`` with an atomic write of the checkpoint tracker; everything else delegated."""

    def __init__(self, inner: Any):
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __dir__(self):
        return dir(self._inner)

    @property
    def open(self):
        inner_open = self._inner.open

        def open_(path, mode: str = "r", *args: Any, **kwargs: Any):
            if (
                mode == "w"
                and not args
                and not kwargs
                and str(path).endswith(TRACKER_NAME)
                and not _msc_enabled()
            ):
                return atomic_text_file(str(path))
            return inner_open(path, mode, *args, **kwargs)

        return open_


def tracker_problem(load_dir: str) -> str | None:
    """Why ``load_dir``'s tracker cannot be resumed from (None: it can, or there is none).

    megatron 0.19.2's ``read_metadata`` answers a tracker that is neither an iteration number
    nor ``release`` with ``sys.exit()``: status 0 on every rank, nothing trained, and a launcher
    that reports success. Checked before ``pretrain`` so the run fails, named."""
    path = os.path.join(str(load_dir), TRACKER_NAME)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, errors="replace") as f:
            text = f.read(200).strip()
    except OSError as exc:
        return f"{path} cannot be read: {exc.strerror}"
    if text == "release" or (text.isdigit() and text.isascii()):
        return None
    return (
        f"{path} holds {text[:40]!r}, not an iteration number or 'release': write the iteration "
        "of the newest iter_NNNNNNN directory there (e.g. 4), or remove the file to start afresh"
    )


class TrackerUnreadable(MegatronExtError, ValueError):
    """A tracker that names no iteration of a run (one line: the file, what it holds, the fix)."""


def read_iteration(ckpt_dir: str | os.PathLike) -> int | None:
    """The iteration ``ckpt_dir``'s tracker names, for resuming a run of our own.

    None when there is no tracker file (no save of the run finished). Anything else that is not
    an iteration number >= 1 (empty, ``release``, ``0``, text, a directory) raises
    :class:`TrackerUnreadable`: a run's own saves always write a positive iteration, so such a
    tracker was written by someone else and nothing can be concluded from it, least of all which
    saves are incomplete (issue 34, item 2)."""
    path = os.path.join(str(ckpt_dir), TRACKER_NAME)
    if not os.path.lexists(path):
        return None
    if os.path.islink(path) or not os.path.isfile(path):
        raise TrackerUnreadable(f"{path} is not a regular file; remove it or restore the tracker")
    try:
        with open(path, errors="replace") as f:
            text = f.read(64).strip()
    except OSError as exc:
        raise TrackerUnreadable(f"{path} cannot be read: {exc.strerror}") from None
    if text.isascii() and text.isdigit() and len(text) <= 12 and int(text) >= 1:
        return int(text)
    raise TrackerUnreadable(
        f"{path} holds {text[:40]!r}, not the iteration (>= 1) of a checkpoint of this run: "
        "write the iteration of its newest complete iter_NNNNNNN directory there (e.g. 4)"
    )
