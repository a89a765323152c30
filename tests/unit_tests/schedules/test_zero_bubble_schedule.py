"""ZB-H1 as data (megatron_ext.schedules.schedule.zero_bubble_h1): for many plans, every rank
runs one F, B and W per micro-batch, each W after its B with at most ``rank`` W pending, the
steps complete (no compute or P2P deadlock), the P2P calls pair up between neighbours in
order, peak in-flight micro-batches stay at 1F1B's, and the simulated bubble is the zero-bubble
paper's (p-1)/(3m+p-1). Each check is shown to catch a wrong theory (a mutated step list)."""

from __future__ import annotations

import copy
from collections import Counter

import pytest

from megatron_ext.schedules.schedule import (
    Compute,
    Exchange,
    Message,
    Schedule,
    ScheduleDeadlock,
    SchedulePlan,
    build_schedule,
    simulate,
    textbook_bubble,
    zero_bubble_h1,
)

# (pp, m): m < pp, m = 1, pp = 1, odd sizes, m = pp, m >> pp.
PLANS = [
    (1, 1),
    (1, 5),
    (2, 1),
    (2, 2),
    (2, 3),
    (2, 8),
    (3, 1),
    (3, 2),
    (3, 5),
    (3, 7),
    (4, 1),
    (4, 3),
    (4, 4),
    (4, 8),
    (4, 13),
    (5, 2),
    (5, 5),
    (5, 9),
    (7, 3),
    (7, 16),
    (8, 8),
    (8, 32),
]


def zb(pp: int, m: int) -> Schedule:
    return build_schedule(SchedulePlan(pp=pp, microbatches=m, schedule="zb-h1"))


# ---------------------------------------------------------------------------------------------
# The checks (each returns the problems it finds; empty when the schedule is right)
# ---------------------------------------------------------------------------------------------
def each_pass_once(schedule: Schedule) -> list[str]:
    problems = []
    m = schedule.plan.microbatches
    for rank in range(len(schedule.ranks)):
        counts = Counter((s.kind, s.microbatch) for s in schedule.computes(rank))
        wanted = Counter((k, mb) for k in "FBW" for mb in range(m))
        if counts != wanted:
            problems.append(f"rank {rank}: {sorted((counts - wanted) + (wanted - counts))}")
    return problems


def order_and_pending(schedule: Schedule) -> list[str]:
    """F before B before W of each micro-batch, and before every F or B (and at the end) at
    most ``rank`` weight gradients pending: the ZB-H1 memory rule."""
    problems = []
    for rank in range(len(schedule.ranks)):
        done: set[tuple[str, int]] = set()
        pending = 0
        for step in schedule.computes(rank):
            before = {"B": "F", "W": "B"}.get(step.kind)
            if before and (before, step.microbatch) not in done:
                problems.append(f"rank {rank}: {step.label()} before {before}{step.microbatch}")
            if step.kind in "FB" and pending > rank:
                problems.append(f"rank {rank}: {pending} W pending before {step.label()}")
            pending += {"B": 1, "W": -1}.get(step.kind, 0)
            done.add((step.kind, step.microbatch))
        if pending:
            problems.append(f"rank {rank}: {pending} W never run")
    return problems


def _messages(steps, direction: str) -> list[tuple[int, Message]]:
    """(index of the exchange, message) of every message of ``direction``, in order."""
    return [
        (index, message)
        for index, step in enumerate(steps)
        if isinstance(step, Exchange)
        for message in step.messages
        if message.direction == direction
    ]


# A message and the one it pairs with on the neighbour (the next rank for *_next).
PARTNER = {"send_next": "recv_prev", "recv_next": "send_prev"}


