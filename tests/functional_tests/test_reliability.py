"""Real (tiny) training runs that end badly end cleanly: SIGTERM of `megatron-ext run` stops
every rank and every process the ranks started, and writes the run summary."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO_ROOT = Path(__file__).resolve().parents[2]
SMALL_GPT_PP2 = ["recipes/gpt_tp2_pp2.yaml", "parallelism.tp=1", "training.iterations=400"]


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_sigterm_of_run_stops_every_rank_and_writes_the_summary(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    cli = subprocess.Popen([sys.executable, "-m", "megatron_ext.cli", "run", *SMALL_GPT_PP2, "--no-compare",
                            "--skip-megatron-checks", "--run-dir", str(run_dir)],
                           cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    try:
        for line in cli.stdout:  # wait until training runs: ranks, their helpers, gloo all up
            seen.append(line)
            if "iteration    2/" in line:
                break
        else:
            raise AssertionError("".join(seen[-40:]))
        descendants = [p.pid for p in psutil.Process(cli.pid).children(recursive=True)]
        assert len(descendants) >= 2, "both ranks are running"
        start = time.monotonic()
        cli.send_signal(signal.SIGTERM)
        rest, _ = cli.communicate(timeout=60)
        seconds = time.monotonic() - start
    finally:
        if cli.poll() is None:
            cli.kill()
    out = "".join(seen) + rest
    assert cli.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "stopped by SIGTERM" in out
    assert seconds < 20, seconds
    assert all(_gone(pid) for pid in descendants), [psutil.Process(p).cmdline() for p in descendants if not _gone(p)]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    assert summary["phases"][-1]["reason"] == "stopped by SIGTERM"
