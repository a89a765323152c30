"""Run a recipe as a Slurm batch job: the sbatch script, submission, waiting.

:func:`sbatch_script` writes one job for all the recipe's training runs (ckpt-resume has
two, with the checkpoint step between them). Every run is one ``srun`` step with one task
per rank (on GPU: one per GPU), each task exporting torch.distributed's variables from
Slurm's (``RANK=$SLURM_PROCID``, ``WORLD_SIZE=$SLURM_NTASKS``, ``LOCAL_RANK=$SLURM_LOCALID``,
``MASTER_ADDR`` = the first node of the allocation, ``MASTER_PORT`` from the job id) and
writing ``logs/rank-%t.log``, the same layout as a local run. With a container image the
steps run through pyxis (``--container-image``, ``--container-mounts``). The script records
its exit status in ``job_exit_code``, so waiting needs no accounting database.

:func:`submit` calls ``sbatch --parsable``; :func:`wait` polls ``squeue`` until the job has
left the queue, and reads the job's state from ``scontrol`` (or the exit-code file). Every
step's ranks write heartbeats to ``<step logs>/heartbeat`` on the shared file system, and
:func:`wait`, given a :class:`StepWatch`, cancels a running job in which no rank progressed
for the stall limit and names the stalled rank, as the local launcher does.

A job with a :class:`Requeue` policy (a resumable recipe) outlives its allocation: it asks for
Slurm's warning signal (``#SBATCH --signal=USR1@N``, sent to the ranks, which save through
megatron's exit-signal handler and stop), and when the step ended before the last iteration
it requeues itself (``scontrol requeue``; ``#SBATCH --requeue``) at most ``max_requeues``
times. A restarted job loads the latest complete checkpoint and writes its logs and TensorBoard
events to ``resumed-$SLURM_RESTART_COUNT`` segments. SIGTERM (``scancel``, preemption, the
time limit itself) also makes the ranks save (``MEGATRON_EXT_SAVE_ON``); the job then ends
"stopped, resumable" (exit 75) without requeueing itself. A restart never takes a Slurm step
id an earlier start of the job used (:func:`_skip_used_step_ids_lines`): Slurm would deliver
a signal it queued for the lost start's step to the restart's step of the same number.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from megatron_ext.errors import MegatronExtError
from megatron_ext.launch import heartbeat

POLL_S = 2.0

SEGMENT = "@SEGMENT@"
"""Stands for the restart's segment in step arguments and log paths ('' on the first start,
``resumed-N`` after the N-th requeue); the script expands it from $SLURM_RESTART_COUNT."""


@dataclass
class Requeue:
    """How a resumable job survives its time limit."""

    checkpoint_dir: Path
    final_iteration: int
    signal_warning_s: int = 120
    max_requeues: int = 3


@dataclass
class Step:
    """One training run inside the job."""

    name: str
    module: str
    args: list[str]
    log_dir: Path
    before: str | None = None  # a shell command run before the step (checkpoint preparation)


@dataclass
class SlurmJob:
    name: str
    run_dir: Path
    steps: list[Step]
    nodes: int
    tasks_per_node: int
    device: str  # "cpu" | "gpu"
    workdir: Path
    python: str
    env: dict[str, str] = field(default_factory=dict)
    gpus_per_node: int | None = None
    partition: str | None = None
    account: str | None = None
    time: str = "00:30:00"
    container_image: str | None = None
    container_mounts: list[str] = field(default_factory=list)
    sbatch_args: list[str] = field(default_factory=list)
    requeue: Requeue | None = None

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node


# Slurm's bounded --time formats; UNLIMITED / INFINITE are refused because the job is watched
# until its limit (plus a margin) and a job past its limit would never be declared lost.
_TIME_FORMAT = re.compile(r"(\d{1,3}-\d{1,2}(:\d{1,2}){0,2}|\d{1,6}(:\d{1,2}){0,2})\Z")
MAX_TIME_S = 366 * 86400


def time_problem(text: object) -> str | None:
    """Why ``text`` is not a Slurm time limit this launcher can watch (None: it is)."""
    shown = str(text)[:40]
    if not isinstance(text, str) or not _TIME_FORMAT.match(text):
        return (
            f"{shown!r} is not a Slurm time limit: use MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or "
            "D-HH:MM:SS, e.g. 00:30:00 (UNLIMITED is refused: the job is watched until its limit)"
        )
    seconds = time_limit_seconds(text)
    if not 0 < seconds <= MAX_TIME_S:
        return f"{shown!r} is {seconds} s: give a limit between 1 s and 366 days, e.g. 04:00:00"
    return None


def time_limit_seconds(text: str) -> int:
    """Slurm's --time formats: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS."""
    days, _, rest = text.rpartition("-") if "-" in text else ("0", "", text)
    parts = [int(p) for p in rest.split(":")]
    if "-" in text:
        h, m, s = (parts + [0, 0])[:3]
    elif len(parts) == 1:
        h, m, s = 0, parts[0], 0
    elif len(parts) == 2:
        h, m, s = 0, parts[0], parts[1]
    else:
        h, m, s = parts[:3]
    return int(days or 0) * 86400 + h * 3600 + m * 60 + s


