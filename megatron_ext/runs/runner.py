"""``megatron-ext run``: validate a recipe, train it locally, and judge the result.

A run directory (``runs/<name>-<platform>-<time>/`` unless ``--run-dir`` says otherwise)::

    recipe.yaml          the resolved recipe (platform and overrides applied, every field)
    run.json             how the run was started (recipe, platform, overrides): run --resume
    command.sh           the exact command line(s), runnable: torchrun + entry + Megatron flags
    logs/rank-N.log      each rank's stdout and stderr (ckpt-resume: logs/resume/ too)
    tensorboard/         the last rank's TensorBoard event files (ckpt-resume: resume/ too)
    checkpoints/         megatron's checkpoints (ckpt-resume; every other run saves at the
                         end, every checkpoint.save_interval iterations and on a stop signal)
    logs/resumed-N/, tensorboard/resumed-N/   the N-th `run --resume` of a stopped run
    metrics.json         Megatron golden-value JSON of test.metrics, read from TensorBoard as
                         Megatron-LM's CI does (logs as fallback); ckpt-resume: of the
                         uninterrupted run, metrics_resume.json: of the resumed one
    loss.png             every logged loss, grad norm and learning rate per step (matplotlib;
                         golden values dashed, the resumed run dotted from its resume step)
    comparison.txt       the comparison reports, as printed
    trace.json           with --trace: every rank's passes and P2P calls (Chrome trace events)
    timeline.png         with --trace: the measured pipeline timeline of one iteration
    summary.json         status, timings, the reports, paths, throughput and memory, the
                         versions (megatron-core, torch, megatron-ext and its git commit)
                         and the resolved plan

Exit status: 0 trained and every comparison passed (or nothing to compare); 1 a comparison
failed; 2 the recipe is invalid or cannot start here; 3 training failed or timed out; 75
stopped by SIGTERM or SIGUSR1 after saving a checkpoint, resumable (``megatron-ext run --resume
RUN_DIR``). Ctrl-C stops at once (130), SIGHUP too (129); a ckpt-resume test recipe and the
multi-module entry stop at once on SIGTERM as well (143).

The same post-processing (:func:`finalize`) serves ``submit --slurm`` once its job ends.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron_ext import files
from megatron_ext.checkpoint import layout
from megatron_ext.launch import env_policy, faults, heartbeat, local, shell, stop_signals
from megatron_ext.launch.local import stop_signals_interrupt
from megatron_ext.launch.stop_signals import EXIT_STOPPED
from megatron_ext.recipes.request import (
    RECIPE_PLACEHOLDER,
    RUN_DIR_PLACEHOLDER,
    RunDirRecipe,
    RunRequest,
)
from megatron_ext.recipes.schema import RecipeError
from megatron_ext.runs import (
    lock as run_lock,
    metrics as met,
    options as run_options,
    resume as rsm,
    trace as run_trace,
)
from megatron_ext.runs.options import RunOptions
from megatron_ext.runs.outcome import (
    EXIT_INVALID,
    EXIT_OK,
    EXIT_TRAINING_FAILED,
    Echo,
    Outcome,
    cannot_write,
    default_echo,
)
from megatron_ext.runs.verdict import finalize, write_summary


# ---- phases -------------------------------------------------------------------------------------
@dataclass
class Phase:
    """One training run of a recipe (ckpt-resume has two)."""

    name: str  # "train" | "resume"
    args: list[str]
    log_dir: Path


def _placed(arg: str, run_dir: Path) -> str:
    if arg == RECIPE_PLACEHOLDER:
        return str(run_dir / "recipe.yaml")
    return arg.replace(RUN_DIR_PLACEHOLDER, str(run_dir))


def metrics_args(request: RunRequest, tensorboard_dir: Path) -> list[str]:
    """Where the last rank writes its TensorBoard scalars, and which: iteration time and
    throughput always, the memory counters on GPUs (Megatron-LM's functional-test flags)."""
    args = [
        "--tensorboard-dir",
        str(tensorboard_dir),
        "--log-timers-to-tensorboard",
        "--log-throughput",
    ]
    if request.launch.device == "gpu":
        args.append("--log-memory-to-tensorboard")
    return args


def phases(
    request: RunRequest, run_dir: Path, segment: str = "", load: bool = False
) -> list[Phase]:
    """The training runs of a start of the recipe (``segment``: a resume's, see
    :mod:`megatron_ext.runs.resume`; ``load``: from the latest complete checkpoint)."""
    flags = request.phases
    args = _all_placed(flags.megatron_args, run_dir)
    logs = run_dir / "logs"
    tensorboard = run_dir / met.TENSORBOARD_SUBDIR
    if flags.resumable:
        long_run = _all_placed(flags.long_run_load_args if load else flags.long_run_args, run_dir)
        metrics = metrics_args(request, tensorboard / segment if segment else tensorboard)
        return [Phase(segment or "train", args + metrics + long_run, logs / segment)]
    if not flags.ckpt_resume:
        return [Phase("train", args + metrics_args(request, tensorboard), logs)]
    save, load_half = (
        _all_placed(flags.save_args, run_dir),
        _all_placed(flags.load_args, run_dir),
    )
    return [
        Phase("train", args + metrics_args(request, tensorboard) + save, logs),
        Phase(
            "resume",
            args + metrics_args(request, tensorboard / "resume") + load_half,
            logs / "resume",
        ),
    ]


def _all_placed(args: Sequence[str], run_dir: Path) -> list[str]:
    return [_placed(a, run_dir) for a in args]


def prepare_resume(request: RunRequest, run_dir: Path) -> None:
    """Between the phases, as Megatron's CI does: drop the final checkpoint and point
    ``latest`` at the one saved at iterations/2."""
    iterations = request.phases.iterations
    ckpt = run_dir / "checkpoints"
    half = ckpt / f"iter_{iterations // 2:07d}"
    if not half.is_dir():
        raise FileNotFoundError(
            f"the first run saved no checkpoint at iteration {iterations // 2} ({half})"
        )
    shutil.rmtree(ckpt / f"iter_{iterations:07d}", ignore_errors=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text(str(iterations // 2))


def resume_shell(ckpt: Path, iterations: int) -> str:
    """The shell twin of :func:`prepare_resume` (paths quoted)."""
    q = shlex.quote
    last = Path(ckpt) / f"iter_{iterations:07d}"
    tracker = Path(ckpt) / "latest_checkpointed_iteration.txt"
    return f"rm -rf {q(str(last))} && echo {int(iterations) // 2} > {q(str(tracker))}"


def command_script(request: RunRequest, run_dir: Path, launcher: str = "torchrun") -> str:
    """command.sh: the exact commands, runnable from any shell on this machine."""
    shown, launch = request.display, request.launch
    env = dict(launch.environment)
    lines = [
        "#!/usr/bin/env bash",
        shell.comment(
            f"# megatron-ext {launcher} run of {shown.source} (platform {shown.platform}"
            + (f", overrides: {shlex.join(list(shown.shown_overrides))}" if shown.overrides else "")
            + ")"
        ),
        shell.comment(f"# {shown.describe}"),
        "# Each rank runs `python -m ENTRY FLAGS` with torchrun's environment; this is the same.",
        "set -euo pipefail",
        f"cd {shlex.quote(str(Path.cwd()))}",
    ]
    for key in env:
        if not shell.ENV_KEY.match(str(key)):
            raise shell.UnsafeValueError(f"launch.env key {str(key)!r} is not a variable name")
    lines += [shell.secret_check_line(k) for k in env if shell.is_secret(k)]
    plain = {k: v for k, v in env.items() if not shell.is_secret(k)}
    if plain:
        lines.append("export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in plain.items()))
    for phase in phases(request, run_dir):
        if phase.name == "resume":
            lines.append(resume_shell(run_dir / "checkpoints", request.phases.iterations))
        lines.append(f"# {phase.name}")
        assert launch.entry is not None  # a recipe without one fails validation
        head = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(launch.world_size),
            "-m",
            launch.entry,
        ]
        lines.append(format_command(head, phase.args))
    return "\n".join(lines) + "\n"


def dry_run(
    request: RunRequest, options: RunOptions = RunOptions(), echo: Echo = default_echo
) -> Outcome:
    """``run --dry-run``: every check, then the plan and the exact commands; no rank starts
    and nothing is written."""
    shown = request.display
    echo(f"megatron-ext run --dry-run {shown.source} (platform {shown.platform})")
    echo(f"  {shown.describe}")
    for note in shown.notes:
        echo(f"  note: {note}")
    why = preflight(request, echo)
    if why is not None:
        echo(f"cannot run: {why}")
        return Outcome(EXIT_INVALID, None, message=why)
    run_dir = _run_dir(request, options)
    golden = request.verdict.golden_path
    echo(f"  run directory (not created): {run_dir}")
    echo(f"  golden values: {golden}" + ("" if golden is None or golden.exists() else " (missing)"))
    echo("  command.sh:")
    for line in command_script(request, run_dir).splitlines():
        echo(f"    {line}")
    return Outcome(EXIT_OK, None, message="dry run")


def format_command(head: list[str], args: list[str]) -> str:
    """One flag (with its values) per continued line."""
    groups: list[list[str]] = []
    for a in args:
        if a.startswith("--") or not groups:
            groups.append([a])
        else:
            groups[-1].append(a)
    return " \\\n    ".join([shlex.join(head)] + [shlex.join(g) for g in groups])


# ---- progress ------------------------------------------------------------------------------------
PLAIN_PROGRESS = re.compile(r"^multimodule: iteration (\d+)/(\d+) \| (.*)$")


LOSS_SOURCES = (
    "  (losses below: Megatron's log line, averaged over the iteration's micro-batches as it "
    "prints them; metrics.json, loss.png and the golden comparison use the per-step "
    "TensorBoard scalars, which can differ from them)"
)
TRAINING_LOOP_MARKER = "before the start of training step"
"""What Megatron's rank 0 prints once set-up is over and the training loop begins."""


class Progress:
    """Turns the followed rank's log lines into one short line per event."""

    def __init__(self, echo: Echo, phase: str, start: float | None = None):
        """``start``: when the ranks were started (None: at the first line seen, as for a
        Slurm job whose start the submitter does not see)."""
        self.echo, self.phase, self.start = echo, phase, start
        self.training_seen = False
        self.recent_s: list[float] = []  # the last iterations' times, for the ETA

    def __call__(self, line: str) -> None:
        if self.start is None:
            self.start = time.monotonic()
        parsed = met.parse_iteration_line(line)
        if parsed is not None:
            step, total, values = parsed
            if not self.training_seen:
                self.training_seen = True
                self.echo(
                    f"  first iteration after {time.monotonic() - self.start:.1f} s "
                    "(imports, process groups, model, data)"
                )
                self.echo(LOSS_SOURCES)
            parts = [f"  iteration {step:>4}/{total}"]
            for name in sorted(values):
                if name.endswith("loss"):
                    parts.append(f"{name} {values[name]:.6f}")
            if "grad-norm" in values:
                parts.append(f"grad norm {values['grad-norm']:.3f}")
            if "iteration-time" in values:
                parts.append(f"{values['iteration-time'] * 1000:.0f} ms/iter")
                self.recent_s = [*self.recent_s[-4:], values["iteration-time"]]
                eta = (total - step) * sum(self.recent_s) / len(self.recent_s)
                parts.append(f"ETA {format_eta(eta)}")
            self.echo(" | ".join(parts))
            return
        text = line.strip()
        plain = PLAIN_PROGRESS.match(text)
        if plain:  # an entry's own progress line (pretrain_multimodule): shown as it is
            self.training_seen = True
            self.echo(f"  iteration {int(plain.group(1)):>4}/{plain.group(2)} | {plain.group(3)}")
            return
        if "successfully saved checkpoint from iteration" in text:
            self.echo(f"  checkpoint saved at iteration {text.split('iteration')[1].split()[0]}")
        elif "successfully loaded checkpoint" in text:
            self.echo(f"  checkpoint loaded (iteration {text.rsplit('iteration', 1)[1].strip()})")
        elif "validation loss at iteration" in text and "lm loss value" in text:
            self.echo("  " + text.strip(" |"))


def format_eta(seconds: float) -> str:
    """12s, 3m05s, 2h07m: the training time left at the recent iterations' pace."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def default_run_dir(request: RunRequest, root: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    shown = request.display
    if shown.run_dir_name_problem is not None:
        raise shell.UnsafeValueError(shown.run_dir_name_problem)
    base = root / f"{shown.name}-{shown.platform}-{stamp}"
    if not files.inside(root, base):
        raise shell.UnsafeValueError(f"the run directory {base} would leave the runs root {root}")
    candidate, n = base, 1
    while candidate.exists():
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate


def _start_problem(request: RunRequest, echo: Echo) -> str | None:
    """``checkpoint.load``'s problems (found by the request once the pickles were checked),
    each echoed on its own line; the summary, or None when it can start."""
    found = request.launch.start_problems
    for line in found:
        echo(line)
    return f"{len(found)} problem(s) with checkpoint.load" if found else None


def preflight(request: RunRequest, echo: Echo) -> str | None:
    """Why this recipe cannot start here (None: it can). Prints the problems."""
    if request.problems:
        for problem in request.problems:
            echo(f"{request.display.source}: {problem}")
        return f"{len(request.problems)} problem(s) in the recipe"
    fault = fault_problem(request)
    if fault is not None:
        return fault
    return request.launch.entry_problem


def fault_problem(request: RunRequest) -> str | None:
    """A malformed MEGATRON_EXT_FAULT (the environment's or launch.env's), or one naming a rank
    the run does not have, found here rather than by every rank after start-up."""
    launch, iterations = request.launch, request.phases.iterations
    text = launch.fault if launch.fault is not None else os.environ.get(faults.FAULT_ENV)
    if not text:
        return None
    try:
        fault = faults.parse_fault(str(text))
    except ValueError as exc:
        return f"{exc}; fix it or unset {faults.FAULT_ENV}"
    if fault.rank >= launch.world_size:
        return (
            f"{faults.FAULT_ENV}={text!r}: rank {fault.rank} does not exist in a run of "
            f"{launch.world_size} ranks; give rank=0..{launch.world_size - 1}"
        )
    if fault.step > iterations:
        return (
            f"{faults.FAULT_ENV}={text!r}: step {fault.step} is past the run's "
            f"{iterations} iterations; give step=1..{iterations}"
        )
    return None


def write_run_files(
    request: RunRequest,
    run_dir: Path,
    launcher: str = "torchrun",
    options: RunOptions = RunOptions(),
) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    shown = request.display
    (run_dir / "recipe.yaml").write_text(shown.recipe_yaml)
    rsm.write_run_record(
        run_dir,
        {
            "recipe": str(shown.source),
            "name": shown.name,
            "platform": shown.platform,
            "overrides": list(shown.shown_overrides),
            "launcher": launcher,
            "resumable": request.phases.resumable,
            "options": run_options.to_record(options),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        },
    )
    script = run_dir / "command.sh"
    script.write_text(command_script(request, run_dir, launcher))
    script.chmod(0o755)


def _stall_environment_problem() -> str | None:
    """A malformed MEGATRON_EXT_STALL_TIMEOUT_S / MEGATRON_EXT_STARTUP_TIMEOUT_S, before any rank starts."""
    try:
        heartbeat.Watchdog(Path("."), 1)
    except ValueError as exc:
        return str(exc)
    return None


def _run_dir(request: RunRequest, options: RunOptions) -> Path:
    return Path(options.run_dir) if options.run_dir else default_run_dir(request, options.runs_root)


def run(
    request: RunRequest, options: RunOptions = RunOptions(), echo: Echo = default_echo
) -> Outcome:
    """Check, train locally (every phase), then :func:`finalize`. ``options.trace``: record
    every rank's pipeline schedule (trace.json, timeline.png, measured vs theoretical bubble);
    the pickles of the checkpoints the run loads were checked by the request (unless
    ``--trust-pickle``) before anything read them."""
    started = time.monotonic()
    shown = request.display
    echo(f"megatron-ext run {shown.source} (platform {shown.platform})")
    echo(f"  {shown.describe}")
    for note in shown.notes:
        echo(f"  note: {note}")
    # first: nothing else (megatron's argument checks included) may read a hostile checkpoint
    why = request.refusal
    if why is None:
        why = _start_problem(request, echo)
    if why is None:
        why = preflight(request, echo)
    if why is None and request.launch.device == "gpu":
        import torch

        if not torch.cuda.is_available():
            why = "launch.device is gpu but torch sees no GPU here; use --device cpu (or --platform cpu)"
    if why is None:
        why = _stall_environment_problem()
    if why is not None:
        echo(f"cannot run: {why}")
        return Outcome(EXIT_INVALID, None, message=why)
    if options.write_golden and (why := request.verdict.golden_write_problem):
        echo(f"cannot run: {why}")
        return Outcome(EXIT_INVALID, None, message=why)
    if options.write_golden and request.verdict.numerics_overridden:
        why = (
            "--write-golden refuses a run whose overrides change numerics; edit the recipe instead"
        )
        echo(f"cannot run: {why}")
        return Outcome(EXIT_INVALID, None, message=why)

    run_dir = _run_dir(request, options)
    try:  # a SIGTERM before the ranks start is reported and summarised too (issue 34, item 16)
        with run_lock.holding(run_dir), stop_signals_interrupt():
            return _run_in(request, run_dir, started, options, echo)
    except run_lock.RunDirectoryBusy as exc:
        echo(f"cannot run: {exc}")
        return Outcome(EXIT_INVALID, None, message=str(exc))


def _run_in(
    request: RunRequest, run_dir: Path, started: float, options: RunOptions, echo: Echo
) -> Outcome:
    """:func:`run` once the run directory is held."""
    if (why := rsm.existing_run_problem(run_dir)) is not None:
        echo(f"cannot run: {why}")
        return Outcome(EXIT_INVALID, None, message=why)
    results: list[dict] = []
    try:
        write_run_files(request, run_dir, options=options)
    except OSError as exc:
        why = cannot_write(exc, run_dir)
        echo(f"cannot run: {why}")
        return Outcome(EXIT_INVALID, None, message=why)
    except KeyboardInterrupt as exc:  # stopped while the run directory was being written
        _write_interrupted_summary(request, run_dir, results, started, exc, echo)
        raise
    echo(f"  run directory {run_dir}")
    try:
        return _run_phases(request, run_dir, results, started, options, echo)
    except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM, SIGHUP: the launcher stopped the ranks
        _write_interrupted_summary(request, run_dir, results, started, exc, echo)
        raise


def _write_interrupted_summary(
    request: RunRequest,
    run_dir: Path,
    results: list[dict],
    started: float,
    exc: BaseException,
    echo: Echo,
) -> None:
    signum = getattr(exc, "signum", None)
    how = f"stopped by {signal.Signals(signum).name}" if signum else "interrupted (Ctrl-C)"
    results.append(
        {
            "phase": "interrupted",
            "returncode": 128 + (signum or signal.SIGINT),
            "seconds": round(time.monotonic() - started, 2),
            "reason": how,
        }
    )
    write_summary(request, run_dir, "interrupted", results, [], time.monotonic() - started)
    echo(f"  {how}: every rank stopped; summary {run_dir / 'summary.json'}")


def _training_loop_started(job, progress: Progress) -> bool:
    """Whether the ranks got past set-up: an iteration was logged, or rank 0 printed
    Megatron's training-loop marker."""
    if progress.training_seen:
        return True
    try:
        return TRAINING_LOOP_MARKER in job.log_path(0).read_text(errors="replace")
    except OSError:
        return False


def _echo_first_failure(job, result, echo: Echo) -> None:
    summary = local.failure_summary(job, result)
    if summary:
        echo(f"  first failure: {summary}")


def _run_phases(
    request: RunRequest,
    run_dir: Path,
    results: list[dict],
    started: float,
    options: RunOptions,
    echo: Echo,
    run_phases: list[Phase] | None = None,
) -> Outcome:
    launch, iterations = request.launch, request.phases.iterations
    for phase in run_phases or phases(request, run_dir):
        if phase.name == "resume":
            prepare_resume(request, run_dir)
        echo(
            f"  [{phase.name}] starting {launch.world_size} rank(s): python -m {launch.entry} "
            f"(logs: {phase.log_dir}/rank-*.log)"
        )
        env = dict(launch.environment)
        if options.trace:
            env.update(run_trace.environment(run_dir))
        assert launch.entry is not None  # preflight refused a recipe without one
        job = local.LocalJob(
            module=launch.entry,
            args=phase.args,
            nproc=launch.world_size,
            log_dir=phase.log_dir,
            env=env,
            timeout_s=launch.timeout_s,
            stall_timeout_s=launch.stall_timeout_s,
            startup_timeout_s=launch.startup_timeout_s,
            save_signal=stop_signals.SAVE_SIGNAL if request.phases.resumable else None,
        )
        progress = Progress(echo, phase.name, start=time.monotonic())
        result = local.launch(job, on_line=progress)
        results.append(
            {
                "phase": phase.name,
                "returncode": result.returncode,
                "seconds": round(result.seconds, 2),
                "timed_out": result.timed_out,
                "peak_rss_mib": {
                    str(r): round(kib / 1024, 1) for r, kib in sorted(result.peak_rss_kib.items())
                },
            }
        )
        echo(f"  [{phase.name}] finished in {result.seconds:.1f} s (exit {result.returncode})")
        ckpt = rsm.checkpoint_dir(run_dir)
        if result.stopped_by is not None and rsm.latest_complete(ckpt) != iterations:
            results[-1]["stopped_by"] = signal.Signals(result.stopped_by).name
            return _stopped(request, run_dir, results, started, result, echo)
        if _stopped_after_the_end(result, rsm.latest_complete(ckpt), iterations):
            echo("  the stop signal came after the final checkpoint: the run is complete")
        elif not result.ok:
            named = local.failing_rank(job, result)
            rank = named if named is not None else launch.world_size - 1
            reason = local.failure_summary(job, result)
            what = (
                f"timed out after {launch.timeout_s} s"
                if result.timed_out
                else f"rank {rank} stalled {result.stall.at} (no progress for {result.stall.idle_s:.0f} s)"
                if result.stall
                else reason or f"rank {rank} exited with {result.returncode}"
            )
            results[-1].update({"failed_rank": rank, "reason": reason or what})
            _echo_first_failure(job, result, echo)
            echo(f"training failed: {what}; last lines of {job.log_path(rank)}:")
            for line in local.tail(job.log_path(rank), 40):
                echo(f"    {line}")
            if options.trace:
                where = run_trace.failing_step(run_dir / run_trace.TRACE_SUBDIR)
                if where:
                    echo(f"failed at pipeline step: {where}")
                    what += f"; failed at pipeline step: {where}"
            elif launch.pipelined and _training_loop_started(job, progress):
                # A start-up error (arguments, imports, model build) has no pipeline step.
                echo("  (rerun with --trace to name the failing pipeline step: rank, chunk, step)")
            write_summary(
                request, run_dir, "training-failed", results, [], time.monotonic() - started
            )
            return Outcome(
                EXIT_TRAINING_FAILED, run_dir, seconds=time.monotonic() - started, message=what
            )
    flags = request.phases
    if flags.resumable:
        removed = rsm.prune(
            rsm.checkpoint_dir(run_dir), flags.most_recent_k, flags.keep_final, iterations
        )
        if removed:
            echo(f"  checkpoints removed (checkpoint.most_recent_k / keep_final): {removed}")
    return finalize(request, run_dir, results, started, options, echo)


def _stopped_after_the_end(result, latest: int | None, iterations: int) -> bool:
    """A stop signal that came once training was over: the final checkpoint is complete and a
    rank that did not exit 0 was ended by the save signal while tearing down (Megatron's
    handler gone). The run finished; the stop must not make it a failure (issue 34, item 8)."""
    if result.stopped_by is None or result.ok or result.timed_out or latest != iterations:
        return False
    return all(code in (0, -stop_signals.SAVE_SIGNAL) for code in result.rank_codes.values())


STOPPED_RESUMABLE = "stopped, resumable"
"""What a run stopped by SIGTERM / SIGUSR1 reports (exit status 75, summary status 'stopped')."""


def _stopped(request, run_dir: Path, results: list[dict], started: float, result, echo) -> Outcome:
    """A run the launcher's SIGTERM / SIGUSR1 stopped: where it can continue from."""
    name = signal.Signals(result.stopped_by).name
    latest = rsm.latest_complete(rsm.checkpoint_dir(run_dir))
    where = (
        f"latest complete checkpoint at iteration {latest}"
        if latest is not None
        else "no checkpoint yet (stopped before the first iteration): a resume starts over"
    )
    if not result.ok:
        where += f" (the ranks exited with {result.returncode} while stopping)"
    results[-1]["resume_from"] = latest
    write_summary(request, run_dir, "stopped", results, [], time.monotonic() - started)
    echo(f"  {name}: {where}")
    echo(f"{STOPPED_RESUMABLE}: megatron-ext run --resume {run_dir}")
    return Outcome(
        EXIT_STOPPED, run_dir, seconds=time.monotonic() - started, message=STOPPED_RESUMABLE
    )


def resume_run(
    run_dir: Path,
    recipes: RunDirRecipe,
    options: RunOptions = RunOptions(),
    echo: Echo = default_echo,
    overrides: Sequence[str] = (),
    allow_env: tuple[str, ...] = (),
) -> Outcome:
    """``megatron-ext run --resume RUN_DIR``: the run's own recipe.yaml (its platform and
    overrides applied; ``recipes`` reads it and makes the request) from its latest complete
    checkpoint, in a new segment of the run. ``overrides``: parallelism.* and
    training.iterations only (another layout, a longer run: :mod:`megatron_ext.checkpoint.layout`).
    Holds the run directory's lock (as ``run`` does) before it reads or changes anything there.
    ``allow_env``: the code-loading launch.env keys allowed again with ``--allow-env`` (a run
    directory never allows them by itself)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():  # the lock would create it
        echo(f"cannot resume: {run_dir}: not a directory")
        return Outcome(EXIT_INVALID, None, message=f"{run_dir}: not a directory")
    try:
        with run_lock.holding(run_dir), stop_signals_interrupt():
            return _resume_in(run_dir, recipes, options, echo, list(overrides), allow_env)
    except run_lock.RunDirectoryBusy as exc:
        echo(f"cannot resume: {exc}")
        return Outcome(EXIT_INVALID, None, message=str(exc))


def _resume_in(
    run_dir: Path,
    recipes: RunDirRecipe,
    options: RunOptions,
    echo: Echo,
    overrides: list[str],
    allow_env: tuple[str, ...],
) -> Outcome:
    """:func:`resume_run` once the run directory is held."""
    started = time.monotonic()
    try:
        if why := layout.override_problem(overrides):
            raise rsm.ResumeError(why)
        record = rsm.read_run_record(run_dir)
        options = run_options.for_resume(record.get("options"), options)
        if not record.get("resumable"):
            raise rsm.ResumeError(
                f"{run_dir}: this run cannot be resumed (a ckpt-resume test recipe or the "
                "multi-module entry); start it again with megatron-ext run"
            )
        status = _summary_status(run_dir)
        finished = status in ("passed", "mismatch")
        resolved = (
            None
            if finished and not overrides
            else recipes.recipe(run_dir / "recipe.yaml", overrides)
        )
        if finished and not (resolved and layout.finished_run_continues(run_dir, resolved)):
            raise rsm.ResumeError(
                f"{run_dir}: the run already finished (status {status}); to train it further, "
                "raise training.iterations (run --resume RUN_DIR training.iterations=N)"
            )
        # resolved is None only for a finished run without overrides, refused just above
        assert resolved is not None
        before = recipes.recipe(run_dir / "recipe.yaml", []) if overrides else None
        if before is not None and (why := layout.change_problem(before, resolved)):
            raise rsm.ResumeError(why)
        env = resolved.launch.env
        try:  # secrets were never written there: the caller's environment has them
            resolved.launch.env = env_policy.restore_secrets(env, os.environ)
        except ValueError as exc:
            raise rsm.ResumeError(str(exc)) from None
        ckpt = rsm.checkpoint_dir(run_dir)
        # nothing is changed before this: a tracker that is not an iteration of this run, or
        # an iter_ entry that cannot be its save, is refused (issue 34, item 2)
        latest, cut = rsm.resume_point(ckpt, resolved.training.iterations)
    except (rsm.ResumeError, RecipeError) as exc:
        echo(f"cannot resume: {exc}")
        return Outcome(EXIT_INVALID, None, message=str(exc))
    assert resolved is not None  # None only for a finished run, refused above
    # every pickle of the checkpoint a rank will load is checked (the request's refusal)
    # before anything reads it or is removed
    request = recipes.request(
        resolved,
        Path(record.get("recipe") or run_dir / "recipe.yaml"),
        record.get("platform", "cpu"),
        list(record.get("overrides", [])) + overrides,
        tuple(allow_env),
        megatron_checks=options.megatron_checks,
        trust_pickle=options.trust_pickle,
        resume_from=ckpt if latest is not None else None,
    )
    segment = rsm.next_segment(run_dir)
    shown = request.display
    echo(f"megatron-ext run --resume {run_dir} ({shown.source}, platform {shown.platform})")
    echo(f"  {shown.describe}")
    why = request.refusal
    if why is None:
        why = preflight(request, echo)
    if why is not None:
        echo(f"cannot resume: {why}")
        return Outcome(EXIT_INVALID, None, message=why)
    if cut:
        try:
            rsm.discard_incomplete(ckpt, request.phases.iterations)
        except OSError as exc:
            why = cannot_write(exc, run_dir)
            echo(f"cannot resume: {why}")
            return Outcome(EXIT_INVALID, None, message=why)
        echo(f"  removed checkpoint(s) cut short while saving: iteration(s) {cut}")
    echo(
        f"  resuming from the checkpoint at iteration {latest}"
        if latest is not None
        else "  no complete checkpoint: training starts over"
    )
    run_phases = phases(request, run_dir, segment, load=latest is not None)
    if before is not None:
        run_phases[0].args.extend(layout.apply(run_dir, before, resolved, request, latest, echo))
    results: list[dict] = []
    try:
        return _run_phases(
            request,
            run_dir,
            results,
            started,
            RunOptions(compare_golden=options.compare_golden, force_compare=options.force_compare),
            echo,
            run_phases=run_phases,
        )
    except KeyboardInterrupt as exc:
        _write_interrupted_summary(request, run_dir, results, started, exc, echo)
        raise


def _summary_status(run_dir: Path) -> str | None:
    try:
        return json.loads(files.read_record(run_dir / "summary.json", "summary")).get("status")
    except (OSError, ValueError, AttributeError):
        return None
