"""ZB-H1 executing a schedule given as text (config.pipeline_schedule_file, megatron_ext.
schedules.text) on 2 ranks: the built order's text gives the built run's losses and gradients
bit for bit, a different order (every W right after its B) matches the single-rank reference
and is the order the ranks trace, and a text that fails the checks stops every rank with the
same one-line error.
Run: torchrun --nproc_per_node 2 -m pytest tests/unit_tests/pipeline/test_zero_bubble_text_2ranks.py"""

from __future__ import annotations

import dataclasses

import pytest
from zero_bubble_cases import (
    assert_runs_identical,
    check_zb,
    recorded_orders,
    traced_zb_run,
    zb_plan,
    zb_schedule,
)

from megatron_ext.pipeline.zero_bubble import ZeroBubbleUnsupportedError
from megatron_ext.schedules.schedule import Compute, SchedulePlan, assert_same_order, build_schedule
from megatron_ext.schedules.text import format_text, schedule_from_text
from megatron_ext.testing.equivalence import TrainPlan

pytestmark = [
    pytest.mark.world_size(2),
    pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC recompute"),
]


def _from_text(plan: TrainPlan, text: str, tmp_path) -> TrainPlan:
    """``plan`` with its ZB-H1 order read from ``text`` (each rank writes its own copy)."""
    path = tmp_path / "order.txt"
    path.write_text(text)
    overrides = dict(plan.parallel_overrides, pipeline_schedule_file=str(path))
    return dataclasses.replace(plan, parallel_overrides=overrides)


def _w_after_every_b(plan: TrainPlan) -> str:
    """1F1B's order with each backward's W right after its B: not the built ZB-H1 order on
    rank 1 (which keeps one W pending), the same work."""
    one_f_one_b = build_schedule(SchedulePlan(pp=plan.pp, microbatches=plan.local_microbatches()))
    lines = []
    for rank in range(plan.pp):
        tokens = []
        for step in one_f_one_b.computes(rank):
            tokens.append(step.label())
            if step.kind == "B":
                tokens.append(f"W{step.microbatch}")
        lines.append(" ".join(tokens))
    return "\n".join(lines) + "\n"


def test_text_of_the_built_order_gives_identical_loss_and_gradients(tmp_path):
    plan = zb_plan(pp=2, global_batch_size=12)
    text = format_text(zb_schedule(plan))
    assert_runs_identical(plan, _from_text(plan, text, tmp_path))


def test_a_different_order_matches_the_reference_and_is_what_runs(monkeypatch, tmp_path):
    plan = zb_plan(pp=2, global_batch_size=8)
    text = _w_after_every_b(plan)
    assert text != format_text(zb_schedule(plan))
    ordered = _from_text(plan, text, tmp_path)
    check_zb(ordered, monkeypatch)
    traced = dataclasses.replace(ordered, steps=1)
    recorded = recorded_orders(traced, traced_zb_run(traced))
    expected = schedule_from_text(
        text, SchedulePlan(pp=2, microbatches=plan.local_microbatches(), schedule="zb-h1")
    )
    assert_same_order(expected, recorded)
    assert any(isinstance(s, Compute) and s.kind == "W" for s in recorded[1])


def test_a_text_over_the_peak_stops_every_rank_in_one_line(tmp_path):
    plan = zb_plan(pp=2, global_batch_size=8, steps=1)
    m = plan.local_microbatches()
    forwards = " ".join(f"F{i}" for i in range(m))
    rest = " ".join(f"B{i} W{i}" for i in range(m))
    text = f"{forwards} {rest}\n" + _w_after_every_b(plan).splitlines()[1] + "\n"
    with pytest.raises(ZeroBubbleUnsupportedError) as raised:
        assert_runs_identical(plan, _from_text(plan, text, tmp_path))
    message = str(raised.value)
    assert "pipeline_schedule_file" in message and "rank 0, token 3 'F2'" in message
    assert "\n" not in message