def _check_directive_values(job: SlurmJob) -> None:
    """#SBATCH lines cannot be quoted for bash (they are comments); refuse line breaks."""
    from megatron_ext.launch.shell import UnsafeValueError, check_directives

    check_directives(
        [
            ("job name", job.name),
            ("partition", job.partition),
            ("account", job.account),
            ("time", job.time),
            *((f"sbatch_args[{i}]", a) for i, a in enumerate(job.sbatch_args)),
        ]
    )
    for problem in path_directive_problems(job.run_dir, job.workdir):
        raise UnsafeValueError(str(problem))


def path_directive_problems(run_dir: Path, workdir: Path) -> list:
    """The run and working directories go on #SBATCH lines (--output, --chdir) as one word."""
    from megatron_ext.launch.shell import directive_word_problem

    found = [
        directive_word_problem("run directory (--run-dir / --runs-root)", run_dir),
        directive_word_problem("working directory (submit from another one)", workdir),
    ]
    return [p for p in found if p is not None]


def sbatch_script(job: SlurmJob) -> str:
    """The batch script. Every value that reaches shell is quoted; values on #SBATCH lines
    are checked (:class:`megatron_ext.launch.shell.UnsafeValueError`)."""
    q = shlex.quote
    _check_directive_values(job)
    run_dir = str(job.run_dir)
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name=megatron-ext-{job.name}",
        f"#SBATCH --nodes={job.nodes}",
        f"#SBATCH --ntasks-per-node={job.tasks_per_node}",
    ]
    if job.device == "gpu":
        lines.append(f"#SBATCH --gpus-per-node={job.gpus_per_node or job.tasks_per_node}")
    else:
        # CPU ranks are single-threaded (OMP_NUM_THREADS=1); let them share small nodes.
        lines.append("#SBATCH --overcommit")
    if job.partition:
        lines.append(f"#SBATCH --partition={job.partition}")
    if job.account:
        lines.append(f"#SBATCH --account={job.account}")
    lines += [
        f"#SBATCH --time={job.time}",
        f"#SBATCH --output={run_dir}/slurm-%j.out",
        f"#SBATCH --chdir={job.workdir}",
        *[f"#SBATCH {arg}" for arg in job.sbatch_args],
        *_requeue_directives(job),
        "",
        f"RUN_DIR={q(run_dir)}",
        "trap 'echo $? > \"$RUN_DIR/job_exit_code\"' EXIT",
        "set -eo pipefail",
        'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        "BASE_PORT=$((20000 + SLURM_JOB_ID % 20000))",
        *_requeue_preamble(job),
        *_layout_lines(job),
    ]
    from megatron_ext.launch.shell import is_secret, secret_check_line

    # Secrets reach the job through sbatch's environment (--export=ALL), never the script.
    lines += [secret_check_line(k) for k in job.env if is_secret(k)]
    plain = {k: v for k, v in job.env.items() if not is_secret(k)}
    if plain:
        lines.append("export " + " ".join(f"{k}={q(v)}" for k, v in plain.items()))
    rank_env = (
        "export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID "
        "LOCAL_WORLD_SIZE=${SLURM_NTASKS_PER_NODE:-$SLURM_NTASKS} GROUP_RANK=$SLURM_NODEID"
    )
    container: list[str] = []
    if job.container_image:
        mounts = list(
            dict.fromkeys(
                [*job.container_mounts, f"{run_dir}:{run_dir}", f"{job.workdir}:{job.workdir}"]
            )
        )
        container = [
            f"--container-image={job.container_image}",
            f"--container-mounts={','.join(mounts)}",
            f"--container-workdir={job.workdir}",
        ]
    from megatron_ext.launch.shell import ENV_KEY, UnsafeValueError

    for key in job.env:
        if not ENV_KEY.match(str(key)):
            raise UnsafeValueError(f"environment key {str(key)!r} is not a variable name")
    for i, step in enumerate(job.steps):
        lines += ["", f"# ---- {step.name}: {job.world_size} tasks ----"]
        beats = str(heartbeat_dir(step))
        lines += [
            f"mkdir -p {q(str(step.log_dir))}",
            # a fresh heartbeat directory per step, made before the step's preparation: the
            # submitting side's StepWatch takes its appearance as the step's start (so the
            # preparation gets the start-up allowance; a resume step reuses no old beats)
            f"rm -rf {q(beats)} && mkdir -p {q(beats)}",
            # which start of the job made it: a requeued job's step gets a fresh watchdog
            f'echo "${{SLURM_RESTART_COUNT:-0}}" > {q(str(Path(beats) / START))}',
            f"export {heartbeat.DIR_ENV}={q(beats)}",
        ]
        if step.before:
            lines.append(step.before)
        lines.append(f"export MASTER_PORT=$((BASE_PORT + {i}))")
        if job.requeue:
            lines += _claim_step_id_lines()
        lines.append(
            f'echo "[megatron-ext] step {step.name} starting on $SLURM_JOB_NODELIST'
            + (' (step id $NEXT_STEP)"' if job.requeue else '"')
        )
        logs = f"{step.log_dir}/{_QUOTED}" if job.requeue else str(step.log_dir)
        srun = [
            "srun",
            "--mpi=none",
            "--kill-on-bad-exit=1",
            f"--ntasks={job.world_size}",
            f"--output={logs}/rank-%t.log",
            *container,
        ]
        inner = f'{rank_env}; exec {q(job.python)} -m {q(step.module)} "$@"'
        head = shlex.join(srun) + f" bash -c {q(inner)} megatron-ext"
        groups: list[list[str]] = []
        for a in (a.replace(SEGMENT, _QUOTED) for a in step.args):
            if a.startswith("--") or not groups:
                groups.append([a])
            else:
                groups[-1].append(a)
        command = " \\\n    ".join([head] + [shlex.join(g) for g in groups])
        if job.requeue:
            lines.append(f'mkdir -p {q(str(step.log_dir))}/"$SEGMENT"')
            command = command.replace(_QUOTED, _SEGMENT_SHELL)
            lines += [command + " &", 'STEP_RC=0; wait_step "$!" || STEP_RC=$?']
            lines += _after_step_lines()
        else:
            lines.append(command)
        # the step is over (a failed one ends the script): stop watching it until the
        # next step, while the job finishes
        lines.append(f"touch {q(str(Path(beats) / ENDED))}")
        if job.requeue:
            lines += _requeue_epilogue(job)
    lines.append("")
    return "\n".join(lines)


