"""What ``megatron-ext schedule`` prints: the grid, the bubble, peak in-flight micro-batches
and bytes per pipeline edge, for a plan given on the command line or taken from a recipe
(:mod:`megatron_ext.recipes.schedule` turns a recipe into a plan)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_ext.schedules.schedule import (
    Schedule,
    SchedulePlan,
    build_schedule,
    format_timeline,
    message_bytes,
    simulate,
    textbook_bubble,
)

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass
class MessageSize:
    """The tensor on a pipeline edge: [seq / cp (/ tp with SP), micro_batch_size, n * hidden]."""

    hidden: int
    seq: int
    micro_batch_size: int
    mhc_streams: int = 1
    dtype_bytes: int = 4
    tp: int = 1
    cp: int = 1
    sequence_parallel: bool = False

    @property
    def bytes(self) -> int:
        return message_bytes(
            self.hidden,
            self.seq,
            self.micro_batch_size,
            self.mhc_streams,
            self.dtype_bytes,
            self.tp,
            self.cp,
            self.sequence_parallel,
        )

    def describe(self) -> str:
        s = self.seq // self.cp // (self.tp if self.sequence_parallel else 1)
        width = f"{self.mhc_streams}*{self.hidden}" if self.mhc_streams > 1 else str(self.hidden)
        return (
            f"[{s}, {self.micro_batch_size}, {width}] x {self.dtype_bytes} B = {_size(self.bytes)}"
        )


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def kind_of(plan: SchedulePlan) -> str:
    if plan.multimodule is not None:
        return "multi-module 1F1B (forward_backward_pipelining_without_interleaving, one warm-up per rank)"
    if plan.vpp:
        return (
            "interleaved 1F1B (forward_backward_pipelining_with_interleaving, "
            f"microbatch_group_size_per_vp_stage={plan.group_size})"
        )
    return "1F1B (forward_backward_pipelining_without_interleaving)"


def report(
    plan: SchedulePlan, size: Optional[MessageSize] = None, steps: bool = False
) -> tuple[list[str], Schedule]:
    """The printed report and the schedule it describes."""
    schedule = build_schedule(plan)
    timeline = simulate(schedule)
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
    lines += [
        "",
        "grid (ranks x time; a forward takes 1 column, a backward 2 (~); '.' idle;",
        "     F3c1 = forward of micro-batch 3 on chunk 1):",
        format_timeline(timeline, schedule.chunks),
        "",
    ]
    lines.append(
        f"bubble: {timeline.bubble():.1%} of the iteration idle (this schedule, F=1, B=2, "
        "communication free)"
    )
    if plan.multimodule is None:
        formula = "(p-1)/(m+p-1)" + ("/v" if plan.vpp else "")
        lines.append(
            f"        textbook {formula} = {textbook_bubble(plan.pp, plan.microbatches, plan.chunks):.1%}"
        )
    peaks = schedule.peak_in_flight()
    unit = f" (chunk micro-batches; /{plan.vpp} = stage micro-batches)" if plan.vpp else ""
    lines.append(
        f"peak in-flight micro-batches (activations held) per rank{unit}: "
        + ", ".join(f"rank {r}: {p}" for r, p in enumerate(peaks))
    )
    lines.append("pipeline edges, per iteration:")
    for (src, dst), counts in schedule.messages_per_edge().items():
        text = f"  {src} -> {dst}: {counts['F']} activation(s), {counts['B']} gradient(s)"
        if size is not None:
            total = (counts["F"] + counts["B"]) * size.bytes
            text += f" = {_size(total)}"
        lines.append(text)
    if size is not None:
        lines.append(f"  each message {size.describe()}")
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
