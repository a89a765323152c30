"""Start the ranks of one training run on this machine, with torchrun's semantics.

Each rank is ``python -m ENTRY FLAGS`` with torchrun's environment (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) and,
like ``torchrun --standalone``, a rendezvous store that the launcher itself hosts on a port
the OS picks (``TORCHELASTIC_USE_AGENT_STORE``: every rank connects as a client, so no rank
races other programs for a port), and its own log file ``LOG_DIR/rank-N.log``
(stdout and stderr). :func:`launch` follows one rank's log while the run goes (a callback
per line, for progress), and stops the run as torchrun does: when a rank fails, the others
get SIGTERM after a short grace, then SIGKILL; on timeout, Ctrl-C, SIGTERM or SIGHUP (raised
as :class:`Interrupted`), all of them. A job with a ``save_signal`` (its ranks save on it through
megatron.training's exit-signal handler, :mod:`megatron_ext.launch.stop_signals`) turns the
launcher's SIGTERM and SIGUSR1 into that signal for every rank instead and waits for them to save
and exit (:attr:`LaunchResult.stopped_by`); Ctrl-C and SIGHUP still stop at once. A rank that hangs without exiting is found through the
ranks' heartbeats (:mod:`megatron_ext.launch.heartbeat`): when no rank has progressed for the
stall limit, every rank is stopped and the stalled one is named. Ranks die with the launcher
(Linux parent-death signal), so even a SIGKILLed launcher leaves no training behind. Every rank runs in its own process group, so checkpoint
writers and resource trackers it spawned stop with it, and what a dead rank leaves in its
group is ended when the run ends. The ranks and their workers share one multiprocessing
temporary directory, removed when the run ends (:mod:`megatron_ext.launch.mp_temp_dir`).

Only the processes this launcher started are ever signalled, by their ids.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from megatron_ext.launch import heartbeat, mp_temp_dir

POLL_S = 0.2
GRACE_S = 10.0
"""How long the other ranks may keep running after one failed (they usually fail too, with
their own error, which is worth having in their logs)."""


def _agent_store(world_size: int, timeout_s: float):
    """The rendezvous server of one run, as torchrun's agent hosts it: on port 0 (the OS picks
    a free one, with no window for another program to take it), ranks as clients."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    return TCPStore(
        "127.0.0.1",
        0,
        world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=max(60.0, timeout_s)),
    )


def rank_environment(
    rank: int,
    world_size: int,
    port: int,
    local_world_size: int | None = None,
    master_addr: str = "127.0.0.1",
    agent_store: bool = False,
) -> dict[str, str]:
    """The variables torchrun gives rank ``rank`` of a single-node job."""
    local = local_world_size or world_size
    env = {"TORCHELASTIC_USE_AGENT_STORE": str(True)} if agent_store else {}
    return {
        **env,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank % local),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(local),
        "GROUP_RANK": str(rank // local),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": "megatron-ext",
    }


@dataclass
class LocalJob:
    """One run: the command each rank executes (without the interpreter), and where."""

    module: str
    args: list[str]
    nproc: int
    log_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    timeout_s: float = 900.0
    python: str = sys.executable
    grace_s: float = GRACE_S
    stall_timeout_s: float | None = None
    """No progress on any rank for this long ends the run (0: never); None: the environment's
    MEGATRON_EXT_STALL_TIMEOUT_S, else relative to the slowest step (heartbeat.Watchdog)."""
    startup_timeout_s: float | None = None
    """The same for start-up, the first step and checkpoint I/O; None: environment, else 300 s."""
    save_signal: int | None = None
    """The signal on which the ranks save and stop (megatron's --exit-signal); None: SIGTERM
    to the launcher stops the ranks at once."""

    def rank_command(self) -> list[str]:
        return [self.python, "-m", self.module, *self.args]

    def log_path(self, rank: int) -> Path:
        return self.log_dir / f"rank-{rank}.log"

    @property
    def heartbeat_dir(self) -> Path:
        return self.log_dir / "heartbeat"


