"""The run-time switches of ``megatron-ext run`` (and ``run --resume``), as one frozen value.

What the recipe asks for is the :class:`~megatron_ext.recipes.request.RunRequest`; what the
person starting the run asks for on the command line (where the run directory goes, whether to
compare or write golden values, Megatron's argument checks, ``--trace``, ``--trust-pickle``) is
a :class:`RunOptions`, passed once from the command line down to the phases and the verdict.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunOptions:
    run_dir: Path | None = None
    """The run directory (None: RUNS_ROOT/<name>-<platform>-<time>)."""
    runs_root: Path = Path("runs")
    compare_golden: bool = True
    """False: ``--no-compare``."""
    force_compare: bool = False
    """``--compare``: compare although the overrides change the recipe's numerics."""
    write_golden: bool = False
    megatron_checks: bool = True
    """False: ``--skip-megatron-checks`` (the plan's checks only)."""
    trace: bool = False
    trust_pickle: bool = False
    """``--trust-pickle``: load the checkpoints the run reads without checking their pickles."""
