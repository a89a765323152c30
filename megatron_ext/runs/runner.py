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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from megatron_ext import files
from megatron_ext.checkpoint import preload
from megatron_ext.launch import shell
from megatron_ext.launch.stop_signals import EXIT_STOPPED
from megatron_ext.recipes.request import (
    RECIPE_PLACEHOLDER,
    RUN_DIR_PLACEHOLDER,
    RunDirRecipe,
    RunRequest,
)
from megatron_ext.recipes.schema import RecipeError
from megatron_ext.runs import golden as cmp, metrics as met, mhc_report, resume as rsm
from megatron_ext.runs.options import RunOptions
from megatron_ext.runs.plot import write_run_plot

EXIT_OK, EXIT_MISMATCH, EXIT_INVALID, EXIT_TRAINING_FAILED = 0, 1, 2, 3

Echo = Callable[[str], None]


def _default_echo(text: str) -> None:
    print(text, flush=True)


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
    if request.recipe.launch.device == "gpu":
        args.append("--log-memory-to-tensorboard")
    return args


def phases(
    request: RunRequest, run_dir: Path, segment: str = "", load: bool = False
) -> list[Phase]:
    """The training runs of a start of the recipe (``segment``: a resume's, see
    :mod:`megatron_ext.runs.resume`; ``load``: from the latest complete checkpoint)."""
    args = _all_placed(request.megatron_args, run_dir)
    logs = run_dir / "logs"
    tensorboard = run_dir / met.TENSORBOARD_SUBDIR
    if request.recipe.resumable:
        long_run = _all_placed(
            request.long_run_load_args if load else request.long_run_args, run_dir
        )
        metrics = metrics_args(request, tensorboard / segment if segment else tensorboard)
        return [Phase(segment or "train", args + metrics + long_run, logs / segment)]
    if request.recipe.test.type != "ckpt-resume":
        return [Phase("train", args + metrics_args(request, tensorboard), logs)]
    save, load_half = (
        _all_placed(request.save_args, run_dir),
        _all_placed(request.load_args, run_dir),
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
    iterations = request.recipe.training.iterations
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
    recipe = request.recipe
    env = dict(request.environment)
    lines = [
        "#!/usr/bin/env bash",
        shell.comment(
            f"# megatron-ext {launcher} run of {request.source} (platform {request.platform}"
            + (
                f", overrides: {shlex.join(list(request.shown_overrides))}"
                if request.overrides
                else ""
            )
            + ")"
        ),
        shell.comment(f"# {request.describe}"),
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
            lines.append(resume_shell(run_dir / "checkpoints", recipe.training.iterations))
        lines.append(f"# {phase.name}")
        assert recipe.entry is not None  # a recipe without one fails validation
        head = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(recipe.world_size),
            "-m",
            recipe.entry,
        ]
        lines.append(format_command(head, phase.args))
    return "\n".join(lines) + "\n"


def dry_run(
    request: RunRequest, options: RunOptions = RunOptions(), echo: Echo = _default_echo
) -> Outcome:
    """``run --dry-run``: every check, then the plan and the exact commands; no rank starts
    and nothing is written."""
    echo(f"megatron-ext run --dry-run {request.source} (platform {request.platform})")
    echo(f"  {request.describe}")
    for note in request.notes:
        echo(f"  note: {note}")
    why = preflight(request, echo)
    if why is not None:
        echo(f"cannot run: {why}")
        return Outcome(EXIT_INVALID, None, message=why)
    run_dir = _run_dir(request, options)
    golden = request.golden_path
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


# ---- outcome -------------------------------------------------------------------------------------
@dataclass
class Outcome:
    exit_code: int
    run_dir: Path | None
    reports: list[cmp.Report] = field(default_factory=list)
    seconds: float = 0.0
    message: str = ""


def default_run_dir(request: RunRequest, root: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if request.run_dir_name_problem is not None:
        raise shell.UnsafeValueError(request.run_dir_name_problem)
    base = root / f"{request.name}-{request.platform}-{stamp}"
    if not files.inside(root, base):
        raise shell.UnsafeValueError(f"the run directory {base} would leave the runs root {root}")
    candidate, n = base, 1
    while candidate.exists():
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate


def preflight(request: RunRequest, echo: Echo) -> str | None:
    """Why this recipe cannot start here (None: it can). Prints the problems."""
    if request.problems:
        for problem in request.problems:
            echo(f"{request.source}: {problem}")
        return f"{len(request.problems)} problem(s) in the recipe"
    fault = fault_problem(request)
    if fault is not None:
        return fault
    if not request.entry_importable:
        return (
            f"the entry module {request.recipe.entry} is not importable (model.type "
            f"{request.recipe.model.type}); install it or set model.entry"
        )
    return None


def fault_problem(request: RunRequest) -> str | None:
    """A malformed MEGATRON_EXT_FAULT (the environment's or launch.env's), or one naming a rank
    the run does not have, found here rather than by every rank after start-up."""
    from megatron_ext.launch import faults

    text = request.recipe.launch.env.get(faults.FAULT_ENV, os.environ.get(faults.FAULT_ENV))
    if not text:
        return None
    try:
        fault = faults.parse_fault(str(text))
    except ValueError as exc:
        return f"{exc}; fix it or unset {faults.FAULT_ENV}"
    if fault.rank >= request.recipe.world_size:
        return (
            f"{faults.FAULT_ENV}={text!r}: rank {fault.rank} does not exist in a run of "
            f"{request.recipe.world_size} ranks; give rank=0..{request.recipe.world_size - 1}"
        )
    if fault.step > request.recipe.training.iterations:
        return (
            f"{faults.FAULT_ENV}={text!r}: step {fault.step} is past the run's "
            f"{request.recipe.training.iterations} iterations; give step=1.."
            f"{request.recipe.training.iterations}"
        )
    return None


def write_run_files(
    request: RunRequest,
    run_dir: Path,
    launcher: str = "torchrun",
    options: RunOptions = RunOptions(),
) -> None:
    from megatron_ext.runs import options as run_options

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "recipe.yaml").write_text(request.recipe_yaml)
    rsm.write_run_record(
        run_dir,
        {
            "recipe": str(request.source),
            "name": request.name,
            "platform": request.platform,
            "overrides": list(request.shown_overrides),
            "launcher": launcher,
            "resumable": request.recipe.resumable,
            "options": run_options.to_record(options),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        },
    )
    script = run_dir / "command.sh"
    script.write_text(command_script(request, run_dir, launcher))
    script.chmod(0o755)


def cannot_write(exc: OSError, run_dir: Path) -> str:
    """One line for a failed write under the run directory (disk full, read-only, not a dir)."""
    where = exc.filename or run_dir
    return (
        f"cannot write {where}: {files.failure_reason(exc)}; free space there or choose another "
        "directory with --run-dir / --runs-root"
    )


def _stall_environment_problem() -> str | None:
    """A malformed MEGATRON_EXT_STALL_TIMEOUT_S / MEGATRON_EXT_STARTUP_TIMEOUT_S, before any rank starts."""
    from megatron_ext.launch import heartbeat

    try:
        heartbeat.Watchdog(Path("."), 1)
    except ValueError as exc:
        return str(exc)
    return None


def _run_dir(request: RunRequest, options: RunOptions) -> Path:
    return Path(options.run_dir) if options.run_dir else default_run_dir(request, options.runs_root)


def run(
    request: RunRequest, options: RunOptions = RunOptions(), echo: Echo = _default_echo
) -> Outcome:
    """Check, train locally (every phase), then :func:`finalize`. ``options.trace``: record
    every rank's pipeline schedule (trace.json, timeline.png, measured vs theoretical bubble);
    the pickles of the checkpoints the run loads were checked by the request (unless
    ``--trust-pickle``) before anything read them."""
    started = time.monotonic()
    recipe = request.recipe
    echo(f"megatron-ext run {request.source} (platform {request.platform})")
    echo(f"  {request.describe}")
    for note in request.notes:
        echo(f"  note: {note}")
    # first: nothing else (megatron's argument checks included) may read a hostile checkpoint
    why = request.refusal
    if why is None:
        why = preload.start_problem(recipe, echo)
    if why is None:
        why = preflight(request, echo)
    if why is None and recipe.launch.device == "gpu":
        import torch

        if not torch.cuda.is_available():
            why = "launch.device is gpu but torch sees no GPU here; use --device cpu (or --platform cpu)"
    if why is None:
        why = _stall_environment_problem()
    if why is not None:
        echo(f"cannot run: {why}")
        return Outcome(EXIT_INVALID, None, message=why)
    if options.write_golden and (why := request.golden_write_problem):
        echo(f"cannot run: {why}")
        return Outcome(EXIT_INVALID, None, message=why)
    if options.write_golden and request.numerics_overridden:
        why = (
            "--write-golden refuses a run whose overrides change numerics; edit the recipe instead"
        )
        echo(f"cannot run: {why}")
        return Outcome(EXIT_INVALID, None, message=why)

    run_dir = _run_dir(request, options)
    from megatron_ext.launch.local import stop_signals_interrupt
    from megatron_ext.runs import lock as run_lock

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
    _write_summary(request, run_dir, "interrupted", results, [], time.monotonic() - started)
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
    from megatron_ext.launch import local

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
    from megatron_ext.launch import local, stop_signals

    recipe = request.recipe
    for phase in run_phases or phases(request, run_dir):
        if phase.name == "resume":
            prepare_resume(request, run_dir)
        echo(
            f"  [{phase.name}] starting {recipe.world_size} rank(s): python -m {recipe.entry} "
            f"(logs: {phase.log_dir}/rank-*.log)"
        )
        env = dict(request.environment)
        if options.trace:
            from megatron_ext.runs import trace as run_trace

            env.update(run_trace.environment(run_dir))
        assert recipe.entry is not None  # preflight refused a recipe without one
        job = local.LocalJob(
            module=recipe.entry,
            args=phase.args,
            nproc=recipe.world_size,
            log_dir=phase.log_dir,
            env=env,
            timeout_s=recipe.launch.timeout_s,
            stall_timeout_s=recipe.launch.stall_timeout_s,
            startup_timeout_s=recipe.launch.startup_timeout_s,
            save_signal=stop_signals.SAVE_SIGNAL if request.recipe.resumable else None,
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
        if (
            result.stopped_by is not None
            and rsm.latest_complete(ckpt) != recipe.training.iterations
        ):
            results[-1]["stopped_by"] = signal.Signals(result.stopped_by).name
            return _stopped(request, run_dir, results, started, result, echo)
        if _stopped_after_the_end(result, rsm.latest_complete(ckpt), recipe.training.iterations):
            echo("  the stop signal came after the final checkpoint: the run is complete")
        elif not result.ok:
            named = local.failing_rank(job, result)
            rank = named if named is not None else recipe.world_size - 1
            reason = local.failure_summary(job, result)
            what = (
                f"timed out after {recipe.launch.timeout_s} s"
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
                from megatron_ext.runs import trace as run_trace

                where = run_trace.failing_step(run_dir / run_trace.TRACE_SUBDIR)
                if where:
                    echo(f"failed at pipeline step: {where}")
                    what += f"; failed at pipeline step: {where}"
            elif (
                recipe.parallelism.pp > 1 or recipe.model.type == "multimodule"
            ) and _training_loop_started(job, progress):
                # A start-up error (arguments, imports, model build) has no pipeline step.
                echo("  (rerun with --trace to name the failing pipeline step: rank, chunk, step)")
            _write_summary(
                request, run_dir, "training-failed", results, [], time.monotonic() - started
            )
            return Outcome(
                EXIT_TRAINING_FAILED, run_dir, seconds=time.monotonic() - started, message=what
            )
    if request.recipe.resumable:
        c = recipe.checkpoint
        removed = rsm.prune(
            rsm.checkpoint_dir(run_dir), c.most_recent_k, c.keep_final, recipe.training.iterations
        )
        if removed:
            echo(f"  checkpoints removed (checkpoint.most_recent_k / keep_final): {removed}")
    return finalize(request, run_dir, results, started, options, echo)


def _stopped_after_the_end(result, latest: int | None, iterations: int) -> bool:
    """A stop signal that came once training was over: the final checkpoint is complete and a
    rank that did not exit 0 was ended by the save signal while tearing down (Megatron's
    handler gone). The run finished; the stop must not make it a failure (issue 34, item 8)."""
    from megatron_ext.launch import stop_signals

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
    _write_summary(request, run_dir, "stopped", results, [], time.monotonic() - started)
    echo(f"  {name}: {where}")
    echo(f"{STOPPED_RESUMABLE}: megatron-ext run --resume {run_dir}")
    return Outcome(
        EXIT_STOPPED, run_dir, seconds=time.monotonic() - started, message=STOPPED_RESUMABLE
    )


def resume_run(
    run_dir: Path,
    recipes: RunDirRecipe,
    options: RunOptions = RunOptions(),
    echo: Echo = _default_echo,
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
    from megatron_ext.launch.local import stop_signals_interrupt
    from megatron_ext.runs import lock as run_lock

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
    from megatron_ext.checkpoint import layout
    from megatron_ext.launch import env_policy
    from megatron_ext.runs import options as run_options

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
    echo(f"megatron-ext run --resume {run_dir} ({request.source}, platform {request.platform})")
    echo(f"  {request.describe}")
    why = request.refusal
    if why is None:
        why = preflight(request, echo)
    if why is not None:
        echo(f"cannot resume: {why}")
        return Outcome(EXIT_INVALID, None, message=why)
    if cut:
        try:
            rsm.discard_incomplete(ckpt, request.iterations)
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
        run_phases[0].args.extend(layout.apply(run_dir, before, request, latest, echo))
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
        return json.loads((run_dir / "summary.json").read_text()).get("status")
    except (OSError, ValueError, AttributeError):
        return None


def finalize(
    request: RunRequest,
    run_dir: Path,
    phase_results: list[dict],
    started: float,
    options: RunOptions = RunOptions(),
    echo: Echo = _default_echo,
) -> Outcome:
    """Metrics, plot and comparisons of a finished run directory (local or Slurm)."""
    recipe = request.recipe
    names = list(recipe.test.metrics)
    logs = run_dir / "logs"
    if request.recipe.resumable:  # every segment of a stopped and resumed run, as one
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
        _write_summary(
            request, run_dir, "no-metrics", phase_results, [], time.monotonic() - started
        )
        return Outcome(EXIT_TRAINING_FAILED, run_dir, message="no metrics")
    echo(
        f"  metrics read from {'TensorBoard event files' if source == 'tensorboard' else 'the rank logs'}"
    )
    recorded = met.with_validation(mhc_report.recorded_names(recipe, names), run_metrics)
    met.write_golden(run_dir / "metrics.json", run_metrics, recorded)
    resumed, resume_step = None, None

    if recipe.test.type == "ckpt-resume":
        resume_step = recipe.training.iterations // 2
        resumed, resumed_source = met.read_run_metrics(run_dir, "resume")
        met.write_golden(run_dir / "metrics_resume.json", resumed, names)
        # Log lines carry Megatron's 2-iteration mean at a process's second step; TensorBoard does not.
        reports.append(
            cmp.compare_resume(
                run_metrics,
                resumed,
                recipe.training.iterations // 2,
                names,
                logged_means=resumed_source == "logs",
            )
        )

    golden_path = request.golden_path
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
            f"`megatron-ext run {request.source} --platform {request.platform} --write-golden`"
        )
    elif request.numerics_overridden and not options.force_compare:
        echo(
            f"  golden values: not compared, the overrides change the recipe "
            f"({' '.join(list(request.shown_overrides))}); --compare forces it"
        )
    else:
        golden = met.read_golden(golden_path)
        rules = cmp.rules_for(names, recipe.launch.device, recipe.test.tolerances)
        reports.insert(
            0, cmp.compare(run_metrics, golden, rules, title=f"golden values {golden_path}")
        )

    title = plot_title(request)
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
        from megatron_ext.runs import trace as run_trace

        pipeline = run_trace.summarize(request, run_dir, echo)
    passed = all(r.passed for r in reports)
    seconds = time.monotonic() - started
    performance = _performance(recipe, run_metrics, phase_results)
    for line in _performance_lines(performance):
        echo(f"  {line}")
    _write_summary(
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
    echo(f"{verdict(reports)}: {request.name} in {seconds:.1f} s")
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


def plot_title(request: RunRequest, width: int = 90) -> str:
    """loss.png's and mhc.png's title: the recipe and platform, then the overrides (secrets
    redacted), wrapped; a ``model.mhc.variant=deepseek-v4`` run's plots read like the
    default's without them (issue 41, item 7)."""
    import textwrap

    title = f"{request.name} ({request.platform})"
    if not request.shown_overrides:
        return title
    lines = textwrap.wrap(" ".join(request.shown_overrides), width=width, break_on_hyphens=False)
    return "\n".join([title] + lines)


def _performance(recipe, run_metrics: met.Metrics, phase_results: list[dict]) -> dict:
    """Throughput (tokens/s from the steady-window median iteration time, as compare's
    iteration-time rule reads it) and memory (CPU: each rank's peak RSS; GPU: Megatron's
    mem-max-allocated-bytes / mem-allocated-bytes scalars of the last rank)."""
    out: dict = {}
    times = run_metrics.get("iteration-time") or {}
    if times:
        median, chosen = cmp._steady_median(times, sorted(times))  # the window compare judges
        tokens = recipe.training.global_batch_size * recipe.model.seq_length
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
        out["peak_rss_mib_per_rank"] = {
            str(rank): rss.get(str(rank)) for rank in range(recipe.world_size)
        } | rss
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


def _write_summary(
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
    golden = request.golden_path
    summary = {
        "recipe": str(request.source),
        "name": request.name,
        "platform": request.platform,
        "overrides": list(request.shown_overrides),
        "status": status,
        "seconds": round(seconds, 2),
        "world_size": request.recipe.world_size,
        "entry": request.recipe.entry,
        "phases": phase_results,
        "golden_values": str(golden) if golden else None,
        "reports": [r.to_dict() for r in reports],
        "host": os.uname().nodename,
        "metrics_source": metrics_source,
        "performance": performance or {},
        "losses": losses or {},
        "versions": versions(),
        "plan": dict(request.plan),
    }
    if pipeline is not None:  # megatron-ext run --trace
        summary["pipeline"] = pipeline
    try:
        files.write_text_atomically(run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    except OSError as exc:  # disk full: the verdict still reaches the console and exit status
        print(f"megatron-ext run: no summary.json: {cannot_write(exc, run_dir)}", file=sys.stderr)
