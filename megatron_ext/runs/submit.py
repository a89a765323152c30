"""``megatron-ext submit RECIPE --slurm``: the recipe as a Slurm job, then the run's verdict.

The run directory is the one ``run`` writes (recipe.yaml, command.sh, logs/rank-N.log,
metrics, plot, comparisons), plus ``sbatch.sh``, ``slurm-<jobid>.out`` and ``job_exit_code``.
It must be on a file system that the compute nodes share with the submitting machine: a
multi-node job refuses a node-local one (the temporary directory, tmpfs).

A resumable recipe (see :attr:`megatron_ext.recipes.schema.Recipe.resumable`) becomes a job that saves on
Slurm's warning signal, requeues itself and resumes (:class:`megatron_ext.launch.slurm.Requeue`);
its restarts are segments of the run directory, joined like ``run --resume``'s.
"""

from __future__ import annotations

import os
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_ext.launch import faults, nodes as node_layout, shell, slurm
from megatron_ext.launch.local import LogFollower
from megatron_ext.launch.shell import UnsafeValueError
from megatron_ext.recipes.request import RunRequest
from megatron_ext.runs import resume as rsm, runner
from megatron_ext.runs.options import RunOptions
from megatron_ext.runs.outcome import EXIT_INVALID, EXIT_TRAINING_FAILED, Outcome, default_echo
from megatron_ext.runs.runner import Progress
from megatron_ext.runs.verdict import finalize, write_summary


@dataclass
class SlurmOptions:
    nodes: int | None = None
    gpus_per_node: int | None = None
    partition: str | None = None
    account: str | None = None
    time: str | None = None
    container_image: str | None = None
    container_mounts: list[str] | None = None
    python: str | None = None


def build_job(
    request: RunRequest, run_dir: Path, options: SlurmOptions
) -> tuple[slurm.SlurmJob | None, list[str]]:
    """The job for this recipe, or None and the reasons it cannot be laid out."""
    launch, flags = request.launch, request.phases
    cfg = launch.slurm
    nodes = options.nodes or launch.nodes
    world = launch.world_size
    gpus = options.gpus_per_node if options.gpus_per_node is not None else cfg.gpus_per_node
    tasks = gpus if launch.device == "gpu" else None
    problems = node_layout.layout_problems(world, nodes, tasks, launch.grids, cfg.tp_within_node)
    if nodes < 1 or world % nodes:
        return None, problems
    per_node = world // nodes
    time_limit = options.time or cfg.time
    if problem := slurm.time_problem(time_limit):
        where = "--time" if options.time else "launch.slurm.time"
        problems.append(f"{where}: {problem}")
        return None, problems
    image = options.container_image or cfg.container_image
    problems += _shared_run_dir_problems(run_dir, nodes)
    problems += [str(p) for p in slurm.path_directive_problems(run_dir, Path.cwd())]
    image_problem = container_image_problem(image)
    if image_problem:
        problems.append(image_problem)
    python = options.python or ("python" if image else sys.executable)
    steps = []
    resumable = flags.resumable
    for phase in runner.phases(request, run_dir, slurm.SEGMENT if resumable else "", resumable):
        before = None
        if phase.name == "resume":
            before = runner.resume_shell(run_dir / "checkpoints", flags.iterations)
        # a resumable job's restarts write below logs/ (the srun output names the segment)
        logs = run_dir / "logs" if resumable else phase.log_dir
        name = "train" if resumable else phase.name
        assert launch.entry is not None  # a recipe without one fails validation
        steps.append(slurm.Step(name, launch.entry, phase.args, logs, before))
    job = slurm.SlurmJob(
        name=request.display.name,
        run_dir=run_dir,
        steps=steps,
        nodes=nodes,
        tasks_per_node=per_node,
        device=launch.device,
        workdir=Path.cwd(),
        python=python,
        env=dict(launch.environment),
        gpus_per_node=gpus,
        partition=options.partition or cfg.partition,
        account=options.account or cfg.account,
        time=options.time or cfg.time,
        container_image=image,
        container_mounts=options.container_mounts
        if options.container_mounts is not None
        else list(cfg.container_mounts),
        sbatch_args=list(cfg.sbatch_args),
        requeue=slurm.Requeue(
            checkpoint_dir=rsm.checkpoint_dir(run_dir),
            final_iteration=flags.iterations,
            signal_warning_s=cfg.signal_warning_s,
            max_requeues=cfg.max_requeues,
        )
        if resumable
        else None,
    )
    return (None if problems else job), problems


NODE_LOCAL_FS = ("tmpfs", "ramfs", "devtmpfs", "overlay")
NODE_LOCAL_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run")


def _mount_type(path: Path) -> str | None:
    """The file system type of the mount holding ``path`` (Linux /proc/mounts; None elsewhere)."""
    try:
        mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return None
    best, kind = "", None
    text = str(path)
    for fields in mounts:
        if len(fields) >= 3 and (text == fields[1] or text.startswith(fields[1].rstrip("/") + "/")):
            if len(fields[1]) >= len(best):
                best, kind = fields[1], fields[2]
    return kind