_QUOTED = "@SEG MENT@"
"""SEGMENT while the words are quoted: its space makes shlex single-quote every word holding it."""
_SEGMENT_SHELL = "'\"${SEGMENT}\"'"
"""What replaces it inside that single-quoted word: close the quote, expand, reopen."""


def _layout_lines(job: SlurmJob) -> list[str]:
    """Print which ranks each node of this allocation holds (srun's block distribution): the
    submitting side names a lost node's ranks from this line."""
    from megatron_ext.launch.nodes import LAYOUT_PREFIX

    per = int(job.tasks_per_node)
    return [
        'K=0; LAYOUT=""; for NODE in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do '
        f'LAYOUT="$LAYOUT $NODE=$((K * {per}))-$((K * {per} + {per - 1}))"; K=$((K + 1)); done',
        f'echo "{LAYOUT_PREFIX}$LAYOUT (batch script on $(hostname), MASTER_ADDR $MASTER_ADDR)"',
    ]


def _requeue_directives(job: SlurmJob) -> list[str]:
    if job.requeue is None:
        # a lost node ends the job (NODE_FAIL) instead of Slurm running it again from scratch
        return ["#SBATCH --no-requeue"]
    return [
        # USR1 to the ranks (not the batch shell) N s before the time limit: they save and stop
        f"#SBATCH --signal=USR1@{int(job.requeue.signal_warning_s)}",
        # also what lets Slurm requeue the job when it loses a node
        "#SBATCH --requeue" if job.requeue.max_requeues > 0 else "#SBATCH --no-requeue",
        "#SBATCH --open-mode=append",
    ]


