"""A loaded recipe becomes one :class:`~megatron_ext.recipes.request.RunRequest`: where
``recipes/`` ends and ``megatron_ext.runs`` begins.

:func:`prepare` runs the recipe's checks once and derives everything a run reads of it; the
command line builds the request and hands it to the runner, the Slurm submitter or a resume.
:class:`RunDirRecipes` is the same for a run directory's own recipe.yaml (``run --resume``).
"""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType
from typing import Any

from megatron_ext.launch.nodes import GPT_ORDER, MODULE_ORDER, Grid
from megatron_ext.recipes import command
from megatron_ext.recipes.loader import LoadedRecipe, dump, load
from megatron_ext.recipes.request import CHECKPOINTS_PLACEHOLDER, RunRequest
from megatron_ext.recipes.schema import Recipe

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
    anything (Megatron's argument checks included) reads it; ``trace``: the schedule plan too."""
    from megatron_ext.checkpoint import preload

    recipe = loaded.recipe
    refusal = (
        preload.pickle_problem(recipe, resume_from, trust_pickle=trust_pickle)
        if check_pickles
        else None
    )
    problems: list[Any] = []
    if refusal is None:
        from megatron_ext.recipes.validate import validate

        problems = list(validate(loaded, megatron_checks=megatron_checks).problems)
    ok = refusal is None and not problems
    derived = _derived(loaded, ok, trace, refused=refusal is not None)
    return RunRequest(
        recipe=recipe,
        source=loaded.source,
        platform=loaded.platform,
        name=loaded.name,
        overrides=tuple(loaded.overrides),
        shown_overrides=tuple(_shown_overrides(loaded.overrides)),
        notes=tuple(loaded.notes),
        allowed_env=tuple(loaded.allowed_env),
        numerics_overridden=loaded.numerics_overridden,
        run_dir_name_problem=_name_problem(loaded),
        describe=command.describe(loaded),
        entry=recipe.entry,
        nproc=recipe.world_size,
        nodes=recipe.launch.nodes,
        resumable=recipe.resumable,
        iterations=recipe.training.iterations,
        test_type=recipe.test.type,
        golden_path=loaded.golden_path(),
        grids=_grids(recipe, ok),
        problems=tuple(problems),
        refusal=refusal,
        **derived,
    )


def _name_problem(loaded: LoadedRecipe) -> str | None:
    from megatron_ext.recipes import safety

    for where, value in (("name", loaded.name), ("platform", loaded.platform)):
        problem = safety.name_problem(where, value)
        if problem is not None:
            return str(problem)
    return None


def _shown_overrides(overrides: list[str]) -> list[str]:
    from megatron_ext.launch import shell

    return [shell.redact_override(o) for o in overrides]


def _derived(loaded: LoadedRecipe, ok: bool, trace: bool, refused: bool) -> dict[str, Any]:
    """The flags, environment and plans; for a recipe with problems, what can be derived of
    them (``run --dry-run`` never shows them, but its files can be written); nothing at all for
    one refused before its checks (a checkpoint it names is not to be read)."""
    from megatron_ext.recipes.golden_paths import golden_write_problem
    from megatron_ext.recipes.validate import entry_importable

    ckpt = CHECKPOINTS_PLACEHOLDER
    empty: dict[str, Any] = {
        "golden_write_problem": None,
        "entry_importable": False,
        "megatron_args": (),
        "save_args": (),
        "load_args": (),
        "long_run_args": (),
        "long_run_load_args": (),
        "environment": MappingProxyType({}),
        "plan": MappingProxyType({}),
        "schedule_plan": None,
        "recipe_yaml": "",
    }
    if refused:
        return empty
    try:
        derived: dict[str, Any] = {
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
    if not ok:
        return {**empty, **derived}
    derived["golden_write_problem"] = golden_write_problem(loaded)
    derived["entry_importable"] = entry_importable(loaded.recipe.entry)
    derived["schedule_plan"] = _schedule_plan(loaded) if trace else None
    return derived


def _schedule_plan(loaded: LoadedRecipe) -> Any:
    from megatron_ext.recipes.schedule import plan_from_loaded

    return plan_from_loaded(loaded)


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