def p2p_pairs(schedule: Schedule) -> list[str]:
    """Every send_next of rank r is received, in order and for the same micro-batch, by a
    recv_prev of rank r+1, and every send_prev of r+1 by a recv_next of r; the ends post
    nothing outwards."""
    problems = []
    ranks = schedule.ranks
    if _messages(ranks[0], "recv_prev") + _messages(ranks[0], "send_prev"):
        problems.append("rank 0 talks to a previous stage")
    if _messages(ranks[-1], "send_next") + _messages(ranks[-1], "recv_next"):
        problems.append(f"rank {len(ranks) - 1} talks to a next stage")
    for r in range(len(ranks) - 1):
        for mine, theirs in PARTNER.items():
            here = [m.microbatch for _, m in _messages(ranks[r], mine)]
            there = [m.microbatch for _, m in _messages(ranks[r + 1], theirs)]
            if here != there or here != list(range(schedule.plan.microbatches)):
                problems.append(f"ranks {r}/{r + 1}: {mine} {here} vs {theirs} {there}")
    return problems


def p2p_completes(schedule: Schedule) -> list[str]:
    """Run every rank's steps with P2P calls that post all their messages and wait for each
    to be matched (batched isend/irecv, then wait): a call finishes once the neighbour has
    reached the call holding each message's partner. Returns where the ranks got stuck."""
    ranks = schedule.ranks
    # (rank, direction, k) -> index of the exchange holding the k-th such message
    where = {}
    for r, steps in enumerate(ranks):
        for direction in ("send_next", "recv_prev", "send_prev", "recv_next"):
            for k, (index, _) in enumerate(_messages(steps, direction)):
                where[(r, direction, k)] = index
    partner = {
        "send_next": (1, "recv_prev"),
        "recv_next": (1, "send_prev"),
        "recv_prev": (-1, "send_next"),
        "send_prev": (-1, "recv_next"),
    }
    numbered = []  # per rank, per exchange: [(direction, k)]
    for steps in ranks:
        count: Counter = Counter()
        rows = []
        for step in steps:
            row = []
            if isinstance(step, Exchange):
                for message in step.messages:
                    row.append((message.direction, count[message.direction]))
                    count[message.direction] += 1
            rows.append(row)
        numbered.append(rows)
    position = [0] * len(ranks)
    progressed = True
    while progressed:
        progressed = False
        for r, steps in enumerate(ranks):
            while position[r] < len(steps):
                ready = True
                for direction, k in numbered[r][position[r]]:
                    offset, other = partner[direction]
                    index = where.get((r + offset, other, k))
                    if index is None or position[r + offset] < index:
                        ready = False
                if not ready:
                    break
                position[r] += 1
                progressed = True
    return [
        f"rank {r} stuck at step {position[r]}"
        for r, steps in enumerate(ranks)
        if position[r] < len(steps)
    ]


def data_flows(schedule: Schedule) -> list[str]:
    """A tensor is sent after the pass that makes it (an activation after its F, a gradient
    after its B) and received before the pass that takes it."""
    made_by = {"send_next": "F", "send_prev": "B"}
    taken_by = {"recv_prev": "F", "recv_next": "B"}
    problems = []
    for rank, steps in enumerate(schedule.ranks):
        done: set[tuple[str, int]] = set()
        received: set[tuple[str, int]] = set()
        for step in steps:
            if isinstance(step, Compute):
                wanted = {"F": "recv_prev", "B": "recv_next"}.get(step.kind)
                if wanted in _expected_receives(schedule, rank) and (
                    (wanted, step.microbatch) not in received
                ):
                    problems.append(f"rank {rank}: {step.label()} before its tensor arrived")
                done.add((step.kind, step.microbatch))
                continue
            for m in step.messages:
                if m.direction in made_by and (made_by[m.direction], m.microbatch) not in done:
                    problems.append(f"rank {rank}: {m.label()} before {made_by[m.direction]}")
                if m.direction in taken_by:
                    received.add((m.direction, m.microbatch))
    return problems


def _expected_receives(schedule: Schedule, rank: int) -> set[str]:
    """The first stage gets no activations, the last no gradients."""
    last = len(schedule.ranks) - 1
    return {
        d for d, at_end in (("recv_prev", rank == 0), ("recv_next", rank == last)) if not at_end
    }


CHECKS = (each_pass_once, order_and_pending, data_flows, p2p_pairs, p2p_completes)


def all_problems(schedule: Schedule) -> list[str]:
    return [f"{check.__name__}: {p}" for check in CHECKS for p in check(schedule)]


