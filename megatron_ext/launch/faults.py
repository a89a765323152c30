"""Fault injection and fail-fast exits for training entry points.

``MEGATRON_EXT_FAULT="rank=R,step=S[,kind=raise|kill|hang|kill-while-saving]"`` makes global
rank ``R`` fail at training step ``S`` (1-based, as Megatron's log counts iterations): ``raise``
(default) raises :class:`InjectedFault`, ``kill`` sends the rank SIGKILL, ``hang`` sleeps forever
(the launcher's stall watchdog, :mod:`megatron_ext.launch.heartbeat`, ends the run and names the
rank). ``kill-while-saving`` sends the rank SIGKILL inside the first ``torch_dist`` checkpoint
save at or after step ``S``, at a fixed point: every rank has written its shard files, nothing
has yet written the checkpoint's metadata (``.metadata``, ``metadata.json``) or the tracker
``latest_checkpointed_iteration.txt`` (:func:`killing_before_save_finalize`, the registry's
``fault`` group, applied only when this kind is asked for). Unset, nothing happens; every
training entry (``pretrain_gpt``, ``pretrain_hybrid``, ``pretrain_multimodule``) calls
:func:`at_step` once per step.

:func:`run_failing_fast` runs a rank's work so that an exception can never leave the other
ranks waiting: the traceback and one marker line (:data:`MARKER`, naming the rank, where it
was and the original error) go to the rank's log, then the process exits at once with status
1, skipping clean-up that would wait on peers (a barrier in a ``finally``, process-group
destruction, atexit handlers). The launcher then stops the other ranks (local launcher after
its grace period, ``srun --kill-on-bad-exit``, torchrun), and :func:`failure_report` reads the
marker back for ``megatron-ext run`` / ``submit``.
"""

from __future__ import annotations

import functools
import os
import re
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_ext.errors import EnvVariableError, MegatronExtError
from megatron_ext.launch import heartbeat, mp_temp_dir

FAULT_ENV = "MEGATRON_EXT_FAULT"
KILL_WHILE_SAVING = "kill-while-saving"
KINDS = ("raise", "kill", "hang", KILL_WHILE_SAVING)
MARKER = "[megatron-ext] rank failed:"
_MARKER_LINE = re.compile(re.escape(MARKER) + r" rank=(\d+) time=([\d.]+) where=(.*?) error=(.*)$")


class InjectedFault(MegatronExtError, RuntimeError):
    """The failure MEGATRON_EXT_FAULT asked for."""


@dataclass(frozen=True)
class Fault:
    rank: int
    step: int
    kind: str = "raise"


def parse_fault(text: str) -> Fault:
    """``rank=R,step=S[,kind=K]`` -> :class:`Fault`; a clear EnvVariableError otherwise."""
    fields: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in ("rank", "step", "kind"):
            raise EnvVariableError(
                f"{FAULT_ENV}={text!r}: expected rank=R,step=S[,kind={'|'.join(KINDS)}]"
            )
        fields[key.strip()] = value.strip()
    try:
        rank, step = int(fields["rank"]), int(fields["step"])
    except (KeyError, ValueError):
        raise EnvVariableError(f"{FAULT_ENV}={text!r}: rank and step must be integers") from None
    kind = fields.get("kind", "raise")
    if kind not in KINDS or rank < 0 or step < 1:
        raise EnvVariableError(
            f"{FAULT_ENV}={text!r}: kind is one of {', '.join(KINDS)}, rank >= 0, step >= 1"
        )
    return Fault(rank, step, kind)


_fault: Fault | None = None
_fault_read = False
_fired = False
_current_step: int | None = None


def fault_from_env() -> Fault | None:
    global _fault, _fault_read
    if not _fault_read:
        text = os.environ.get(FAULT_ENV, "").strip()
        _fault, _fault_read = (parse_fault(text) if text else None), True
    return _fault


