"""mHC under pipeline parallelism on 2 ranks: every exchange carries n*h, and 1F1B and
interleaved runs match the single-rank reference (loss, every gradient, weights after 3 steps)."""

import os

import pytest
import torch
from mhc_pipeline_cases import (
    all_ranks,
    assert_birkhoff_gains_are_one,
    assert_every_exchange_is_n_streams_wide,
    check_mhc,
    check_mhc_and_stats,
    mhc_plan,
    recorded_p2p_shapes,
)

from megatron_ext.config import MHCTransformerConfig
from megatron_ext.testing.equivalence import (
    gpt_forward_step,
    gpt_model_factory,
    run_reference,
    run_sharded,
)

pytestmark = [
    pytest.mark.world_size(2),
    pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC recompute"),
]


def test_pp2_1f1b_birkhoff_carries_n_streams_and_matches_reference(monkeypatch):
    """mHC-lite's H_res (mhc_h_res_method='birkhoff'); sinkhorn's PP=2 1F1B run is the
    recompute test's reference check below. The mHC statistics equal the single rank's and
    the composite gains are 1 after 3 steps."""
    plan = mhc_plan(pp=2, config_overrides=dict(mhc_h_res_method="birkhoff"))
    with recorded_p2p_shapes(monkeypatch) as seen:
        check = check_mhc_and_stats(plan)
    assert_every_exchange_is_n_streams_wide(plan, all_ranks(seen))
    assert_birkhoff_gains_are_one(check)


@pytest.mark.parametrize("batch_p2p_comm", [True, False])
def test_pp2_vpp2_interleaved_carries_n_streams_and_matches_reference(monkeypatch, batch_p2p_comm):
    """With mHC statistics equal to the single rank's (near init H_res is near uniform, so the
    chunk order of the gains is tested by test_mhc_stats.py's combine test, not here)."""
    plan = mhc_plan(pp=2, vpp=2, config_overrides=dict(batch_p2p_comm=batch_p2p_comm))
    with recorded_p2p_shapes(monkeypatch) as seen:
        check_mhc_and_stats(plan)
    assert_every_exchange_is_n_streams_wide(plan, all_ranks(seen))


@pytest.mark.parametrize("variant", ["deepseek-v4", "glm5"])
def test_pp2_variant_matches_reference(monkeypatch, variant):
    """mhc_variant's maps at plain PP=2 (1F1B), the n*h streams on the one edge."""
    plan = mhc_plan(pp=2, steps=1, config_overrides=dict(mhc_variant=variant))
    with recorded_p2p_shapes(monkeypatch) as seen:
        check_mhc(plan)
    assert_every_exchange_is_n_streams_wide(plan, all_ranks(seen))


@pytest.mark.parametrize("variant", ["deepseek-v4", "glm5"])
def test_pp2_vpp2_interleaved_variant_matches_reference(monkeypatch, variant):
    """mhc_variant's maps on every virtual stage (deepseek-v4's learned head on the last)."""
    plan = mhc_plan(pp=2, vpp=2, steps=2, config_overrides=dict(mhc_variant=variant))
    with recorded_p2p_shapes(monkeypatch) as seen:
        check_mhc_and_stats(plan)
    assert_every_exchange_is_n_streams_wide(plan, all_ranks(seen))


def test_pp2_standalone_embedding_and_loss_stages_match_reference(monkeypatch):
    """Layout E|tt|tt|L: rank 0's first chunk only embeds (and expands), rank 1's last chunk
    only contracts, normalises and computes the loss."""
    plan = mhc_plan(
        pp=2, vpp=2, parallel_overrides=dict(pipeline_model_parallel_layout="E|tt|tt|L")
    )
    with recorded_p2p_shapes(monkeypatch) as seen:
        check_mhc(plan)
    assert_every_exchange_is_n_streams_wide(plan, all_ranks(seen))


@pytest.mark.parametrize("vpp, h_res_method", [(None, "sinkhorn"), (2, "birkhoff")])
def test_mhc_recompute_under_pipeline_gives_identical_gradients(vpp, h_res_method):
    """Eager selective 'mhc' recompute with PP (and VPP): groups end at every chunk, and the
    sharded run's gradients and weights are bit-identical with and without it (with either
    H_res method)."""
    method = dict(mhc_h_res_method=h_res_method)
    plain = mhc_plan(pp=2, vpp=vpp, config_overrides=method)
    recompute = mhc_plan(
        pp=2,
        vpp=vpp,
        config_overrides=dict(
            recompute_granularity="selective",
            recompute_modules=["mhc"],
            mhc_recompute_layer_num=1,
            **method,
        ),
    )
    factory = gpt_model_factory(plain)
    reference = run_reference(plain, factory, gpt_forward_step, MHCTransformerConfig)
    without, final_without = run_sharded(
        plain, factory, gpt_forward_step, reference.initial_weights, MHCTransformerConfig
    )
    with_, final_with = run_sharded(
        recompute, factory, gpt_forward_step, reference.initial_weights, MHCTransformerConfig
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
    check_mhc(recompute)


def test_pp2_1f1b_with_fused_mhc_kernels_matches_reference():
    """use_fused_mhc=True (the Triton kernels; under Triton's interpreter on CPU, switched on by
    tests/conftest.py) through a PP=2 1F1B run: matches the single-rank fused reference. Tiny:
    2 layers, one step of 2 micro-batches, 3 Sinkhorn iterations (interpreted kernels are slow)."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not 1")
    plan = mhc_plan(
        pp=2,
        num_layers=2,
        steps=1,
        global_batch_size=4,
        seq_length=8,
        config_overrides=dict(use_fused_mhc=True, mhc_sinkhorn_iterations=3),
    )
    check_mhc(plan)
