"""`megatron-ext submit --slurm` on a real Slurm: one node, brought up on this machine.

scripts/slurm_single_node.sh installs Debian's slurmctld, slurmd, slurm-client and munge
(apt-get; root), writes a one-node slurm.conf under a scratch directory, starts munged,
slurmctld and slurmd and waits for the node to be idle. The test then submits a CPU recipe
(ckpt-resume: two srun steps in one batch job), waits for the job, and checks its metrics
against the recipe's golden values; the daemons are stopped by pid afterwards, pass or fail.

The first test is in the soak tier (`make test-soak`): in `make test` the two-node job of
tests/functional_tests/test_slurm_multinode.py checks submit's golden-values and ckpt-resume
reports, and the signalled job below checks this recipe's losses against its golden values.

A second test submits a resumable recipe (the same PP=2 mHC recipe as a regular run) and sends
the job Slurm's warning signal (``scancel --signal=USR1``, what ``#SBATCH --signal`` makes Slurm
send before the time limit) while it trains: the ranks save, the job requeues itself, restarts,
resumes from the checkpoint and finishes with the uninterrupted run's losses. The one-node
Slurm lets a requeued job start again after ``cred_expire`` (20 s here, Slurm's default 120).
Both tests share one Slurm.

This test does not skip: where the packages cannot be installed (no root, no package
mirror) it fails, because then the Slurm path has not been exercised.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

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


@pytest.fixture(scope="module")
def slurm_env(tmp_path_factory):
    """A one-node Slurm for this module's tests; its daemons are stopped by pid afterwards."""
    assert os.geteuid() == 0, (
        "this test installs Slurm with apt-get and runs its daemons: run it as root (CI does)"
    )
    state = tmp_path_factory.mktemp("slurm")
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
        yield env
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


@pytest.mark.skipif(
    not timing.soak(),
    reason="soak tier: the two-node job checks submit's golden and ckpt-resume reports in CI",
)
def test_submit_runs_a_recipe_on_a_real_single_node_slurm(tmp_path, slurm_env):
    env = slurm_env
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


GOLDEN = REPO_ROOT / "recipes/golden/gpt_mhc_pp2_standalone_embedding_loss/golden_values_cpu.json"


def _wait_for(path_glob, text: str, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for path in path_glob():
            if text in path.read_text(errors="replace"):
                return path
        time.sleep(0.2)
    return None


def test_a_signalled_job_saves_requeues_resumes_and_finishes_exactly(tmp_path, slurm_env):
    run_dir = tmp_path / "run"
    submit = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "megatron_ext.cli",
            "submit",
            RECIPE,
            "test.type=regular",
            "launch.slurm.max_requeues=1",
            "--slurm",
            "--platform",
            "cpu",
            "--time",  # minutes: 15 idle, scaled to the load now
            str(math.ceil(timing.bound(15 * 60) / 60)),
            "--run-dir",
            str(run_dir),
            "--no-compare",
            "--skip-megatron-checks",
        ],
        cwd=REPO_ROOT,
        env=slurm_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        log = _wait_for(
            lambda: (run_dir / "logs").glob("rank-1.log"), "iteration        3/", timing.bound(600)
        )
        assert log is not None, "the job did not reach iteration 3"
        job_id = next(run_dir.glob("slurm-*.out")).stem.split("-")[1]
        # what Slurm sends signal_warning_s before the time limit: USR1 to the job's ranks
        warn = subprocess.run(
            ["scancel", "--signal=USR1", job_id], env=slurm_env, capture_output=True, text=True
        )
        assert warn.returncode == 0, warn.stderr
        out, _ = submit.communicate(timeout=timing.bound(1200))
    finally:
        if submit.poll() is None:
            submit.kill()
    assert submit.returncode == 0, out[-5000:]
    assert "state COMPLETED, exit code 0" in out
    slurm_out = (run_dir / f"slurm-{job_id}.out").read_text()
    assert "requeue 1 of 1" in slurm_out, slurm_out[-3000:]
    assert "start 2 (restart count 1)" in slurm_out
    stopped_at = int(slurm_out.split("stopped at iteration ")[1].split()[0])
    assert 3 <= stopped_at < 10
    assert sorted(p.name for p in (run_dir / "logs" / "resumed-1").glob("rank-*.log")) == [
        "rank-0.log",
        "rank-1.log",
    ]
    assert f"at iteration {stopped_at}" in (run_dir / "logs/resumed-1/rank-0.log").read_text()
    losses = json.loads((run_dir / "metrics.json").read_text())["lm loss"]["values"]
    golden = json.loads(GOLDEN.read_text())["lm loss"]["values"]
    assert sorted(map(int, losses)) == list(range(1, 11))
    for step, value in golden.items():  # the uninterrupted run, to TensorBoard's float32
        assert abs(losses[step] - value) <= 1e-6 * abs(value), (step, losses[step], value)
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "passed"
