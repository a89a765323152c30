"""An opt-in glibc malloc setting for CPU training: keep freed memory for reuse.

By default glibc serves every allocation above a (dynamic) threshold with a fresh ``mmap`` and
returns freed heap tops to the kernel, so each new multi-MiB activation tensor is first-touched
page by page: on the project's VM a fresh 4 MiB tensor costs ~600 minor page faults (~2 ms).
A training step allocates the same sizes every step, so keeping freed memory in the heap makes
those allocations reuse already-mapped pages. mHC's n-stream tensors are n times larger than a
plain layer's, so this matters more for mHC (measured in bench/README.md).

Process-wide and not undoable (glibc has no "restore the dynamic threshold"); the process keeps
its peak heap instead of returning it. Hence opt-in: nothing in megatron-ext calls it by itself.
The same can be had without code through the environment:
``MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=1073741824``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc caps the mmap threshold at 32 MiB on 64-bit systems.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Serve allocations up to 32 MiB from the heap and trim it only above 1 GiB free.
    Returns False (and changes nothing) where glibc's ``mallopt`` is not available."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        logger.info("keep_freed_memory: no glibc mallopt here; allocator left as it is")
        return False
    ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    if not ok:
        logger.info("keep_freed_memory: mallopt refused the setting; allocator left as it is")
    return ok


__all__ = ["keep_freed_memory"]
