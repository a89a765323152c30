"""Timelines of a pipeline iteration: theoretical or measured, as a picture or a trace file.

- :func:`measured_timeline` turns the events recorded by :mod:`megatron_ext.schedules.trace`
  (one list per rank) into a :class:`~megatron_ext.schedules.schedule.Timeline`, whose
  ``bubble()`` is the measured idle share (waiting in P2P counts as idle);
- :func:`chrome_trace` writes them in the Chrome trace-event format (the format PyTorch's
  profiler writes; open it in Perfetto or chrome://tracing): one process per rank, passes on
  one thread, P2P calls on another; ZB-H1's weight-gradient steps (``W``) have their own
  category, ``weight``;
- :func:`plot_timeline` draws a timeline with matplotlib, one row per rank, forwards and
  backwards coloured by chunk, ``W`` steps in green, labelled with their micro-batch.

A ``W`` step is busy time like a forward or backward: the measured bubble counts only what
no pass covers (waiting in P2P included).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from megatron_ext.schedules.schedule import Compute, Slot, Timeline


def measured_timeline(events_per_rank: Sequence[Iterable], iteration: int) -> Timeline:
    """The passes of one iteration as recorded (times in seconds from the earliest start)."""
    chosen = [
        [e for e in events if e.iteration == iteration and e.call is None]
        for events in events_per_rank
    ]
    starts = [e.start_ns for events in chosen for e in events]
    origin = min(starts) if starts else 0
    slots = [
        Slot(
            rank,
            Compute(e.kind, e.microbatch, e.chunk or 0),
            (e.start_ns - origin) / 1e9,
            (e.end_ns - origin) / 1e9,
        )
        for rank, events in enumerate(chosen)
        for e in events
    ]
    return Timeline(slots, len(events_per_rank))


def iterations(events_per_rank: Sequence[Iterable]) -> list[int]:
    return sorted({e.iteration for events in events_per_rank for e in events})


# The trace-event category of each kind of pass.
CATEGORIES = {"F": "forward", "B": "backward", "W": "weight"}


def chrome_trace(
    events_per_rank: Sequence[Iterable],
    chunks: int = 1,
    modules: Sequence[str | None] | None = None,
) -> dict:
    """Trace-event JSON ({"traceEvents": [...]}): complete ("X") events in microseconds."""
    trace = []
    for rank, events in enumerate(events_per_rank):
        name = f"rank {rank}" + (f" ({modules[rank]})" if modules and modules[rank] else "")
        trace.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": name}})
        trace.append(
            {"name": "thread_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": "compute"}}
        )
        trace.append(
            {"name": "thread_name", "ph": "M", "pid": rank, "tid": 1, "args": {"name": "p2p"}}
        )
        for e in events:
            step = e.step()
            is_pass = e.call is None
            trace.append(
                {
                    "name": step.label(chunks) if is_pass else f"{e.call} {step.label(chunks)}",
                    "cat": CATEGORIES.get(e.kind, "backward") if is_pass else "p2p",
                    "ph": "X",
                    "pid": rank,
                    "tid": 0 if is_pass else 1,
                    "ts": e.start_ns / 1e3,
                    "dur": max(e.end_ns - e.start_ns, 0) / 1e3,
                    "args": {
                        "iteration": e.iteration,
                        "step": e.index,
                        "microbatch": e.microbatch,
                        "chunk": e.chunk,
                    },
                }
            )
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


# Forward passes in blues, backward passes in oranges, weight gradients (W) in greens; later
# chunks darker.
_FORWARD = ["#9ecae1", "#4292c6", "#2171b5", "#08519c"]
_BACKWARD = ["#fdd0a2", "#fd8d3c", "#e6550d", "#a63603"]
_WEIGHT = ["#a1d99b", "#41ab5d", "#238b45", "#005a32"]
_PALETTES = {"F": _FORWARD, "B": _BACKWARD, "W": _WEIGHT}
_NAMES = {"F": "forward", "B": "backward", "W": "weight gradient (W)"}


def colour_of(kind: str, chunk: int) -> str:
    palette = _PALETTES.get(kind, _BACKWARD)
    return palette[min(chunk, len(palette) - 1)]


def plot_timeline(
    timeline: Timeline,
    path: Path,
    title: str,
    chunks: int = 1,
    unit: str = "time units",
    note: str | None = None,
    row_labels: Sequence[str] | None = None,
) -> Path:
    """One horizontal bar per pass, one row per rank (rank 0 on top); ``note`` goes under
    the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = timeline.ranks
    fig, ax = plt.subplots(
        figsize=(
            max(8.0, min(16.0, 0.35 * len(timeline.slots) / max(ranks, 1) + 4)),
            0.55 * ranks + 1.6,
        )
    )
    span = timeline.makespan or 1.0
    for slot in timeline.slots:
        colour = colour_of(slot.step.kind, slot.step.chunk)
        width = slot.end - slot.start
        ax.barh(
            slot.rank,
            width,
            left=slot.start,
            height=0.8,
            color=colour,
            edgecolor="white",
            linewidth=0.5,
        )
        if width / span > 0.014:
            ax.text(
                slot.start + width / 2,
                slot.rank,
                f"{slot.step.kind}{slot.step.microbatch}",
                ha="center",
                va="center",
                fontsize=7,
            )
    ax.set_yticks(range(ranks), list(row_labels or [f"rank {r}" for r in range(ranks)]))
    ax.invert_yaxis()
    ax.set_xlim(0, span)
    ax.set_xlabel(unit)
    ax.set_title(title + (f"\n{note}" if note else ""), fontsize=10)
    handles = []
    kinds = [k for k in _PALETTES if any(s.step.kind == k for s in timeline.slots)] or ["F", "B"]
    if "W" in kinds:  # B is then the input gradient only
        names = dict(_NAMES, B="input gradient (B)", F="forward (F)")
    else:
        names = _NAMES
    for chunk in range(chunks):
        suffix = f" (chunk {chunk})" if chunks > 1 else ""
        for kind in kinds:
            handles.append(Patch(color=colour_of(kind, chunk), label=names[kind] + suffix))
    ax.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.22 - 0.05 * (ranks < 3)),
        ncol=min(len(handles), 4),
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout()
    path = Path(path)
    from megatron_ext import files

    files.save_figure(fig, path, dpi=110)
    plt.close(fig)
    return path
