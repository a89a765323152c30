"""Issue 34's high findings reproduced as filed, on one real run: the base run (gpt_tp2_pp2 at
tp=1, 40 iterations, a checkpoint every iteration) is started once per module, and stopped with
SIGTERM after iteration 3.

- item 3, live: ``run --resume R`` while the run trains is refused by the run directory's lock;
  the live run's saves stay and it still stops cleanly (it used to lose its save and fail);
- item 2: a tracker holding ``banana``, ``release``, ``0`` or nothing makes ``run --resume R``
  refuse in one line, every checkpoint still there (the listing unchanged);
- item 1: a ``__reduce__`` payload written over ``iter_N/.metadata`` runs neither on
  ``run --resume R`` nor through ``extra_args.--pretrained-checkpoint``: both are refused in one
  line naming the file and the global, before any rank starts;
- item 3, two resumes at once: the one that holds the lock starts, the other is refused.

The refused resumes run in this process (``megatron_ext.cli.main``, the console script's own
entry: another process than the run's, as the issue's second command is), the rest as
subprocesses. Item 4 (a run into a finished run's directory) is checked in test_stop_resume.py,
on the run that test finishes."""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
BASE = [
    "recipes/gpt_tp2_pp2.yaml",
    "parallelism.tp=1",
    "training.iterations=40",
    "checkpoint.save_interval=1",
]
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
EXIT_INVALID = 2
EXIT_STOPPED = 75
TRACKER = "latest_checkpointed_iteration.txt"


class _WritesAFile:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron_ext.cli", *args],
        cwd=REPO_ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _cli_here(capsys, *args: str) -> tuple[int, str]:
    """``megatron-ext ARGS`` in this process: its status and everything it printed."""
    from megatron_ext.cli import main

    capsys.readouterr()
    status = main(list(args))
    out = capsys.readouterr()
    return status, out.out + out.err


def _saves(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("iter_*"))


def _listing(run_dir: Path) -> list[tuple[str, int, int]]:
    """Every entry below the run directory with its size and modification time (``.lock``
    left out: taking the lock writes the holder's pid there, which is the point of it)."""
    return sorted(
        (str(p.relative_to(run_dir)), p.lstat().st_size, p.lstat().st_mtime_ns)
        for p in run_dir.rglob("*")
        if p.name != ".lock"
    )


@dataclass
class BaseRun:
    """The base run's process; its output is read on a thread (the console's progress lines
    may lag behind training on a loaded machine: the checkpoint tracker tells where it is)."""

    run_dir: Path
    process: subprocess.Popen
    seen: list[str] = field(default_factory=list)
    latest: int = 0
    output: str = ""
    paused: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.seen.append(line)

    def saved(self) -> int:
        """The iteration of the newest complete checkpoint (Megatron's tracker), 0: none."""
        try:
            return int((self.run_dir / "checkpoints" / TRACKER).read_text())
        except (OSError, ValueError):
            return 0

    def pause(self) -> None:
        """Hold the run's ranks (each the leader of its own process group) with SIGSTOP: the
        run stays live (its launcher holds the run directory; a save may be in progress) for
        as long as a test takes (seconds; under the launcher's 30 s stall limit), on a machine of
        any speed (40 iterations take seconds: the run would be over before a resume starts)."""
        self.paused = _children(self.process.pid)
        _signal_groups(self.paused, signal.SIGSTOP)

    def resume(self) -> None:
        _signal_groups(self.paused, signal.SIGCONT)
        self.paused = []

    def wait_until_saved(self, iteration: int) -> None:
        while self.saved() < iteration:
            if self.process.poll() is not None:
                self.reader.join(timeout=10)
                raise AssertionError("the base run ended early:\n" + "".join(self.seen)[-3000:])
            time.sleep(0.01)


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
    return found


def _signal_groups(groups: list[int], sig: signal.Signals) -> None:
    for group in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, sig)


