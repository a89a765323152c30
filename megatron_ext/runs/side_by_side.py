"""Runs side by side: ``megatron-ext compare RUN_A RUN_B [RUN_C ...] [--plot FILE.png]``.

Each run's metrics are every scalar it logged (TensorBoard, else its log lines), its stopped and
resumed segments joined (:func:`megatron_ext.runs.resume.read_metrics`). The difference table
has one row per metric and later run (each compared with the first, run A): the steps both logged, the largest absolute and relative difference and
where, and both runs' last values. The plot overlays the runs' curves, one panel per metric (units in
the titles; metrics constant in every run left out), with a dotted vertical line where a run
was resumed (its step offset).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from megatron_ext.errors import MegatronExtError
from megatron_ext.runs import listing as runs, metrics as met, resume as rsm


class CompareError(MegatronExtError, ValueError):
    """Inputs that cannot be compared (one line)."""


@dataclass
class RunCurves:
    label: str
    metrics: met.Metrics
    resumed_at: list[int]


def read(run_dir: Path) -> RunCurves:
    run_dir = Path(run_dir)
    if not runs.is_run_dir(run_dir):
        raise CompareError(
            f"{run_dir} is not a run directory (no recipe.yaml with a run.json or summary.json)"
        )
    joined = rsm.read_metrics(run_dir)
    if not joined.metrics:
        raise CompareError(
            f"{run_dir} logged no metrics (no TensorBoard files, no iteration lines)"
        )
    return RunCurves(run_dir.name, joined.metrics, joined.resumed_at)


# Metric -> unit shown beside its name (Megatron's --log-throughput logs TFLOP/s per GPU;
# iteration-time is converted to seconds when read).
UNITS = {"throughput": "TFLOP/s/GPU", "iteration-time": "s"}


def with_unit(metric: str) -> str:
    """``throughput (TFLOP/s/GPU)``: the metric's name with its unit, when it has one."""
    unit = UNITS.get(metric)
    return f"{metric} ({unit})" if unit else metric


def letter(index: int) -> str:
    """A, B, C, ...: the name a run has in the table (AA, AB, ... past Z)."""
    name = ""
    index += 1
    while index:
        index, rest = divmod(index - 1, 26)
        name = chr(ord("A") + rest) + name
    return name


@dataclass
class MetricSets:
    """What the runs logged: the metrics all have (losses first) and, per run, those it has
    that some other run lacks."""

    common: list[str]
    only: dict[str, list[str]]


def metric_sets(*curves: RunCurves) -> MetricSets:
    """Split the runs' metrics; CompareError when they share none (nothing to compare). An mHC
    run logs its statistics and a plain one does not: they are compared on what all have."""
    shared = set.intersection(*(set(c.metrics) for c in curves))
    common = sorted(shared, key=lambda m: (not m.endswith("loss"), m))
    sets = MetricSets(common, {c.label: sorted(set(c.metrics) - shared) for c in curves})
    if not common:
        logged = ", ".join(f"{c.label} logged {sorted(c.metrics)}" for c in curves)
        raise CompareError(f"the runs share no metric: {logged} (compare runs of the same kind)")
    return sets


def wrapped(head: str, names: list[str], width: int = 100) -> list[str]:
    """``head names`` on one line when it fits, else ``head`` with the count and then the names,
    several to an indented line (64 ``mhc/*`` names on one line were unreadable: issue 41,
    item 7)."""
    import textwrap

    joined = ", ".join(names)
    if len(head) + 1 + len(joined) <= width:
        return [f"{head} {joined}"]
    body = textwrap.wrap(joined, width=width - 4, break_on_hyphens=False)
    return [f"{head} {len(names)} metrics"] + [f"    {line}" for line in body]


def only_in_one_run(curves: list[RunCurves], sets: MetricSets) -> list[str]:
    """Lines naming the metrics some runs lack, per run that has them (none when the sets
    are equal)."""
    lines = []
    for run in curves:
        only = sets.only.get(run.label, [])
        if only:
            lines += wrapped(f"present in {run.label} only (not compared):", only)
    return lines


@dataclass
class Row:
    metric: str
    other: str
    """The letter of the run compared with run A."""
    steps: int
    max_abs: float
    max_rel: float
    at_step: int | None
    last_a: float | None
    last_b: float | None


