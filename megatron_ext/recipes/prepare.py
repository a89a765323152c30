"""A loaded recipe becomes one :class:`~megatron_ext.recipes.request.RunRequest`: where
``recipes/`` ends and ``megatron_ext.runs`` begins.

:func:`prepare` runs the recipe's checks once and derives everything a run reads of it; the
command line builds the request and hands it to the runner, the Slurm submitter or a resume.
:class:`RunDirRecipes` is the same for a run directory's own recipe.yaml (``run --resume``).
"""

from __future__ import annotations

import copy
from pathlib import Path
from types import MappingProxyType
from typing import Any

from megatron_ext.checkpoint import preload, start_from
from megatron_ext.launch import shell
from megatron_ext.launch.faults import FAULT_ENV
from megatron_ext.launch.nodes import GPT_ORDER, MODULE_ORDER, Grid
from megatron_ext.recipes import command, safety
from megatron_ext.recipes.golden_paths import golden_write_problem
from megatron_ext.recipes.loader import LoadedRecipe, dump, load
from megatron_ext.recipes.request import (
    CHECKPOINTS_PLACEHOLDER,
    Display,
    Launch,
    Phases,
    RunRequest,
    SlurmSettings,
    Verdict,
)
from megatron_ext.recipes.schedule import plan_from_loaded
from megatron_ext.recipes.schema import Recipe
from megatron_ext.recipes.validate import entry_importable, validate

# What deriving the flags of a recipe that failed its checks may raise: the request is refused
# anyway and carries no flags (a valid recipe's derivation never fails).
_INVALID_RECIPE_ERRORS = (ValueError, TypeError, KeyError, AttributeError, ZeroDivisionError)


def prepare(
    loaded: LoadedRecipe,
    *,
    megatron_checks: bool = True,
    check_pickles: bool = True,
    trust_pickle: bool = False,
    resume_from: Path | None = None,
    trace: bool = False,
) -> RunRequest:
    """Check ``loaded`` and answer it for a run. ``megatron_checks``: Megatron's own argument
    checks too; ``check_pickles``: first refuse a checkpoint the run would load whose pickles
    could run code (unless ``trust_pickle``; ``resume_from``: the run's own checkpoints), before
    anything (Megatron's argument checks included) reads it, then check ``checkpoint.load``
    against the recipe; ``trace``: the schedule plan too."""
    recipe = loaded.recipe
    refusal = (
        preload.pickle_problem(recipe, resume_from, trust_pickle=trust_pickle)
        if check_pickles
        else None
    )
    problems: list[Any] = []
    if refusal is None:
        problems = list(validate(loaded, megatron_checks=megatron_checks).problems)
    ok = refusal is None and not problems
    flags = _derived(loaded, ok, refused=refusal is not None)
    return RunRequest(
        display=_display(loaded, flags),
        launch=_launch(loaded, flags, ok, start_checks=check_pickles and refusal is None),
        phases=_phases(recipe, flags),
        verdict=_verdict(loaded, ok, trace),
        problems=tuple(problems),
        refusal=refusal,
    )


def _display(loaded: LoadedRecipe, flags: dict[str, Any]) -> Display:
    return Display(
        source=loaded.source,
        platform=loaded.platform,
        name=loaded.name,
        overrides=tuple(loaded.overrides),
        shown_overrides=tuple(shell.redact_override(o) for o in loaded.overrides),
        notes=tuple(loaded.notes),
        describe=command.describe(loaded),
        plan=flags["plan"],
        recipe_yaml=flags["recipe_yaml"],
        run_dir_name_problem=_name_problem(loaded),
    )


def _launch(loaded: LoadedRecipe, flags: dict[str, Any], ok: bool, *, start_checks: bool) -> Launch:
    recipe = loaded.recipe
    launch, s = recipe.launch, recipe.launch.slurm
    return Launch(
        entry=recipe.entry,
        entry_problem=_entry_problem(recipe, ok),
        world_size=recipe.world_size,
        device=launch.device,
        nodes=launch.nodes,
        environment=flags["environment"],
        fault=launch.env.get(FAULT_ENV),
        timeout_s=launch.timeout_s,
        stall_timeout_s=launch.stall_timeout_s,
        startup_timeout_s=launch.startup_timeout_s,
        pipelined=recipe.parallelism.pp > 1 or recipe.model.type == "multimodule",
        grids=_grids(recipe, ok),
        start_problems=tuple(start_from.problems(recipe)) if start_checks else (),
        slurm=SlurmSettings(
            partition=s.partition,
            account=s.account,
            time=s.time,
            gpus_per_node=s.gpus_per_node,
            container_image=s.container_image,
            container_mounts=tuple(s.container_mounts),
            sbatch_args=tuple(s.sbatch_args),
            signal_warning_s=s.signal_warning_s,
            max_requeues=s.max_requeues,
            tp_within_node=s.tp_within_node,
        ),
    )


def _entry_problem(recipe: Recipe, ok: bool) -> str | None:
    """Why the entry module cannot start (checked for a recipe without problems only)."""
    if ok and entry_importable(recipe.entry):
        return None
    return (
        f"the entry module {recipe.entry} is not importable (model.type "
        f"{recipe.model.type}); install it or set model.entry"
    )


