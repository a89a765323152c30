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


STORED = ("compare_golden", "force_compare", "megatron_checks")
"""The switches a run directory remembers (run.json's "options") for ``run --resume``. Not
stored: where the run goes (a resume stays in it), ``--write-golden`` and ``--trace`` (a resume
refuses them) and ``--trust-pickle`` (trust is given anew each time, never remembered)."""


def to_record(options: RunOptions) -> dict[str, bool]:
    """run.json's "options": the switches a resume keeps."""
    return {name: getattr(options, name) for name in STORED}


def for_resume(stored: object, given: RunOptions) -> RunOptions:
    """The options of ``run --resume``: those the run was started with, unless the resume's
    command line says otherwise (issue 41, item 3: a ``--no-compare`` run compared again on
    resume). The command line's defaults are compare-on and checks-on, so a switch the resume
    turns off (``--no-compare``, ``--skip-megatron-checks``) wins, and ``--compare`` turns
    comparing back on. A run directory from before the record has none: the command line's."""
    record = stored if isinstance(stored, dict) else {}

    def kept(name: str) -> bool:
        value = record.get(name, getattr(RunOptions(), name))
        return value if isinstance(value, bool) else getattr(RunOptions(), name)

    force = given.force_compare or (kept("force_compare") and given.compare_golden)
    return RunOptions(
        compare_golden=given.force_compare or (given.compare_golden and kept("compare_golden")),
        force_compare=force,
        megatron_checks=given.megatron_checks and kept("megatron_checks"),
        trust_pickle=given.trust_pickle,
    )
