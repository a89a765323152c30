"""`megatron-ext submit --slurm` on a real Slurm: one node, brought up on this machine.

scripts/slurm_single_node.sh installs Debian's slurmctld, slurmd, slurm-client and munge
(apt-get; root), writes a one-node slurm.conf under a scratch directory, starts munged,
slurmctld and slurmd and waits for the node to be idle. The test then submits a CPU recipe
(ckpt-resume: two srun steps in one batch job), waits for the job, and checks its metrics
against the recipe's golden values; the daemons are stopped by pid afterwards, pass or fail.

This test does not skip: where the packages cannot be installed (no root, no package
mirror) it fails, because then the Slurm path has not been exercised.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from megatron_ext.testing import timing

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "slurm_single_node.sh"
RECIPE = "recipes/gpt_mhc_pp2_standalone_embedding_loss.yaml"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_submit_runs_a_recipe_on_a_real_single_node_slurm(tmp_path):
    assert os.geteuid() == 0, (
        "this test installs Slurm with apt-get and runs its daemons: run it as root (CI does)"
    )
    state = tmp_path / "slurm"
    env = {
        **os.environ,
        "SLURM_CI_DIR": str(state),
        "SLURM_CONF": str(state / "slurm.conf"),
        "CUDA_VISIBLE_DEVICES": "",
        **timing.watchdog_env(),
    }
    start = subprocess.run(
        ["bash", str(SCRIPT), "start"],
        env=env,
        capture_output=True,
        text=True,
        timeout=timing.bound(900),
    )
    pids = []
    try:
        assert start.returncode == 0, f"Slurm did not come up:\n{start.stdout}\n{start.stderr}"
        pids = [int(p) for p in (state / "daemons.pid").read_text().split()]
        if (state / "munged.pid").exists():
            pids.append(int((state / "munged.pid").read_text()))
        assert all(_alive(p) for p in pids), start.stdout

        run_dir = tmp_path / "run"
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "megatron_ext.cli",
                "submit",
                RECIPE,
                "--slurm",
                "--platform",
                "cpu",
                "--time",  # minutes: 15 idle, scaled to the load now
                str(math.ceil(timing.bound(15 * 60) / 60)),
                "--run-dir",
                str(run_dir),
            ],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timing.bound(1200),
        )
        out = result.stdout + result.stderr
        assert result.returncode == 0, f"submit exited {result.returncode}:\n{out[-6000:]}"
        assert "state COMPLETED, exit code 0" in result.stdout

        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "passed"
        assert summary["phases"][0]["state"] == "COMPLETED"
        titles = [r["title"] for r in summary["reports"]]
        assert any(t.startswith("golden values") for t in titles), out[-3000:]
        assert any(t.startswith("ckpt-resume") for t in titles), out[-3000:]
        # Slurm's own traces of the job: the batch script, its output, one log per task and step.
        assert (run_dir / "sbatch.sh").is_file() and list(run_dir.glob("slurm-*.out"))
        for step in ("logs", "logs/resume"):
            assert sorted(p.name for p in (run_dir / step).glob("rank-*.log")) == [
                "rank-0.log",
                "rank-1.log",
            ]
        assert (run_dir / "job_exit_code").read_text().strip() == "0"
    finally:
        stop = subprocess.run(
            ["bash", str(SCRIPT), "stop"],
            env=env,
            capture_output=True,
            text=True,
            timeout=timing.bound(120),
        )
        assert stop.returncode == 0, stop.stderr
        assert not [p for p in pids if _alive(p)], f"daemons still running: {stop.stdout}"
