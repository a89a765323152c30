"""Single-pass mHC (megatron_ext.mhc.single_pass) under pipeline parallelism on 2 ranks: the
coefficients ride the payload's ``pre_mix`` field with their gradient, and 1F1B, interleaved
(wrap-around edge included) and ZB-H1 runs equal the single-rank reference (loss, every
gradient, weights after 2 steps), on the megatron maps and on DeepSeek's (upstream's single
pass); cutting that gradient makes them differ."""

import pytest
from mhc_pipeline_cases import all_ranks, check_mhc, recorded_p2p_shapes
from single_pass_cases import (
    DEEPSEEK_MAPS,
    assert_cut_differs_from_reference,
    deepseek_single_pass_plan,
    single_pass_plan,
)

pytestmark = [
    pytest.mark.world_size(2),
    pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC recompute"),
]


def _assert_every_exchange_carries_the_payload(plan, records_per_rank) -> None:
    """Every message is [s', b, n*h + n] (fp32 pipeline: the coefficients take n slots)."""
    expected = (plan.seq_length, plan.micro_batch_size, plan.hidden_size * 4 + 4)
    shapes = {shape for records in records_per_rank for _, shape in records}
    assert shapes == {expected}, shapes


def test_pp2_1f1b_matches_reference(monkeypatch):
    plan = single_pass_plan(pp=2)
    with recorded_p2p_shapes(monkeypatch) as seen:
        check_mhc(plan)
    _assert_every_exchange_carries_the_payload(plan, all_ranks(seen))


def test_pp2_vpp2_interleaved_matches_reference(monkeypatch):
    """Four virtual stages: three edges, one of them the wrap-around from rank 1 to rank 0."""
    plan = single_pass_plan(pp=2, vpp=2)
    with recorded_p2p_shapes(monkeypatch) as seen:
        check_mhc(plan)
    _assert_every_exchange_carries_the_payload(plan, all_ranks(seen))


def test_pp2_zero_bubble_matches_reference():
    check_mhc(single_pass_plan(pp=2, schedule="zb-h1", global_batch_size=12))


def test_pp2_cutting_the_coefficient_gradient_differs_from_reference(monkeypatch):
    """Negative control: the same run with the received pre_mix detached fails."""
    assert_cut_differs_from_reference(single_pass_plan(pp=2, steps=1), monkeypatch)


def test_pp2_standalone_embedding_and_loss_stages_match_reference():
    """Layout E|tt|tt|L: the embedding-only chunk sends e_0 as the coefficients, the loss-only
    chunk contracts with the coefficients it received."""
    plan = single_pass_plan(
        pp=2, vpp=2, steps=1, parallel_overrides=dict(pipeline_model_parallel_layout="E|tt|tt|L")
    )
    check_mhc(plan)


@pytest.mark.parametrize("variant", DEEPSEEK_MAPS)
def test_pp2_1f1b_deepseek_maps_match_reference(variant, monkeypatch):
    """Upstream's single pass (DeepSeek's maps, fp32 aggregation) across a stage edge."""
    plan = deepseek_single_pass_plan(variant, pp=2)
    with recorded_p2p_shapes(monkeypatch) as seen:
        check_mhc(plan)
    _assert_every_exchange_carries_the_payload(plan, all_ranks(seen))


def test_pp2_vpp2_interleaved_deepseek_maps_match_reference():
    check_mhc(deepseek_single_pass_plan(pp=2, vpp=2))


def test_pp2_zero_bubble_deepseek_maps_match_reference():
    check_mhc(deepseek_single_pass_plan(pp=2, schedule="zb-h1", global_batch_size=12))
