"""Run directories as a list and one by one: ``megatron-ext runs`` and ``runs show RUN``.

A run directory is one with a ``recipe.yaml`` and a ``run.json`` or ``summary.json`` (what
``megatron-ext run`` and ``submit`` write). Its status is the summary's (passed, mismatch,
training-failed, stopped, interrupted, ...); a run without a summary yet is "running" while
its logs still change, else "incomplete" (its launcher was killed). Steps and the last loss
come from metrics.json once a run finished, else from the rank logs of every segment (no
TensorBoard import: listing stays fast).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron_ext import files
from megatron_ext.errors import MegatronExtError
from megatron_ext.runs import metrics as met, resume as rsm

RUNNING_WITHIN_S = 120.0
"""A run without a summary whose logs changed this recently counts as running."""


class RunDirError(MegatronExtError, ValueError):
    """Not a run directory (one line)."""


def is_run_dir(path: Path) -> bool:
    path = Path(path)
    return (path / "recipe.yaml").is_file() and (
        (path / rsm.RUN_FILE).is_file() or (path / "summary.json").is_file()
    )


def _json(path: Path) -> dict:
    try:
        data = json.loads(files.read_record(path))
    except (OSError, ValueError, RecursionError):  # a 100k-deep document is unreadable too
        return {}
    return data if isinstance(data, dict) else {}


def _iterations(run_dir: Path) -> int | None:
    import yaml

    try:
        data = yaml.safe_load(files.read_record(run_dir / "recipe.yaml", "recipe")) or {}
        return int(data["training"]["iterations"])
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError, ArithmeticError):
        return None  # .inf iterations: OverflowError


def quick_metrics(run_dir: Path) -> met.Metrics:
    """metrics.json when the run finished, else the rank logs of every segment, joined."""
    finished = run_dir / "metrics.json"
    if finished.is_file():
        try:
            return met.read_golden(finished)
        except (OSError, ValueError, TypeError, AttributeError, ArithmeticError, RecursionError):
            pass
    joined: met.Metrics = {}
    for segment in rsm.segments(run_dir):
        part = met.parse_run_logs(run_dir / "logs" / segment if segment else run_dir / "logs")
        first = min((min(s) for s in part.values() if s), default=None)
        if first is None:
            continue
        for series in joined.values():
            for step in [s for s in series if s >= first]:
                del series[step]
        for name, series in part.items():
            joined.setdefault(name, {}).update(series)
    return joined


@dataclass
class RunInfo:
    path: Path
    name: str
    recipe: str
    status: str
    steps: int | None
    iterations: int | None
    last_loss: float | None
    when: float
    platform: str = ""
    overrides: list[str] = field(default_factory=list)
    summary: dict = field(default_factory=dict)


def _last_change(run_dir: Path) -> float:
    times = [p.stat().st_mtime for p in run_dir.glob("logs/**/rank-*.log")]
    for name in ("summary.json", rsm.RUN_FILE, "recipe.yaml"):
        if (run_dir / name).exists():
            times.append((run_dir / name).stat().st_mtime)
    return max(times, default=0.0)


def info(run_dir: Path) -> RunInfo:
    run_dir = Path(run_dir)
    if not is_run_dir(run_dir):
        raise RunDirError(
            f"{run_dir} is not a run directory (no recipe.yaml with a run.json or summary.json)"
        )
    record, summary = _json(run_dir / rsm.RUN_FILE), _json(run_dir / "summary.json")
    when = _last_change(run_dir)
    status = summary.get("status")
    if status is None or (
        status == "stopped" and when > (run_dir / "summary.json").stat().st_mtime
    ):
        status = "running" if time.time() - when < RUNNING_WITHIN_S else "incomplete"
    losses = quick_metrics(run_dir).get("lm loss", {})
    last = max(losses) if losses else None
    return RunInfo(
        path=run_dir,
        name=run_dir.name,
        recipe=str(record.get("recipe") or summary.get("recipe") or "?"),
        status=str(status)[:80],
        steps=last,
        iterations=_iterations(run_dir),
        last_loss=_finite(losses[last]) if last is not None else None,
        when=when,
        platform=str(record.get("platform") or summary.get("platform") or ""),
        overrides=[str(o) for o in _list(record.get("overrides") or summary.get("overrides"))],
        summary=summary,
    )


def find(root: Path) -> list[RunInfo]:
    """Every run directory directly below ``root`` (or ``root`` itself), newest first."""
    root = Path(root)
    if not root.is_dir():
        raise RunDirError(f"{root} is not a directory (pass --runs-root DIR)")
    candidates = [root] if is_run_dir(root) else sorted(p for p in root.iterdir() if p.is_dir())
    return sorted((_info_or_why(p) for p in candidates if is_run_dir(p)), key=lambda r: -r.when)


def _list(value: object) -> list:
    return value if isinstance(value, list) else []


def _finite(value: object) -> float | None:
    """A loss as a float, None when it is none (a 400-digit number, inf, NaN, text)."""
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return None
    return number if math.isfinite(number) else None


def _info_or_why(run_dir: Path) -> RunInfo:
    """:func:`info`, or a row saying why this one directory cannot be read: one corrupt run
    never hides the others (issue 34, item 13)."""
    try:
        return info(run_dir)
    except (OSError, ValueError, TypeError, ArithmeticError, RecursionError) as exc:
        why = type(exc).__name__
        return RunInfo(run_dir, run_dir.name, "?", f"unreadable ({why})", None, None, None, 0.0)


def printable(text: str) -> str:
    """Text of a run directory as a terminal may show it: escapes (ANSI colours, title
    changes, screen clears) and other controls written as ``\\x1b`` etc., never sent raw."""
    return "".join(
        ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text
    )


def _when(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(seconds)) if seconds else "?"


def shown_status(status: str, summary: dict) -> str:
    """A run that finished without comparing anything did not pass anything."""
    if status == "passed" and not summary.get("reports"):
        return "finished, not compared"
    return status


def shown_recipe(r: RunInfo) -> str:
    """The recipe's name and the overrides that change the model (mHC on/off, sizes)."""
    model = [o for o in r.overrides if o.startswith("model.")]
    return Path(r.recipe).stem + (f" [{' '.join(model)}]" if model else "")


