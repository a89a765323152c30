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
