"""ZB-H1 (megatron_ext.pipeline.zero_bubble) on 2 ranks: PP=2 with mHC matches the single-rank
reference and megatron's 1F1B, every W step computes deferred weight gradients, and the
traced order is build_schedule's, action for action.
Run: torchrun --nproc_per_node 2 -m pytest tests/unit_tests/pipeline/test_zero_bubble_2ranks.py"""

import pytest
from mhc_moe_mla_cases import MOE
from zero_bubble_cases import (
    assert_same_as_1f1b,
    assert_traced_order_is_the_schedule,
    check_zb,
    zb_plan,
)

pytestmark = [
    pytest.mark.world_size(2),
    pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC recompute"),
]


def test_pp2_mhc_matches_reference(monkeypatch):
    """6 micro-batches: rank 1 defers one W through the steady state, flushes at the end."""
    check_zb(zb_plan(pp=2, global_batch_size=12), monkeypatch)


@pytest.mark.parametrize("variant", ["deepseek-v4", "glm5"])
def test_pp2_mhc_variant_matches_reference(monkeypatch, variant):
    """The variants' maps under ZB-H1 (deepseek-v4's learned head's weight gradient deferred
    on the last stage too)."""
    plan = zb_plan(pp=2, global_batch_size=8, steps=1, config_overrides=dict(mhc_variant=variant))
    check_zb(plan, monkeypatch)


def test_pp2_equals_1f1b():
    assert_same_as_1f1b(zb_plan(pp=2, global_batch_size=12))


def test_pp2_fewer_microbatches_than_stages_matches_reference(monkeypatch):
    """One micro-batch: everything is warm-up and flush."""
    check_zb(zb_plan(pp=2, global_batch_size=2, steps=1), monkeypatch)


def test_pp2_traced_order_is_the_schedule():
    assert_traced_order_is_the_schedule(zb_plan(pp=2, global_batch_size=8, steps=1))


def test_pp2_moe_mhc_matches_reference(monkeypatch):
    """mhc_moe_mla_cases' DeepSeek-shaped MoE (dense first layer, shared expert, top-2 of 4
    routed experts, aux loss on): every expert's linears defer their weight gradients."""
    overrides = dict(MOE, moe_layer_freq=[0, 1, 1, 1])
    plan = zb_plan(
        pp=2, num_moe_experts=4, global_batch_size=8, steps=1, config_overrides=overrides
    )
    check_zb(plan, monkeypatch)