@dataclass
class LaunchResult:
    returncode: int
    """0 when every rank exited 0; else the first failing rank's code (124 on timeout)."""
    failed_rank: int | None
    seconds: float
    rank_codes: dict[int, int | None]
    timed_out: bool = False
    peak_rss_kib: dict[int, int] = field(default_factory=dict)
    """Each rank's peak resident memory (the kernel's ru_maxrss of the rank process, KiB)."""
    stall: heartbeat.Stall | None = None
    """Set when the watchdog stopped a run in which no rank progressed (returncode 124)."""
    stopped_by: int | None = None
    """The signal (SIGTERM / SIGUSR1) that asked a job with a save_signal to save and stop."""

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class LogFollower:
    """Hands complete new lines of a growing file to a callback."""

    def __init__(self, path: Path, on_line: Callable[[str], None]):
        self.path, self.on_line = path, on_line
        self.offset, self.partial = 0, ""

    def poll(self, final: bool = False) -> None:
        try:
            with open(self.path, errors="replace") as f:
                f.seek(self.offset)
                chunk = f.read()
                self.offset = f.tell()
        except FileNotFoundError:
            return
        text = self.partial + chunk
        lines = text.split("\n")
        self.partial = lines.pop()
        if final and self.partial:
            lines.append(self.partial)
            self.partial = ""
        for line in lines:
            self.on_line(line.rstrip("\r"))


class Interrupted(KeyboardInterrupt):
    """The launcher got SIGTERM or SIGHUP (a scheduler's stop, a closed terminal): handled
    like Ctrl-C, every rank stopped first. ``signum`` says which signal."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


SAVE_STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


@contextlib.contextmanager
def stop_signals_interrupt(on_save_stop: Callable[[int], None] | None = None) -> Iterator[None]:
    """Within the block SIGTERM and SIGHUP raise :class:`Interrupted` (only in the main
    thread, where Python delivers signals); the previous handlers come back afterwards.
    ``on_save_stop``: SIGTERM and SIGUSR1 call it instead (SIGHUP still raises)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    fired: list[int] = []

    def raise_interrupted(signum, _frame):
        if fired:  # already stopping: a second signal must not cut the clean-up short
            return
        fired.append(signum)
        raise Interrupted(signum)

    previous = {sig: signal.signal(sig, raise_interrupted) for sig in STOP_SIGNALS}
    if on_save_stop is not None:
        for sig in SAVE_STOP_SIGNALS:
            previous.setdefault(sig, signal.getsignal(sig))
            signal.signal(sig, lambda signum, _frame: on_save_stop(signum))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def reap_groups(procs: dict[int, subprocess.Popen], grace_s: float = 2.0) -> None:
    """End what is left in the process groups of ranks that have exited: checkpoint writers,
    multiprocessing resource trackers and other helpers a rank spawned (a rank killed with
    SIGKILL cannot stop them itself). The group id is the rank's pid (its own session)."""
    groups = [p.pid for p in procs.values() if p.poll() is not None and _group_alive(p.pid)]
    for pgid in groups:
        _kill_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_group_alive(g) for g in groups):
        time.sleep(0.05)
    for pgid in groups:
        _kill_group(pgid, signal.SIGKILL)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the rank's own process group (start_new_session=True)
    except (ProcessLookupError, PermissionError):
        pass


def _libc_prctl() -> Callable[..., int] | None:
    """libc's prctl, looked up in the launcher (the child between fork and exec imports nothing)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _libc_prctl()
_PR_SET_PDEATHSIG = 1


def _die_with_parent(launcher_pid: int) -> None:
    """In the child before exec: SIGKILL when the launcher dies, however it dies (Linux's
    parent-death signal; elsewhere nothing), so no rank outlives a killed launcher. A launcher
    that died between the fork and the prctl sends no signal (the child is already an
    orphan), so the child checks its parent once the signal is armed."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
        if os.getppid() != launcher_pid:
            os.kill(os.getpid(), signal.SIGKILL)


def _prepare_heartbeats(job: LocalJob) -> heartbeat.Watchdog:
    """An empty heartbeat directory for this run (a resume phase reuses no old beats)."""
    job.heartbeat_dir.mkdir(parents=True, exist_ok=True)
    for old in job.heartbeat_dir.glob("rank-*"):
        old.unlink(missing_ok=True)
    return heartbeat.Watchdog(
        job.heartbeat_dir, job.nproc, stall_s=job.stall_timeout_s, startup_s=job.startup_timeout_s
    )


def stop(procs: dict[int, subprocess.Popen], grace_s: float = 5.0) -> None:
    """SIGTERM every still-running rank's group, then SIGKILL what is left after grace_s."""
    alive = [p for p in procs.values() if p.poll() is None]
    for p in alive:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.poll() is None for p in alive):
        time.sleep(0.05)
    for p in alive:
        if p.poll() is None:
            _signal_group(p, signal.SIGKILL)
            p.wait()