def _row(name: str, other: str, sa: met.Series, sb: met.Series) -> Row:
    steps = sorted(set(sa) & set(sb))
    worst, worst_abs, worst_rel = None, 0.0, 0.0
    for step in steps:
        diff = abs(sa[step] - sb[step])
        if math.isnan(diff):
            diff = 0.0 if math.isnan(sa[step]) and math.isnan(sb[step]) else math.inf
        if worst is None or diff > worst_abs:
            scale = max(abs(sa[step]), abs(sb[step]))
            worst, worst_abs = step, diff
            worst_rel = diff / scale if scale else (0.0 if diff == 0 else math.inf)
    return Row(
        name,
        other,
        len(steps),
        worst_abs,
        worst_rel,
        worst if worst_abs else None,
        sa[max(sa)] if sa else None,
        sb[max(sb)] if sb else None,
    )


def differences(curves: list[RunCurves], names: list[str]) -> list[Row]:
    """Per metric, each later run against the first (run A)."""
    first, rest = curves[0], curves[1:]
    return [
        _row(name, letter(i), first.metrics[name], run.metrics[name])
        for name in names
        for i, run in enumerate(rest, start=1)
    ]


def table(curves: list[RunCurves], rows: list[Row]) -> list[str]:
    """The difference table; with more than two runs a "vs" column says which run each row
    compares with A, and "last X" is that run's last value."""

    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:.6g}"

    many = len(curves) > 2
    head = (
        "metric",
        *(("vs",) if many else ()),
        "steps",
        "max |A-X|" if many else "max |A-B|",
        "max rel",
        "at step",
        "last A",
        "last X" if many else "last B",
    )
    body = [
        (
            with_unit(r.metric),
            *((r.other,) if many else ()),
            str(r.steps),
            num(r.max_abs),
            num(r.max_rel),
            str(r.at_step or "-"),
            num(r.last_a),
            num(r.last_b),
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
    lines = [f"{letter(i)} = {c.label}" for i, c in enumerate(curves)]
    for i, c in enumerate(curves):
        if c.resumed_at:
            lines.append(f"{letter(i)} resumed after step(s) {c.resumed_at}")
    lines += [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)).rstrip()
        for row in [head, *body]
    ]
    return lines


def plot_title(*curves: RunCurves) -> str:
    """ "A vs B [vs C ...]", with the dotted lines explained only when a run was resumed
    (issue 41, item 7: the note was there for runs never resumed)."""
    resumed = any(c.resumed_at for c in curves)
    return " vs ".join(c.label for c in curves) + (" (dotted: resumed)" if resumed else "")


def _is_constant(series: met.Series) -> bool:
    values = list(series.values())
    return all(v == values[0] or (math.isnan(v) and math.isnan(values[0])) for v in values)


def plotted(curves: list[RunCurves], names: list[str]) -> tuple[list[str], list[str]]:
    """(the metrics to draw, those left out): a metric constant in every run (e.g. num-zeros
    at 0, a fixed learning rate) draws a flat panel that says nothing (issue 41, item 7); it
    is drawn when any run varies, or when the runs' constants differ."""
    drawn: list[str] = []
    flat: list[str] = []
    for name in names:
        series = [c.metrics[name] for c in curves]
        firsts = {next(iter(s.values())) for s in series if s}
        same = all(_is_constant(s) for s in series) and len(firsts) <= 1
        (flat if same else drawn).append(name)
    return drawn, flat


STYLES = ("-", "--", "-.", ":")


def plot(path: Path, curves: list[RunCurves], names: list[str], title: str = "") -> Path:
    """One panel per metric, every run's curve, a dotted line at each resume step."""
    from megatron_ext.runs.plot import _pyplot

    plt = _pyplot()
    cols = max(1, min(3, len(names)))
    rows = max(1, math.ceil(len(names) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.2 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):
        for i, run in enumerate(curves):
            series = run.metrics[name]
            steps = sorted(series)
            style = STYLES[i % len(STYLES)]
            line = ax.plot(steps, [series[s] for s in steps], style, label=run.label)[0]
            for step in run.resumed_at:
                ax.axvline(step + 0.5, color=line.get_color(), linestyle=":", linewidth=1)
        ax.set_title(with_unit(name), fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(names) :]:
        ax.set_visible(False)
    if names:
        axes.flat[0].legend(fontsize=7)
    else:
        axes.flat[0].set_visible(True)
        axes.flat[0].text(0.5, 0.5, "every metric is constant", ha="center", va="center")
    fig.suptitle(title or plot_title(*curves), fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    from megatron_ext import files

    files.save_figure(fig, path, dpi=90)
    plt.close(fig)
    return path
