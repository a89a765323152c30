"""One run per run directory: an exclusive ``flock`` on ``RUN_DIR/.lock``, held for the whole
run, so a second ``megatron-ext run`` with the same ``--run-dir`` is refused before it writes
anything instead of both passing while overwriting each other's logs, metrics and summary.
The kernel drops the lock when the process ends, however it ends; no stale lock remains."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from megatron_ext.errors import MegatronExtError

LOCK_NAME = ".lock"


class RunDirectoryBusy(MegatronExtError, RuntimeError):
    """Another live process holds the run directory, or it cannot be created or locked."""


@contextlib.contextmanager
def holding(run_dir: Path) -> Iterator[None]:
    """Hold ``run_dir`` (created if needed) for the duration of the block."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise RunDirectoryBusy(
            f"cannot use run directory {run_dir}: {exc.strerror or exc}; choose another "
            "--run-dir / --runs-root"
        ) from None
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(descriptor, 32, 0).decode(errors="replace").strip() or "?"
            raise RunDirectoryBusy(
                f"run directory {run_dir} is in use by another megatron-ext run (pid {owner}); "
                "wait for it or give another --run-dir"
            ) from None
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(descriptor)  # releases the lock
