"""Per-rank heartbeats and the launcher's stall watchdog: a hung rank ends the run, named.

A rank that stops making progress without exiting (a deadlock, a peer that never sends, a
stuck collective, ``MEGATRON_EXT_FAULT=...,kind=hang``) would otherwise keep every rank
alive until ``launch.timeout_s``. Two halves:

Rank side (:func:`start`, :func:`progress`): when the launcher sets ``MEGATRON_EXT_HEARTBEAT_DIR``,
a daemon thread writes ``rank-R.json`` there every :data:`BEAT_S` seconds: the last training
step the rank reached and when (``progress``, fed by :func:`megatron_ext.launch.faults.at_step`
at every micro-batch), the slowest gap between two such calls so far, and where the main
thread is right now, with whether that is inside ``torch.distributed`` or megatron's communicators (waiting on a peer).
A sleeping or communicating main thread releases the GIL, so the thread keeps beating.

Launcher side (:class:`Watchdog`): when no rank has progressed for the stall limit, it names
the stalled rank: among ranks *not* waiting in communication, the one whose progress is
oldest (its peers then wait on it); if every rank waits, the oldest of all (a deadlock). The
limit is ``stall_s`` when given (recipe ``launch.stall_timeout_s`` or
``MEGATRON_EXT_STALL_TIMEOUT_S``; 0 turns the watchdog off), else ``max(STALL_MIN_S,
STALL_FACTOR x the slowest step gap seen)``. Start-up and the first step (compilation,
dataset building, the first allocation) get ``startup_s`` instead, and so does a rank that
is inside checkpoint I/O.

A rank whose training returned says so (:func:`finished`): it is tearing down (process groups,
torch's operator registry, interpreter exit), which on a loaded machine can outlast the stall
limit, and is never named stalled; when every rank has finished the watchdog stands down
(``launch.timeout_s`` still bounds the teardown). A rank whose heartbeat itself went stale
(the process is stopped, ``kill -STOP``, or frozen) is named first: the others wait on it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_ext import registry
from megatron_ext.errors import EnvVariableError

DIR_ENV = "MEGATRON_EXT_HEARTBEAT_DIR"
STALL_ENV = "MEGATRON_EXT_STALL_TIMEOUT_S"
STARTUP_ENV = "MEGATRON_EXT_STARTUP_TIMEOUT_S"
BEAT_S = 1.0
STALL_MIN_S = 30.0
STALL_FACTOR = 10.0
STARTUP_S = 300.0
# A heartbeat this much older than the newest one: the rank's process is not running at all
# (its beating thread stopped too), not merely slow to step.
FROZEN_S = 10.0

# Main-thread frames whose file path contains one of these: the rank waits on its peers
# (a blocked ``work.wait()`` is a C call, so the innermost Python frame is its caller's).
_WAITING_PATHS = (
    "/torch/distributed/",
    "p2p_communication.py",
    "bridge_communicator.py",
    "multimodule_communicator.py",
    "/megatron_ext/multimodule/communicator.py",
    "/megatron_ext/pipeline/p2p.py",
)
# ... or is busy with checkpoint I/O (may take long without being stuck).
_IO_PATHS = ("checkpointing.py", "/dist_checkpointing/")


# ---- rank side ------------------------------------------------------------------------------
class _State:
    step: int | None = None
    progress: float | None = None
    slowest_gap: float = 0.0
    finished: bool = False
    thread: threading.Thread | None = None
    path: Path | None = None
    rank: int | None = None


_state = _State()
# One writer at a time: the beating thread and finished() share rank-R.json's temporary file,
# and a beat built before finished() must not land after it (the launcher reads "finished" to
# leave a rank that is tearing down alone; issue 34, item 8).
_write_lock = threading.Lock()


def progress(step: int) -> None:
    """Training reached ``step`` now (cheap: two assignments, no I/O)."""
    now = time.time()
    if _state.progress is not None and _state.step is not None and _state.step >= 1:
        _state.slowest_gap = max(_state.slowest_gap, now - _state.progress)
    _state.step, _state.progress = step, now


def finished() -> None:
    """Training returned on this rank: what follows is teardown, not a stall. Written at once,
    so the watchdog knows before the next beat."""
    with _write_lock:
        _state.finished = True
        if _state.path is not None and _state.rank is not None:
            try:
                _write(_state.path, beat_record(_state.rank, _main_ident()))
            except OSError:
                pass


def main_thread_place(main_ident: int) -> tuple[str, bool, bool]:
    """(innermost Python frame of the main thread, waiting in communication, in checkpoint I/O)."""
    frame = registry.private("sys:_current_frames")().get(main_ident)
    if frame is None:
        return "?", False, False
    place = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} in {frame.f_code.co_name}"
    waiting = io = False
    while frame is not None:
        name = frame.f_code.co_filename.replace("\\", "/")
        waiting = waiting or any(p in name for p in _WAITING_PATHS)
        io = io or any(p in name for p in _IO_PATHS)
        frame = frame.f_back
    return place, waiting, io


def _main_ident() -> int:
    ident = threading.main_thread().ident
    assert ident is not None  # the main thread has started: this code runs in a thread of it
    return ident


def beat_record(rank: int, main_ident: int) -> dict:
    place, waiting, io = main_thread_place(main_ident)
    return {
        "rank": rank,
        "pid": os.getpid(),
        "step": _state.step,
        "progress": _state.progress,
        "slowest_gap": _state.slowest_gap,
        "beat": time.time(),
        "where": place,
        "waiting": waiting,
        "io": io,
        "finished": _state.finished,
    }


def _write(path: Path, record: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)  # the launcher never reads half a record


def start(rank: int) -> bool:
    """Start this rank's heartbeat thread when the launcher asked for one (idempotent)."""
    directory = os.environ.get(DIR_ENV)
    if not directory or _state.thread is not None:
        return False
    path = Path(directory) / f"rank-{rank}.json"
    _state.path, _state.rank = path, rank
    main_ident = _main_ident()

    def run() -> None:
        while True:
            try:
                with _write_lock:
                    _write(path, beat_record(rank, main_ident))
            except OSError:
                pass  # the run directory went away: the launcher is not watching any more
            time.sleep(BEAT_S)

    _state.thread = threading.Thread(target=run, name="megatron-ext-heartbeat", daemon=True)
    _state.thread.start()
    return True


