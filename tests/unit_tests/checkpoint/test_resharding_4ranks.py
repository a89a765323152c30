"""Training continued under another parallel layout equals the same-layout continuation
(issue 31's resharding pairs), in one 4-rank world: megatron_ext.testing.continuation trains
an mHC model at one layout with megatron's DDP, schedules and Adam, saves model and optimizer
with dist_checkpointing (the torch_dist format), continues at the same layout, then rebuilds
at the next layout, loads both and continues the same steps on the same batches: every loss
agrees within LOSS_RTOL (fp32 reassociation: the layouts sum in other orders), dropout 0.
Run: torchrun --nproc_per_node 4 -m pytest tests/unit_tests/checkpoint/test_resharding_4ranks.py"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from megatron_ext.config import MHCMLATransformerConfig, MHCTransformerConfig
from megatron_ext.testing import timing
from megatron_ext.testing.continuation import (
    Continued,
    Link,
    fresh_optimizer_losses,
    max_difference,
    run_chain,
    shared_directory,
)
from megatron_ext.testing.equivalence import TrainPlan, gpt_model_factory
from megatron_ext.testing.hybrid import hybrid_forward_step, hybrid_model_factory, hybrid_plan

pytestmark = [
    pytest.mark.world_size(4),
    pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC recompute"),
]

LOSS_RTOL = 1e-5
# Tiny and fast: 4 micro-batches of 1 sequence of 8 tokens per step.
SMALL = dict(hidden_size=16, num_attention_heads=2, seq_length=8, micro_batch_size=1)
SMALL.update(global_batch_size=4)


def _mhc(streams: int, **overrides) -> dict:
    return dict(enable_mhc_connections=True, mhc_num_residual_streams=streams, **overrides)


def gpt_link(
    name: str, streams: int = 4, num_layers: int = 8, overrides=None, config_class=None, **layout
) -> Link:
    """An mHC GPT (untied output layer) at ``layout``."""
    config = dict(_mhc(streams), **(overrides or {}))
    plan = TrainPlan(num_layers=num_layers, config_overrides=config, **SMALL, **layout)
    factory = gpt_model_factory(plan, share_embeddings_and_output_weights=False)
    return Link(name, plan, factory, config_class=config_class or MHCTransformerConfig)


def check_chain(links: list[Link], prefix: str) -> list[Continued]:
    """Run the chain; every layout's losses after loading equal the same steps of the
    same-layout continuation within LOSS_RTOL (each pair's gap printed on rank 0)."""
    with shared_directory(f"megatron-ext-resharding-{prefix}-") as root:
        results = run_chain(links, root)
        check_pairs(results)
        return results


def check_pairs(results: list[Continued]) -> None:
    pairs = max_difference(results)
    scale = max(abs(loss) for loss in results[0].continued)
    if dist.get_rank() == 0:
        print("\n" + "\n".join(f"{pair}: max |loss difference| {gap:.2e}" for pair, gap in pairs))
    for pair, gap in pairs:
        assert gap <= LOSS_RTOL * scale, f"{pair}: losses differ by {gap:.3e}; {results}"


DENSE_CHAIN = [
    gpt_link("TP2xPP2+SP", tp=2, pp=2, sequence_parallel=True),
    gpt_link("TP1xPP4", pp=4),
    gpt_link("PP4 zb-h1", pp=4, schedule="zb-h1"),
    gpt_link("PP4xVPP2", pp=4, vpp=2),
    gpt_link("PP2 (DP2)", pp=2),
    gpt_link("PP2xVPP2 (DP2)", pp=2, vpp=2),
]


@pytest.mark.skipif(
    not timing.soak(),
    reason="soak tier: the longest chain (five moves); make test moves dense mHC checkpoints in "
    "test_layouts_4ranks.py and continues a run under another layout in functional_tests",
)
def test_dense_mhc_n4_continues_at_every_layout_and_a_fresh_optimizer_does_not():
    """TP2xPP2+SP -> TP1xPP4; 1F1B -> ZB-H1 (PP4); zb-h1 -> PP4xVPP2 (1F1B interleaved);
    PP4xVPP2 -> PP2; PP2 -> PP2xVPP2 (DP2 both). The chain's first checkpoint loaded at
    TP1xPP4 with a fresh optimizer: the same first loss (weights), another second one."""
    with shared_directory("megatron-ext-resharding-dense-") as root:
        results = run_chain(DENSE_CHAIN, root)
        check_pairs(results)
        fresh = fresh_optimizer_losses(DENSE_CHAIN[1], root / "0", range(1, 3))
    same = results[0].continued
    assert abs(fresh[0] - same[0]) <= LOSS_RTOL * same[0], (fresh, same)
    assert abs(fresh[1] - same[1]) > 100 * LOSS_RTOL * same[1], (fresh, same)


# DeepSeek-V3 in miniature: MLA, a dense first layer then MoE (4 experts top-2, a shared one).
MOE_MLA = dict(
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_head_dim=8,
    qk_pos_emb_head_dim=4,
    v_head_dim=8,
    moe_layer_freq=[0, 1, 1, 1],
    moe_ffn_hidden_size=32,
    moe_shared_expert_intermediate_size=32,
    add_bias_linear=False,
)


def moe_mla_link(name: str, **layout) -> Link:
    return gpt_link(
        name,
        streams=3,
        num_layers=4,
        overrides=MOE_MLA,
        config_class=MHCMLATransformerConfig,
        num_moe_experts=4,
        **layout,
    )


def test_moe_mla_mhc_n3_moves_between_expert_layouts():
    """MoE+MLA, 3 streams: EP2xPP2 -> EP2 (PP1, DP4) with its optimizer; EP2xPP2 -> EP1xPP2
    with the weights only (the first loss equals): megatron-core gives the expert parameters
    an optimizer of their own only when EP > 1, and 0.19.2 cannot load two chained
    optimizers' state into one (`run --resume` refuses that change). MoE under TP is not
    run here: gloo cannot all-gather the uneven token counts megatron's dispatcher sends."""
    with shared_directory("megatron-ext-resharding-moe-") as root:
        results = run_chain(
            [moe_mla_link("EP2xPP2", ep=2, pp=2), moe_mla_link("EP2 (DP4)", ep=2)], root
        )
        check_pairs(results)
        weights = fresh_optimizer_losses(moe_mla_link("EP1xPP2", pp=2), root / "0", range(1, 2))
    same = results[0].continued
    assert abs(weights[0] - same[0]) <= LOSS_RTOL * same[0], (weights, same)


# CP: megatron's exact loss sums the token count over DP x CP (calculate_per_token_loss).
BIRKHOFF_LEARNED = dict(
    mhc_h_res_method="birkhoff", mhc_learned_output_contract=True, calculate_per_token_loss=True
)


def test_cp2_birkhoff_learned_contraction_n3_moves_to_pp2():
    """A GPT with birkhoff H_res and the learned output contraction, 3 streams:
    CP2xPP2 -> PP2 (DP2) -> TP2+SP (DP2)."""
    check_chain(
        [
            gpt_link(name, streams=3, num_layers=4, overrides=BIRKHOFF_LEARNED, **layout)
            for name, layout in [
                ("CP2xPP2", dict(cp=2, pp=2)),
                ("PP2 (DP2)", dict(pp=2)),
                ("TP2+SP (DP2)", dict(tp=2, sequence_parallel=True)),
            ]
        ],
        "cp-birkhoff",
    )


HYBRID_MTP = "*-|*-/*-"  # attention + MLP per stage, one MTP depth; '|' splits stages at PP2


def hybrid_link(name: str, **layout) -> Link:
    plan = hybrid_plan(HYBRID_MTP, config_overrides=_mhc(4), **SMALL, **layout)
    # megatron-core 0.19.2 cannot index a tied output layer on a non-first MTP stage.
    factory = hybrid_model_factory(plan, HYBRID_MTP, share_embeddings_and_output_weights=False)
    return Link(name, plan, factory, hybrid_forward_step, MHCTransformerConfig)


def test_hybrid_with_mtp_n4_moves_between_pipeline_and_tensor_parallel():
    """Hybrid (attention, MLP) with an MTP depth, 4 streams: TP2xPP2+SP -> PP2 (DP2) ->
    TP2+SP (DP2) (the '|' stage marks dropped at PP1)."""
    check_chain(
        [
            hybrid_link("TP2xPP2+SP", tp=2, pp=2, sequence_parallel=True),
            hybrid_link("PP2 (DP2)", pp=2),
            hybrid_link("TP2+SP (DP2)", tp=2, sequence_parallel=True),
        ],
        "hybrid-mtp",
    )