def _requeue_preamble(job: SlurmJob) -> list[str]:
    if job.requeue is None:
        return []
    from megatron_ext.launch.stop_signals import EXIT_STOPPED, ROUTE_ENV

    return [
        "RESTART=${SLURM_RESTART_COUNT:-0}",
        'SEGMENT=""; if [ "$RESTART" -gt 0 ]; then SEGMENT="resumed-$RESTART"; fi',
        f"export {ROUTE_ENV}=SIGTERM  # scancel, preemption, the time limit: the ranks save too",
        # the batch shell outlives a SIGTERM while its ranks save (srun runs in the background)
        'STOPPED=""; INTERRUPTED=""',
        "trap 'STOPPED=SIGTERM; INTERRUPTED=1' TERM",
        'wait_step() { local rc; while :; do INTERRUPTED=""; rc=0; wait "$1" || rc=$?; '
        '[ -z "$INTERRUPTED" ] && return "$rc"; done; }',
        'echo "[megatron-ext] start $((RESTART + 1)) (restart count $RESTART) on '
        '$SLURM_JOB_NODELIST"',
        # Slurm requeues a job that lost a node by itself: keep to the bound there too
        f'if [ "$RESTART" -gt {int(job.requeue.max_requeues)} ]; then echo "[megatron-ext] '
        f'restart count $RESTART is past the requeue limit {int(job.requeue.max_requeues)}: '
        f'stopped, resumable"; exit {EXIT_STOPPED}; fi',
        *_skip_used_step_ids_lines(),
    ]


STEP_IDS_FILE = ".slurm-step-ids-"
"""In the run directory, + the job id: how many step ids the job's starts have used so far."""
STEP_ID_MARK = "(step id "
"""How the batch script names a step's Slurm step id in its "starting" line."""


def _skip_used_step_ids_lines() -> list[str]:
    """A requeued job's start takes no step id an earlier start of the job used.

    Slurm numbers a job's steps from 0 again in every start (JOB.0, JOB.1, ...), and a signal
    it queued for a step of an earlier start (a lost node's kill of JOB.0, resent about 60 s
    later when the node answers again) reaches the step of that number now: the requeued
    training step's ranks died of SIGTERM (issue 40, item 7). So every step the job starts
    records its id before it runs (:func:`_claim_step_id_lines`), and a later start first runs
    throwaway one-task steps (``printenv SLURM_STEP_ID``, so the count is Slurm's own, not
    assumed) until those ids are used up; a stale signal then finds a finished throwaway step
    or none. Bounded: a throwaway that fails to start is tried again at most twice as often
    as ids to skip, plus 3."""
    return [
        'STEP_IDS="$RUN_DIR/' + STEP_IDS_FILE + '$SLURM_JOB_ID"',
        'USED_STEPS=$(cat "$STEP_IDS" 2>/dev/null || echo 0)',
        'case "$USED_STEPS" in ""|*[!0-9]*) USED_STEPS=0 ;; esac',
        "LAST_STEP=-1; TRIES=0",
        'while [ "$LAST_STEP" -lt $((USED_STEPS - 1)) ] && '
        '[ "$TRIES" -lt $((2 * USED_STEPS + 3)) ]; do',
        "  TRIES=$((TRIES + 1))",
        "  ID=$(srun --mpi=none --nodes=1 --ntasks=1 printenv SLURM_STEP_ID 2>/dev/null || true)",
        '  case "$ID" in ""|*[!0-9]*) ;; *) LAST_STEP=$ID ;; esac',
        "done",
        "NEXT_STEP=$((LAST_STEP + 1))",
        'if [ "$NEXT_STEP" -gt 0 ]; then echo "[megatron-ext] step ids 0-$LAST_STEP were used by '
        'an earlier start of the job: skipped"; fi',
    ]


def _claim_step_id_lines() -> list[str]:
    """Record the id the next step takes before it starts (a start cut short by a lost node
    still counts it), then count it."""
    return ['echo "$((NEXT_STEP + 1))" > "$STEP_IDS"']


