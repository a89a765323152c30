"""ZB-H1 at PP=4 with micro-batch counts the 1F1B-shaped tests do not reach: fewer than the
stages (m=3: no steady state, rank 0 never fills its warm-up) and odd (m=7); and activation
recompute with TP=2 x PP=2 and sequence parallelism (megatron's full recompute, plain; mHC's
recompute). Each matches the single-rank reference (loss, every gradient, weights after the
step) and its W steps computed deferred weight gradients (mHC, 4 streams, unless stated).
Run: torchrun --nproc_per_node 4 -m pytest tests/unit_tests/pipeline/test_zero_bubble_matrix_4ranks.py"""

import pytest
from zero_bubble_cases import check_zb, zb_plan

pytestmark = [
    pytest.mark.world_size(4),
    pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC recompute"),
]


@pytest.mark.parametrize("microbatches", [3, 7], ids=["m3_fewer_than_stages", "m7_odd"])
def test_pp4_microbatch_counts_match_reference(monkeypatch, microbatches):
    check_zb(zb_plan(pp=4, global_batch_size=2 * microbatches, steps=1), monkeypatch)


@pytest.mark.parametrize(
    "recompute, mhc",
    [
        (
            dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
            False,
        ),
        (dict(recompute_granularity="selective", recompute_modules=["mhc"]), True),
    ],
    ids=["full_uniform", "mhc"],
)
def test_tp2_pp2_sp_recompute_matches_reference(monkeypatch, recompute, mhc):
    """B's recomputed forward under sequence parallelism: the W work keeps the recomputed
    layer input before its all-gather and gathers it again in W."""
    plan = zb_plan(
        mhc=mhc,
        tp=2,
        pp=2,
        sequence_parallel=True,
        global_batch_size=6,
        steps=1,
        config_overrides=recompute,
    )
    check_zb(plan, monkeypatch)