def _phases(recipe: Recipe, flags: dict[str, Any]) -> Phases:
    return Phases(
        megatron_args=flags["megatron_args"],
        save_args=flags["save_args"],
        load_args=flags["load_args"],
        long_run_args=flags["long_run_args"],
        long_run_load_args=flags["long_run_load_args"],
        iterations=recipe.training.iterations,
        ckpt_resume=recipe.test.type == "ckpt-resume",
        resumable=recipe.resumable,
        most_recent_k=recipe.checkpoint.most_recent_k,
        keep_final=recipe.checkpoint.keep_final,
    )


def _verdict(loaded: LoadedRecipe, ok: bool, trace: bool) -> Verdict:
    recipe = loaded.recipe
    return Verdict(
        metrics=tuple(recipe.test.metrics),
        logs_mhc_stats=recipe.logs_mhc_stats,
        tolerances=MappingProxyType(copy.deepcopy(recipe.test.tolerances)),
        golden_path=loaded.golden_path(),
        golden_write_problem=golden_write_problem(loaded) if ok else None,
        numerics_overridden=loaded.numerics_overridden,
        tokens_per_iteration=recipe.training.global_batch_size * recipe.model.seq_length,
        schedule_plan=plan_from_loaded(loaded) if ok and trace else None,
    )


def _name_problem(loaded: LoadedRecipe) -> str | None:
    for where, value in (("name", loaded.name), ("platform", loaded.platform)):
        problem = safety.name_problem(where, value)
        if problem is not None:
            return str(problem)
    return None


def _derived(loaded: LoadedRecipe, ok: bool, refused: bool) -> dict[str, Any]:
    """The flags, environment, plan and recipe.yaml; for a recipe with problems, what can be
    derived of them (``run --dry-run`` never shows them, but its files can be written); nothing
    at all for one refused before its checks (a checkpoint it names is not to be read)."""
    ckpt = CHECKPOINTS_PLACEHOLDER
    empty: dict[str, Any] = {
        "megatron_args": (),
        "save_args": (),
        "load_args": (),
        "long_run_args": (),
        "long_run_load_args": (),
        "environment": MappingProxyType({}),
        "plan": MappingProxyType({}),
        "recipe_yaml": "",
    }
    if refused:
        return empty
    try:
        return {
            "recipe_yaml": dump(loaded),
            "megatron_args": tuple(command.megatron_args(loaded)),
            "save_args": tuple(command.save_args(loaded, ckpt)),
            "load_args": tuple(command.load_args(loaded, ckpt)),
            "long_run_args": tuple(command.long_run_args(loaded, ckpt, False)),
            "long_run_load_args": tuple(command.long_run_args(loaded, ckpt, True)),
            "environment": MappingProxyType(command.run_environment(loaded)),
            "plan": MappingProxyType(resolved_plan(loaded)),
        }
    except _INVALID_RECIPE_ERRORS:
        if ok:
            raise
        return empty


def _grids(recipe: Recipe, ok: bool) -> tuple[Grid, ...]:
    """:func:`node_grids`; none for a multi-module recipe whose modules make no plan."""
    try:
        return node_grids(recipe)
    except _INVALID_RECIPE_ERRORS:
        if ok:
            raise
        return ()


def node_grids(recipe: Recipe) -> tuple[Grid, ...]:
    """The grids the recipe's ranks form, in megatron's rank order (fastest first): one for a
    GPT or Hybrid model, one per module of a multi-module recipe. The node layout of a Slurm
    job (:mod:`megatron_ext.launch.nodes`) places them on nodes."""
    if recipe.model.type == "multimodule":
        from megatron_ext.recipes.multimodule import plan_of

        plan = plan_of(recipe, recipe.world_size)
        return tuple(
            Grid(name, m.first_rank, tuple((k, getattr(m, k)) for k in MODULE_ORDER))
            for name, m in plan.modules.items()
        )
    p = recipe.parallelism
    sizes = {"tp": p.tp, "cp": p.cp, "dp": p.dp, "pp": p.pp}
    return (Grid("model", 0, tuple((k, sizes[k]) for k in GPT_ORDER)),)


def resolved_plan(loaded: LoadedRecipe) -> dict:
    """The plan the run used: sizes, derived virtual stages and micro-batches, the world."""
    r = loaded.recipe
    p, t = r.parallelism, r.training
    dp = p.dp if r.model.type != "multimodule" else 1
    return {
        "describe": command.describe(loaded),
        "world_size": r.world_size,
        "tp": p.tp,
        "pp": p.pp,
        "vpp": r.virtual_stages,
        "cp": p.cp,
        "ep": p.ep,
        "dp": p.dp,
        "sp": p.sp,
        "schedule": p.schedule,
        "micro_batch_size": t.micro_batch_size,
        "global_batch_size": t.global_batch_size,
        "micro_batches": t.global_batch_size // max(1, t.micro_batch_size * dp),
        "modules": r.to_dict()["model"]["modules"] if r.model.type == "multimodule" else None,
    }


class RunDirRecipes:
    """:class:`~megatron_ext.recipes.request.RunDirRecipe` for ``run --resume``."""

    def recipe(self, path: Path, overrides: list[str]) -> Recipe:
        return load(path, "cpu", overrides).recipe

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
        loaded = LoadedRecipe(recipe, source, platform, overrides, allowed_env=allowed_env)
        return prepare(
            loaded,
            megatron_checks=megatron_checks,
            trust_pickle=trust_pickle,
            resume_from=resume_from,
        )