# ---- launcher side --------------------------------------------------------------------------
@dataclass(frozen=True)
class Stall:
    rank: int
    step: int | None
    idle_s: float
    limit_s: float
    where: str
    waiting: tuple[int, ...]
    logged_step: int | None = None
    """The last training step the ranks' logs show (their iteration lines), for a rank whose
    heartbeat carries no step: a run that printed step 3 did not stall during start-up."""

    def with_logged_step(self, logs: list[Path]) -> Stall:
        """This stall with the last step ``logs`` (the ranks' logs) show, when its heartbeat
        carries none: the local launcher and the Slurm watch say the same."""
        if self.step is not None:
            return self
        return dataclasses.replace(self, logged_step=last_logged_step(logs))

    @property
    def at(self) -> str:
        """Where training was: the heartbeat's step, else the logs' last step, else start-up."""
        if self.step is not None:
            return f"at step {self.step}"
        if self.logged_step is not None:
            return f"after step {self.logged_step} (the last iteration line in the logs)"
        return "during start-up (before step 1)"

    def __str__(self) -> str:
        text = (
            f"rank {self.rank} stalled {self.at}: no progress on any rank for {self.idle_s:.0f} s "
            f"(stall limit {self.limit_s:.0f} s), its main thread in {self.where}"
        )
        if self.waiting:
            text += f"; rank(s) {', '.join(map(str, self.waiting))} waiting on a peer (in communication)"
        return text


# Megatron's progress line, "[...] iteration        3/      40 | consumed samples: ...", and
# pretrain_multimodule's "multimodule: iteration 3/40 | ...".
_ITERATION_LINE = re.compile(r"\biteration\s+(\d+)/\s*\d+\s*\|")


def last_logged_step(logs: list[Path], lines: int = 200) -> int | None:
    """The highest training step the last ``lines`` lines of ``logs`` report finished (None:
    none yet, or no log)."""
    steps = []
    for path in logs:
        try:
            with open(path, errors="replace") as f:
                ending = f.read().splitlines()[-lines:]
        except OSError:
            continue
        steps += [int(m.group(1)) for line in ending if (m := _ITERATION_LINE.search(line))]
    return max(steps) if steps else None


