"""Hybrid mHC under pipeline parallelism on 2 ranks: '|' segments become stages and virtual
chunks, every exchange carries n*h, and each run matches the single-rank reference (the same
pattern without '|'): loss, every gradient of every step and the weights after 3 steps.
Run: torchrun --nproc_per_node 2 -m pytest tests/unit_tests/pipeline/test_pp_mhc_hybrid.py"""

import os
from functools import partial

import pytest
import torch
from mhc_pipeline_cases import (
    MHC_LR,
    STREAMS,
    all_ranks,
    assert_birkhoff_gains_are_one,
    assert_every_exchange_is_n_streams_wide,
    check_mhc_and_stats,
    recorded_p2p_shapes,
)

from megatron_ext.config import MHCTransformerConfig
from megatron_ext.mhc.stats import MTP_GAIN_NAMES
from megatron_ext.testing.equivalence import check_equivalence, run_reference, run_sharded
from megatron_ext.testing.hybrid import (
    hybrid_forward_step,
    hybrid_model_factory,
    hybrid_plan,
)

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


# What megatron's training loop sets: after sending an activation the schedule frees its data
# ("pseudo-deallocates" it) and runs backward through the C++ engine directly.
DEALLOCATE = dict(deallocate_pipeline_outputs=True)


def mhc_hybrid_plan(pattern: str, **kwargs):
    overrides = dict(enable_mhc_connections=True, mhc_num_residual_streams=STREAMS, **DEALLOCATE)
    overrides.update(kwargs.pop("config_overrides", {}))
    return hybrid_plan(pattern, lr=MHC_LR, config_overrides=overrides, **kwargs)


def check_hybrid(plan, pattern, on_gradients=None):
    # megatron-core 0.19.2 cannot index a tied output layer on a non-first MTP stage (see
    # hybrid_model_factory), so MTP runs untie the output layer; the MTP embedding stays tied.
    tied = "/" not in pattern
    return check_equivalence(
        plan,
        factory=hybrid_model_factory(plan, pattern, share_embeddings_and_output_weights=tied),
        forward_step=hybrid_forward_step,
        config_class=MHCTransformerConfig,
        on_gradients=on_gradients,
    )


def check_pipelined(monkeypatch, pattern, with_stats=False, **layout):
    """The equivalence run; ``with_stats``: also the mHC statistics (returns the StatsCheck)."""
    plan = mhc_hybrid_plan(pattern, **layout)
    check = None
    with recorded_p2p_shapes(monkeypatch) as seen:
        if with_stats:
            check = check_mhc_and_stats(plan, partial(check_hybrid, plan, pattern))
        else:
            check_hybrid(plan, pattern)
    assert_every_exchange_is_n_streams_wide(plan, all_ranks(seen))
    return check


def test_pp2_attention_mlp_moe_carries_n_streams_and_matches_reference(monkeypatch):
    check_pipelined(monkeypatch, "*-E|*-E", pp=2)


@pytest.mark.parametrize(
    "pattern",
    ["*-||*-|*-", "*-|*-|*-|", "|*-*-|*-|*-"],
    ids=["empty_intermediate_chunk", "empty_final_chunk", "empty_first_chunk"],
)
def test_pp2_vpp2_with_an_empty_segment_carries_n_streams_and_matches_reference(
    monkeypatch, pattern
):
    """Segment k runs on rank k % 2, chunk k // 2. An empty intermediate chunk passes the
    streams on (as an independent clone the schedule may free after sending); an empty final
    chunk only contracts, normalises and computes the loss; an empty first chunk only embeds
    and expands."""
    check_pipelined(monkeypatch, pattern, pp=2, vpp=2)


def test_pp2_with_mtp_on_the_last_chunk_matches_reference(monkeypatch):
    """MTP (after '/') on the final post_process chunk consumes the decoder's n streams;
    only decoder stages exchange anything, all of it n*h wide. The mHC statistics (decoder and
    MTP depth) equal the single rank's."""
    check = check_pipelined(monkeypatch, "*-|*-/*-", pp=2, with_stats=True)
    assert set(MTP_GAIN_NAMES) <= set(check.first)


