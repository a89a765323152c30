"""The learning-rate schedule settings Megatron refuses only once the ranks have started.

Megatron checks these when it builds ``OptimizerParamScheduler``
(``megatron/core/optimizer_param_scheduler.py`` in megatron-core 0.19.2: ``lr_decay_steps > 0``,
``lr_warmup_steps < lr_decay_steps``, ``init_lr <= max_lr``, WSD needs its decay steps), after
``validate_args`` has passed and every rank has built its model; here they are named with the
recipe's fields before any process starts. Steps are iterations times the global batch in
Megatron's iteration-based schedule (``get_optimizer_param_scheduler``), so the comparisons
hold in iterations.
"""

from __future__ import annotations

from typing import Any

from megatron_ext.recipes.schema import Problem


def _number(extra_args: dict[str, Any], flag: str) -> float | None:
    value = extra_args.get(flag)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def lr_schedule_problems(training: Any, extra_args: dict[str, Any]) -> list[Problem]:
    """One problem per schedule setting Megatron's scheduler would assert on."""
    t = training
    problems = []
    decay_field = (
        "training.lr_decay_iters" if t.lr_decay_iters is not None else "training.iterations"
    )
    decay_iters = t.lr_decay_iters if t.lr_decay_iters is not None else t.iterations
    if t.lr_warmup_fraction is None and t.lr_warmup_iters >= decay_iters:
        problems.append(
            Problem(
                "training.lr_warmup_iters",
                f"{t.lr_warmup_iters} is not below the {decay_iters} decay iterations "
                f"({decay_field}); Megatron needs the warm-up to end before the decay does: "
                f"set lr_warmup_iters below {decay_iters} or raise {decay_field}",
            )
        )
    if t.lr_warmup_fraction is not None and t.lr_warmup_fraction >= 1.0:
        problems.append(
            Problem(
                "training.lr_warmup_fraction",
                f"{t.lr_warmup_fraction} warms up over the whole decay ({decay_field}); Megatron "
                "needs a fraction below 1",
            )
        )
    warmup_init = _number(extra_args, "--lr-warmup-init")
    if warmup_init is not None and warmup_init > t.lr:
        problems.append(
            Problem(
                "extra_args.--lr-warmup-init",
                f"{warmup_init} is above training.lr {t.lr}; the warm-up starts below the peak",
            )
        )
    wsd_flags = ("--lr-wsd-decay-iters", "--lr-wsd-decay-samples")
    if t.lr_schedule == "WSD" and not any(_number(extra_args, f) for f in wsd_flags):
        problems.append(
            Problem(
                "training.lr_schedule",
                "WSD needs its decay length: add extra_args --lr-wsd-decay-iters N "
                f"(N <= {decay_iters})",
            )
        )
    return problems
