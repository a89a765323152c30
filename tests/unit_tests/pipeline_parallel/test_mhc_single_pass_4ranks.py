"""Single-pass mHC (megatron_ext.mhc.single_pass) on 4 ranks: PP4 (three edges, each carrying
the coefficients), TP2 x PP2 with sequence parallelism and CP2 x PP2 (the payload's fields
split along the sequence axis) equal the single-rank reference (loss, every gradient, weights)."""

import pytest
from mhc_pipeline_cases import all_ranks, check_mhc, recorded_p2p_shapes
from single_pass_cases import single_pass_plan

pytestmark = [
    pytest.mark.world_size(4),
    pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC recompute"),
]


def test_pp4_matches_reference(monkeypatch):
    plan = single_pass_plan(pp=4, steps=1)
    with recorded_p2p_shapes(monkeypatch) as seen:
        check_mhc(plan)
    shapes = {shape for records in all_ranks(seen) for _, shape in records}
    assert shapes == {(plan.seq_length, plan.micro_batch_size, plan.hidden_size * 4 + 4)}


def test_tp2_pp2_sequence_parallel_matches_reference(monkeypatch):
    """Each TP rank sends its half of the sequence of both fields."""
    plan = single_pass_plan(tp=2, pp=2, sequence_parallel=True)
    with recorded_p2p_shapes(monkeypatch) as seen:
        check_mhc(plan)
    shapes = {shape for records in all_ranks(seen) for _, shape in records}
    assert shapes == {(plan.seq_length // 2, plan.micro_batch_size, plan.hidden_size * 4 + 4)}


def test_cp2_pp2_matches_reference(monkeypatch):
    """Each CP rank sends the coefficients of its own (load-balanced) chunks of the sequence
    (megatron-ext's local CP attention; per-token loss as megatron sums it over CP)."""
    plan = single_pass_plan(
        cp=2,
        pp=2,
        steps=1,
        num_layers=2,
        global_batch_size=4,
        config_overrides=dict(calculate_per_token_loss=True),
    )
    with recorded_p2p_shapes(monkeypatch) as seen:
        check_mhc(plan)
    shapes = {shape for records in all_ranks(seen) for _, shape in records}
    assert shapes == {(plan.seq_length // 2, plan.micro_batch_size, plan.hidden_size * 4 + 4)}
