"""The verdict of a finished run directory (a local run, a resume or a Slurm job): its metrics
read back (TensorBoard, or the rank logs), the ckpt-resume and golden-value comparisons and
their reports, the plots, the throughput and memory figures, and summary.json. It reads only
the run's :class:`~megatron_ext.recipes.request.RunRequest` (its ``verdict`` part chiefly)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from megatron_ext import files
from megatron_ext.recipes.request import RunRequest
from megatron_ext.runs import (
    golden as cmp,
    metrics as met,
    mhc_report,
    resume as rsm,
    trace as run_trace,
)
from megatron_ext.runs.options import RunOptions
from megatron_ext.runs.outcome import (
    EXIT_MISMATCH,
    EXIT_OK,
    EXIT_TRAINING_FAILED,
    Echo,
    Outcome,
    cannot_write,
    default_echo,
)
from megatron_ext.runs.plot import write_run_plot


def finalize(
    request: RunRequest,
    run_dir: Path,
    phase_results: list[dict],
    started: float,
    options: RunOptions = RunOptions(),
    echo: Echo = default_echo,
) -> Outcome:
    """Metrics, plot and comparisons of a finished run directory (local or Slurm)."""
    shown, judged, flags = request.display, request.verdict, request.phases
    names = list(judged.metrics)
    logs = run_dir / "logs"
    if flags.resumable:  # every segment of a stopped and resumed run, as one
        joined = rsm.read_metrics(run_dir)
        run_metrics, source = joined.metrics, joined.source
    else:
        run_metrics, source = met.read_run_metrics(run_dir)
    reports: list[cmp.Report] = []
    if not run_metrics.get("lm loss") and "lm loss" in names:
        echo(
            f"no metrics found: no TensorBoard scalars in {run_dir / met.TENSORBOARD_SUBDIR} and no "
            f"iteration lines in {logs}/rank-*.log"
        )
        write_summary(request, run_dir, "no-metrics", phase_results, [], time.monotonic() - started)
        return Outcome(EXIT_TRAINING_FAILED, run_dir, message="no metrics")
    echo(
        f"  metrics read from {'TensorBoard event files' if source == 'tensorboard' else 'the rank logs'}"
    )
    recorded = met.with_validation(
        mhc_report.recorded_names(judged.logs_mhc_stats, names), run_metrics
    )
    met.write_golden(run_dir / "metrics.json", run_metrics, recorded)
    resumed, resume_step = None, None

    if flags.ckpt_resume:
        resume_step = flags.iterations // 2
        resumed, resumed_source = met.read_run_metrics(run_dir, "resume")
        met.write_golden(run_dir / "metrics_resume.json", resumed, names)
        # Log lines carry Megatron's 2-iteration mean at a process's second step; TensorBoard does not.
        reports.append(
            cmp.compare_resume(
                run_metrics,
                resumed,
                flags.iterations // 2,
                names,
                logged_means=resumed_source == "logs",
            )
        )

    golden_path = judged.golden_path
    golden = None
    if options.write_golden:
        if all(r.passed for r in reports):
            assert golden_path is not None  # run() refuses --write-golden without one
            met.write_golden(golden_path, run_metrics, names)
            echo(f"  golden values written: {golden_path}")
        else:
            echo("  golden values NOT written: the ckpt-resume check failed")
    elif not options.compare_golden:
        echo("  golden values: not compared (--no-compare)")
    elif golden_path is None:
        echo("  golden values: none configured (test.golden_values is null)")
    elif golden_path.exists() and not _readable_golden(golden_path, echo):
        reports.insert(
            0,
            cmp.Report(
                f"golden values {golden_path}",
                [cmp.CheckResult("(file)", "missing", False, 0, detail="not golden-value JSON")],
            ),
        )
    elif not golden_path.exists():
        echo(
            f"  golden values: not compared, none at {golden_path}; create them with "
            f"`megatron-ext run {shown.source} --platform {shown.platform} --write-golden`"
        )
    elif judged.numerics_overridden and not options.force_compare:
        echo(
            f"  golden values: not compared, the overrides change the recipe "
            f"({' '.join(list(shown.shown_overrides))}); --compare forces it"
        )
    else:
        golden = met.read_golden(golden_path)
        rules = cmp.rules_for(names, request.launch.device, judged.tolerances)
        reports.insert(
            0, cmp.compare(run_metrics, golden, rules, title=f"golden values {golden_path}")
        )

    title = plot_title(shown)
    write_run_plot(
        run_dir / "loss.png",
        run_metrics,
        golden=golden,
        resumed=resumed,
        resume_step=resume_step,
        title=title,
    )
    mhc_plot = mhc_report.write_plot(run_dir, run_metrics, title)
    lines = [line for report in reports for line in report.lines()]
    (run_dir / "comparison.txt").write_text("\n".join(lines) + ("\n" if lines else ""))
    for line in lines:
        echo(f"  {line}")
    pipeline = None
    if options.trace:
        pipeline = run_trace.summarize(request, run_dir, echo)
    passed = all(r.passed for r in reports)
    seconds = time.monotonic() - started
    performance = _performance(
        judged.tokens_per_iteration, run_metrics, phase_results, request.launch.world_size
    )
    for line in _performance_lines(performance):
        echo(f"  {line}")
    write_summary(
        request,
        run_dir,
        "passed" if passed else "mismatch",
        phase_results,
        reports,
        seconds,
        pipeline=pipeline,
        performance=performance,
        metrics_source=source,
        losses=met.final_losses(run_metrics),
    )
    losses = run_metrics.get("lm loss", {})
    if losses:
        first, last = min(losses), max(losses)
        per_step = "TensorBoard per-step" if source == "tensorboard" else "log line"
        echo(
            f"  lm loss ({per_step}) {losses[first]:.4f} (step {first}) -> "
            f"{losses[last]:.4f} (step {last})"
        )
    for name in (met.VALIDATION_METRIC, met.TEST_METRIC):
        if name in (final := met.final_losses(run_metrics)):
            echo(f"  {name} {final[name]['value']:.4f} (step {final[name]['step']})")
    for line in mhc_report.summary_lines(run_metrics):
        echo(f"  {line}")
    echo(f"  metrics {run_dir / 'metrics.json'}, plot {run_dir / 'loss.png'}")
    if mhc_plot is not None:
        echo(f"  mHC plot {mhc_plot}")
    echo(f"{verdict(reports)}: {shown.name} in {seconds:.1f} s")
    return Outcome(EXIT_OK if passed else EXIT_MISMATCH, run_dir, reports, seconds)


def verdict(reports: list[cmp.Report]) -> str:
    """PASSED or FAILED only when something was compared with golden values."""
    if not reports:
        return "FINISHED (nothing compared with golden values)"
    return "PASSED" if all(r.passed for r in reports) else "FAILED"


def _readable_golden(path: Path, echo: Echo) -> bool:
    try:
        met.read_golden(path)
        return True
    except (ValueError, TypeError, AttributeError, OSError) as exc:
        echo(f"  golden values: {path} is not golden-value JSON ({exc})")
        return False


def plot_title(shown: Any, width: int = 90) -> str:
    """loss.png's and mhc.png's title: the recipe and platform (of ``shown``, the request's
    display part), then the overrides (secrets redacted), wrapped; a
    ``model.mhc.variant=deepseek-v4`` run's plots read like the default's without them (issue
    41, item 7)."""
    import textwrap

    title = f"{shown.name} ({shown.platform})"
    if not shown.shown_overrides:
        return title
    lines = textwrap.wrap(" ".join(shown.shown_overrides), width=width, break_on_hyphens=False)
    return "\n".join([title] + lines)


def _performance(
    tokens: int,
    run_metrics: met.Metrics,
    phase_results: list[dict],
    world_size: int | None = None,
) -> dict:
    """Throughput (tokens/s from the steady-window median iteration time, as compare's
    iteration-time rule reads it) and memory (CPU: each rank's peak RSS; GPU: Megatron's
    mem-max-allocated-bytes / mem-allocated-bytes scalars of the last rank)."""
    out: dict = {}
    times = run_metrics.get("iteration-time") or {}
    if times:
        median, chosen = cmp._steady_median(times, sorted(times))  # the window compare judges
        out["iteration_time_s"] = round(median, 6)
        out["iteration_time_steps"] = [chosen[0], chosen[-1]] if chosen else []
        out["tokens_per_iteration"] = tokens
        out["tokens_per_s"] = round(tokens / median, 1) if median > 0 else None
    throughput = run_metrics.get("throughput")
    if throughput:
        out["megatron_throughput_tflops_per_gpu_last"] = round(throughput[max(throughput)], 4)
    rss = {
        rank: mib
        for phase in phase_results
        for rank, mib in (phase.get("peak_rss_mib") or {}).items()
        if phase.get("phase") == "train"
    }
    if rss:
        # every rank, None where none was measured (a rank stopped by the launcher): a rank
        # missing from the line read as if the run had fewer (issue 41, item 10)
        every = {str(rank): rss.get(str(rank)) for rank in range(world_size or 0)}
        out["peak_rss_mib_per_rank"] = every | rss
    for tag in ("mem-max-allocated-bytes", "mem-allocated-bytes"):
        series = run_metrics.get(tag)
        if series:
            out[tag.replace("-", "_")] = max(series.values())
    return out


def _performance_lines(performance: dict) -> list[str]:
    lines = []
    if "tokens_per_s" in performance:
        steps = performance["iteration_time_steps"]
        lines.append(
            f"throughput: {performance['tokens_per_s']:.0f} tokens/s, "
            f"{performance['iteration_time_s'] * 1000:.0f} ms/iteration "
            f"(median of steps {steps[0]}-{steps[-1]})"
        )
    if "peak_rss_mib_per_rank" in performance:
        rss = performance["peak_rss_mib_per_rank"]
        lines.append(
            "peak RSS per rank (MiB): "
            + ", ".join(f"{r}: {'n/a' if v is None else f'{v:.0f}'}" for r, v in rss.items())
        )
    if "mem_max_allocated_bytes" in performance:
        lines.append(
            f"GPU memory: max allocated {performance['mem_max_allocated_bytes'] / 2**20:.0f} MiB "
            "(last rank, Megatron's mem-max-allocated-bytes)"
        )
    return lines


def versions() -> dict:
    """megatron-core, torch and megatron-ext versions, and megatron-ext's git commit (None
    outside a git checkout; "+dirty" when it has uncommitted changes)."""
    import subprocess
    from importlib import metadata

    import megatron_ext

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    commit = None
    here = Path(megatron_ext.__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if head.returncode == 0:
            dirty = subprocess.run(
                ["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
            commit = head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "megatron-core": version("megatron-core"),
        "torch": version("torch"),
        "megatron-ext": megatron_ext.__version__,
        "megatron-ext-git-commit": commit,
        "python": sys.version.split()[0],
    }


def write_summary(
    request: RunRequest,
    run_dir: Path,
    status: str,
    phase_results: list[dict],
    reports: list[cmp.Report],
    seconds: float,
    pipeline: dict | None = None,
    performance: dict | None = None,
    metrics_source: str | None = None,
    losses: dict | None = None,
) -> None:
    shown, golden = request.display, request.verdict.golden_path
    summary = {
        "recipe": str(shown.source),
        "name": shown.name,
        "platform": shown.platform,
        "overrides": list(shown.shown_overrides),
        "status": status,
        "seconds": round(seconds, 2),
        "world_size": request.launch.world_size,
        "entry": request.launch.entry,
        "phases": phase_results,
        "golden_values": str(golden) if golden else None,
        "reports": [r.to_dict() for r in reports],
        "host": os.uname().nodename,
        "metrics_source": metrics_source,
        "performance": performance or {},
        "losses": losses or {},
        "versions": versions(),
        "plan": dict(shown.plan),
    }
    if pipeline is not None:  # megatron-ext run --trace
        summary["pipeline"] = pipeline
    try:
        files.write_text_atomically(run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    except OSError as exc:  # disk full: the verdict still reaches the console and exit status
        print(f"megatron-ext run: no summary.json: {cannot_write(exc, run_dir)}", file=sys.stderr)