# ---------------------------------------------------------------------------------------------
# The theory holds
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pp,m", PLANS, ids=[f"pp{p}_m{m}" for p, m in PLANS])
def test_zb_h1_holds_its_rules(pp, m):
    schedule = zb(pp, m)
    assert all_problems(schedule) == []
    one_f_one_b = build_schedule(SchedulePlan(pp=pp, microbatches=m))
    for check in (data_flows, p2p_pairs, p2p_completes):  # (1F1B passes the P2P checks too)
        assert check(one_f_one_b) == [], check.__name__
    timeline = simulate(schedule)  # raises ScheduleDeadlock if the order cannot complete
    assert {s.step.kind for s in timeline.slots} == {"F", "B", "W"}
    # Activations are held until W, and still no rank holds more than 1F1B's first stage.
    assert max(schedule.peak_in_flight()) == max(one_f_one_b.peak_in_flight()) == min(pp, m)
    # The same work as 1F1B (B+W = one backward), never slower.
    assert timeline.makespan <= simulate(one_f_one_b).makespan
    if m >= pp:
        assert timeline.bubble() == pytest.approx((pp - 1) / (3 * m + pp - 1))


def test_pp4_m8_bubble_is_at_most_half_of_1f1b():
    """F=1, B=1, W=1 (backward_time=2, weight_time=1): ZB-H1 takes 3m + p - 1 = 27 units,
    1F1B (m + p - 1) * 3 = 33; every rank computes 24: bubbles 3/27 and 9/33."""
    schedule = zb(4, 8)
    timeline = simulate(schedule, forward_time=1, backward_time=2, weight_time=1)
    baseline = simulate(build_schedule(SchedulePlan(pp=4, microbatches=8)), 1, 2, 1)
    assert timeline.makespan == 27 and baseline.makespan == 33
    assert timeline.bubble() == pytest.approx(1 / 9) == pytest.approx(3 / (3 * 8 + 3))
    assert baseline.bubble() == pytest.approx(textbook_bubble(4, 8)) == pytest.approx(3 / 11)
    assert timeline.bubble() <= baseline.bubble() / 2
    assert schedule.peak_in_flight() == [4, 4, 4, 4]
    # The last rank never waits once it started: F0 B0 F1 B1 ... with its W's in between.
    last = [s.step.label() for s in timeline.slots if s.rank == 3]
    assert last[:8] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]
    assert last[-4:] == ["W4", "W5", "W6", "W7"]


def test_a_steady_b_followed_by_w_sends_its_gradient_first():
    """When a W follows a steady B, 1F1B's send_backward_recv_forward is split: the gradient
    leaves, the W runs, then the next activation is received."""
    steps = zb(4, 8).ranks[2]
    labels = [s.call if isinstance(s, Exchange) else s.label() for s in steps]
    at = labels.index("W0")
    assert labels[at - 2 : at + 2] == ["B2", "send_backward", "W0", "recv_forward"]
    assert steps[at - 1] == Exchange("send_backward", (Message("send_prev", 2, 0),))
    assert steps[at + 1] == Exchange("recv_forward", (Message("recv_prev", 4, 0),))


# ---------------------------------------------------------------------------------------------
# A wrong theory is caught
# ---------------------------------------------------------------------------------------------
def mutated(schedule: Schedule, rank: int, change) -> Schedule:
    wrong = copy.deepcopy(schedule)
    wrong.ranks[rank] = change(list(wrong.ranks[rank]))
    return wrong


def _index(steps, label: str) -> int:
    return next(i for i, s in enumerate(steps) if isinstance(s, Compute) and s.label() == label)


def _drop(label):
    return lambda steps: [s for i, s in enumerate(steps) if i != _index(steps, label)]


def _move_before(label, anchor):
    def change(steps):
        step = steps.pop(_index(steps, label))
        steps.insert(_index(steps, anchor), step)
        return steps

    return change


def test_a_missing_w_is_caught():
    problems = all_problems(mutated(zb(4, 8), 2, _drop("W5")))
    assert any(p.startswith("each_pass_once: rank 2") for p in problems)
    assert any("order_and_pending: rank 2: 1 W never run" in p for p in problems)