def _after_step_lines() -> list[str]:
    return ["NEXT_STEP=$((NEXT_STEP + 1))"]


def _requeue_epilogue(job: SlurmJob) -> list[str]:
    """After the step: finished, requeue (stopped by the warning signal), or stopped for good."""
    from megatron_ext.launch.stop_signals import EXIT_STOPPED

    r = job.requeue
    assert r is not None  # written only for jobs that requeue
    q = shlex.quote
    tracker = q(str(Path(r.checkpoint_dir) / "latest_checkpointed_iteration.txt"))
    final, most = int(r.final_iteration), int(r.max_requeues)
    return [
        f"DONE=$(cat {tracker} 2>/dev/null || echo 0)",
        f'if [ "$STEP_RC" -eq 0 ] && [ "$DONE" != {final} ]; then STEP_RC={EXIT_STOPPED}; fi',
        f'if [ "$STEP_RC" -eq {EXIT_STOPPED} ]; then',
        f'  if [ -z "$STOPPED" ] && [ "$RESTART" -lt {most} ]; then',
        f'    echo "[megatron-ext] stopped at iteration $DONE of {final}: requeue '
        f'$((RESTART + 1)) of {most}"',
        '    scontrol requeue "$SLURM_JOB_ID" && exit 0',
        "  fi",
        f'  echo "[megatron-ext] stopped, resumable at iteration $DONE of {final} '
        f'(${{STOPPED:-requeue limit {most} reached}})"',
        f"  exit {EXIT_STOPPED}",
        "fi",
        'if [ "$STEP_RC" -ne 0 ]; then exit "$STEP_RC"; fi',
    ]


class SlurmError(MegatronExtError, RuntimeError):
    pass


ENDED = "ended"
"""Written into a step's heartbeat directory by the batch script once its srun returned."""
START = "start"
"""Written into a step's heartbeat directory when it is made: the job's restart count."""


def heartbeat_dir(step: Step) -> Path:
    return step.log_dir / "heartbeat"


class StepWatch:
    """The stall watchdog of the step running now: the last step whose heartbeat directory
    the batch script has created (its start-up allowance counts from when it was first seen,
    so time in the queue and earlier steps do not count)."""

    def __init__(
        self,
        steps: list[Step],
        nproc: int,
        stall_s: float | None = None,
        startup_s: float | None = None,
    ):
        self.dirs = [heartbeat_dir(step) for step in steps]
        self.log_dirs = [step.log_dir for step in steps]
        self.nproc, self.stall_s, self.startup_s = nproc, stall_s, startup_s
        self.active: int | None = None
        self.watchdog: heartbeat.Watchdog | None = None
        self.ended = False  # the active step's srun returned (a requeued job starts it again)
        self.start: str | None = None  # the restart count that made the active step's directory

    def clear(self) -> None:
        """Remove heartbeat directories an earlier job left (before submitting): a step
        starts when the batch script creates its directory."""
        for directory in self.dirs:
            shutil.rmtree(directory, ignore_errors=True)

    def check(self) -> heartbeat.Stall | None:
        started = [i for i, d in enumerate(self.dirs) if d.is_dir()]
        if not started:
            return None  # the job's first step has not begun
        ended = (self.dirs[started[-1]] / ENDED).exists()
        start: str | None
        try:
            start = (self.dirs[started[-1]] / START).read_text().strip()
        except OSError:
            start = self.start
        restarted = start != self.start  # requeued (a lost node: the step never ended)
        if started[-1] != self.active or (self.ended and not ended) or restarted:
            self.active, self.start = started[-1], start
            self.watchdog = heartbeat.Watchdog(
                self.dirs[self.active], self.nproc, self.stall_s, self.startup_s
            )
        self.ended = ended
        if ended:
            return None  # between steps, requeued, or the job is finishing
        assert self.watchdog is not None  # made when the first step started (above)
        stall = self.watchdog.check()
        return stall.with_logged_step(self.rank_logs()) if stall is not None else None

    def rank_logs(self) -> list[Path]:
        """The active step's rank logs: ``rank-%t.log`` in its log directory, or in the
        ``resumed-N`` segment of a requeued job's N-th restart (as the batch script writes)."""
        assert self.active is not None
        logs = self.log_dirs[self.active]
        if self.start and self.start != "0" and (logs / f"resumed-{self.start}").is_dir():
            logs = logs / f"resumed-{self.start}"
        return [logs / f"rank-{rank}.log" for rank in range(self.nproc)]


