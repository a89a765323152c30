"""The local launcher (torchrun semantics, per-rank logs, failure handling) and the sbatch
script, without Megatron: the ranks here are a few lines of Python."""

import sys
import time
from pathlib import Path

import pytest

from megatron_ext.launch import local, slurm
from megatron_ext.recipes import load
from megatron_ext.recipes.submit import SlurmOptions, build_job

from conftest import REPO_ROOT

RANK_MODULE = """
import os, sys, time
rank = int(os.environ["RANK"])
print("env", rank, os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_ADDR"],
      os.environ["MASTER_PORT"], os.environ.get("EXTRA"), os.environ["TORCHELASTIC_USE_AGENT_STORE"],
      sys.argv[1:], flush=True)
mode = sys.argv[1] if len(sys.argv) > 1 else "ok"
if mode == "fail" and rank == 1:
    sys.exit(3)
if mode in ("fail", "hang"):
    time.sleep(60)
for i in range(3):
    print(f" iteration {i + 1}/3 | lm loss: 1.0E+00 |", flush=True)
"""


@pytest.fixture
def job(tmp_path):
    (tmp_path / "fake_rank.py").write_text(RANK_MODULE)

    def make(mode: str, nproc: int = 2, **kwargs) -> local.LocalJob:
        return local.LocalJob(module="fake_rank", args=[mode], nproc=nproc, log_dir=tmp_path / "logs",
                              env={"EXTRA": "x", "PYTHONPATH": str(tmp_path)}, cwd=tmp_path, **kwargs)

    return make


def test_ranks_get_torchruns_environment_and_their_own_logs(job):
    lines = []
    result = local.launch(job("ok", nproc=3), on_line=lines.append)
    assert result.ok and result.rank_codes == {0: 0, 1: 0, 2: 0}
    for rank in range(3):
        first = Path(job("ok").log_path(rank)).read_text().splitlines()[0].split()
        assert first[:5] == ["env", str(rank), str(rank), "3", "127.0.0.1"]
        assert first[6] == "x", "the job's env reaches every rank"
        assert first[7] == "True", "ranks join the launcher's rendezvous store as clients"
    assert sum("iteration" in line for line in lines) == 3, "the last rank's log is followed"


def test_a_failing_rank_stops_the_others_and_reports_its_code(job):
    start = time.monotonic()
    result = local.launch(job("fail", grace_s=0.5))
    assert result.returncode == 3 and result.failed_rank == 1
    assert result.rank_codes[0] is not None and result.rank_codes[0] != 0, "rank 0 was stopped"
    assert time.monotonic() - start < 20


def test_a_run_past_its_timeout_is_stopped_with_124(job):
    result = local.launch(job("hang", timeout_s=1.0))
    assert result.timed_out and result.returncode == 124
    assert all(code is not None for code in result.rank_codes.values())


def test_log_follower_hands_over_complete_lines_only(tmp_path):
    path, seen = tmp_path / "f.log", []
    follower = local.LogFollower(path, seen.append)
    follower.poll()
    path.write_text("a\nb")
    follower.poll()
    assert seen == ["a"]
    with open(path, "a") as f:
        f.write("c\n")
    follower.poll()
    assert seen == ["a", "bc"]


@pytest.mark.parametrize("text, seconds", [("30", 1800), ("10:05", 605), ("01:00:00", 3600),
                                           ("1-00", 86400), ("2-01:30:00", 2 * 86400 + 5400)])
def test_slurm_time_limits(text, seconds):
    assert slurm.time_limit_seconds(text) == seconds


def test_cpu_sbatch_script_runs_each_phase_as_one_srun_step(tmp_path):
    loaded = load(REPO_ROOT / "recipes/gpt_mhc_pp2_standalone_embedding_loss.yaml")
    job, problems = build_job(loaded, tmp_path / "run", SlurmOptions(partition="debug", time="00:10:00"))
    assert problems == []
    script = slurm.sbatch_script(job)
    assert "#SBATCH --nodes=1\n#SBATCH --ntasks-per-node=2\n" in script
    assert "#SBATCH --overcommit" in script and "--gpus-per-node" not in script
    assert "#SBATCH --partition=debug" in script and "#SBATCH --time=00:10:00" in script
    assert script.count("srun --mpi=none --kill-on-bad-exit=1 --ntasks=2") == 2, "train and resume"
    assert f"--output={tmp_path}/run/logs/rank-%t.log" in script
    assert f"--output={tmp_path}/run/logs/resume/rank-%t.log" in script
    assert "RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID" in script
    assert 'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"' in script
    assert "export CUDA_VISIBLE_DEVICES='' OMP_NUM_THREADS=1" in script
    assert f"echo 5 > {tmp_path}/run/checkpoints/latest_checkpointed_iteration.txt" in script
    assert "--save-interval 5" in script and f"--load {tmp_path}/run/checkpoints" in script
    assert f"exec {sys.executable} -m megatron_ext.pretrain_gpt" in script
    assert "job_exit_code" in script


def test_gpu_sbatch_script_has_one_task_per_gpu_and_the_container(tmp_path):
    loaded = load(REPO_ROOT / "recipes/gpt_tp2_pp2.yaml", "gpu-cluster")
    options = SlurmOptions(nodes=1, account="proj", container_image="nvcr.io/x/megatron-ext:1",
                           container_mounts=["/data:/data"])
    job, problems = build_job(loaded, tmp_path / "run", options)
    assert problems == []
    script = slurm.sbatch_script(job)
    assert "#SBATCH --ntasks-per-node=8\n#SBATCH --gpus-per-node=8\n" in script
    assert "#SBATCH --account=proj" in script and "--overcommit" not in script
    assert "--container-image=nvcr.io/x/megatron-ext:1" in script
    assert f"--container-mounts=/data:/data,{tmp_path}/run:{tmp_path}/run," in script
    assert "exec python -m megatron_ext.pretrain_gpt" in script, "the container's interpreter"
    assert "--distributed-backend" not in script, "NCCL on GPUs (megatron's default)"


def test_slurm_layout_problems(tmp_path):
    loaded = load(REPO_ROOT / "recipes/gpt_tp2_pp2.yaml", "gpu-cluster")
    _, problems = build_job(loaded, tmp_path, SlurmOptions(nodes=3))
    assert problems == ["8 ranks do not split evenly over 3 node(s)"]
    _, problems = build_job(loaded, tmp_path, SlurmOptions(nodes=2, gpus_per_node=8))
    assert problems == ["one task per GPU: 8 ranks over 2 node(s) need 4 GPUs per node, not 8 "
                        "(change --nodes or the recipe's parallelism)"]