def _global_rank() -> int:
    dist = sys.modules.get("torch.distributed")  # never import torch just to ask
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def at_step(step: int) -> None:
    """Called by the entries at (every micro-batch of) training step ``step``: records where
    training is, and fires the injected fault once when rank and step match."""
    global _fired, _current_step
    _current_step = step
    heartbeat.progress(step)
    fault = fault_from_env()
    if fault is None or fault.kind == KILL_WHILE_SAVING:
        return
    if _fired or step != fault.step or _global_rank() != fault.rank:
        return
    _fired = True
    if fault.kind == "kill":
        _kill_self()
    if fault.kind == "hang":
        while True:
            time.sleep(3600)
    raise InjectedFault(f"injected by {FAULT_ENV} on rank {fault.rank} at step {fault.step}")


def _kill_self() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def arm_save_fault() -> None:
    """Wrap the checkpoint save's finalisation (registry group ``fault``) when
    ``kind=kill-while-saving`` is asked for; otherwise nothing is wrapped."""
    fault = fault_from_env()
    if fault is not None and fault.kind == KILL_WHILE_SAVING:
        from megatron_ext import registry

        registry.apply("fault")


def killing_before_save_finalize(original: Callable[..., Any]) -> Callable[..., Any]:
    """megatron-core's ``save_state_dict_async_finalize``, first killing the faulty rank.

    A synchronous ``torch_dist`` save (``AsyncRequest.execute_sync``) writes every rank's
    shard files, waits in a barrier, then calls this on every rank: it gathers the write
    results so that the coordinator writes ``.metadata``; ``metadata.json`` and the tracker
    follow. Killing a rank here leaves the iteration's directory with all its shards but no
    metadata: a broken checkpoint that nothing may point at."""

    @functools.wraps(original)
    def finalize(*args: Any, **kwargs: Any) -> Any:
        global _fired
        fault = fault_from_env()
        if (
            fault is not None
            and fault.kind == KILL_WHILE_SAVING
            and not _fired
            and _current_step is not None
            and _current_step >= fault.step
            and _global_rank() == fault.rank
        ):
            _fired = True
            print(
                f"[megatron-ext] {FAULT_ENV}: killing rank {fault.rank} while saving the "
                f"checkpoint of step {_current_step} (shards written, no metadata, no tracker)",
                file=sys.stderr,
            )
            _kill_self()
        return original(*args, **kwargs)

    return finalize


def where(exc: BaseException) -> str:
    """The training step (if one had started) and the innermost frame of the error."""
    frames = traceback.extract_tb(exc.__traceback__)
    place = (
        f"{Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name}"
        if frames
        else "?"
    )
    step = f"step {_current_step}" if _current_step is not None else "start-up (before step 1)"
    return f"{step}, {place}"


MAX_ERROR_CHARS = 500
LOG_TAIL_BYTES = 1 << 20  # how far back from a rank log's end megatron's last words are looked for


# What torch's writers say when the disk under them fills up: the zip writer of torch.save
# ("unexpected pos N vs M", "file write failed") and DCP's flattened CheckpointException carry
# no errno, so the disk itself is asked (:func:`disk_failure`).
_WRITER_FAILURE_TEXTS = ("unexpected pos", "file write failed", "PytorchStreamWriter failed")
# Below this many free bytes the disk counts as full: a save that failed there failed on it.
FULL_DISK_BYTES = 1 << 20


def _save_dir() -> str | None:
    """The rank's ``--save`` directory, when megatron's arguments are parsed (never before
    megatron.training is imported: a failing process that never trained does not import it)."""
    global_vars = sys.modules.get("megatron.training.global_vars")
    if global_vars is None:
        return None
    try:
        return getattr(global_vars.get_args(), "save", None)
    except Exception:  # noqa: BLE001 - not initialised yet, or no megatron: no save dir
        return None


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc``, what it was raised from, and each rank's error inside a CheckpointException."""
    found: list[BaseException] = []
    pending: list[BaseException] = [exc]
    while pending and len(found) < 64:
        current = pending.pop(0)
        if current in found:
            continue
        found.append(current)
        pending += [e for e in (current.__cause__, current.__context__) if e is not None]
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            for inner in failures.values():
                inner = inner[0] if isinstance(inner, tuple) and inner else inner
                if isinstance(inner, BaseException):
                    pending.append(inner)
    return found


