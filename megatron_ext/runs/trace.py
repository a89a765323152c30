"""``megatron-ext run RECIPE --trace``: what the traced ranks wrote, turned into the run's
``trace.json`` (Chrome trace events), ``timeline.png`` and the measured bubble next to the
theoretical one, and a check that every rank ran megatron-core's order exactly (or, with
``parallelism.schedule: zb-h1``, megatron-ext's ZB-H1 order, its ``W`` steps included; they
count as busy time in the measured bubble)."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_ext import files
from megatron_ext.schedules.report import zb_h1_textbook_bubble
from megatron_ext.schedules.schedule import (
    ZB_H1,
    compare,
    simulate,
    textbook_bubble,
)
from megatron_ext.schedules.text import schedule_of
from megatron_ext.schedules.timeline import (
    chrome_trace,
    iterations,
    measured_timeline,
    plot_timeline,
)
from megatron_ext.schedules.trace import TRACE_ENV, Event

TRACE_SUBDIR = "trace"


def environment(run_dir: Path) -> dict[str, str]:
    """What every rank needs to trace itself into the run directory."""
    return {TRACE_ENV: str(Path(run_dir).resolve() / TRACE_SUBDIR)}


def read_ranks(trace_dir: Path) -> list[dict]:
    """Every rank's dump, in rank order, events as :class:`Event`."""
    ranks = []
    for path in sorted(
        Path(trace_dir).glob("trace-rank-*.json"), key=lambda p: int(p.stem.rsplit("-", 1)[1])
    ):
        data = json.loads(files.read_record(path, "trace"))
        data["events"] = [Event.from_dict(e) for e in data["events"]]
        ranks.append(data)
    return ranks


def failing_step(trace_dir: Path) -> str | None:
    """Where the first pass or exchange that raised was (rank, chunk, step), if any."""
    for data in read_ranks(trace_dir) if Path(trace_dir).is_dir() else []:
        failed = [e for e in data["events"] if e.error]
        if failed:
            e = failed[0]
            step = e.step()
            return (
                f"rank {data['rank']}"
                + (f" ({data['module']})" if data.get("module") else "")
                + (f", chunk {e.chunk}" if e.call is None and e.chunk else "")
                + f", step {e.index}: {step.label(1)} (iteration {e.iteration + 1}): {e.error}"
            )
    return None


def message_sizes(events: list[list[Event]], size: Any) -> dict:
    """The bytes of every message the ranks sent (as recorded) beside the stage payload's:
    per field (pipeline.payload) and in total."""
    sent = [
        m.nbytes for ev in events for e in ev for m in e.messages if m.direction.startswith("send")
    ]
    measured = sorted(set(sent))
    return {
        "sent": len(sent),
        "bytes_measured": measured[0] if len(measured) == 1 else measured,
        "bytes_expected": size.bytes,
        "fields": size.payload.field_bytes(size.local_seq, size.micro_batch_size),
    }