def _reap(procs: dict[int, subprocess.Popen], peak_rss_kib: dict[int, int]) -> None:
    """Collect ranks that ended with wait4, which also gives their peak RSS (Popen.poll
    would discard it); the exit status is handed to Popen, so poll() reads it after this."""
    for rank, proc in procs.items():
        if proc.returncode is not None:
            continue
        try:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        except ChildProcessError:  # already reaped elsewhere: Popen knows its status
            proc.poll()
            continue
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            peak_rss_kib[rank] = int(usage.ru_maxrss)


def launch(
    job: LocalJob,
    on_line: Callable[[str], None] | None = None,
    follow_rank: int | None = None,
) -> LaunchResult:
    """Run ``job`` to the end; ``on_line`` receives each line that rank ``follow_rank``
    (default: the last, which prints Megatron's iteration lines) writes to its log."""
    job.log_dir.mkdir(parents=True, exist_ok=True)
    store = _agent_store(job.nproc, job.timeout_s)
    port = store.port
    start = time.monotonic()
    procs: dict[int, subprocess.Popen] = {}
    follow = job.nproc - 1 if follow_rank is None else follow_rank
    follower = LogFollower(job.log_path(follow), on_line) if on_line else None
    failed_rank, timed_out, stall = None, False, None
    peak_rss_kib: dict[int, int] = {}
    watchdog = _prepare_heartbeats(job)
    next_check = time.monotonic()
    requested: list[int] = []  # the stop signal the launcher got (save_signal jobs)
    asked: set[int] = set()  # ranks already sent the save signal

    def ask_ranks_to_save() -> None:
        # A rank whose training returned has no save handler left (Megatron's is gone): the
        # signal would kill a finished rank and turn success into failure (issue 34, item 8).
        done = {r for r, beat in watchdog.read().items() if beat.get("finished") is True}
        _reap(procs, peak_rss_kib)  # not Popen.poll: it would reap a rank and lose its peak RSS
        for rank, proc in procs.items():
            if rank not in asked and rank not in done and proc.returncode is None:
                asked.add(rank)
                with contextlib.suppress(ProcessLookupError):
                    assert job.save_signal is not None  # asked only of jobs that save on a signal
                    os.kill(proc.pid, job.save_signal)  # the rank alone, not its writers

    def on_save_stop(signum: int) -> None:
        if requested:
            print(
                f"megatron-ext: {signal.Signals(signum).name} again: already saving and "
                "stopping (Ctrl-C stops at once)",
                file=sys.stderr,
                flush=True,
            )
            return
        requested.append(signum)
        print(
            f"megatron-ext: {signal.Signals(signum).name}: every rank saves a checkpoint at the "
            "next iteration and stops",
            file=sys.stderr,
            flush=True,
        )
        ask_ranks_to_save()

    # the ranks' multiprocessing directory goes once the ranks and their groups have ended
    # (reap_groups below), whatever ended them: no worker's socket is left (issue 41, item 13)
    with (
        stop_signals_interrupt(on_save_stop if job.save_signal else None),
        mp_temp_dir.for_the_ranks() as ranks_temp_dir,
    ):
        try:
            for rank in range(job.nproc):
                env = {
                    **os.environ,
                    **job.env,
                    **rank_environment(rank, job.nproc, port, agent_store=True),
                    heartbeat.DIR_ENV: str(job.heartbeat_dir),
                    mp_temp_dir.DIR_ENV: ranks_temp_dir,
                }
                with open(job.log_path(rank), "w") as log:
                    procs[rank] = subprocess.Popen(
                        job.rank_command(),
                        cwd=job.cwd,
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                        preexec_fn=functools.partial(_die_with_parent, os.getpid()),
                    )
            failed_at = None
            while True:
                if requested:
                    ask_ranks_to_save()  # ranks started after the signal came
                if follower:
                    follower.poll()
                _reap(procs, peak_rss_kib)
                # what _reap saw, not Popen.poll: a rank ending between the two was reaped by
                # poll, without its peak RSS (the peak-memory line missed a rank: issue 41,
                # item 10); the next _reap collects it
                codes = {r: p.returncode for r, p in procs.items()}
                if failed_rank is None:
                    # Several may have ended since the last poll: a rank killed by a signal
                    # caused its peers' communication errors, not the other way round.
                    ended = {r: c for r, c in codes.items() if c is not None and c != 0}
                    bad = sorted(ended, key=lambda r: (ended[r] >= 0, r))
                    if bad:
                        failed_rank, failed_at = bad[0], time.monotonic()
                if all(c is not None for c in codes.values()):
                    break
                if failed_at is not None and time.monotonic() - failed_at > job.grace_s:
                    stop(procs)
                    break
                if time.monotonic() - start > job.timeout_s:
                    timed_out = True
                    stop(procs)
                    break
                if failed_rank is None and time.monotonic() >= next_check:
                    next_check = time.monotonic() + heartbeat.BEAT_S
                    stall = watchdog.check()
                    if stall is not None:
                        failed_rank = stall.rank
                        stop(procs)
                        break
                time.sleep(POLL_S)
        except BaseException:
            stop(procs, grace_s=2.0)
            raise
        finally:
            _reap(procs, peak_rss_kib)  # ranks that ended while stop() was not yet needed
            if follower:
                follower.poll(final=True)
            del store  # the ranks are gone; close the rendezvous server
            reap_groups(procs)
    codes = {r: p.poll() for r, p in procs.items()}
    if stall is not None:
        stall = stall.with_logged_step([job.log_path(rank) for rank in range(job.nproc)])
    if timed_out or stall is not None:
        returncode = 124
    elif failed_rank is not None:
        returncode = codes[failed_rank] or 1
    else:
        returncode = next((c for c in codes.values() if c), 0)
    return LaunchResult(
        returncode,
        failed_rank,
        time.monotonic() - start,
        codes,
        timed_out,
        peak_rss_kib,
        stall,
        stopped_by=requested[0] if requested else None,
    )


