"""What ``megatron-ext schedule`` prints: the grid, the bubble, peak in-flight micro-batches
and bytes per pipeline edge, for a plan given on the command line or taken from a recipe
(:mod:`megatron_ext.recipes.schedule` turns a recipe into a plan). For ZB-H1 the report
sets the simulated bubble and peak in-flight micro-batches beside 1F1B's for the same plan and
the same work (:class:`Costs`), and both textbook figures."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Protocol

from megatron_ext.errors import Problem
from megatron_ext.schedules.schedule import (
    ONE_F_ONE_B,
    ZB_H1,
    Schedule,
    SchedulePlan,
    Timeline,
    build_schedule,
    format_bytes,
    format_timeline,
    simulate,
    textbook_bubble,
)


class EdgeMessage(Protocol):
    """The message on a pipeline edge, as the report prints it: handed in by the caller
    (:class:`megatron_ext.pipeline.message_size.MessageSize`), so that the schedules, below the
    pipeline, never import it."""

    @property
    def bytes(self) -> int: ...

    def describe(self) -> str: ...

    def describe_fields(self) -> list[str]: ...


# The grid gives every rank a row and every time unit a column; beyond this many cells (a few
# MB of text) it takes long to build and print and nobody reads it (64 ranks x 312 micro-batches
# with F=1, B=2 is about 72,000).
MAX_GRID_CELLS = 2_000_000
# One column is the largest time dividing every step's: times like 1, 1.999, 0.001 would make a
# step thousands of columns wide.
MAX_COLUMNS_PER_STEP = 100


@dataclass(frozen=True)
class Costs:
    """Time of each compute step in :func:`~megatron_ext.schedules.schedule.simulate`.
    ``backward`` is a whole backward pass; a schedule with ``W`` steps spends ``weight`` of it
    in ``W`` (weight gradient) and the rest in ``B`` (input gradient), so 1F1B and ZB-H1 do the
    same work. The default (1, 2, 1) is the zero-bubble paper's F = B = W."""

    forward: float = 1.0
    backward: float = 2.0
    weight: float = 1.0

    def problems(self) -> list[Problem]:
        found = []
        for flag, value in (("--forward-time", self.forward), ("--backward-time", self.backward)):
            if not (math.isfinite(value) and value > 0):
                found.append(Problem(f"{flag} {value:g}", "give a positive time"))
        if found:
            return found
        if not (math.isfinite(self.weight) and 0 < self.weight < self.backward):
            found.append(
                Problem(
                    f"--weight-time {self.weight:g}",
                    f"the weight gradient is part of the backward: give a time in (0, "
                    f"--backward-time {self.backward:g})",
                )
            )
        return found

    def step_times(self, split: bool) -> dict[str, float]:
        if not split:
            return {"F": self.forward, "B": self.backward}
        return {"F": self.forward, "B": self.backward - self.weight, "W": self.weight}

    def describe(self, split: bool) -> str:
        return ", ".join(f"{k}={_number(v)}" for k, v in self.step_times(split).items())

    def unit(self, split: bool) -> float:
        """The largest time that divides every step's time: one grid column."""
        times = self.step_times(split).values()
        fractions = [Fraction(v).limit_denominator(1000) for v in times]
        numerator = math.gcd(*(f.numerator for f in fractions))
        denominator = math.lcm(*(f.denominator for f in fractions))
        # A time below 1/1000 rounds to 0: the smallest time is the column then (a step far
        # longer than it is refused by megatron-ext schedule as too wide).
        if any(f == 0 for f in fractions):
            return min(times)
        return numerator / denominator

    def simulate(self, schedule: Schedule) -> Timeline:
        return simulate(schedule, self.forward, self.backward, self.weight)


def _number(value: float) -> str:
    return f"{value:g}"


def zb_h1_textbook_bubble(pp: int, microbatches: int) -> float:
    """The zero-bubble paper's ZB-H1 figure with F = B = W: (p - 1) / (3m + p - 1) (the
    paper's (p-1)/(3m) is this over the iteration without the bubble); exact for m >= p."""
    return (pp - 1) / (3 * microbatches + pp - 1)


def kind_of(plan: SchedulePlan) -> str:
    if plan.schedule == ZB_H1:
        return (
            "ZB-H1 (megatron_ext.pipeline.zero_bubble: B = input gradient, W = weight "
            "gradient; rank r keeps up to r W pending)"
        )
    if plan.multimodule is not None:
        return "multi-module 1F1B (forward_backward_pipelining_without_interleaving, one warm-up per rank)"
    if plan.vpp:
        return (
            "interleaved 1F1B (forward_backward_pipelining_with_interleaving, "
            f"microbatch_group_size_per_vp_stage={plan.group_size})"
        )
    return "1F1B (forward_backward_pipelining_without_interleaving)"


_CAP = 1e18  # a column or cell count beyond every limit: still a finite whole number


def columns_per_step(plan: SchedulePlan, costs: Costs) -> int:
    """The widest step's columns in the grid."""
    split = plan.schedule == ZB_H1
    # capped: 1 over 1e-308 is infinite as a float (issue 34, item 17); far above any limit
    return round(min(max(costs.step_times(split).values()) / costs.unit(split), _CAP))


def grid_cells(plan: SchedulePlan, costs: Costs) -> int:
    """About how many cells (ranks x columns) the grid of ``plan`` has with ``costs``, known
    before any work: a row lasts about (m * v + stages) steps of every kind, and a column is
    :meth:`Costs.unit`."""
    split = plan.schedule == ZB_H1
    per_microbatch = sum(costs.step_times(split).values())
    chunks = max(plan.vpp or 1, 1)
    ranks = max(plan.pp, 1)
    row = (max(plan.microbatches, 1) * chunks + ranks * chunks) * per_microbatch
    return math.ceil(min(ranks * row / costs.unit(split), _CAP))


