"""Two runs side by side: ``megatron-ext compare RUN_A RUN_B [--plot FILE.png]``.

Each run's metrics are every scalar it logged (TensorBoard, else its log lines), its stopped and
resumed segments joined (:func:`megatron_ext.runs.resume.read_metrics`). The difference table
has one row per metric: the steps both logged, the largest absolute and relative difference and
where, and both runs' last values. The plot overlays the two runs' curves, one panel per metric,
with a dotted vertical line where a run was resumed (its step offset).
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


@dataclass
class MetricSets:
    """What two runs logged: the metrics both have (losses first) and those only one has."""

    common: list[str]
    only_a: list[str]
    only_b: list[str]


def metric_sets(a: RunCurves, b: RunCurves) -> MetricSets:
    """Split the runs' metrics; CompareError when they share none (nothing to compare). An mHC
    run logs its statistics and a plain one does not: they are compared on what both have."""
    common = sorted(set(a.metrics) & set(b.metrics), key=lambda m: (not m.endswith("loss"), m))
    sets = MetricSets(
        common, sorted(set(a.metrics) - set(b.metrics)), sorted(set(b.metrics) - set(a.metrics))
    )
    if not common:
        raise CompareError(
            f"the runs share no metric: {a.label} logged {sorted(a.metrics)}, {b.label} "
            f"{sorted(b.metrics)} (compare runs of the same kind)"
        )
    return sets


def only_in_one_run(a: RunCurves, b: RunCurves, sets: MetricSets) -> list[str]:
    """Lines naming the metrics present in one run only (none when the sets are equal)."""
    return [
        f"present in {curves.label} only (not compared): {', '.join(only)}"
        for curves, only in ((a, sets.only_a), (b, sets.only_b))
        if only
    ]


@dataclass
class Row:
    metric: str
    steps: int
    max_abs: float
    max_rel: float
    at_step: int | None
    last_a: float | None
    last_b: float | None


def differences(a: RunCurves, b: RunCurves, names: list[str]) -> list[Row]:
    rows = []
    for name in names:
        sa, sb = a.metrics[name], b.metrics[name]
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
        rows.append(
            Row(
                name,
                len(steps),
                worst_abs,
                worst_rel,
                worst if worst_abs else None,
                sa[max(sa)] if sa else None,
                sb[max(sb)] if sb else None,
            )
        )
    return rows


def table(a: RunCurves, b: RunCurves, rows: list[Row]) -> list[str]:
    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:.6g}"

    head = ("metric", "steps", "max |A-B|", "max rel", "at step", "last A", "last B")
    body = [
        (
            r.metric,
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
    lines = [f"A = {a.label}", f"B = {b.label}"]
    for name, curves in (("A", a), ("B", b)):
        if curves.resumed_at:
            lines.append(f"{name} resumed after step(s) {curves.resumed_at}")
    lines += [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)).rstrip()
        for row in [head, *body]
    ]
    return lines


def plot_title(a: RunCurves, b: RunCurves) -> str:
    """ "A vs B", with the dotted lines explained only when a run was resumed (issue 41,
    item 7: the note was there for runs never resumed)."""
    resumed = any(curves.resumed_at for curves in (a, b))
    return f"{a.label} vs {b.label}" + (" (dotted: resumed)" if resumed else "")


def plot(path: Path, a: RunCurves, b: RunCurves, names: list[str], title: str = "") -> Path:
    """One panel per metric, both runs' curves, a dotted line at each resume step."""
    from megatron_ext.runs.plot import _pyplot

    plt = _pyplot()
    cols = min(3, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.2 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):
        for curves, style in ((a, "-"), (b, "--")):
            series = curves.metrics[name]
            steps = sorted(series)
            line = ax.plot(steps, [series[s] for s in steps], style, label=curves.label)[0]
            for step in curves.resumed_at:
                ax.axvline(step + 0.5, color=line.get_color(), linestyle=":", linewidth=1)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(names) :]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(title or plot_title(a, b), fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    from megatron_ext import files

    files.save_figure(fig, path, dpi=90)
    plt.close(fig)
    return path