def summarize(request: Any, run_dir: Path, echo: Callable[[str], None]) -> dict | None:
    """Write trace.json and timeline.png; return the run summary's "pipeline" entry.
    ``request``: the run's :class:`~megatron_ext.recipes.request.RunRequest` (its
    ``schedule_plan`` is what the measured timeline is compared with)."""

    ranks = read_ranks(Path(run_dir) / TRACE_SUBDIR)
    if not ranks:
        echo("  trace: no rank wrote a trace")
        return None
    events = [r["events"] for r in ranks]
    if not any(events):
        echo("  trace: the ranks recorded no pipelined schedule (PP=1 runs have none)")
        return None
    plan, size = request.verdict.schedule_plan
    schedule = schedule_of(plan)  # a ZB-H1 order given as text: that order
    (Path(run_dir) / "trace.json").write_text(
        json.dumps(chrome_trace(events, schedule.chunks, [r.get("module") for r in ranks]))
    )
    # Training iterations only (an evaluation runs forward-only, with no backward).
    trained = [
        i
        for i in iterations(events)
        if any(e.kind == "B" for ev in events for e in ev if e.iteration == i)
    ]
    measured = {i: measured_timeline(events, i).bubble() for i in trained}
    steady = trained[1:] or trained  # the first iteration also warms up allocators and caches
    entry: dict[str, Any] = {
        "trace": "trace.json",
        "timeline": "timeline.png",
        "iterations_traced": len(trained),
        "bubble_theoretical": round(simulate(schedule).bubble(), 4),
        "bubble_measured": round(statistics.median(measured[i] for i in steady), 4)
        if steady
        else None,
        "bubble_measured_per_iteration": {str(i + 1): round(b, 4) for i, b in measured.items()},
    }
    if plan.schedule == ZB_H1:
        # The textbook figure with F = B = W (what simulate()'s default costs give too).
        entry["schedule"] = ZB_H1
        entry["bubble_textbook"] = round(zb_h1_textbook_bubble(plan.pp, plan.microbatches), 4)
    elif plan.multimodule is None:
        entry["bubble_textbook"] = round(
            textbook_bubble(plan.pp, plan.microbatches, plan.chunks), 4
        )
    mismatches = []
    for data in ranks:
        theory = (
            schedule.ranks[data["pipeline_rank"]] if data.get("pipeline_rank") is not None else None
        )
        for i in trained:
            recorded = [e.step() for e in data["events"] if e.iteration == i]
            found = compare([theory], [recorded], schedule.chunks) if theory is not None else []
            if found:
                mismatches.append(f"world rank {data['rank']}, iteration {i + 1}: {found[0]}")
                break
    entry["order_matches_theory"] = not mismatches
    entry["order_mismatches"] = mismatches
    if size is not None:
        entry["messages"] = message_sizes(events, size)
    if steady:
        shown = min(steady, key=lambda i: abs(measured[i] - entry["bubble_measured"]))
        timeline = measured_timeline(events, shown)
        for slot in timeline.slots:  # seconds -> milliseconds
            slot.start, slot.end = slot.start * 1e3, slot.end * 1e3
        labels = [
            f"rank {r['rank']}"
            + (f" ({r['module']})" if r.get("module") else f" (stage {r['pipeline_rank']})")
            for r in ranks
        ]
        plot_timeline(
            timeline,
            Path(run_dir) / "timeline.png",
            f"{request.display.name}: measured iteration {shown + 1}",
            schedule.chunks,
            unit="ms",
            note=f"bubble {measured[shown]:.1%} measured, {entry['bubble_theoretical']:.1%} in theory",
            row_labels=labels,
        )
    echo(
        f"  pipeline bubble: {entry['bubble_measured']:.1%} measured (median of {len(steady)} "
        f"iteration(s); waiting in P2P counts as idle"
        + (", W steps count as busy" if plan.schedule == ZB_H1 else "")
        + f"), {entry['bubble_theoretical']:.1%} in theory"
        + (f" (textbook {entry['bubble_textbook']:.1%})" if "bubble_textbook" in entry else "")
    )
    echo(
        "  schedule order: "
        + (
            (
                "every rank ran megatron-ext's ZB-H1 order exactly"
                if plan.schedule == ZB_H1
                else "every rank ran megatron-core's order exactly"
            )
            if not mismatches
            else f"{len(mismatches)} rank(s) differ: {mismatches[0]}"
        )
    )
    if "messages" in entry:
        m = entry["messages"]
        fields = ", ".join(f"{name} {n} B" for name, n in m["fields"].items())
        echo(
            f"  messages: {m['sent']} sent, {m['bytes_measured']} B each (payload: {fields}; "
            f"{m['bytes_expected']} B expected)"
        )
    echo(
        f"  trace {Path(run_dir) / 'trace.json'} (Perfetto / chrome://tracing), timeline "
        f"{Path(run_dir) / 'timeline.png'}"
    )
    return entry