@pytest.mark.parametrize(
    "pattern, vpp", [("*-|*-/*-", None), ("*-|-|*|*-/*-", 2)], ids=["pp2", "pp2_vpp2"]
)
def test_birkhoff_learned_contraction_with_mtp_matches_reference(monkeypatch, pattern, vpp):
    """mHC-lite's H_res in the Hybrid stack (learned contraction on the last chunk, an MTP
    depth carrying the streams): loss, every gradient and the weights equal the single rank's,
    so do the mHC statistics, and the decoder's and the MTP path's gains are 1."""
    check = check_pipelined(
        monkeypatch,
        pattern,
        pp=2,
        vpp=vpp,
        with_stats=True,
        config_overrides=dict(mhc_h_res_method="birkhoff"),
    )
    assert_birkhoff_gains_are_one(check, MTP_GAIN_NAMES)


GLM5_SOAK = pytest.mark.skipif(
    os.environ.get("MEGATRON_EXT_SOAK") != "1",
    reason="soak only (~12 s): CI runs glm5 under TP2xPP2+SP (4 ranks), deepseek-v4 here",
)


@pytest.mark.parametrize("variant", ["deepseek-v4", pytest.param("glm5", marks=GLM5_SOAK)])
def test_variant_with_mtp_matches_reference(monkeypatch, variant):
    """mhc_variant: DeepSeek-V4's maps; deepseek-v4's learned head on the decoder and the MTP
    depth, glm5's mean (no head parameters). Loss, gradients, weights and the statistics."""
    check_pipelined(
        monkeypatch, "*-|*-/*-", pp=2, with_stats=True, config_overrides=dict(mhc_variant=variant)
    )


@pytest.mark.parametrize("pattern", ["*-|-|*|*-/*-", "*-|*-|*-|/*-"], ids=["layers", "empty"])
def test_pp2_vpp2_with_mtp_on_the_last_chunk_matches_reference(monkeypatch, pattern):
    """Also when the last chunk has no decoder layer: it receives the streams, contracts them
    for the main loss and runs the MTP depth on them."""
    check_pipelined(monkeypatch, pattern, pp=2, vpp=2)


@pytest.mark.parametrize("pattern", ["*-||*-|*-", "|*-*-|*-|*-"], ids=["intermediate", "first"])
def test_plain_hybrid_pp2_vpp2_with_an_empty_chunk_matches_reference(pattern):
    """Without mHC too: an empty chunk's output is not its input tensor."""
    plan = hybrid_plan(pattern, pp=2, vpp=2, config_overrides=DEALLOCATE)
    check_hybrid(plan, pattern)


@pytest.mark.parametrize("vpp", [None, 2])
def test_mhc_recompute_under_pipeline_gives_identical_gradients(vpp):
    """Eager selective 'mhc' recompute: groups end with every chunk, and the sharded run's
    losses, gradients and weights are bit-identical with and without it."""
    pattern = "*-E|*-|*E|-*" if vpp else "*-E|*-E"
    plain = mhc_hybrid_plan(pattern, pp=2, vpp=vpp)
    recompute = mhc_hybrid_plan(
        pattern,
        pp=2,
        vpp=vpp,
        config_overrides=dict(
            recompute_granularity="selective", recompute_modules=["mhc"], mhc_recompute_layer_num=2
        ),
    )
    factory = hybrid_model_factory(plain, pattern)
    args = (factory, hybrid_forward_step)
    reference = run_reference(plain, *args, MHCTransformerConfig)
    without, final_without = run_sharded(
        plain, *args, reference.initial_weights, MHCTransformerConfig
    )
    with_, final_with = run_sharded(
        recompute, *args, reference.initial_weights, MHCTransformerConfig
    )
    for step, (a, b) in enumerate(zip(without, with_, strict=True)):
        assert a.losses == b.losses, step
        for (key, _, region, x), (key_b, _, region_b, y) in zip(a.grads, b.grads, strict=True):
            assert (key, region) == (key_b, region_b)
            assert torch.equal(x, y), (
                f"step {step}: gradient of {key}{region} differs with recompute"
            )
    for (key, _, _, x), (_, _, _, y) in zip(final_without, final_with, strict=True):
        assert torch.equal(x, y), key
