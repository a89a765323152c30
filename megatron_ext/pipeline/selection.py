"""Which pipeline schedule a run uses, and where ZB-H1 may be chosen.

A run chooses its schedule with ``--pipeline-schedule {1f1b,zb-h1}`` (our entries and the
patched Megatron-LM scripts; recipes: ``parallelism.schedule``), which fills the config field
``pipeline_schedule``. This module owns two things:

- **the choice inside megatron.training**: ``train()`` and ``evaluate()`` ask
  ``get_forward_backward_func()`` (imported into ``megatron.training.training``) for the
  schedule. :func:`choosing_pipeline_schedule` wraps it (a declared Patch): when the run's
  arguments say zb-h1 and megatron would run its 1F1B schedule, the answer is megatron-ext's
  ZB-H1 (:func:`megatron_ext.pipeline.zero_bubble.forward_backward_pipelining_zero_bubble_h1`),
  which runs training steps itself and hands forward-only calls (evaluation) to megatron's
  1F1B. Otherwise megatron's own function is returned unchanged.
- **the refusals**: :func:`schedule_problems` lists every setting ZB-H1 does not run with
  (the runtime's rules), reading megatron's names, which parsed arguments and a
  TransformerConfig share. The entries refuse them right after parsing
  (:func:`megatron_ext.launch.training.parse_megatron_args`), and
  :func:`megatron_ext.guards.check_schedule_supported` on a config before the model is built.
  Recipes are refused earlier, by field (:func:`megatron_ext.recipes.checks._check_schedule`).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

from megatron_ext.errors import MegatronExtError, Problem
from megatron_ext.schedules.schedule import ONE_F_ONE_B, SCHEDULES, ZB_H1

__all__ = [
    "SCHEDULES",
    "ScheduleChoiceError",
    "choosing_pipeline_schedule",
    "schedule_problems",
    "selected_schedule",
]


class ScheduleChoiceError(MegatronExtError, RuntimeError):
    """megatron.training was about to run a schedule that the chosen one cannot replace (the
    argument checks refuse such runs first; this is what a run that skipped them meets)."""


FLAG = "--pipeline-schedule"
FIELD = "pipeline_schedule"
# A schedule text (megatron_ext.schedules.text) whose order ZB-H1 executes.
FILE_FLAG = "--pipeline-schedule-file"
FILE_FIELD = "pipeline_schedule_file"

# The ZB-H1 runtime (its refusals and its function), imported when first needed (it loads
# megatron-core) and looked up on the module (tracing wraps its attributes).
ZERO_BUBBLE_MODULE = "megatron_ext.pipeline.zero_bubble"


def selected_schedule(settings: Any) -> str:
    """The schedule ``settings`` (parsed arguments or a config) ask for; 1f1b when unset."""
    return getattr(settings, FIELD, None) or ONE_F_ONE_B


# ---- the refusals ----------------------------------------------------------------------------
def schedule_problems(settings: Any, *, multimodule: bool = False) -> list[Problem]:
    """Every reason ``settings`` (parsed arguments or a TransformerConfig: megatron's names)
    cannot run the schedule they ask for; empty for 1f1b, which megatron itself checks. The
    ZB-H1 rules are the runtime's own
    (:func:`megatron_ext.pipeline.zero_bubble.zero_bubble_problems`)."""
    schedule = selected_schedule(settings)
    if schedule not in SCHEDULES:
        return [Problem(FIELD, f"must be one of {', '.join(SCHEDULES)} ({FLAG}), got {schedule!r}")]
    if getattr(settings, FILE_FIELD, None) and schedule != ZB_H1:
        return [
            Problem(
                FILE_FLAG,
                f"only ZB-H1 executes an order given as text ({FLAG} is {schedule}); add "
                f"{FLAG} zb-h1 or drop {FILE_FLAG}",
            )
        ]
    if schedule != ZB_H1:
        return []
    zero_bubble = importlib.import_module(ZERO_BUBBLE_MODULE)
    return list(zero_bubble.zero_bubble_problems(settings, multimodule=multimodule))


# ---- the choice inside megatron.training ---------------------------------------------------
def _megatron_1f1b() -> Callable[..., Any]:
    """megatron's 1F1B as megatron.core looks it up now (tracing may have wrapped it)."""
    schedules = importlib.import_module("megatron.core.pipeline_parallel.schedules")
    return schedules.forward_backward_pipelining_without_interleaving


def _run_arguments() -> Any:
    from megatron.training import get_args

    return get_args()


# What rank 0 prints (once) when megatron.training runs ZB-H1: the run's log says which
# schedule trained it, as megatron's argument dump says what was asked for.
ANNOUNCEMENT = (
    "> pipeline schedule: zb-h1 (megatron_ext.pipeline.zero_bubble for training steps, "
    "megatron's 1F1B for forward-only steps)"
)
_announced = False


def _announce_once() -> None:
    global _announced
    if _announced:
        return
    _announced = True
    from megatron.training.utils import print_rank_0

    print_rank_0(ANNOUNCEMENT)


def choosing_pipeline_schedule(
    get_forward_backward_func: Callable[..., Any],
) -> Callable[..., Any]:
    """Wrap megatron.training's ``get_forward_backward_func``: the run's ``--pipeline-schedule
    zb-h1`` turns megatron's 1F1B answer into megatron-ext's ZB-H1 function (which hands
    forward-only calls, evaluation, to megatron's 1F1B). Any other
    answer (no pipelining, interleaving, the multi-module bridge) and every 1f1b run get
    megatron's function itself; the argument checks refused zb-h1 with those already."""

    @functools.wraps(get_forward_backward_func)
    def chosen(*args: Any, **kwargs: Any) -> Callable[..., Any]:
        func = get_forward_backward_func(*args, **kwargs)
        if selected_schedule(_run_arguments()) != ZB_H1:
            return func
        if func is not _megatron_1f1b():
            raise ScheduleChoiceError(
                f"{FLAG} zb-h1 replaces megatron's 1F1B schedule, but this run's schedule is "
                f"{getattr(func, '__name__', func)}; use one pipeline chunk per rank and more "
                f"than one stage, or {FLAG} 1f1b"
            )
        _announce_once()
        # Looked up now, not imported by name: tracing wraps the module attribute.
        return importlib.import_module(
            ZERO_BUBBLE_MODULE
        ).forward_backward_pipelining_zero_bubble_h1

    return chosen
