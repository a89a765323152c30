"""How a run, a resume or a Slurm job ends: its exit status, the :class:`Outcome` the command
line reads, and the one line for a write that failed under the run directory. Shared by the
runner, the verdict (:mod:`megatron_ext.runs.verdict`) and the Slurm submitter."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from megatron_ext import files
from megatron_ext.runs import golden as cmp

EXIT_OK, EXIT_MISMATCH, EXIT_INVALID, EXIT_TRAINING_FAILED = 0, 1, 2, 3

Echo = Callable[[str], None]


def default_echo(text: str) -> None:
    print(text, flush=True)


@dataclass
class Outcome:
    exit_code: int
    run_dir: Path | None
    reports: list[cmp.Report] = field(default_factory=list)
    seconds: float = 0.0
    message: str = ""


def cannot_write(exc: OSError, run_dir: Path) -> str:
    """One line for a failed write under the run directory (disk full, read-only, not a dir)."""
    where = exc.filename or run_dir
    return (
        f"cannot write {where}: {files.failure_reason(exc)}; free space there or choose another "
        "directory with --run-dir / --runs-root"
    )
