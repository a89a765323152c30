"""ZB-H1 at PP=4 with micro-batch counts the 1F1B-shaped tests do not reach: fewer than the
stages (m=3: no steady state, rank 0 never fills its warm-up) and odd (m=7). With mHC, each
matches the single-rank reference (loss, every gradient, weights after the step) and its W
steps computed deferred weight gradients.
Run: torchrun --nproc_per_node 4 -m pytest tests/unit_tests/pipeline_parallel/test_zero_bubble_matrix_4ranks.py"""

import pytest
from zero_bubble_cases import check_zb, zb_plan

pytestmark = [
    pytest.mark.world_size(4),
    pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC recompute"),
]


@pytest.mark.parametrize("microbatches", [3, 7], ids=["m3_fewer_than_stages", "m7_odd"])
def test_pp4_microbatch_counts_match_reference(monkeypatch, microbatches):
    check_zb(zb_plan(pp=4, global_batch_size=2 * microbatches, steps=1), monkeypatch)
