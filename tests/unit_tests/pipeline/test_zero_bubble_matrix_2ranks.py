"""ZB-H1 under the combinations users will try, on 2 ranks (PP=2): odd and single micro-batch
counts, odd and single mHC stream counts, every activation recompute (megatron's full and
selective, megatron-ext's mHC recompute: B re-runs the forward, W must use what that
recomputed forward saw), the Hybrid model with and without MTP, MoE with linear biases, MLA,
and untied embeddings. Each matches the single-rank reference (loss, every gradient of every
step, weights after the last) and its W steps computed deferred weight gradients.
Run: torchrun --nproc_per_node 2 -m pytest tests/unit_tests/pipeline/test_zero_bubble_matrix_2ranks.py"""

import pytest
from mhc_moe_mla_cases import MHC_LR, MLA, MOE
from zero_bubble_cases import check_zb, zb_plan

from megatron_ext.config import MHCMLATransformerConfig
from megatron_ext.testing.equivalence import gpt_model_factory
from megatron_ext.testing.hybrid import hybrid_forward_step, hybrid_model_factory, hybrid_plan

pytestmark = [
    pytest.mark.world_size(2),
    pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC recompute"),
]


@pytest.fixture(autouse=True)
def fresh_mtp_loss_tracker():
    """megatron's MTP loss tracker is global and sized by the first model's MTP depth."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker.clear()
    yield
    MTPLossLoggingHelper.tracker.clear()


def test_pp2_odd_microbatch_count_matches_reference(monkeypatch):
    """m=5 through the steady state (m=1 is test_zero_bubble_2ranks' fewer-than-stages case)."""
    check_zb(zb_plan(pp=2, global_batch_size=10, steps=1), monkeypatch)


@pytest.mark.parametrize("streams", [1, 3], ids=["n1", "n3_odd"])
def test_pp2_mhc_stream_counts_match_reference(monkeypatch, streams):
    """Messages n*h wide with n odd (3) and n=1."""
    overrides = dict(mhc_num_residual_streams=streams)
    check_zb(zb_plan(pp=2, global_batch_size=6, config_overrides=overrides), monkeypatch)


RECOMPUTE = {
    "full_uniform": dict(
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    ),
    "full_block": dict(
        recompute_granularity="full", recompute_method="block", recompute_num_layers=1
    ),
    "selective_core_attn": dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
    # With linear biases (megatron's default; megatron_ext.models.linears returns fc2's bias
    # as a view, without which megatron-core 0.19.2 hangs here under any schedule).
    "selective_mlp": dict(
        recompute_granularity="selective", recompute_modules=["mlp"], add_bias_linear=True
    ),
    "mhc": dict(
        recompute_granularity="selective", recompute_modules=["mhc"], mhc_recompute_layer_num=1
    ),
}


@pytest.mark.parametrize("recompute", list(RECOMPUTE.values()), ids=list(RECOMPUTE))
def test_pp2_recompute_matches_reference(monkeypatch, recompute):
    """B re-runs the layer's forward: the W work it stores must be the recomputed forward's.
    The reference recomputes too (same config), so the comparison is exact in kind."""
    # megatron-ext refuses mHC with full recompute (megatron_ext.guards): those run plain.
    mhc = recompute["recompute_granularity"] != "full"
    plan = zb_plan(mhc=mhc, pp=2, global_batch_size=6, config_overrides=recompute)
    check_zb(plan, monkeypatch)


@pytest.mark.parametrize("mtp", [False, True], ids=["no_mtp", "mtp_last_stage"])
def test_hybrid_pp2_matches_reference(monkeypatch, mtp):
    """The Hybrid stack (attention, MLP, MoE) with mHC; with MTP its depth runs on the last
    stage (the output layer untied, as megatron-core 0.19.2 needs at PP>1 with MTP)."""
    pattern = "*-E|*-E/*-" if mtp else "*-E|*-E"
    mhc = dict(enable_mhc_connections=True, mhc_num_residual_streams=4)
    plan = hybrid_plan(
        pattern,
        pp=2,
        schedule="zb-h1",
        hidden_size=16,
        num_attention_heads=2,
        seq_length=8,
        global_batch_size=6,
        steps=2,
        lr=MHC_LR,
        config_overrides=mhc,
    )
    factory = hybrid_model_factory(plan, pattern, share_embeddings_and_output_weights=not mtp)
    check_zb(plan, monkeypatch, factory=factory, forward_step=hybrid_forward_step)


def test_pp2_moe_with_linear_bias_mhc_matches_reference(monkeypatch):
    """MoE experts with add_bias_linear=True (shared experts have none: megatron refuses)."""
    overrides = dict(
        MOE,
        add_bias_linear=True,
        moe_shared_expert_intermediate_size=None,
        moe_layer_freq=[0, 1, 1, 1],
    )
    plan = zb_plan(pp=2, num_moe_experts=4, global_batch_size=6, config_overrides=overrides)
    check_zb(plan, monkeypatch)


def test_pp2_mla_mhc_matches_reference(monkeypatch):
    plan = zb_plan(pp=2, global_batch_size=6, config_overrides=dict(MLA))
    check_zb(plan, monkeypatch, config_class=MHCMLATransformerConfig)


def test_pp2_untied_embeddings_match_reference(monkeypatch):
    """Own output layer on the last stage (its weight gradient stays in B) and no embedding
    all-reduce between the stages."""
    plan = zb_plan(pp=2, global_batch_size=6)
    factory = gpt_model_factory(plan, share_embeddings_and_output_weights=False)
    check_zb(plan, monkeypatch, factory=factory)


@pytest.mark.parametrize(
    "settings",
    [dict(deallocate_pipeline_outputs=True), dict(calculate_per_token_loss=True)],
    ids=["deallocate_pipeline_outputs", "per_token_loss"],
)
def test_pp2_training_loop_settings_match_reference(monkeypatch, settings):
    """What megatron's training loop sets: sent activations freed after the send (B then runs
    through the C++ engine on the pseudo-freed output), and losses scaled by token count."""
    check_zb(zb_plan(pp=2, global_batch_size=10, steps=1, config_overrides=settings), monkeypatch)
