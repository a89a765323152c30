"""Shared plans of the GPT MoE / MLA + mHC equivalence tests (2- and 4-rank sessions)."""

from __future__ import annotations

from megatron_ext.config import MHCMLATransformerConfig, MHCTransformerConfig
from megatron_ext.testing.equivalence import TrainPlan, check_equivalence

STREAMS = 4
# See tests/unit_tests/pipeline/mhc_pipeline_cases.py: Adam turns the rounding noise
# of alpha_res's init-time gradient into full steps; a small lr keeps the final weights close.
MHC_LR = 1e-4

# A DeepSeek-V3-shaped MoE in miniature: the first layer dense, then MoE layers with a shared
# expert, top-2 of 4 routed experts, the load-balancing aux loss on.
MOE = dict(
    moe_layer_freq=[0, 1],
    moe_ffn_hidden_size=32,
    moe_shared_expert_intermediate_size=32,
    moe_aux_loss_coeff=0.01,
    add_bias_linear=False,
)
# Multi-latent attention in miniature (q/kv LoRA ranks, nope/rope head dims, YaRN).
MLA = dict(
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_head_dim=8,
    qk_pos_emb_head_dim=4,
    v_head_dim=8,
    add_bias_linear=False,
)


def moe_plan(num_layers: int = 2, **kwargs) -> TrainPlan:
    """A MoE + mHC plan; ``moe_layer_freq`` keeps the first layer dense at any depth."""
    overrides = dict(MOE, enable_mhc_connections=True, mhc_num_residual_streams=STREAMS)
    overrides["moe_layer_freq"] = [0] + [1] * (num_layers - 1)
    overrides.update(kwargs.pop("config_overrides", {}))
    kwargs = dict(dict(num_moe_experts=4, steps=2, lr=MHC_LR), **kwargs)
    return TrainPlan(num_layers=num_layers, config_overrides=overrides, **kwargs)


def mla_plan(**kwargs) -> TrainPlan:
    overrides = dict(MLA, enable_mhc_connections=True, mhc_num_residual_streams=STREAMS)
    overrides.update(kwargs.pop("config_overrides", {}))
    kwargs = dict(dict(num_layers=2, steps=2, lr=MHC_LR), **kwargs)
    return TrainPlan(config_overrides=overrides, **kwargs)


def check(plan: TrainPlan, **kwargs):
    """check_equivalence with the mHC config (the MLA one when the plan sets MLA fields)."""
    mla = "q_lora_rank" in plan.config_overrides
    config_class = MHCMLATransformerConfig if mla else MHCTransformerConfig
    return check_equivalence(plan, config_class=config_class, **kwargs)
