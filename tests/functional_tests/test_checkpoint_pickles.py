"""Issue 34 item 1, reproduced as filed: a ``__reduce__`` payload written over a stopped run's
``checkpoints/iter_N/.metadata`` must not run when the run is resumed (``run --resume R``) or
when another run names that checkpoint through ``extra_args.--pretrained-checkpoint``: both
are refused in one line naming the file and the global, before any rank starts."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
BASE = [
    "recipes/gpt_tp2_pp2.yaml",
    "parallelism.tp=1",
    "training.iterations=40",
    "checkpoint.save_interval=1",
]
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
EXIT_INVALID = 2


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


def _stopped_run(run_dir: Path) -> int:
    """The issue's base run, stopped with SIGTERM after iteration 3; its tracker's iteration."""
    cli = subprocess.Popen(
        [sys.executable, "-m", "megatron_ext.cli", "run", *BASE, "--run-dir", str(run_dir)]
        + ["--no-compare"],
        cwd=REPO_ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen = []
    try:
        for line in cli.stdout:
            seen.append(line)
            if "iteration    3/" in line:
                cli.send_signal(signal.SIGTERM)
                break
        rest, _ = cli.communicate(timeout=300)
    finally:
        if cli.poll() is None:
            cli.kill()
    assert cli.returncode == 75, "".join(seen)[-3000:] + rest[-3000:]
    return int((run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text())


def test_a_payload_in_metadata_runs_on_neither_resume_nor_pretrained_checkpoint(tmp_path):
    run_dir = tmp_path / "R"
    latest = _stopped_run(run_dir)
    marker = tmp_path / "code-ran"
    metadata = run_dir / "checkpoints" / f"iter_{latest:07d}" / ".metadata"
    metadata.write_bytes(pickle.dumps(_WritesAFile(marker)))

    resumed = _cli("run", "--resume", str(run_dir), "--no-compare")
    assert resumed.returncode == EXIT_INVALID, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    refusal = [line for line in resumed.stdout.splitlines() if "cannot resume" in line]
    assert len(refusal) == 1, resumed.stdout[-3000:]
    assert str(metadata) in refusal[0] and "pathlib.Path.touch" in refusal[0], refusal
    assert "--trust-pickle" in refusal[0] and "starting" not in resumed.stdout
    assert not marker.exists()

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
    assert pretrained.returncode == EXIT_INVALID, pretrained.stdout[-3000:]
    refusal = [line for line in pretrained.stdout.splitlines() if "cannot run" in line]
    assert len(refusal) == 1 and "extra_args.--pretrained-checkpoint" in refusal[0], refusal
    assert str(metadata) in refusal[0] and "pathlib.Path.touch" in refusal[0], refusal
    assert not marker.exists() and not (tmp_path / "R2").exists()