def disk_failure(exc: BaseException) -> str | None:
    """``cannot write PATH: No space left on device`` (or ``Read-only file system``) when
    ``exc`` is a write that the disk refused (issue 40, item 11); None otherwise. An error
    with a write errno names itself; a checkpoint writer's errno-less failure is judged by
    the save directory's file system (read-only, or under :data:`FULL_DISK_BYTES` free)."""
    import errno as errno_names

    from megatron_ext import files

    chain = _chain(exc)
    for error in chain:
        if isinstance(error, OSError) and error.errno in files.DISK_ERRNOS:
            return files.cannot_write(error.filename or _save_dir() or "the output", error)
    text = " ".join(str(e) for e in chain)
    checkpointing = any(type(e).__name__ == "CheckpointException" for e in chain)
    save = _save_dir()
    if save is None or not (checkpointing or any(t in text for t in _WRITER_FAILURE_TEXTS)):
        return None
    try:
        disk = os.statvfs(save)
    except OSError:
        return None
    if disk.f_flag & os.ST_RDONLY:
        code = errno_names.EROFS
    elif disk.f_bavail * disk.f_frsize < FULL_DISK_BYTES:
        code = errno_names.ENOSPC
    else:
        return None
    return files.cannot_write(save, OSError(code, os.strerror(code)))


# megatron's result validation (megatron.core.rerun_state_machine) names the rejected value and
# its check, whichever way it ends the run: "Unexpected result nan (message='found NaN in local
# forward loss calculation')" in the RuntimeError of --rerun-mode disabled, "Unexpected result
# nan on rank 1 at iteration #5 invocation #1 (message='...')" logged before exit code 16/17.
_REJECTED_RESULT = re.compile(r"Unexpected result (\S+)(.*?)\(message='([^']*)'\)")
NON_FINITE_FIX = (
    "the loss or gradients overflowed: lower training.lr (or raise training.lr_warmup_iters, "
    "set training.clip_grad) and restart from a checkpoint saved before it"
)


def non_finite_result(text: str) -> str | None:
    """``NaN loss/grad (found NaN in ...) - fix`` when ``text`` carries megatron's rejection of a
    NaN or Inf (its validation of the loss and of each gradient bucket's norm); else None."""
    match = _REJECTED_RESULT.search(text)
    if match is None:
        return None
    value, check = match.group(1).lower(), match.group(3)
    what = "NaN" if "nan" in value else "Inf" if "inf" in value else None
    if what is None:
        return None
    iteration = re.search(r"iteration #?(\d+)", match.group(0))
    at = f" at iteration {iteration.group(1)}" if iteration else ""
    return f"{what} in training{at} ({check}): {NON_FINITE_FIX}"