def report(
    plan: SchedulePlan,
    size: EdgeMessage | None = None,
    steps: bool = False,
    costs: Costs | None = None,
    schedule: Schedule | None = None,
) -> tuple[list[str], Schedule]:
    """The printed report and the schedule it describes (``schedule``: an order of ``plan``
    read from text, :mod:`megatron_ext.schedules.text`; None: the built one)."""
    costs = costs or Costs()
    schedule = schedule or build_schedule(plan)
    zero_bubble = plan.schedule == ZB_H1
    timeline = costs.simulate(schedule)
    ranks = len(schedule.ranks)
    lines = [
        f"schedule: {kind_of(plan)}",
        f"plan: {ranks} pipeline rank(s)"
        + (f" x {plan.vpp} chunks" if plan.vpp else "")
        + f", {plan.microbatches} micro-batch(es) per iteration",
    ]
    if plan.multimodule is not None:
        mm = plan.multimodule
        for rank in range(ranks):
            lines.append(
                f"  rank {rank}: {', '.join(mm.modules_on(rank))}, warm-up {mm.warmup_on(rank)}"
            )
    unit = costs.unit(zero_bubble)
    lines += [
        "",
        *_grid_legend(costs, zero_bubble, unit),
        format_timeline(timeline, schedule.chunks, unit),
        "",
    ]
    if zero_bubble:
        lines += _zero_bubble_figures(plan, schedule, timeline, costs)
    else:
        lines += _one_f_one_b_figures(plan, schedule, timeline, costs)
    lines.append("pipeline edges, per iteration:")
    for (src, dst), counts in schedule.messages_per_edge().items():
        text = f"  {src} -> {dst}: {counts['F']} activation(s), {counts['B']} gradient(s)"
        if size is not None:
            total = (counts["F"] + counts["B"]) * size.bytes
            text += f" = {format_bytes(total)}"
        lines.append(text)
    if size is not None:
        lines.append(f"  each message {size.describe()}, its fields:")
        lines += size.describe_fields()
    elif plan.multimodule is not None:
        lines.append(
            "  (multi-module: shapes vary per module and micro-batch and are exchanged with "
            "every message)"
        )
    if steps:
        from megatron_ext.schedules.schedule import format_steps

        for rank in range(ranks):
            lines += [
                "",
                f"rank {rank}'s steps (P2P calls as megatron-core makes them; s=send r=receive):",
                format_steps(schedule, rank),
            ]
    return lines, schedule


def _columns(time: float, unit: float) -> str:
    n = round(time / unit)
    return f"{n} column" + ("s" if n != 1 else "")


def _grid_legend(costs: Costs, zero_bubble: bool, unit: float) -> list[str]:
    times = costs.step_times(zero_bubble)
    if not zero_bubble:
        return [
            f"grid (ranks x time; a forward takes {_columns(times['F'], unit)}, a backward "
            f"{round(times['B'] / unit)} (~); '.' idle;",
            "     F3c1 = forward of micro-batch 3 on chunk 1):",
        ]
    return [
        f"grid (ranks x time, one column = {_number(unit)} time unit"
        + ("" if unit == 1 else "s")
        + f"; F (forward) takes {_columns(times['F'], unit)}, B (input gradient) "
        f"{round(times['B'] / unit)}, W (weight gradient) {round(times['W'] / unit)}; "
        "~ continues a step, '.' idle):"
    ]


def _one_f_one_b_figures(
    plan: SchedulePlan, schedule: Schedule, timeline: Timeline, costs: Costs
) -> list[str]:
    lines = [
        f"bubble: {timeline.bubble():.1%} of the iteration idle (this schedule, "
        f"{costs.describe(False)}, communication free)"
    ]
    if plan.multimodule is None:
        formula = "(p-1)/(m+p-1)" + ("/v" if plan.vpp else "")
        lines.append(
            f"        textbook {formula} = {textbook_bubble(plan.pp, plan.microbatches, plan.chunks):.1%}"
        )
    unit = f" (chunk micro-batches; /{plan.vpp} = stage micro-batches)" if plan.vpp else ""
    lines.append(
        f"peak in-flight micro-batches (activations held) per rank{unit}: "
        + _per_rank(schedule.peak_in_flight())
    )
    return lines


def _zero_bubble_figures(
    plan: SchedulePlan, schedule: Schedule, timeline: Timeline, costs: Costs
) -> list[str]:
    """The bubble and peak in-flight micro-batches of ZB-H1 beside 1F1B's for the same plan."""
    baseline = build_schedule(replace(plan, schedule=ONE_F_ONE_B))
    baseline_bubble = costs.simulate(baseline).bubble()
    p, m = plan.pp, plan.microbatches
    return [
        f"bubble: {timeline.bubble():.1%} of the iteration idle (ZB-H1, {costs.describe(True)}; "
        "communication free)",
        f"        1F1B, same plan and work: {baseline_bubble:.1%} "
        f"({costs.describe(False)}, B being the whole backward)",
        f"        textbook 1F1B (p-1)/(m+p-1) = {textbook_bubble(p, m):.1%}; ZB-H1 (p-1)/(3m+p-1) "
        f"= {zb_h1_textbook_bubble(p, m):.1%} (F = B = W; "
        + ("m >= p)" if m >= p else "it assumes m >= p, here m < p)"),
        "peak in-flight micro-batches per rank (activations held; under ZB-H1 until W):",
        f"        ZB-H1: {_per_rank(schedule.peak_in_flight())}",
        f"        1F1B:  {_per_rank(baseline.peak_in_flight())}",
    ]


def _per_rank(values: list[int]) -> str:
    return ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
