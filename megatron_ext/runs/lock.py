"""One run per run directory: an exclusive ``flock`` on ``RUN_DIR/.lock``, held for the whole
run, so a second ``megatron-ext run`` with the same ``--run-dir`` is refused before it writes
anything instead of both passing while overwriting each other's logs, metrics and summary.
The kernel drops the lock when the process ends, however it ends; no stale lock remains.

The lock covers what lies inside the directory, so a run directory whose own entries
(``checkpoints/``, ``logs/``, the tracker, ...) are links to somewhere else is refused once the
lock is held (:func:`escape_problem`): a resume would otherwise delete and rewrite another
run's saves without holding that run's lock (issue 40, item 5)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from megatron_ext.errors import MegatronExtError

LOCK_NAME = ".lock"
# Below these, the entries a run writes and a resume removes or rewrites (the tracker, the
# non-persistent saves, the segments of logs and TensorBoard events).
HELD_SUBDIRS = ("checkpoints", "logs", "tensorboard")


class RunDirectoryBusy(MegatronExtError, RuntimeError):
    """Another live process holds the run directory, or it cannot be created or locked."""


class RunDirectoryEscapes(RunDirectoryBusy):
    """An entry of the run directory resolves outside it (one line: the entry, the fix)."""


def _entries(run_dir: Path) -> list[Path]:
    """The run directory's own entries, and those of the subdirectories a run changes."""
    found = sorted(run_dir.iterdir())
    for name in HELD_SUBDIRS:
        sub = run_dir / name
        if sub.is_dir() and not sub.is_symlink():
            found += sorted(sub.iterdir())
    return found


def escape_problem(run_dir: Path) -> str | None:
    """Why ``run_dir`` cannot be held as one run's (None: it can): an entry a run writes or
    removes resolves outside it (a symbolic link to another directory, e.g. another run's
    ``checkpoints/``). Saved ``iter_*`` entries are judged by the resume itself, which names
    a linked save and removes nothing."""
    root = run_dir.resolve()
    try:
        entries = _entries(run_dir)
    except OSError as exc:
        return f"cannot list run directory {run_dir}: {exc.strerror}; give another --run-dir"
    for entry in entries:
        if entry.parent.name == "checkpoints" and entry.name.startswith("iter_"):
            continue
        target = entry.resolve()
        if target != root and root not in target.parents:
            return (
                f"{entry} leads outside the run directory (to {target}); a run changes only "
                f"what its own lock covers: replace the link by a real directory or file, or "
                f"give another --run-dir"
            )
    return None


@contextlib.contextmanager
def holding(run_dir: Path) -> Iterator[None]:
    """Hold ``run_dir`` (created if needed) for the duration of the block."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        # never through a link: the lock must be this directory's own
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        descriptor = os.open(run_dir / LOCK_NAME, flags, 0o644)
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            os.close(descriptor)
            raise OSError(errno.EINVAL, f"{LOCK_NAME} is not a regular file")
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
        if (why := escape_problem(run_dir)) is not None:
            raise RunDirectoryEscapes(why)
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(descriptor)  # releases the lock