def test_a_w_before_its_b_is_caught_and_cannot_be_simulated():
    wrong = mutated(zb(4, 8), 1, _move_before("W3", "B3"))
    assert "order_and_pending: rank 1: W3 before B3" in all_problems(wrong)
    with pytest.raises(ScheduleDeadlock, match="rank 1 at W3"):
        simulate(wrong)


def test_deferring_one_w_too_many_is_caught():
    """Rank 1 allowed two pending W (rank + 1): it holds one micro-batch more than 1F1B's
    first stage would allow, and the pending rule says where."""
    right = zb(4, 8)
    wrong = copy.deepcopy(right)
    wrong.ranks[1] = zero_bubble_h1(8, 2, False, False, pending_limit=2)
    assert "order_and_pending: rank 1: 2 W pending before F4" in all_problems(wrong)
    assert max(wrong.peak_in_flight()) == 5 > max(right.peak_in_flight())


def test_a_mislabelled_message_is_caught():
    """Rank 1 says it sends micro-batch 4's activation where it sends 3's."""

    def relabel(steps):
        for i, step in enumerate(steps):
            if isinstance(step, Exchange) and Message("send_next", 3, 0) in step.messages:
                steps[i] = Exchange(
                    step.call,
                    tuple(
                        Message("send_next", 4, 0) if m == Message("send_next", 3, 0) else m
                        for m in step.messages
                    ),
                )
        return steps

    problems = all_problems(mutated(zb(4, 8), 1, relabel))
    assert problems == [
        "data_flows: rank 1: sF4 before F",
        "p2p_pairs: ranks 1/2: send_next [0, 1, 2, 4, 4, 5, 6, 7] vs recv_prev "
        "[0, 1, 2, 3, 4, 5, 6, 7]",
    ]


def test_sending_a_gradient_before_computing_it_is_caught():
    """Rank 1 swaps two exchanges: B0's gradient goes out before B0 ran."""

    def swap(steps):
        a = _index(steps, "B0") + 1  # send_backward_recv_forward(rF3+sB0)
        b = a - 2  # send_forward_recv_backward(sF2+rB0), before B0
        steps[a], steps[b] = steps[b], steps[a]
        return steps

    problems = all_problems(mutated(zb(4, 8), 1, swap))
    assert "data_flows: rank 1: sB0 before B" in problems
    assert "data_flows: rank 1: B0 before its tensor arrived" in problems


def test_receiving_before_sending_deadlocks():
    """Rank 1 waits for micro-batch 4's activation before it sends B1's gradient, and rank 0
    (its call split into recv_backward, then send_forward) waits for that gradient before it
    sends the activation: each order is fine alone, together both ranks hang."""
    right = zb(4, 8)

    def receive_first(steps):
        send = steps.index(Exchange("send_backward", (Message("send_prev", 1, 0),)))
        recv = next(i for i in range(send, len(steps)) if steps[i].label() == "rF4")
        steps.insert(send, steps.pop(recv))
        return steps

    def split_call(steps):
        both = Exchange(
            "send_forward_recv_backward", (Message("send_next", 4, 0), Message("recv_next", 1, 0))
        )
        at = steps.index(both)
        steps[at : at + 1] = [
            Exchange("recv_backward", (Message("recv_next", 1, 0),)),
            Exchange("send_forward", (Message("send_next", 4, 0),)),
        ]
        return steps

    alone = mutated(right, 1, receive_first)
    assert all_problems(alone) == []  # waiting first is fine while rank 0 posts both at once
    wrong = mutated(alone, 0, split_call)
    for check in CHECKS[:-1]:
        assert check(wrong) == [], check.__name__
    stuck = p2p_completes(wrong)
    calls = [
        Exchange("recv_backward", (Message("recv_next", 1, 0),)),
        Exchange("recv_forward", (Message("recv_prev", 4, 0),)),
    ]
    assert stuck[:2] == [f"rank {r} stuck at step {wrong.ranks[r].index(calls[r])}" for r in (0, 1)]