def describe_error(exc: BaseException) -> str:
    """``Type: message`` in one line. A write the disk refused is ``cannot write PATH: No
    space left on device`` (:func:`disk_failure`). A distributed-checkpoint failure (torch's
    CheckpointException: every rank's traceback in one message) is described by its first
    failing rank's own error ("Size mismatch ... for key ...") instead of the flattened text."""
    if (disk := disk_failure(exc)) is not None:
        return disk
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank = min(failures, key=lambda r: (not isinstance(r, int), r if isinstance(r, int) else 0))
        inner = failures[rank]
        if isinstance(inner, tuple) and inner:  # torch keeps (exception, traceback) per rank
            inner = inner[0]
        if isinstance(inner, BaseException):
            return f"{type(exc).__name__} (checkpoint rank {rank}): {describe_error(inner)}"
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = " ".join(" ".join(lines).split())
    if (non_finite := non_finite_result(text)) is not None:
        return f"{type(exc).__name__}: {non_finite}"
    if len(text) > MAX_ERROR_CHARS:
        text = text[: MAX_ERROR_CHARS - 3] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def report_failure(exc: BaseException, stream: Any = None) -> str:
    """Write the traceback and the marker line; returns the marker line."""
    stream = stream or sys.stderr
    error = describe_error(exc)
    line = f"{MARKER} rank={_global_rank()} time={time.time():.3f} where={where(exc)} error={error}"
    traceback.print_exception(type(exc), exc, exc.__traceback__, file=stream)
    print(line, file=stream, flush=True)
    return line


def run_failing_fast(work: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``work(*args, **kwargs)``; on an exception report it and exit with status 1 at once.
    Also starts the rank's heartbeat when the launcher watches for stalls, and arms a
    ``kill-while-saving`` fault. The rank's multiprocessing temporary directory is settled first,
    before any worker starts: its workers share it, so no signal that ends them leaves one of
    theirs behind (:mod:`megatron_ext.launch.mp_temp_dir`)."""
    mp_temp_dir.share_with_children()
    heartbeat.start(_global_rank())
    arm_save_fault()
    try:
        result = work(*args, **kwargs)
        heartbeat.finished()  # what follows is teardown: never a stall
        return result
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:  # noqa: BLE001 - any error must end this rank, not hang it
        sys.stdout.flush()  # what the rank printed before, so the report ends its log
        report_failure(exc)
        _clean_up_multiprocessing()
        os._exit(1)


def _clean_up_multiprocessing() -> None:
    """What multiprocessing's exit handler does (shut a Manager's server down, stop Pool
    workers and DataLoader workers, remove this rank's pymp-* temporary directory unless the
    launcher owns it), which os._exit skips: without it a failing rank that had started a
    Manager (megatron's dist-checkpoint results queue outside megatron.training) left the server
    process and its directory behind (issue 41, item 13). The workers it stops with a signal
    leave their sockets in the rank's directory (:mod:`megatron_ext.launch.mp_temp_dir`).
    Errors are ignored: the rank is already failing and must still exit."""
    from megatron_ext import registry

    try:
        registry.private("multiprocessing.util:_exit_function")()
    except Exception:  # noqa: BLE001 - never keep a failing rank from exiting
        pass


# ---- reading it back (launchers) -----------------------------------------------------------------
@dataclass(frozen=True)
class RankFailure:
    rank: int
    time: float
    where: str
    error: str

    def __str__(self) -> str:
        return f"rank {self.rank} failed at {self.where}: {self.error}"


def failure_in_log(path: Path) -> RankFailure | None:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return None
    for line in reversed(text.splitlines()):
        match = _MARKER_LINE.search(line)
        if match:
            return RankFailure(
                int(match.group(1)), float(match.group(2)), match.group(3), match.group(4)
            )
    return None


def first_failure(logs: Iterable[Path]) -> RankFailure | None:
    """The earliest reported failure among the rank logs (the others fail because of it)."""
    found = [f for f in (failure_in_log(p) for p in logs) if f is not None]
    return min(found, key=lambda f: f.time) if found else None


def non_finite_in_log(path: Path) -> str | None:
    """The last NaN/Inf rejection megatron logged near the end of a rank's log
    (:func:`non_finite_result`): a rank that megatron itself stops on one (exit 16/17,
    ``--rerun-mode validate_results``) writes no failure marker."""
    try:
        with open(path, "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - LOG_TAIL_BYTES))
            text = log.read(LOG_TAIL_BYTES).decode(errors="replace")
    except OSError:
        return None
    for line in reversed(text.splitlines()):
        if (found := non_finite_result(line)) is not None:
            return found
    return None


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with {code}"
