"""Continuing a run under another parallel layout: ``megatron-ext run --resume RUN_DIR
parallelism.tp=1 parallelism.pp=4 training.iterations=N``.

Megatron's ``torch_dist`` checkpoints hold every tensor at its global shape (stacked layers,
global vocabulary rows), and megatron-core's ``dist_checkpointing`` reads each rank's shard
out of them whatever TP / PP / VPP / EP / CP / DP wrote them: that is the resharding. What the
user should not have to know is handled here:

- the padded vocabulary: Megatron pads to a multiple of ``--make-vocab-size-divisible-by x TP``,
  so another TP would pad to another size and the embedding would not load; the checkpoint's
  padded size is kept (:func:`megatron_ext.checkpoint.start_from.vocab_args`);
- the scheduler: ``--override-opt_param-scheduler`` takes the learning-rate schedule from the
  recipe (``training.iterations`` may be raised), the step count and consumed samples from the
  checkpoint;
- the RNG state, saved per (PP, TP) rank, has no counterpart under another layout:
  ``--no-load-rng`` (the data order does not depend on it; dropout does, so the tests that
  compare losses run with dropout 0);
- the change is recorded in ``run.json`` (``layout_changes``) and shown by ``runs show``; the
  run's ``recipe.yaml`` becomes the new layout, so later resumes keep it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megatron_ext import files
from megatron_ext.checkpoint import start_from

RESUME_OVERRIDES = ("parallelism.", "training.iterations=")
LAYOUT_FIELDS = ("tp", "pp", "vpp", "ep", "cp", "dp", "sp", "schedule")
CHANGES_KEY = "layout_changes"


def override_problem(overrides: list[str]) -> str | None:
    """Why ``run --resume`` cannot take these overrides (None: it can)."""
    other = [o for o in overrides if not o.startswith(RESUME_OVERRIDES)]
    if other:
        return (
            f"run --resume takes only parallelism.* and training.iterations overrides, got "
            f"{other[0]!r}; start a new run with checkpoint.load for anything else"
        )
    return None


def layout(recipe: Any) -> dict[str, Any]:
    p = recipe.parallelism
    return {name: getattr(p, name, None) for name in LAYOUT_FIELDS}


WORLD = "world"
"""The key of a changed world size (ranks) in a change: dp stays as the recipe sets it, so
``parallelism.pp=4`` on a PP2 run doubles the ranks, which the user must be told (issue 41,
item 10)."""


def changed(before: Any, after: Any) -> dict[str, list[Any]]:
    """{field: [before, after]} of every parallel setting that differs, and ``world`` when the
    number of ranks does."""
    old, new = layout(before), layout(after)
    change = {k: [old[k], new[k]] for k in LAYOUT_FIELDS if old[k] != new[k]}
    if change and before.world_size != after.world_size:
        change[WORLD] = [before.world_size, after.world_size]
    return change


def change_problem(before: Any, after: Any) -> str | None:
    """Why Megatron cannot continue under this layout change (None: it can). A Hybrid
    pattern's '|' marks are its pipeline stages, part of the model a resume keeps. Expert
    parameters get an optimizer of their own only when EP > 1 (megatron-core's
    get_megatron_optimizer chains the two), and megatron-core 0.19.2 cannot load the state of
    two chained optimizers into one or of one into two."""
    pattern = getattr(after.model, "hybrid_layer_pattern", None) or ""
    moved = [
        f for f in ("pp", "vpp") if getattr(before.parallelism, f) != getattr(after.parallelism, f)
    ]
    if after.model.type == "hybrid" and "|" in pattern and moved:
        field = moved[0]
        old_size, new_size = getattr(before.parallelism, field), getattr(after.parallelism, field)
        return (
            f"parallelism.{field} {old_size} -> {new_size}: the '|' marks of "
            f"model.hybrid_layer_pattern {pattern!r} set a Hybrid run's pipeline stages and "
            "run --resume keeps the model; start a new run with checkpoint.load: RUN_DIR and "
            "the pattern's '|' re-split for the new stages (the layers keep their names)"
        )
    return start_from.ep_change_problem(
        before.parallelism.ep,
        after.parallelism.ep,
        "start a new run with checkpoint.load: RUN_DIR and checkpoint.load_optim: false",
    )


def resume_args(ckpt_dir: Path, recipe: Any, layout_changed: bool) -> list[str]:
    """The Megatron flags a resume under RECIPE adds to ``--load CKPT_DIR``."""
    args = ["--override-opt_param-scheduler"]
    if not layout_changed:
        return args
    args.append("--no-load-rng")
    saved = start_from.saved_args(ckpt_dir)
    if saved is not None and "--make-vocab-size-divisible-by" not in recipe.extra_args:
        args += start_from.vocab_args(saved, recipe.parallelism.tp)
    return args


def record(run_dir: Path, change: dict[str, list[Any]], iteration: int | None) -> None:
    """Append the change to run.json's ``layout_changes``."""
    path = Path(run_dir) / "run.json"
    data = json.loads(files.read_record(path, "run record"))
    data.setdefault(CHANGES_KEY, []).append({"at_iteration": iteration, "changed": change})
    path.write_text(json.dumps(data, indent=2) + "\n")


def describe(change: dict[str, list[Any]]) -> str:
    """``pp 2 -> 4, world 4 -> 8 ranks``."""
    return ", ".join(
        f"{k} {old} -> {new}" + (" ranks" if k == WORLD else "") for k, (old, new) in change.items()
    )


def shown(run_record: dict) -> list[str]:
    """``runs show`` lines for the recorded layout changes."""
    return [
        f"layout     changed at iteration {c.get('at_iteration')}: {describe(c.get('changed', {}))}"
        for c in run_record.get(CHANGES_KEY, [])
        if isinstance(c, dict)
    ]


def finished_run_continues(run_dir: Path, recipe: Any) -> bool:
    """A finished run resumes only to train further (``training.iterations`` raised past its
    latest complete checkpoint)."""
    from megatron_ext.checkpoint import safe_pickle

    tracker = Path(run_dir) / "checkpoints" / safe_pickle.TRACKER
    try:
        latest = int(files.read_record(tracker, "tracker").strip())
    except (OSError, ValueError):
        return False
    return recipe.training.iterations > latest


def apply(
    run_dir: Path, before: Any, recipe: Any, request: Any, latest: int | None, echo: Any
) -> list[str]:
    """Once a resume with overrides may start: the new ``recipe`` (answered by ``request``, a
    :class:`~megatron_ext.recipes.request.RunRequest`) becomes the run's (recipe.yaml, run.json's
    overrides and layout_changes) and the Megatron flags it needs are returned."""
    change = changed(before, recipe)
    (Path(run_dir) / "recipe.yaml").write_text(request.display.recipe_yaml)
    path = Path(run_dir) / "run.json"
    data = json.loads(files.read_record(path, "run record"))
    data["overrides"] = list(request.display.overrides)
    path.write_text(json.dumps(data, indent=2) + "\n")
    if change:
        record(run_dir, change, latest)
        echo(f"  layout change at iteration {latest}: {describe(change)}")
    if latest is None:
        return []
    return resume_args(Path(run_dir) / "checkpoints", recipe, bool(change))