def table(runs: list[RunInfo]) -> list[str]:
    rows: list[tuple[str, ...]] = [("NAME", "RECIPE", "STATUS", "STEPS", "LAST LOSS", "WHEN")]
    for r in runs:
        steps = f"{r.steps if r.steps is not None else '-'}/{r.iterations or '?'}"
        loss = f"{r.last_loss:.6f}" if r.last_loss is not None else "-"
        status = shown_status(r.status, r.summary)
        rows.append((r.name, shown_recipe(r), status, steps, loss, _when(r.when)))
    rows = [tuple(printable(c) for c in row) for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)).rstrip() for row in rows
    ]


def evaluation_lines(summary: dict) -> list[str]:
    """``runs show``'s validation and test losses (summary.json's "losses")."""
    losses = summary.get("losses")
    lines = []
    for name, label in ((met.VALIDATION_METRIC, "valid loss"), (met.TEST_METRIC, "test loss")):
        entry = losses.get(name) if isinstance(losses, dict) else None
        if not isinstance(entry, dict) or (value := _finite(entry.get("value"))) is None:
            continue
        lines.append(f"{label:<10} {value:.6f} (step {entry.get('step')}, {name!r})")
    return lines


def resolve(run: str, runs_root: Path) -> Path:
    """A run given as a path, or as a name under the runs root."""
    path = Path(run)
    if path.is_dir():
        return path
    if (Path(runs_root) / run).is_dir():
        return Path(runs_root) / run
    raise RunDirError(f"{run}: no such run directory (nor {Path(runs_root) / run})")


def details(run_dir: Path) -> list[str]:
    """``runs show``: the run, its segments and checkpoints, and what to do next."""
    r = _info_or_why(run_dir)
    lines = [
        f"run        {r.path}",
        f"recipe     {r.recipe} (platform {r.platform or '?'})"
        + (f", overrides: {' '.join(r.overrides)}" if r.overrides else ""),
        f"status     {shown_status(r.status, r.summary)}",
        f"steps      {r.steps if r.steps is not None else '-'} of {r.iterations or '?'}",
        f"last loss  {r.last_loss:.6f}" if r.last_loss is not None else "last loss  -",
        f"when       {_when(r.when)}",
    ]
    from megatron_ext.checkpoint import layout

    lines += layout.shown(_json(r.path / rsm.RUN_FILE))
    lines += evaluation_lines(r.summary)
    segments = rsm.segments(r.path)
    if len(segments) > 1:
        metrics_by_segment = []
        for segment in segments[1:]:
            part = met.parse_run_logs(r.path / "logs" / segment)
            first = min((min(s) for s in part.values() if s), default=None)
            metrics_by_segment.append(
                f"{segment} from step {first}" if first else f"{segment} (no step logged)"
            )
        lines.append(f"resumed    {len(segments) - 1} time(s): {', '.join(metrics_by_segment)}")
    ckpt = rsm.checkpoint_dir(r.path)
    saved = rsm.saved_iterations(ckpt)
    if saved:
        latest = rsm.latest_complete(ckpt)
        lines.append(f"checkpoints {saved} (latest complete: {latest})")
    for phase in (p for p in _list(r.summary.get("phases")) if isinstance(p, dict)):
        parts = [
            f"{k} {v}" for k, v in phase.items() if k in ("returncode", "seconds", "stopped_by")
        ]
        lines.append(f"phase      {phase.get('phase')}: {', '.join(parts)}")
    for report in (p for p in _list(r.summary.get("reports")) if isinstance(p, dict)):
        lines.append(
            f"report     {report.get('title')}: {'PASSED' if report.get('passed') else 'FAILED'}"
        )
    if r.status in ("stopped", "incomplete", "interrupted") and _json(r.path / rsm.RUN_FILE).get(
        "resumable"
    ):
        lines.append(f"next       megatron-ext run --resume {r.path}")
    return [printable(line) for line in lines]
