"""ZB-H1 (megatron_ext.pipeline.zero_bubble) on 4 ranks: PP=4 with mHC, TP=2 x PP=2 with
sequence parallelism and DP=2 x PP=2 with the distributed optimizer (DDP's overlapped grad
reduction off and on) match the single-rank reference (loss, every gradient of every step,
weights after the last) with every W step computing deferred weight gradients; PP=4 equals
megatron's 1F1B; the traced order is build_schedule's, action for action.
Run: torchrun --nproc_per_node 4 -m pytest tests/unit_tests/pipeline/test_zero_bubble_4ranks.py"""

import pytest
from zero_bubble_cases import (
    assert_same_as_1f1b,
    assert_traced_order_is_the_schedule,
    check_zb,
    zb_plan,
)

pytestmark = [
    pytest.mark.world_size(4),
    pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC recompute"),
]


@pytest.mark.parametrize(
    "layout",
    [
        # 8 micro-batches: ranks 1-3 keep 1-3 W pending through the steady state.
        dict(pp=4, global_batch_size=16),
        dict(tp=2, pp=2, sequence_parallel=True, global_batch_size=12),
        dict(pp=2, use_distributed_optimizer=True, global_batch_size=24),
        dict(pp=2, use_distributed_optimizer=True, overlap_grad_reduce=True, global_batch_size=24),
    ],
    ids=["pp4", "tp2_pp2_sp", "dp2_pp2_distopt", "dp2_pp2_distopt_overlap_grad_reduce"],
)
def test_zb_h1_with_mhc_matches_reference(monkeypatch, layout):
    check_zb(zb_plan(**layout), monkeypatch)


def test_pp4_equals_1f1b():
    assert_same_as_1f1b(zb_plan(pp=4, global_batch_size=16))


@pytest.mark.parametrize(
    "layout",
    [dict(pp=4, global_batch_size=12), dict(pp=2, global_batch_size=16)],
    ids=["pp4", "dp2_pp2"],
)
def test_traced_order_is_the_schedule(layout):
    assert_traced_order_is_the_schedule(zb_plan(steps=1, **layout))