@pytest.fixture(scope="module")
def live_run(tmp_path_factory) -> Iterator[BaseRun]:
    """The issue's base run, live: yielded with its ranks paused once iteration 1 is saved."""
    # what the in-process resume imports, imported first: the pause stays short on a loaded
    # machine (the launcher's stall limit, 30 s, counts while the ranks are held)
    import megatron_ext.cli.run  # noqa: F401
    import megatron_ext.launch.local  # noqa: F401
    import megatron_ext.runs.lock  # noqa: F401
    import megatron_ext.runs.runner  # noqa: F401

    run_dir = tmp_path_factory.mktemp("base") / "R"
    cli = subprocess.Popen(
        [sys.executable, "-m", "megatron_ext.cli", "run", *BASE, "--run-dir", str(run_dir)]
        + ["--no-compare"],
        cwd=REPO_ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = BaseRun(run_dir, cli)
    try:
        base.wait_until_saved(1)
        base.pause()
        yield base
    finally:
        base.resume()
        if cli.poll() is None:
            cli.kill()
            cli.wait()


@pytest.fixture(scope="module")
def stopped_run(live_run: BaseRun) -> BaseRun:
    """The base run stopped with SIGTERM after iteration 3, as the issue's reproductions start."""
    live_run.resume()
    live_run.wait_until_saved(3)
    live_run.process.send_signal(signal.SIGTERM)
    live_run.process.wait(timeout=300)
    live_run.reader.join(timeout=60)
    live_run.output = "".join(live_run.seen)
    assert live_run.process.returncode == EXIT_STOPPED, live_run.output[-3000:]
    tracker = live_run.run_dir / "checkpoints" / TRACKER
    live_run.latest = int(tracker.read_text())
    return live_run


def test_a_resume_of_the_live_run_is_refused_and_the_run_keeps_its_saves(live_run, capsys):
    """Item 3: a resume started while the run trains used to remove the live run's save in
    progress (newer than the tracker) and the live run failed; now the lock refuses it."""
    assert live_run.process.poll() is None and live_run.paused, "".join(live_run.seen)[-3000:]
    saves_before = _saves(live_run.run_dir)
    status, out = _cli_here(capsys, "run", "--resume", str(live_run.run_dir), "--no-compare")
    saves_after = _saves(live_run.run_dir)
    assert status == EXIT_INVALID, out[-3000:]
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cannot resume: run directory"), out[-3000:]
    assert f"in use by another megatron-ext run (pid {live_run.process.pid})" in lines[0]
    assert saves_after == saves_before
    # the live run goes on: stopped_run (next) lets it, stops it and checks it ends "stopped"


@pytest.mark.parametrize("tracker", ["banana", "release", "0", ""])
def test_a_tracker_that_is_no_iteration_makes_resume_refuse_with_nothing_deleted(
    stopped_run, tracker, capsys
):
    """Item 2: resume took ``latest_complete(...) or 0`` and removed every save as 'cut short'."""
    run_dir = stopped_run.run_dir
    path = run_dir / "checkpoints" / TRACKER
    original = path.read_text()
    assert _saves(run_dir) == [f"iter_{i:07d}" for i in range(1, stopped_run.latest + 1)]
    path.write_text(tracker)
    listing = _listing(run_dir)
    try:
        status, out = _cli_here(capsys, "run", "--resume", str(run_dir), "--no-compare")
    finally:
        after = _listing(run_dir)
        path.write_text(original)
    assert status == EXIT_INVALID, out[-3000:]
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"cannot resume: {path} holds"), out[-3000:]
    assert "nothing was changed" in lines[0] and "removed" not in out
    assert after == listing


def test_a_payload_in_metadata_runs_on_neither_resume_nor_pretrained_checkpoint(
    stopped_run, tmp_path
):
    """Item 1."""
    run_dir = stopped_run.run_dir
    marker = tmp_path / "code-ran"
    metadata = run_dir / "checkpoints" / f"iter_{stopped_run.latest:07d}" / ".metadata"
    original = metadata.read_bytes()
    metadata.write_bytes(pickle.dumps(_WritesAFile(marker)))
    try:
        resumed = _cli("run", "--resume", str(run_dir), "--no-compare")
        pretrained = _cli(
            "run",
            "recipes/gpt_tp2_pp2.yaml",
            "parallelism.tp=1",
            "training.iterations=2",
            f"extra_args.--pretrained-checkpoint={run_dir / 'checkpoints'}",
            "--run-dir",
            str(tmp_path / "R2"),
            "--no-compare",
        )
    finally:
        metadata.write_bytes(original)

    assert resumed.returncode == EXIT_INVALID, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    refusal = [line for line in resumed.stdout.splitlines() if "cannot resume" in line]
    assert len(refusal) == 1, resumed.stdout[-3000:]
    assert str(metadata) in refusal[0] and "pathlib.Path.touch" in refusal[0], refusal
    assert "--trust-pickle" in refusal[0] and "starting" not in resumed.stdout

    assert pretrained.returncode == EXIT_INVALID, pretrained.stdout[-3000:]
    refusal = [line for line in pretrained.stdout.splitlines() if "cannot run" in line]
    assert len(refusal) == 1 and "extra_args.--pretrained-checkpoint" in refusal[0], refusal
    assert str(metadata) in refusal[0] and "pathlib.Path.touch" in refusal[0], refusal
    assert not marker.exists() and not (tmp_path / "R2").exists()


def _holds_the_lock(run_dir: Path, process: subprocess.Popen, timeout_s: float = 120) -> bool:
    """Whether ``process`` took the run directory's lock (it writes its pid into ``.lock``)."""
    deadline = time.monotonic() + timeout_s
    lock = run_dir / ".lock"
    while time.monotonic() < deadline and process.poll() is None:
        if lock.exists() and lock.read_text().strip() == str(process.pid):
            return True
        time.sleep(0.02)
    return False


def test_of_two_resumes_at_once_the_second_is_refused(stopped_run, capsys):
    """Item 3: two resumes at once both ran, into the same resumed-1 segment and the same
    saves. Last in this module: the resume that holds the lock is stopped while it starts."""
    run_dir = stopped_run.run_dir
    saves = _saves(run_dir)
    first = subprocess.Popen(
        [sys.executable, "-m", "megatron_ext.cli", "run", "--resume", str(run_dir)]
        + ["--no-compare"],
        cwd=REPO_ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert _holds_the_lock(run_dir, first), "the first resume never held the run directory"
        status, out = _cli_here(capsys, "run", "--resume", str(run_dir), "--no-compare")
    finally:
        first.send_signal(signal.SIGTERM)
        first_out, _ = first.communicate(timeout=300)
    assert status == EXIT_INVALID, out[-3000:]
    lines = out.strip().splitlines()
    assert len(lines) == 1 and f"(pid {first.pid})" in lines[0], out[-3000:]
    # the first one stopped as asked (before its ranks trained, or after a save)
    assert first.returncode in (EXIT_STOPPED, 143), first_out[-3000:]
    assert set(saves) <= set(_saves(run_dir))
    assert not (run_dir / "logs" / "resumed-2").exists()
