"""The schedule as data: bubble fractions, peak in-flight micro-batches and messages per edge
against values worked out by hand, megatron-core's refusals, and deadlock detection."""

import pytest

from megatron_ext.multimodule import ModulePlan, MultiModulePlan
from megatron_ext.schedules.schedule import (
    Compute,
    Exchange,
    Message,
    ScheduleDeadlock,
    SchedulePlan,
    build_schedule,
    format_timeline,
    message_bytes,
    schedule_table,
    simulate,
    textbook_bubble,
)


def test_1f1b_pp4_m8_by_hand():
    """Rank r warms up with 3-r forwards, so it holds 4-r micro-batches at its fullest. With
    F=1 and B=2 the iteration takes (m+p-1)*3 = 33 units and each rank computes m*3 = 24:
    bubble 9/33 = 3/11, exactly the textbook (p-1)/(m+p-1)."""
    schedule = build_schedule(SchedulePlan(pp=4, microbatches=8))
    assert schedule.peak_in_flight() == [4, 3, 2, 1]
    timeline = simulate(schedule)
    assert timeline.makespan == 33
    assert timeline.bubble() == pytest.approx(3 / 11)
    assert textbook_bubble(4, 8) == pytest.approx(3 / 11)
    assert [s.label() for s in schedule.computes(0)][:6] == ["F0", "F1", "F2", "F3", "B0", "F4"]


def test_1f1b_with_fewer_microbatches_than_stages():
    """m=2 < p=4: every rank's warm-up is capped at m; rank 0 then holds both."""
    schedule = build_schedule(SchedulePlan(pp=4, microbatches=2))
    assert schedule.peak_in_flight() == [2, 2, 2, 1]
    assert simulate(schedule).bubble() == pytest.approx(3 / 5)  # (p-1)/(m+p-1), 9 of 15 units idle


def test_interleaved_pp2_vpp2_m2_by_hand():
    """Chunk order on every rank is F0c0 F1c0 F0c1 F1c1 (group size 2). Rank 0 warms up with
    2*(2-0-1) + (2-1)*2 = 4 forwards (all of them), rank 1 with 2, then one more forward:
    peaks 4 and 3. Virtual stages 0..3 = (c0,r0) (c0,r1) (c1,r0) (c1,r1); with F=1, B=2 the
    last backward on rank 0 ends at 15, and each rank computes 4*3 = 12: bubble 3/15."""
    schedule = build_schedule(SchedulePlan(pp=2, vpp=2, microbatches=2))
    assert schedule_table(2, 2, 2) == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert schedule.peak_in_flight() == [4, 3]
    assert [s.label(2) for s in schedule.computes(0)] == [
        "F0c0",
        "F1c0",
        "F0c1",
        "F1c1",
        "B0c1",
        "B1c1",
        "B0c0",
        "B1c0",
    ]
    timeline = simulate(schedule)
    assert timeline.makespan == 15
    assert timeline.bubble() == pytest.approx(0.2)
    assert textbook_bubble(2, 2, 2) == pytest.approx(1 / 6)


def test_interleaved_messages_wrap_from_the_last_rank_to_the_first():
    """PP=2 x VPP=2, m=4: rank 0 sends both chunks' activations to rank 1 (8) and receives the
    gradients of both (8); rank 1's chunk-0 output wraps round to rank 0's chunk 1 (4), and
    rank 0's chunk-1 gradients go the other way round to rank 1's chunk 0 (4)."""
    schedule = build_schedule(SchedulePlan(pp=2, vpp=2, microbatches=4))
    assert schedule.messages_per_edge() == {(0, 1): {"F": 8, "B": 4}, (1, 0): {"F": 4, "B": 8}}
    first = schedule.ranks[1][0]
    assert first == Exchange("recv_forward", (Message("recv_prev", 0, 0),))
    # The four-way exchange that ends rank 0's warm-up also asks for chunk 1's first gradient.
    assert (
        Exchange(
            "send_forward_backward_recv_forward_backward",
            (Message("send_next", 1, 1), Message("recv_next", 0, 1)),
        )
        in schedule.ranks[0]
    )


def test_bytes_per_message_with_mhc():
    # [s, b, n*h] fp32: 32 * 2 * (4*64) * 4 bytes; sequence parallelism divides s by TP.
    assert message_bytes(64, 32, 2, mhc_streams=4) == 32 * 2 * 256 * 4
    assert message_bytes(64, 32, 2, mhc_streams=4, tp=2, sequence_parallel=True) == 16 * 2 * 256 * 4


def test_megatrons_refusals_are_reported():
    assert "must lie in [pp=4" in SchedulePlan(pp=4, vpp=2, microbatches=2).problems()[0]
    assert "last group of 2" in SchedulePlan(pp=4, vpp=2, microbatches=6).problems()[0]
    with pytest.raises(ValueError, match="--vpp needs --pp > 1"):
        build_schedule(SchedulePlan(pp=1, vpp=2, microbatches=4))


def test_multimodule_warmup_per_rank_and_stage_links():
    """Encoders of depths 1 and 2 into one language model: warm-ups 1, 2, 1, 0 (peaks one
    more), activations flow a -> llm, b0 -> b1 -> llm."""
    plan = MultiModulePlan(
        {"a": ModulePlan(), "b": ModulePlan(pp=2, first_rank=1), "llm": ModulePlan(first_rank=3)},
        {"a": ["llm"], "b": ["llm"]},
        "llm",
        world_size=4,
    )
    schedule = build_schedule(SchedulePlan(microbatches=3, multimodule=plan))
    assert schedule.peak_in_flight() == [2, 3, 2, 1]
    assert schedule.next_ranks == [[3], [2], [3], []]
    assert schedule.prev_ranks == [[], [], [1], [0, 2]]
    assert simulate(schedule).makespan > 0


def test_a_cyclic_order_is_reported_as_a_deadlock():
    schedule = build_schedule(SchedulePlan(pp=2, microbatches=2))
    schedule.ranks[1] = [Compute("B", 0), Compute("F", 0), Compute("F", 1), Compute("B", 1)]
    with pytest.raises(ScheduleDeadlock, match="rank 1 at B0"):
        simulate(schedule)


def test_timeline_grid_marks_idle_slots():
    """PP=2, m=2: rank 1 runs F0 1-2, B0 2-4, F1 4-5, B1 5-7, so rank 0's B0 starts at 4 and
    its B1 at 7: 9 units, 3 of them idle on rank 0 (bubble 1/3)."""
    text = format_timeline(simulate(build_schedule(SchedulePlan(pp=2, microbatches=2))))
    assert text.splitlines()[0].split("|")[1].split() == [
        "F0",
        "F1",
        ".",
        ".",
        "B0",
        "~",
        ".",
        "B1",
        "~",
    ]