def _shared_run_dir_problems(run_dir: Path, nodes: int) -> list[str]:
    """A multi-node job's run directory must be seen by every node: refuse node-local ones."""
    if nodes <= 1:
        return []
    run_dir = Path(run_dir).resolve()
    local_dirs = {*NODE_LOCAL_DIRS, os.path.realpath(tempfile.gettempdir())}
    under = next(
        (d for d in sorted(local_dirs) if str(run_dir) == d or str(run_dir).startswith(d + "/")),
        None,
    )
    kind = _mount_type(run_dir)
    if under is None and kind not in NODE_LOCAL_FS:
        return []
    why = f"under {under}" if under else f"on a {kind} file system"
    return [
        f"run directory {run_dir} is node-local ({why}) but the job spans {nodes} nodes that "
        "must all see it; pass --run-dir on a shared file system"
    ]


IMAGES_WITHOUT_MEGATRON_EXT = (
    "nvcr.io/nvidia/pytorch",
    "nvcr.io#nvidia/pytorch",
    "pytorch/pytorch",
    "nvcr.io/nvidia/cuda",
    "nvcr.io#nvidia/cuda",
)


def container_image_problem(image: str | None) -> str | None:
    """A container image known (by name) to lack megatron-ext: the steps run
    ``python -m megatron_ext...`` inside it."""
    if not image:
        return None
    name = image.split("://", 1)[-1]
    for known in IMAGES_WITHOUT_MEGATRON_EXT:
        if name.startswith(known):
            return (
                f"container image {image} is {known}, which lacks megatron-ext; build ours "
                "(docker build -t megatron-ext .) or an image that pip-installs megatron-ext"
            )
    return None


def container_image_warning(image: str | None) -> str | None:
    if not image or "megatron-ext" in image or "megatron_ext" in image:
        return None
    return (
        f"warning: cannot tell whether container image {image} has megatron-ext (its steps run "
        "python -m megatron_ext...); build it from this repository's Dockerfile"
    )


def _echo_first_failure(job: slurm.SlurmJob, job_id: str, echo) -> None:
    """Why the job's last start ended: the earliest failure a rank of that start reported
    (rank, where, original error), else what srun said of its tasks there. A requeued job's
    earlier starts failed too (a lost node's peers: a gloo error) but are not why it ended
    (issue 40, item 7)."""
    restart, logs = _last_start_logs(job)
    failure = faults.first_failure(logs)
    where = f" (start {restart + 1} of the job, restart count {restart})" if restart else ""
    if failure is not None:
        echo(f"  first failure{where}: {failure}")
        return
    said = _srun_errors_of_last_start(job.run_dir / f"slurm-{job_id}.out")
    if said:
        echo(f"  last start{where}: {said[0]}")


def _last_start_logs(job: slurm.SlurmJob) -> tuple[int, list[Path]]:
    """(restart count, rank logs) of the job's last start: a requeued job's N-th restart
    writes into the ``resumed-N`` segment of its logs."""
    ranks = range(job.world_size)
    if job.requeue is None:
        return 0, [step.log_dir / f"rank-{r}.log" for step in job.steps for r in ranks]
    for restart in range(job.requeue.max_requeues, 0, -1):
        segment = f"{rsm.SEGMENT_PREFIX}{restart}"
        dirs = [step.log_dir / segment for step in job.steps if (step.log_dir / segment).is_dir()]
        if dirs:
            return restart, [d / f"rank-{r}.log" for d in dirs for r in ranks]
    return 0, [step.log_dir / f"rank-{r}.log" for step in job.steps for r in ranks]


def _srun_errors_of_last_start(slurm_out: Path) -> list[str]:
    """srun's "error: NODE: tasks A-B: Terminated"-style lines after the last start's line."""
    try:
        text = slurm_out.read_text(errors="replace")
    except OSError:
        return []
    last = text.rfind("[megatron-ext] start ")
    tail = text[last:] if last >= 0 else text
    return [
        " ".join(line.split())[:300]
        for line in tail.splitlines()
        if line.startswith("srun: error:") and ": tasks " in line
    ]