def _env_seconds(name: str) -> float | None:
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        raise EnvVariableError(f"{name}={text!r}: expected a number of seconds") from None
    if not value >= 0 or value == float("inf"):
        raise EnvVariableError(f"{name}={text!r}: expected a finite number of seconds >= 0")
    return value


class Watchdog:
    """Reads the ranks' heartbeats; :meth:`check` returns a :class:`Stall` once the run is stuck."""

    def __init__(
        self,
        directory: Path,
        nproc: int,
        stall_s: float | None = None,
        startup_s: float | None = None,
        started: float | None = None,
    ):
        self.directory, self.nproc = Path(directory), nproc
        self.stall_s = stall_s if stall_s is not None else _env_seconds(STALL_ENV)
        startup = startup_s if startup_s is not None else _env_seconds(STARTUP_ENV)
        self.startup_s = STARTUP_S if startup is None else startup
        self.started = time.time() if started is None else started

    @property
    def enabled(self) -> bool:
        return self.stall_s != 0

    def read(self) -> dict[int, dict]:
        beats = {}
        for rank in range(self.nproc):
            try:
                beats[rank] = json.loads((self.directory / f"rank-{rank}.json").read_text())
            except (OSError, ValueError):
                continue
        return beats

    def limit(self, beats: dict[int, dict]) -> float:
        steps = [b["step"] for b in beats.values() if b.get("step") is not None]
        if not steps or max(steps) < 2 or any(b.get("io") for b in beats.values()):
            return self.startup_s  # start-up, the first step, checkpoint I/O
        if self.stall_s is not None:
            return self.stall_s
        slowest = max(float(b.get("slowest_gap") or 0.0) for b in beats.values())
        return max(STALL_MIN_S, STALL_FACTOR * slowest)

    def check(self, now: float | None = None) -> Stall | None:
        if not self.enabled:
            return None
        now = time.time() if now is None else now
        beats = self.read()
        if len(beats) == self.nproc and all(b.get("finished") for b in beats.values()):
            return None  # every rank trained to the end and is tearing down
        progressed = [b["progress"] for b in beats.values() if b.get("progress") is not None]
        last = max(progressed) if progressed else self.started
        limit = self.limit(beats)
        if now - last <= limit:
            return None
        return name_stalled(beats, self.nproc, now - last, limit, now)


def name_stalled(
    beats: dict[int, dict],
    nproc: int,
    idle_s: float,
    limit_s: float,
    now: float | None = None,
) -> Stall:
    """The rank the others wait on: a rank with no heartbeat at all (it never got going), then
    one whose heartbeat went stale (its process is stopped or frozen), then, among the ranks
    not waiting in communication, the oldest progress. A rank that finished training is
    tearing down and never the one named."""
    silent = [r for r in range(nproc) if r not in beats]
    live = {r: b for r, b in beats.items() if not b.get("finished")} or beats
    waiting = tuple(sorted(r for r, b in live.items() if b.get("waiting")))
    if silent:
        return Stall(silent[0], None, idle_s, limit_s, "? (no heartbeat from this rank)", waiting)
    newest = max(float(b.get("beat") or 0.0) for b in beats.values())
    # stale by more than a few beats, and by half the idle time (a short configured stall
    # limit) or FROZEN_S, whichever is less
    threshold = max(3 * BEAT_S, min(FROZEN_S, idle_s / 2))
    frozen = [r for r, b in live.items() if newest - float(b.get("beat") or 0.0) > threshold]
    if frozen:
        rank = min(frozen, key=lambda r: (float(live[r].get("beat") or 0.0), r))
        beat = live[rank]
        stale = (now if now is not None else newest) - float(beat.get("beat") or 0.0)
        where = (
            f"{beat.get('where')} when its heartbeat stopped {stale:.0f} s ago (the process is "
            "stopped or frozen: kill -STOP, a debugger, swapped out)"
        )
    else:
        candidates = [r for r in live if r not in waiting] or list(live)
        rank = min(candidates, key=lambda r: (live[r].get("progress") or 0.0, r))
        beat = live[rank]
        where = str(beat.get("where"))
    return Stall(
        rank,
        beat.get("step"),
        idle_s,
        limit_s,
        where,
        tuple(r for r in waiting if r != rank),
    )
