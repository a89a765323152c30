"""Which pipeline schedule a run uses, and where ZB-H1 may be chosen.

A run chooses its schedule with ``--pipeline-schedule {1f1b,zb-h1}`` (our entries and the
patched Megatron-LM scripts; recipes: ``parallelism.schedule``), which fills the config field
``pipeline_schedule``. This module owns two things:

- **the choice inside megatron.training**: ``train()`` and ``evaluate()`` ask
  ``get_forward_backward_func()`` (imported into ``megatron.training.training``) for the
  schedule. :func:`choosing_pipeline_schedule` wraps it (a declared Patch): when the run's
  arguments say zb-h1 and megatron would run its 1F1B schedule, the answer is
  :func:`zero_bubble_for_training`, which runs megatron-ext's ZB-H1
  (:mod:`megatron_ext.pipeline.zero_bubble`) for training steps and megatron's own 1F1B for
  forward-only calls (evaluation). Otherwise megatron's own function is returned unchanged.
- **the refusals**: :func:`schedule_problems` lists every setting ZB-H1 does not run with,
  reading megatron's names, which parsed arguments and a TransformerConfig share; the entries
  refuse them right after parsing (:func:`megatron_ext.launch.training.parse_megatron_args`),
  :func:`megatron_ext.guards.check_pipeline_schedule` on a config. Recipes are refused earlier,
  by field (:func:`megatron_ext.recipes.plan._check_schedule`).
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
    "zero_bubble_for_training",
]


class ScheduleChoiceError(MegatronExtError, RuntimeError):
    """megatron.training was about to run a schedule that the chosen one cannot replace (the
    argument checks refuse such runs first; this is what a run that skipped them meets)."""


FLAG = "--pipeline-schedule"
FIELD = "pipeline_schedule"

# The runtime's own refusals (zero_bubble_problems), when that module is there.
ZERO_BUBBLE_MODULE = "megatron_ext.pipeline.zero_bubble"


def selected_schedule(settings: Any) -> str:
    """The schedule ``settings`` (parsed arguments or a config) ask for; 1f1b when unset."""
    return getattr(settings, FIELD, None) or ONE_F_ONE_B


# ---- the refusals ----------------------------------------------------------------------------
def _cuda_graphs(settings: Any) -> bool:
    return (
        getattr(settings, "cuda_graph_impl", "none") not in (None, "none")
        or bool(getattr(settings, "enable_cuda_graph", False))
        or bool(getattr(settings, "external_cuda_graph", False))
    )


def _own_problems(settings: Any) -> list[Problem]:
    """The settings this module knows ZB-H1 does not run with."""
    problems = []
    use_1f1b = f"or {FIELD}='1f1b' ({FLAG} 1f1b)"
    pp = getattr(settings, "pipeline_model_parallel_size", 1) or 1
    if pp < 2:
        problems.append(
            Problem(
                "pipeline_model_parallel_size",
                f"is {pp}, but {FIELD}='zb-h1' needs a pipeline: one stage has no bubble to "
                f"fill; use 2 or more stages (--pipeline-model-parallel-size) {use_1f1b}",
            )
        )
    vpp = getattr(settings, "virtual_pipeline_model_parallel_size", None)
    if vpp:
        problems.append(
            Problem(
                "virtual_pipeline_model_parallel_size",
                f"is {vpp}, but {FIELD}='zb-h1' is a non-interleaved schedule; remove the "
                "virtual stages (--num-virtual-stages-per-pipeline-rank, a pipeline layout with "
                f"more stages than ranks) {use_1f1b}",
            )
        )
    if getattr(settings, "overlap_p2p_comm", False):
        problems.append(
            Problem(
                "overlap_p2p_comm",
                f"is on, but {FIELD}='zb-h1' posts its exchanges itself (overlap is the "
                f"interleaved schedule's); set overlap_p2p_comm=False {use_1f1b}",
            )
        )
    if getattr(settings, "overlap_moe_expert_parallel_comm", False):
        problems.append(
            Problem(
                "overlap_moe_expert_parallel_comm",
                f"is on, but its overlapped MoE schedule replaces the pipeline schedule "
                f"{FIELD}='zb-h1' (and delays weight gradients its own way); remove "
                f"--overlap-moe-expert-parallel-comm {use_1f1b}",
            )
        )
    if _cuda_graphs(settings):
        problems.append(
            Problem(
                "cuda_graph_impl",
                f"is {getattr(settings, 'cuda_graph_impl', None)!r} (or enable_cuda_graph/"
                f"external_cuda_graph), but CUDA graphs capture a whole backward, which "
                f"{FIELD}='zb-h1' splits into input and weight gradients; set "
                f"--cuda-graph-impl none {use_1f1b}",
            )
        )
    return problems


def _runtime_problems(settings: Any) -> list[Problem]:
    """What the ZB-H1 runtime itself refuses (``zero_bubble_problems``)."""
    try:
        module = importlib.import_module(ZERO_BUBBLE_MODULE)
    except ImportError:
        return []
    check = getattr(module, "zero_bubble_problems", None)
    return list(check(settings)) if check is not None else []


def schedule_problems(settings: Any) -> list[Problem]:
    """Every reason ``settings`` (parsed arguments or a TransformerConfig, megatron's names)
    cannot run the schedule they ask for; empty for 1f1b, which megatron itself checks."""
    schedule = selected_schedule(settings)
    if schedule not in SCHEDULES:
        return [Problem(FIELD, f"must be one of {', '.join(SCHEDULES)} ({FLAG}), got {schedule!r}")]
    if schedule != ZB_H1:
        return []
    problems = _own_problems(settings)
    seen = {p.where for p in problems}
    return problems + [p for p in _runtime_problems(settings) if p.where not in seen]


# ---- the choice inside megatron.training ---------------------------------------------------
def _megatron_1f1b() -> Callable[..., Any]:
    """megatron's 1F1B as megatron.core looks it up now (tracing may have wrapped it)."""
    schedules = importlib.import_module("megatron.core.pipeline_parallel.schedules")
    return schedules.forward_backward_pipelining_without_interleaving


def zero_bubble_for_training(**kwargs: Any) -> Any:
    """A forward-backward function for megatron.training: ZB-H1 for a training step, megatron's
    own 1F1B for a forward-only call (evaluation has no backward to split)."""
    if kwargs.get("forward_only", False):
        return _megatron_1f1b()(**kwargs)
    zero_bubble = importlib.import_module(ZERO_BUBBLE_MODULE)
    return zero_bubble.forward_backward_pipelining_zero_bubble_h1(**kwargs)


def _run_arguments() -> Any:
    from megatron.training import get_args

    return get_args()


def choosing_pipeline_schedule(
    get_forward_backward_func: Callable[..., Any],
) -> Callable[..., Any]:
    """Wrap megatron.training's ``get_forward_backward_func``: the run's ``--pipeline-schedule
    zb-h1`` turns megatron's 1F1B answer into :func:`zero_bubble_for_training`. Any other
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
        return zero_bubble_for_training

    return chosen
