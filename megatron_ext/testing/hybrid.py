"""HybridModel pieces for megatron-ext's equivalence harness
(:func:`megatron_ext.testing.equivalence.check_equivalence`): a plan, a model factory and a
forward step, the Hybrid counterparts of ``gpt_model_factory`` / ``gpt_forward_step``.

The sharded run builds each chunk from the pattern with its ``|`` pipeline segments; the
single-rank reference builds the same layers from the pattern without them, so both number
their layers (and name their checkpoint keys) identically.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols, parse_hybrid_pattern

from megatron_ext.testing.equivalence import (
    ModelFactory,
    TrainPlan,
    masked_lm_loss,
    split_for_context_parallel,
)


def pattern_without_pipeline_segments(pattern: str) -> str:
    """The same layers with every ``|`` removed (what a single-rank model builds)."""
    return pattern.replace(Symbols.PIPE, "")


def hybrid_plan(pattern: str, **kwargs: Any) -> TrainPlan:
    """A :class:`TrainPlan` sized for ``pattern``: ``num_layers`` is its decoder layer count,
    MoE settings when it has ``E`` (4 experts, no linear bias unless ``config_overrides`` asks)
    and ``mtp_num_layers`` when it has MTP depths (after ``/``)."""
    parsed = parse_hybrid_pattern(pattern)
    main = pattern_without_pipeline_segments(parsed.main_pattern or "")
    overrides: dict[str, Any] = {}
    if Symbols.MOE in pattern:
        kwargs.setdefault("num_moe_experts", 4)
        overrides["add_bias_linear"] = False
    if parsed.mtp_num_depths:
        overrides["mtp_num_layers"] = parsed.mtp_num_depths
    overrides.update(kwargs.pop("config_overrides", {}))
    return TrainPlan(num_layers=len(main), config_overrides=overrides, **kwargs)


def hybrid_model_factory(
    plan: TrainPlan,
    pattern: str,
    *,
    position_embedding_type: str = "rope",
    share_embeddings_and_output_weights: bool = True,
    spec: Any | None = None,
) -> ModelFactory:
    """megatron-ext's HybridModel with the local stack spec (mHC when the config enables it);
    chunks of a pipelined config take their segment of ``pattern``.

    Tied embeddings with MTP under pipeline parallelism need megatron_ext.install(): it
    releases the unused output-layer weight megatron-core 0.19.2 allocates on such a stage
    (megatron_ext.models.tied_output)."""
    from megatron_ext.models.hybrid import HybridModel, get_hybrid_stack_local_spec

    def build(config, pre_process: bool, post_process: bool, vp_stage: int | None):
        mhc = bool(getattr(config, "enable_mhc_connections", False))
        if config.pipeline_model_parallel_size == 1:
            stage_pattern = pattern_without_pipeline_segments(pattern)
        else:
            stage_pattern = pattern
        return HybridModel(
            config,
            spec or get_hybrid_stack_local_spec(enable_mhc_connections=mhc),
            vocab_size=plan.vocab_size,
            max_sequence_length=plan.seq_length,
            hybrid_layer_pattern=stage_pattern,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=share_embeddings_and_output_weights,
            position_embedding_type=position_embedding_type,
            vp_stage=vp_stage,
        )

    return build


def hybrid_forward_step(data_iterator, model):
    """Megatron's forward step for a HybridModel: the loss mask also reaches the MTP losses;
    under CP each rank keeps its share of the batch."""
    batch = split_for_context_parallel(next(data_iterator))
    output = model(
        batch["tokens"],
        batch["position_ids"],
        batch["attention_mask"],
        labels=batch["labels"],
        loss_mask=batch["loss_mask"],
    )
    return output, partial(masked_lm_loss, batch["loss_mask"])


__all__ = [
    "hybrid_forward_step",
    "hybrid_model_factory",
    "hybrid_plan",
    "pattern_without_pipeline_segments",
]
