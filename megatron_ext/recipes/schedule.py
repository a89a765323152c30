"""The pipeline schedule a recipe trains with, for ``megatron-ext schedule --recipe`` and a
traced run's summary: a :class:`~megatron_ext.schedules.schedule.SchedulePlan` and the
message size on each pipeline edge, from the typed recipe (``parallelism.schedule`` picks
1F1B or ZB-H1)."""

from __future__ import annotations

from typing import Any

from megatron_ext.pipeline.message_size import DTYPE_BYTES, MessageSize
from megatron_ext.recipes.command import path_for_ranks
from megatron_ext.schedules.schedule import ONE_F_ONE_B, SchedulePlan


def plan_from_recipe(
    path: str, overrides: list[str], platform: str = "cpu"
) -> tuple[SchedulePlan, MessageSize | None]:
    """The schedule plan (and message size) a recipe trains with."""
    from megatron_ext.recipes.loader import load

    return plan_from_loaded(load(path, platform, overrides))


def plan_from_loaded(loaded: Any) -> tuple[SchedulePlan, MessageSize | None]:
    """:func:`plan_from_recipe` for an already loaded recipe."""
    r = loaded.recipe
    if r.model.type == "multimodule":
        from megatron_ext.recipes.multimodule import num_microbatches, plan_of

        plan = plan_of(r)
        # Encoder outputs and image lengths vary per micro-batch (shapes are exchanged with
        # every message), so there is no fixed message size to report.
        return SchedulePlan(microbatches=num_microbatches(r, plan), multimodule=plan), None
    p = r.parallelism
    microbatches = r.training.global_batch_size // (r.training.micro_batch_size * p.dp)
    size = MessageSize(
        hidden=r.model.hidden_size,
        seq=r.model.seq_length,
        micro_batch_size=r.training.micro_batch_size,
        mhc_streams=r.model.mhc.num_residual_streams if r.model.mhc.enabled and p.pp > 1 else 1,
        dtype_bytes=DTYPE_BYTES[r.training.dtype],
        tp=p.tp,
        cp=p.cp,
        sequence_parallel=p.sp,
        single_pass=r.model.mhc.enabled and p.pp > 1 and r.model.mhc.single_pass,
    )
    # parallelism.schedule (1f1b | zb-h1); a schema without the field trains with 1F1B.
    schedule = getattr(p, "schedule", None) or ONE_F_ONE_B
    # megatron's arguments turn overlap_p2p_comm on for every interleaved run (off without
    # virtual stages) unless --no-overlap-p2p-communication is given.
    overlap = p.vpp is not None and "--no-overlap-p2p-communication" not in r.extra_args
    schedule_plan = SchedulePlan(
        pp=p.pp,
        vpp=p.vpp,
        microbatches=microbatches,
        schedule=schedule,
        overlap_p2p_comm=overlap,
        order_file=_order_file(loaded),
    )
    return schedule_plan, size


def _order_file(loaded: Any) -> str | None:
    """parallelism.schedule_file as the ranks read it (relative to the recipe file)."""
    return path_for_ranks(loaded, getattr(loaded.recipe.parallelism, "schedule_file", None))