def submit(
    request: RunRequest,
    options: SlurmOptions,
    run_dir: Path | None = None,
    runs_root: Path = Path("runs"),
    dry_run: bool = False,
    wait: bool = True,
    compare_golden: bool = True,
    force_compare: bool = False,
    echo=default_echo,
) -> Outcome:
    started = time.monotonic()
    if dry_run:  # stdout is the script alone; everything else goes to stderr

        def echo(text: str) -> None:
            print(text, file=sys.stderr)

    # first, as for run: the request refuses a checkpoint whose pickles could run code
    why = request.refusal or runner.preflight(request, echo)
    if why is not None:
        echo(f"cannot submit: {why}")
        return Outcome(EXIT_INVALID, None, message=why)
    run_dir = (Path(run_dir) if run_dir else runner.default_run_dir(request, runs_root)).resolve()
    job, problems = build_job(request, run_dir, options)
    if job is None:
        for p in problems:
            echo(f"cannot submit: {p}")
        return Outcome(EXIT_INVALID, None, message="; ".join(problems))
    warning = container_image_warning(job.container_image)
    if warning:
        echo(warning)
    try:
        script = slurm.sbatch_script(job)
    except UnsafeValueError as exc:
        echo(f"cannot submit: {exc}")
        return Outcome(EXIT_INVALID, None, message=str(exc))
    if dry_run:
        layout = node_layout.layout(request.launch.grids, job.nodes, job.tasks_per_node)
        for line in layout.lines():
            echo(line)
        print(script, end="")
        return Outcome(0, None)
    runner.write_run_files(request, run_dir, launcher="Slurm")
    (run_dir / "logs").mkdir(exist_ok=True)
    script_path = run_dir / "sbatch.sh"
    script_path.write_text(script)
    shown = request.display
    echo(f"megatron-ext submit {shown.source} (platform {shown.platform})")
    echo(f"  {shown.describe}")
    echo(f"  run directory {run_dir}")
    launch = request.launch
    watch = slurm.StepWatch(
        job.steps, job.world_size, launch.stall_timeout_s, launch.startup_timeout_s
    )
    watch.clear()
    try:
        job_id = slurm.submit(
            script_path, env={k: v for k, v in job.env.items() if shell.is_secret(k)}
        )
    except (slurm.SlurmError, FileNotFoundError) as exc:
        echo(f"cannot submit: {exc}")
        return Outcome(EXIT_INVALID, run_dir, message=str(exc))
    echo(f"  submitted job {job_id}: {shlex.join(['sbatch', str(script_path)])}")
    if not wait:
        echo(f"  not waiting; afterwards: megatron-ext compare {run_dir} <golden.json>")
        return Outcome(0, run_dir)

    segments = [""] + [
        f"{rsm.SEGMENT_PREFIX}{n}"
        for n in range(1, (job.requeue.max_requeues + 1 if job.requeue else 1))
    ]
    followers = [
        LogFollower(
            step.log_dir / segment / f"rank-{job.world_size - 1}.log",
            Progress(echo, segment or step.name),
        )
        for step in job.steps
        for segment in segments
    ]

    def poll() -> None:
        for follower in followers:
            follower.poll()

    timeout = slurm.time_limit_seconds(job.time) + 300
    result = slurm.wait(
        job_id,
        run_dir,
        timeout,
        on_poll=poll,
        on_state=lambda s: echo(f"  job {job_id}: {s}"),
        watch=watch,
    )
    for follower in followers:
        follower.poll(final=True)
    echo(
        f"  job {job_id} ended: state {result.state}, exit code {result.exit_code} "
        f"({result.seconds:.1f} s)"
    )
    phase_results = [
        {
            "phase": "slurm-job",
            "job_id": job_id,
            "state": result.state,
            "returncode": result.exit_code,
            "seconds": round(result.seconds, 2),
        }
    ]
    if result.exit_code == runner.EXIT_STOPPED and result.stall is None:
        latest = rsm.latest_complete(rsm.checkpoint_dir(run_dir))
        phase_results[0]["resume_from"] = latest
        write_summary(request, run_dir, "stopped", phase_results, [], time.monotonic() - started)
        echo(f"  latest complete checkpoint at iteration {latest}")
        echo(f"{runner.STOPPED_RESUMABLE}: megatron-ext run --resume {run_dir}")
        return Outcome(runner.EXIT_STOPPED, run_dir, message=runner.STOPPED_RESUMABLE)
    if result.stall is not None:
        echo(f"  first failure: {result.stall}")
        echo(
            f"training failed: rank {result.stall.rank} stalled {result.stall.at} (no progress for "
            f"{result.stall.idle_s:.0f} s); job {job_id} cancelled"
        )
        phase_results[0]["stalled_rank"] = result.stall.rank
    elif not result.ok:
        echo(f"training failed; see {run_dir}/slurm-{job_id}.out and {run_dir}/logs/")
        _echo_first_failure(job, job_id, echo)
    for lost in node_layout.lost_nodes(run_dir / f"slurm-{job_id}.out"):
        echo(f"  {lost}" + (" (the job was requeued)" if result.ok else ""))
    if not result.ok:
        write_summary(
            request, run_dir, "training-failed", phase_results, [], time.monotonic() - started
        )
        return Outcome(EXIT_TRAINING_FAILED, run_dir, message=f"job state {result.state}")
    return finalize(
        request,
        run_dir,
        phase_results,
        started,
        RunOptions(compare_golden=compare_golden, force_compare=force_compare),
        echo=echo,
    )
