"""Schedule settings Megatron refuses only at start-up are refused by validate (issue 33,
item 4), and the boundary is Megatron's own: its scheduler accepts what the plan accepts."""

from __future__ import annotations

import pytest

from megatron_ext.recipes import load
from megatron_ext.recipes.checks import plan_problems
from megatron_ext.recipes.command import megatron_args

from recipe_texts import MINIMAL


def _problems(write_recipe, overrides) -> list[str]:
    loaded = load(write_recipe(MINIMAL), "cpu", list(overrides))
    return [str(p) for p in plan_problems(loaded) if not str(p).startswith("launch.")]


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            ["training.lr_warmup_iters=20"],
            "training.lr_warmup_iters: 20 is not below the 8 decay iterations "
            "(training.iterations)",
        ),
        (
            ["training.lr_warmup_iters=8"],
            "training.lr_warmup_iters: 8 is not below the 8 decay iterations",
        ),
        (
            ["training.lr_warmup_iters=4", "training.lr_decay_iters=3"],
            "training.lr_warmup_iters: 4 is not below the 3 decay iterations "
            "(training.lr_decay_iters)",
        ),
        (
            ["training.lr_warmup_fraction=1.0"],
            "training.lr_warmup_fraction: 1.0 warms up over the whole decay",
        ),
        (["extra_args.--lr-warmup-init=0.5"], "extra_args.--lr-warmup-init: 0.5 is above"),
        (["training.lr_schedule=WSD"], "training.lr_schedule: WSD needs its decay length"),
    ],
    ids=[
        "warmup-past-run",
        "warmup-equals-run",
        "warmup-past-decay",
        "fraction-1",
        "warmup-init",
        "wsd",
    ],
)
def test_start_up_schedule_failures_are_validate_problems(write_recipe, overrides, expected):
    problems = _problems(write_recipe, overrides)
    assert any(p.startswith(expected) for p in problems), problems


def _megatron_scheduler_accepts(loaded) -> bool:
    """Megatron's OptimizerParamScheduler built from the plan's flags, as training does."""
    import torch

    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    args = megatron_args(loaded)
    flags = {a: args[i + 1] for i, a in enumerate(args[:-1]) if a.startswith("--")}
    gbs = int(flags["--global-batch-size"])
    decay = int(flags["--lr-decay-iters"]) * gbs
    if "--lr-warmup-fraction" in flags:
        warmup = float(flags["--lr-warmup-fraction"]) * decay
    else:
        warmup = int(flags.get("--lr-warmup-iters", 0)) * gbs
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    try:
        OptimizerParamScheduler(
            optimizer,
            init_lr=0.0,
            max_lr=float(flags["--lr"]),
            min_lr=float(flags["--min-lr"]),
            lr_warmup_steps=warmup,
            lr_decay_steps=decay,
            lr_decay_style=flags["--lr-decay-style"],
            start_wd=0.0,
            end_wd=0.0,
            wd_incr_steps=decay,
            wd_incr_style="constant",
        )
    except AssertionError:
        return False
    return True


@pytest.mark.parametrize("warmup", [0, 7, 8, 9])
def test_the_plan_and_megatrons_scheduler_agree_on_the_warmup(write_recipe, warmup):
    loaded = load(write_recipe(MINIMAL), "cpu", [f"training.lr_warmup_iters={warmup}"])
    refused = any(str(p).startswith("training.lr_warmup_iters") for p in plan_problems(loaded))
    assert refused == (not _megatron_scheduler_accepts(loaded))
