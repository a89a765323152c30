"""What a run needs of its recipe, built once: the frozen :class:`RunRequest`, in small frozen
parts (what is shown, how the ranks start, the phases' flags, what the verdict reads).

:func:`megatron_ext.recipes.prepare.prepare` checks a loaded recipe and answers every question
a run asks of it (the Megatron flags of each phase, the ranks' environment, the launch sizes,
the golden values, the plan, the schedule for ``--trace``, the lines shown). ``megatron_ext.runs``
starts from that answer and never asks the recipe's loader, checks or command builder again;
this module and the schema are all of ``recipes/`` that it imports.

Paths that only exist once a run directory is chosen stand in the flags as placeholders
(:data:`RUN_DIR_PLACEHOLDER`, :data:`RECIPE_PLACEHOLDER`); the runner places them.

Nothing here imports torch or megatron.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from megatron_ext.launch.nodes import Grid
from megatron_ext.recipes.schema import Problem, Recipe

RUN_DIR_PLACEHOLDER = "@RUN_DIR@"
"""Stands for the run directory in the flags (an imported Megatron-LM test case's
``${CHECKPOINT_SAVE_PATH}``-style paths, the checkpoint directory)."""

RECIPE_PLACEHOLDER = "@RECIPE@"
"""Stands for the run directory's recipe.yaml (the multi-module entry reads it)."""

CHECKPOINTS_PLACEHOLDER = f"{RUN_DIR_PLACEHOLDER}/checkpoints"
"""The run's checkpoint directory, ``RUN_DIR/checkpoints``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Display:
    """What a run shows and records about the recipe it runs."""

    source: Path | None
    platform: str
    name: str
    overrides: tuple[str, ...]
    """As given (``run --resume`` applies them again)."""
    shown_overrides: tuple[str, ...]
    """As shown and recorded: secrets redacted."""
    notes: tuple[str, ...]
    describe: str
    """The one-line plan: model, sizes, ranks, iterations."""
    plan: Mapping[str, Any]
    """summary.json's ``plan``: sizes, virtual stages, micro-batches, the world."""
    recipe_yaml: str
    """recipe.yaml of the run directory: every field resolved, secrets redacted."""
    run_dir_name_problem: str | None
    """Why the name or platform may not name a run directory (a path separator, ...)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SlurmSettings:
    """``launch.slurm``: what a Slurm job of the recipe asks for (the command line's
    ``submit`` options win over each)."""

    partition: str | None
    account: str | None
    time: str
    gpus_per_node: int | None
    container_image: str | None
    container_mounts: tuple[str, ...]
    sbatch_args: tuple[str, ...]
    signal_warning_s: int
    max_requeues: int
    tp_within_node: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class Launch:
    """How the ranks start and are watched."""

    entry: str | None
    """The module every rank runs with ``python -m``."""
    entry_problem: str | None
    """Why the entry cannot start here (not importable); None: it can."""
    world_size: int
    device: str
    """``cpu`` | ``gpu``."""
    nodes: int
    """Nodes of a Slurm job (``--nodes`` wins); a local run uses one."""
    environment: Mapping[str, str]
    """Variables every rank gets on top of the launcher's own."""
    fault: object
    """``launch.env``'s MEGATRON_EXT_FAULT as the recipe writes it (None: not set there)."""
    timeout_s: int
    stall_timeout_s: int | None
    startup_timeout_s: int
    pipelined: bool
    """More than one pipeline stage (pp > 1, or a multi-module recipe): a failure in training
    has a pipeline step that ``--trace`` can name."""
    grids: tuple[Grid, ...]
    """The grids the ranks form (:func:`megatron_ext.recipes.prepare.node_grids`): a Slurm job's
    node layout places them."""
    start_problems: tuple[str, ...]
    """Why ``checkpoint.load`` cannot start this run, one line each (checked when the run will
    load checkpoints, after their pickles)."""
    slurm: SlurmSettings


@dataclass(frozen=True, kw_only=True, slots=True)
class Phases:
    """The Megatron flags of each training phase, and the checkpoints between them."""

    megatron_args: tuple[str, ...]
    save_args: tuple[str, ...]
    """ckpt-resume, first phase: save at iterations/2 into :data:`CHECKPOINTS_PLACEHOLDER`."""
    load_args: tuple[str, ...]
    """ckpt-resume, second phase: load the iterations/2 checkpoint."""
    long_run_args: tuple[str, ...]
    """A resumable run's first start: save as checkpoint.* says and on the stop signal."""
    long_run_load_args: tuple[str, ...]
    """The same when it continues from its latest complete checkpoint."""
    iterations: int
    ckpt_resume: bool
    """A ckpt-resume test: train, then resume from iterations/2 and compare the two."""
    resumable: bool
    """Saves on a stop signal and continues with ``run --resume`` (see
    :attr:`megatron_ext.recipes.schema.Recipe.resumable`)."""
    most_recent_k: int | None
    """checkpoint.most_recent_k: the complete checkpoints a resumable run keeps."""
    keep_final: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class Verdict:
    """What the finished run is judged by."""

    metrics: tuple[str, ...]
    """test.metrics: compared with the golden values."""
    logs_mhc_stats: bool
    """The ranks log the mHC gains (metrics.json records them too)."""
    tolerances: Mapping[str, Mapping[str, Any]]
    golden_path: Path | None
    golden_write_problem: str | None
    numerics_overridden: bool
    """The overrides change the numerics: golden values are compared only when forced."""
    tokens_per_iteration: int
    schedule_plan: Any
    """The :class:`~megatron_ext.schedules.schedule.SchedulePlan` the ranks train with and its
    message size (``run --trace`` compares the measured timeline with it); None unless traced."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunRequest:
    """One recipe, checked and answered for a run, in four parts. Not :attr:`ok`
    (``refusal`` or ``problems``): it may not start; its flags are what could be derived of
    them (none when refused, or when deriving them failed)."""

    display: Display
    launch: Launch
    phases: Phases
    verdict: Verdict
    problems: tuple[Problem, ...]
    """The recipe's own problems (Megatron's argument checks included when asked)."""
    refusal: str | None
    """Why it may not start before the recipe is even checked (a checkpoint it would load
    could run code): the runner says it first, and nothing else was checked."""

    @property
    def ok(self) -> bool:
        return self.refusal is None and not self.problems


class RunDirRecipe(Protocol):
    """How ``run --resume`` reads a run directory's recipe.yaml without importing the loader:
    the caller (the command line) hands an implementation to :mod:`megatron_ext.runs`."""

    def recipe(self, path: Path, overrides: list[str]) -> Recipe:
        """The resolved recipe of ``path`` (platform cpu) with ``overrides`` applied;
        :class:`~megatron_ext.recipes.schema.RecipeError` lists its problems."""
        ...

    def request(
        self,
        recipe: Recipe,
        source: Path,
        platform: str,
        overrides: list[str],
        allowed_env: tuple[str, ...],
        *,
        megatron_checks: bool,
        trust_pickle: bool,
        resume_from: Path | None,
    ) -> RunRequest:
        """The request of a resumed run (see :func:`megatron_ext.recipes.prepare.prepare`)."""
        ...