def submit(script: Path, env: dict[str, str] | None = None) -> str:
    """sbatch the script; returns the job id. ``env``: variables (the recipe's secrets) that
    the job inherits through sbatch's environment instead of the script."""
    import os

    proc = subprocess.run(
        ["sbatch", "--parsable", str(script)],
        capture_output=True,
        text=True,
        env={**os.environ, **env} if env else None,
    )
    if proc.returncode != 0:
        raise SlurmError(
            f"sbatch failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}"
        )
    return proc.stdout.strip().split(";")[0]


def _squeue_state(job_id: str) -> str | None:
    proc = subprocess.run(
        ["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True
    )
    if proc.returncode != 0:
        return None  # the job has left squeue's memory (invalid job id)
    return proc.stdout.strip() or None


def job_state(job_id: str) -> tuple[str | None, int | None]:
    """(JobState, exit code) from scontrol, or (None, None) once Slurm has forgotten the job."""
    proc = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True)
    if proc.returncode != 0:
        return None, None
    state = re.search(r"JobState=(\S+)", proc.stdout)
    code = re.search(r"ExitCode=(\d+):(\d+)", proc.stdout)
    return (state.group(1) if state else None, int(code.group(1)) if code else None)


def unresponsive_nodes(job_id: str) -> list[str]:
    """The job's nodes that Slurm finds not responding or down (sinfo's ``*`` suffix)."""
    try:
        proc = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True)
        listed = re.search(r"\sNodeList=(\S+)", proc.stdout)
        if proc.returncode != 0 or not listed or listed.group(1) == "(null)":
            return []
        proc = subprocess.run(
            ["sinfo", "-h", "-N", "-n", listed.group(1), "-o", "%N %T"],
            capture_output=True,
            text=True,
        )
    except OSError:  # no Slurm client here: nothing known about the nodes
        return []
    return [
        line.split()[0]
        for line in proc.stdout.splitlines()
        if len(line.split()) == 2 and (line.endswith("*") or line.split()[1].startswith("down"))
    ]


def cancel(job_id: str) -> None:
    subprocess.run(["scancel", job_id], capture_output=True)


@dataclass
class JobResult:
    job_id: str
    state: str | None
    exit_code: int | None
    seconds: float
    timed_out: bool = False
    stall: heartbeat.Stall | None = None
    """Set when the job was cancelled because no rank progressed (state STALLED)."""

    @property
    def ok(self) -> bool:
        return (
            not self.timed_out
            and self.stall is None
            and self.exit_code == 0
            and self.state in (None, "COMPLETED")
        )


def wait(
    job_id: str,
    run_dir: Path,
    timeout_s: float,
    on_poll: Callable[[], None] | None = None,
    on_state: Callable[[str], None] | None = None,
    watch: StepWatch | None = None,
) -> JobResult:
    """Block until the job leaves the queue (cancelling it after ``timeout_s``, or once
    ``watch`` reports a stall while it runs)."""
    start = time.monotonic()
    last_state = None
    while True:
        state = _squeue_state(job_id)
        if on_poll:
            on_poll()
        if state != last_state and state is not None and on_state:
            on_state(state)
        last_state = state or last_state
        if state is None:
            break
        if time.monotonic() - start > timeout_s:
            cancel(job_id)
            return JobResult(job_id, "TIMEOUT", None, time.monotonic() - start, timed_out=True)
        stall = watch.check() if watch is not None and state == "RUNNING" else None
        if stall is not None and unresponsive_nodes(job_id):
            stall = None  # a node is lost: Slurm ends the job or requeues it, not a stall
        if stall is not None:
            cancel(job_id)
            return JobResult(job_id, "STALLED", None, time.monotonic() - start, stall=stall)
        time.sleep(POLL_S)
    final_state, code = job_state(job_id)
    exit_file = run_dir / "job_exit_code"
    for _ in range(10):  # the batch script's trap may land a moment after the job leaves squeue
        if exit_file.exists() and exit_file.read_text().strip():
            break
        time.sleep(0.5)
    if exit_file.exists() and exit_file.read_text().strip():
        code = int(exit_file.read_text().strip())
    return JobResult(job_id, final_state, code, time.monotonic() - start)
