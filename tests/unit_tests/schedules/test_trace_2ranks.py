"""Recorded pipeline orders of real runs against megatron-core's rules, on 2 ranks:
interleaved PP=2 x VPP=2 with 4 micro-batches (rank 0's warm-up covers half of its 8 virtual
steps), with batched P2P and with ``overlap_p2p_comm`` (what megatron's training arguments set
for every interleaved run, and require at PP=2: the steady state then has separate forward and
backward exchanges). Same harness as test_trace_4ranks.py.
Run: torchrun --nproc_per_node 2 -m pytest tests/unit_tests/schedules/test_trace_2ranks.py"""

import pytest
from test_trace_4ranks import all_steps, tiny, traced_run

from megatron_ext.schedules.schedule import (
    ScheduleMismatch,
    SchedulePlan,
    assert_same_order,
    build_schedule,
)

pytestmark = [pytest.mark.world_size(2)]

OVERLAP = dict(overlap_p2p_comm=True, batch_p2p_comm=False)


@pytest.mark.parametrize("overlap", [False, True], ids=["batched_p2p", "overlap_p2p_comm"])
def test_pp2_vpp2_four_microbatches_recorded_order_equals_megatrons_rules(overlap):
    plan = tiny(
        pp=2,
        vpp=2,
        num_layers=4,
        global_batch_size=8,
        config_overrides=OVERLAP if overlap else {},
    )
    assert plan.local_microbatches() == 4
    tracer, _, _ = traced_run(plan)
    recorded = all_steps(tracer, plan)
    theory = SchedulePlan(pp=2, vpp=2, microbatches=4, overlap_p2p_comm=overlap)
    assert_same_order(build_schedule(theory), recorded)
    # The other P2P mode's order is a different one: the comparison can fail.
    other = SchedulePlan(pp=2, vpp=2, microbatches=4, overlap_p2p_comm=not overlap)
    with pytest.raises(ScheduleMismatch):
        assert_same_order(build_schedule(other), recorded)