def failing_rank(job: LocalJob, result: LaunchResult) -> int | None:
    """The rank to name for a failed run, the same one :func:`failure_summary` describes: the
    stalled rank, a rank killed from outside, else the first rank that reported an error, else
    the first rank that exited non-zero."""
    from megatron_ext.launch import faults

    if result.stall is not None:
        return result.stall.rank
    code = result.rank_codes.get(result.failed_rank) if result.failed_rank is not None else None
    if code is not None and code < 0:
        return result.failed_rank
    reported = faults.first_failure(job.log_path(r) for r in range(job.nproc))
    return reported.rank if reported is not None else result.failed_rank


def failure_summary(job: LocalJob, result: LaunchResult) -> str | None:
    """Which rank failed first, where, and its original error (from the marker a failing
    rank writes, :mod:`megatron_ext.launch.faults`); else how the first failing rank ended."""
    from megatron_ext.launch import faults

    if result.stall is not None:
        return str(result.stall)
    code = result.rank_codes.get(result.failed_rank) if result.failed_rank is not None else None
    if code is not None and code < 0:  # killed from outside: its peers' errors follow from it
        return (
            f"rank {result.failed_rank} {faults.describe_exit(code)} (no error reported in its log)"
        )
    reported = faults.first_failure(job.log_path(r) for r in range(job.nproc))
    if reported is not None:
        return str(reported)
    if result.failed_rank is not None:
        log = job.log_path(result.failed_rank)
        # megatron's own stop on a NaN/Inf (exit 16/17) logs the rejection, then exits cleanly
        non_finite = faults.non_finite_in_log(log)
        ending = error_ending(log)
        why = (
            non_finite
            or (f"its log ends: {ending}" if ending else None)
            or "no error reported in its log"
        )
        return f"rank {result.failed_rank} {faults.describe_exit(code)} ({why})"
    return None


# An exception's last traceback line ("AssertionError: ...", "ValueError: ..."), or an
# argparse error ("pretrain_gpt.py: error: ..."), or a rank's own refusal (``SystemExit("error:
# --load: ...")`` in megatron_ext.launch.training, issue 34 item 16): what a rank that failed before megatron-ext's
# failure marker was installed (e.g. in Megatron's argument checks) leaves as its last line.
ERROR_LINE = re.compile(
    r"^([A-Za-z_][\w.]*(Error|Exception|Interrupt)\b.*|.*: error: .*|error: .*)$"
)


def error_ending(path: Path) -> str | None:
    """The last non-empty line of a rank's log when it is an error (None otherwise)."""
    lines = [line.strip() for line in tail(path, 20) if line.strip()]
    if lines and ERROR_LINE.match(lines[-1]):
        return lines[-1][:600]
    return None


def tail(path: Path, lines: int = 30) -> list[str]:
    try:
        with open(path, errors="replace") as f:
            return f.read().splitlines()[-lines:]
    except FileNotFoundError:
        return []
