"""A run directory across stops and resumes: what to resume, from which checkpoint, and the
metrics of all its segments as one run.

``run.json`` (written when a run starts) records how it was started: the recipe it came from,
the platform, the overrides as shown (secrets redacted: they travel in the environment, as for
the first start) and whether it can be resumed. The resolved ``recipe.yaml`` beside it is what
``megatron-ext run --resume RUN_DIR`` trains again, so a resumed run has the same recipe and
overrides.

Checkpoints are megatron.training's: ``checkpoints/iter_NNNNNNN/`` and
``latest_checkpointed_iteration.txt``, which Megatron writes only once every rank finished a
save. The tracker therefore names the latest *complete* checkpoint; an ``iter_`` directory
newer than it is a save that was cut short (a second stop, a killed job) and is removed before
a resume (:func:`discard_incomplete`), and only then: a tracker that is not an iteration of this
run, or an ``iter_`` entry that cannot be one of its saves, is refused with nothing changed
(:func:`resume_point`).

Every resume writes its logs and TensorBoard events to a segment of its own
(``logs/resumed-N/``, ``tensorboard/resumed-N/``). :func:`read_metrics` joins the segments: a
later segment's steps replace an earlier one's from its first step on (a stopped run may have
logged steps after its last checkpoint; they were trained again).
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from megatron_ext import files
from megatron_ext.errors import MegatronExtError
from megatron_ext.runs import metrics as met

RUN_FILE = "run.json"
CHECKPOINTS = "checkpoints"
TRACKER = "latest_checkpointed_iteration.txt"
SEGMENT_PREFIX = "resumed-"
ITER_DIR = re.compile(r"^iter_(\d{7})$")


class ResumeError(MegatronExtError, ValueError):
    """A run directory that cannot be resumed (one line: what and why)."""


def write_run_record(run_dir: Path, record: dict) -> None:
    (run_dir / RUN_FILE).write_text(json.dumps(record, indent=2) + "\n")


def read_run_record(run_dir: Path) -> dict:
    path = Path(run_dir) / RUN_FILE
    if not Path(run_dir).is_dir():
        raise ResumeError(f"{run_dir}: not a directory")
    if not path.is_file():
        raise ResumeError(
            f"{run_dir}: not a megatron-ext run directory (no {RUN_FILE}; runs made before "
            "megatron-ext could resume have none)"
        )
    try:
        record = json.loads(files.read_record(path, "run record"))
    except (OSError, ValueError) as exc:
        raise ResumeError(f"{path}: unreadable ({exc})") from None
    if not isinstance(record, dict):
        raise ResumeError(f"{path}: not a run record")
    return record


def existing_run_problem(run_dir: Path) -> str | None:
    """Why a new run may not start in ``run_dir`` (None: it may): it already holds a run.

    A second run into the same directory would print its own losses while ``metrics.json``,
    the summary and the golden comparison still read the first one's files (TensorBoard keeps
    both event files and the older wins), so the directory is refused and the message says how
    to continue the old run or where to start afresh (issue 34, item 4)."""
    run_dir = Path(run_dir)
    if not any((run_dir / name).exists() for name in (RUN_FILE, "summary.json", "metrics.json")):
        return None
    status = "unknown"
    try:
        status = str(
            json.loads(files.read_record(run_dir / "summary.json", "summary")).get("status")
        )[:40]
    except (OSError, ValueError, AttributeError, RecursionError):
        pass
    fresh = f"give another --run-dir to start afresh (or move {run_dir} away first)"
    if status in ("stopped", "interrupted", "unknown") and (run_dir / RUN_FILE).is_file():
        return (
            f"run directory {run_dir} already holds a run (status {status}); continue it with "
            f"megatron-ext run --resume {run_dir}, or {fresh}"
        )
    if status in ("passed", "mismatch") and _resumable(run_dir):  # --resume trains it further
        fresh = (
            f"train it further with megatron-ext run --resume {run_dir} training.iterations=N, "
            f"or {fresh}"
        )
    return f"run directory {run_dir} already holds a finished run (status {status}); {fresh}"


def _resumable(run_dir: Path) -> bool:
    try:
        return bool(read_run_record(run_dir).get("resumable"))
    except ResumeError:
        return False


# ---- checkpoints ---------------------------------------------------------------------------------
def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def latest_complete(ckpt_dir: Path) -> int | None:
    """The iteration of the latest complete checkpoint (Megatron's tracker), None when none."""
    try:
        text = files.read_record(Path(ckpt_dir) / TRACKER, "tracker").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None


def saved_iterations(ckpt_dir: Path) -> list[int]:
    """Iterations that have an ``iter_`` directory (complete or not), ascending."""
    if not Path(ckpt_dir).is_dir():
        return []
    found = (ITER_DIR.match(p.name) for p in Path(ckpt_dir).iterdir() if p.is_dir())
    return sorted(int(m.group(1)) for m in found if m)


def iteration_dir(ckpt_dir: Path, iteration: int) -> Path:
    return Path(ckpt_dir) / f"iter_{iteration:07d}"


def resume_point(ckpt_dir: Path, final_iteration: int) -> tuple[int | None, list[int]]:
    """Where a resume continues from and which saves were cut short, touching nothing.

    Returns (the tracker's iteration or None when no save finished, the iterations of saves cut
    short). A save counts as cut short only when it is provably one of this run's: a real
    ``iter_`` directory (not a link) newer than the tracker and within the run's iterations.
    Anything else (a tracker that is not an iteration, one naming a missing checkpoint, a link,
    a save past the run's end) raises :class:`ResumeError` with the run left as it is."""
    from megatron_ext.checkpoint import tracker

    try:
        latest = tracker.read_iteration(ckpt_dir)
    except tracker.TrackerUnreadable as exc:
        raise ResumeError(f"{exc}; nothing was changed") from None
    saved = saved_iterations(ckpt_dir)
    if latest is not None and latest not in saved:
        raise ResumeError(
            f"{Path(ckpt_dir) / TRACKER} names iteration {latest} but "
            f"{iteration_dir(ckpt_dir, latest)} does not exist; write the iteration of the "
            "newest complete checkpoint there; nothing was changed"
        )
    newer = [i for i in saved if latest is None or i > latest]
    for iteration in newer:
        path = iteration_dir(ckpt_dir, iteration)
        if path.is_symlink() or iteration > final_iteration:
            raise ResumeError(
                f"{path} is newer than the tracker but not a save of this run (a link, or past "
                f"its {final_iteration} iterations); move it away; nothing was changed"
            )
    return latest, newer


def discard_incomplete(ckpt_dir: Path, final_iteration: int) -> list[int]:
    """Remove saves cut short (see :func:`resume_point`, which refuses anything else); returns
    their iterations."""
    _, cut = resume_point(ckpt_dir, final_iteration)
    for iteration in cut:
        shutil.rmtree(iteration_dir(ckpt_dir, iteration))
    return cut


def prune(ckpt_dir: Path, most_recent_k: int | None, keep_final: bool, final: int) -> list[int]:
    """After a finished run: keep the ``most_recent_k`` newest complete checkpoints (None: all)
    and the final one unless ``keep_final`` is false; returns the removed iterations. The
    tracker is moved to the newest kept one (removed when none is left)."""
    latest = latest_complete(ckpt_dir)
    complete = [i for i in saved_iterations(ckpt_dir) if latest is not None and i <= latest]
    keep = list(complete)
    if not keep_final:
        keep = [i for i in keep if i != final]
    if most_recent_k is not None:
        keep = keep[-most_recent_k:] if most_recent_k > 0 else []
    removed = [i for i in complete if i not in keep]
    for iteration in removed:
        shutil.rmtree(iteration_dir(ckpt_dir, iteration), ignore_errors=True)
    tracker = Path(ckpt_dir) / TRACKER
    if keep:
        tracker.write_text(str(keep[-1]))
    elif removed:
        tracker.unlink(missing_ok=True)
    return removed


# ---- segments ------------------------------------------------------------------------------------
def segments(run_dir: Path) -> list[str]:
    """'' (the first start) and every resume's segment name, in order."""
    found = set()
    for sub in ("logs", met.TENSORBOARD_SUBDIR):
        base = Path(run_dir) / sub
        if base.is_dir():
            found |= {p.name for p in base.iterdir() if p.is_dir() and _segment_number(p.name)}
    return [""] + sorted(found, key=_segment_number)


def _segment_number(name: str) -> int:
    if name.startswith(SEGMENT_PREFIX) and name[len(SEGMENT_PREFIX) :].isdigit():
        return int(name[len(SEGMENT_PREFIX) :])
    return 0


def next_segment(run_dir: Path) -> str:
    """The segment of the next resume: resumed-1, resumed-2, ..."""
    return f"{SEGMENT_PREFIX}{len(segments(run_dir))}"


@dataclass
class Joined:
    metrics: met.Metrics
    source: str
    resumed_at: list[int]
    """The step after which each resumed segment took over (its first step - 1)."""


def read_metrics(run_dir: Path) -> Joined:
    """Every segment's metrics as one run (a later segment wins from its first step on)."""
    joined: met.Metrics = {}
    sources, resumed_at = [], []
    for segment in segments(run_dir):
        part, source = met.read_run_metrics(run_dir, segment)
        first = min((min(s) for s in part.values() if s), default=None)
        if first is None:
            continue
        sources.append(source)
        if segment:
            resumed_at.append(first - 1)
        for series in joined.values():
            for step in [s for s in series if s >= first]:
                del series[step]
        for name, series in part.items():
            joined.setdefault(name, {}).update(series)
    source = "tensorboard" if sources and all(s == "tensorboard" for s in sources) else "logs"
    return Joined(joined, source if sources else "logs", resumed_at)
