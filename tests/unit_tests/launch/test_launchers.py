"""The local launcher (torchrun semantics, per-rank logs, failure handling) and the sbatch
script, without Megatron: the ranks here are a few lines of Python."""

import json
import os
import sys
import time
from pathlib import Path

import pytest

from megatron_ext.launch import local, slurm
from megatron_ext.recipes import load
from megatron_ext.recipes.prepare import prepare
from megatron_ext.runs.submit import SlurmOptions, build_job
from megatron_ext.testing import timing

from recipe_texts import REPO_ROOT

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
if mode == "stall":  # MEGATRON_EXT_FAULT hangs rank 1 at step 3; rank 0 then waits on it
    from megatron_ext.launch import faults
    import p2p_communication

    def work():
        for step in range(1, 1000):
            faults.at_step(step)
            if step == 3 and rank == 0:
                p2p_communication.recv()
            time.sleep(0.05)

    faults.run_failing_fast(work)
if mode == "stop":  # rank 1 stops itself (SIGSTOP) inside a communication call at step 3,
    # after a beat that shows it waiting there: every heartbeat then says "waiting"
    from megatron_ext.launch import faults
    import p2p_communication

    def work():
        for step in range(1, 1000):
            time.sleep(0.3 if rank == 1 else 0.05)  # rank 1 progresses last: not the oldest
            faults.at_step(step)
            if step == 3:
                p2p_communication.stop_self() if rank == 1 else p2p_communication.recv()

    faults.run_failing_fast(work)
if mode == "freeze":  # rank 0 prints three iteration lines (no heartbeat step), then stops
    # itself (SIGSTOP); rank 1 waits on it in communication
    from megatron_ext.launch import faults
    import p2p_communication

    def work():
        for step in range(1, 4):
            print(f" iteration {step}/40 | lm loss: 1.0E+00 |", flush=True)
        p2p_communication.stop_self() if rank == 0 else p2p_communication.recv()

    faults.run_failing_fast(work)
if mode == "teardown":  # training finishes, then teardown outlasts the stall limit
    from megatron_ext.launch import faults

    def work():
        for step in range(1, 4):
            faults.at_step(step)
            time.sleep(0.05)

    faults.run_failing_fast(work)
    time.sleep(4)
for i in range(3):
    print(f" iteration {i + 1}/3 | lm loss: 1.0E+00 |", flush=True)
"""


@pytest.fixture
def job(tmp_path):
    (tmp_path / "fake_rank.py").write_text(RANK_MODULE)
    # a stand-in for megatron's p2p module: the watchdog counts a rank in it as waiting on a peer
    (tmp_path / "p2p_communication.py").write_text(
        "import os, signal, time\ndef recv():\n    time.sleep(3600)\n"
        "def stop_self():\n    time.sleep(1.2)\n    os.kill(os.getpid(), signal.SIGSTOP)\n"
    )

    def make(mode: str, nproc: int = 2, **kwargs) -> local.LocalJob:
        return local.LocalJob(
            module="fake_rank",
            args=[mode],
            nproc=nproc,
            log_dir=tmp_path / "logs",
            env={"EXTRA": "x", "PYTHONPATH": f"{tmp_path}:{REPO_ROOT}"},
            cwd=tmp_path,
            **kwargs,
        )

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
    limit = timing.bound(20)  # rank 0 would sleep 60 s if it were not stopped
    start = time.monotonic()
    result = local.launch(job("fail", grace_s=0.5))
    seconds = time.monotonic() - start
    assert result.returncode == 3 and result.failed_rank == 1
    assert result.rank_codes[0] is not None and result.rank_codes[0] != 0, "rank 0 was stopped"
    print(limit.explain(seconds))  # shown with -rP: the margin under load
    assert seconds < limit, limit.explain(seconds)


def test_a_run_past_its_timeout_is_stopped_with_124(job):
    result = local.launch(job("hang", timeout_s=1.0))
    assert result.timed_out and result.returncode == 124
    assert all(code is not None for code in result.rank_codes.values())


def test_a_hung_rank_is_named_and_every_rank_stopped(job, monkeypatch):
    from megatron_ext.launch import faults

    monkeypatch.setenv(faults.FAULT_ENV, "rank=1,step=3,kind=hang")
    # The stall limit is the idle 2 s scaled: under load a healthy 50 ms step can take longer
    # than 2 s, and the watchdog would end the run before rank 1 reaches step 3.
    stall_s, limit = timing.bound(2.0), timing.bound(30)
    start = time.monotonic()
    result = local.launch(job("stall", stall_timeout_s=stall_s, timeout_s=2 * limit))
    seconds = time.monotonic() - start
    assert result.stall is not None and result.failed_rank == 1 and result.returncode == 124, result
    assert (result.stall.rank, result.stall.step) == (1, 3)
    assert "faults.py" in result.stall.where and "in at_step" in result.stall.where
    assert all(code is not None for code in result.rank_codes.values()), "every rank stopped"
    print(limit.explain(seconds))  # shown with -rP: the margin under load
    assert seconds < limit, limit.explain(seconds)
    summary = local.failure_summary(job("stall"), result)
    assert summary.startswith("rank 1 stalled at step 3: no progress on any rank for "), summary


def test_a_stopped_rank_is_named_by_its_stale_heartbeat(job):
    """kill -STOP of rank 1 (here inside a communication call, after rank 0's last progress):
    its heartbeat stops, and it is the one named (issue 25 item 4)."""
    start = time.monotonic()
    result = local.launch(job("stop", stall_timeout_s=6.0, timeout_s=120.0, grace_s=0.5))
    assert result.stall is not None and result.failed_rank == 1, result.stall
    assert "heartbeat stopped" in result.stall.where, result.stall
    assert all(code is not None for code in result.rank_codes.values()), "every rank stopped"
    print(f"stopped rank named in {time.monotonic() - start:.1f} s")


def test_a_rank_frozen_after_step_3_is_not_reported_during_start_up(job):
    """Rank 0 froze after its logs showed step 3 (issue 34 item 16): the stall names the step
    from the iteration lines, never "during start-up"."""
    result = local.launch(
        job("freeze", stall_timeout_s=6.0, startup_timeout_s=6.0, timeout_s=120.0, grace_s=0.5)
    )
    assert result.stall is not None and result.stall.rank == 0, result.stall
    summary = local.failure_summary(job("freeze"), result)
    assert "start-up" not in summary, summary
    assert summary.startswith("rank 0 stalled after step 3 (the last iteration line"), summary


def test_a_rank_tearing_down_after_its_last_step_is_not_stalled(job):
    """Training returned; teardown (4 s) outlasts the stall limit (1 s) (issue 25 item 2)."""
    result = local.launch(job("teardown", stall_timeout_s=1.0, timeout_s=120.0))
    assert result.ok and result.stall is None, result.stall


def test_the_stalled_rank_is_the_one_not_waiting_on_a_peer():
    from megatron_ext.launch import heartbeat

    beats = {
        0: {"step": 5, "progress": 10.0, "waiting": True, "where": "p2p"},
        1: {"step": 5, "progress": 12.0, "waiting": False, "where": "model.py:3 in forward"},
        2: {"step": 5, "progress": 11.0, "waiting": True, "where": "p2p"},
    }
    stall = heartbeat.name_stalled(beats, 3, idle_s=40.0, limit_s=30.0)
    assert (stall.rank, stall.step, stall.waiting) == (1, 5, (0, 2))
    for b in beats.values():
        b["waiting"] = True  # a deadlock: the oldest progress
    assert heartbeat.name_stalled(beats, 3, 40.0, 30.0).rank == 0
    assert heartbeat.name_stalled({0: beats[0]}, 2, 40.0, 30.0).rank == 1, "no heartbeat at all"


def test_stall_limits_start_up_allowance_then_relative_to_the_step(tmp_path, monkeypatch):
    from megatron_ext.launch import heartbeat

    monkeypatch.delenv(heartbeat.STALL_ENV, raising=False)
    monkeypatch.delenv(heartbeat.STARTUP_ENV, raising=False)
    watchdog = heartbeat.Watchdog(tmp_path, 2, started=0.0)
    assert watchdog.check(now=heartbeat.STARTUP_S - 1) is None, "start-up allowance"
    assert watchdog.check(now=heartbeat.STARTUP_S + 1).step is None
    beat = {"step": 1, "progress": 100.0, "slowest_gap": 0.0, "waiting": False, "io": False}
    assert watchdog.limit({0: beat, 1: beat}) == heartbeat.STARTUP_S, "the first step may be slow"
    later = {**beat, "step": 4, "slowest_gap": 5.0}
    assert watchdog.limit({0: later, 1: later}) == 50.0, "10 x the slowest step"
    assert watchdog.limit({0: {**later, "slowest_gap": 0.1}, 1: later}) == 50.0
    assert watchdog.limit({0: {**later, "io": True}, 1: later}) == heartbeat.STARTUP_S, (
        "checkpoint I/O"
    )
    monkeypatch.setenv(heartbeat.STALL_ENV, "7")
    assert heartbeat.Watchdog(tmp_path, 2).limit({0: later, 1: later}) == 7.0
    assert not heartbeat.Watchdog(tmp_path, 2, stall_s=0).enabled
    monkeypatch.setenv(heartbeat.STALL_ENV, "soon")
    with pytest.raises(ValueError, match="MEGATRON_EXT_STALL_TIMEOUT_S='soon': expected a number"):
        heartbeat.Watchdog(tmp_path, 2)


def _stub_slurm(tmp_path, monkeypatch, running_polls: int) -> Path:
    """squeue says RUNNING for ``running_polls`` polls, then the job has left the queue;
    scancel and scontrol record their arguments."""
    bin_dir, log = tmp_path / "bin", tmp_path / "slurm-calls"
    bin_dir.mkdir()
    stubs = {
        "squeue": f'n=$(cat "{log}.n" 2>/dev/null || echo 0); echo $((n + 1)) > "{log}.n"\n'
        f'[ "$n" -lt {running_polls} ] && echo RUNNING || exit 1',
        "scancel": f'echo "scancel $*" >> "{log}"',
        "scontrol": 'echo "JobState=COMPLETED ExitCode=0:0"',
    }
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setattr(slurm, "POLL_S", 0.01)
    return log


def _beat(directory: Path, rank: int, progress: float, waiting: bool) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    record = dict(step=7, progress=progress, slowest_gap=0.1, waiting=waiting, io=False)
    record["where"] = "p2p_communication.py:1 in recv" if waiting else "model.py:3 in forward"
    (directory / f"rank-{rank}.json").write_text(json.dumps(record))


def test_slurm_wait_cancels_a_stalled_job_and_names_the_rank(tmp_path, monkeypatch):
    """The heartbeats come over the shared file system; the stall limit is the recipe's."""
    log = _stub_slurm(tmp_path, monkeypatch, running_polls=1000)
    steps = [slurm.Step(n, "m", [], tmp_path / n / "logs") for n in ("first", "resume")]
    watch = slurm.StepWatch(steps, 2, stall_s=5.0, startup_s=300.0)
    old = time.time() - 60
    _beat(slurm.heartbeat_dir(steps[0]), 0, old + 1, waiting=True)
    _beat(slurm.heartbeat_dir(steps[0]), 1, old, waiting=False)
    result = slurm.wait("42", tmp_path, timeout_s=60.0, watch=watch)
    assert result.state == "STALLED" and not result.ok and not result.timed_out, result
    assert (result.stall.rank, result.stall.step, result.stall.waiting) == (1, 7, (0,))
    assert "model.py:3 in forward" in str(result.stall)
    assert log.read_text() == "scancel 42\n"


def test_slurm_wait_gives_a_new_step_its_start_up_allowance(tmp_path, monkeypatch):
    """The resume step's directory appeared (no beats yet): the first step's stale beats
    no longer count, and the job runs to its end; with no watch nothing is cancelled."""
    log = _stub_slurm(tmp_path, monkeypatch, running_polls=5)
    steps = [slurm.Step(n, "m", [], tmp_path / n / "logs") for n in ("first", "resume")]
    for rank in range(2):
        _beat(slurm.heartbeat_dir(steps[0]), rank, time.time() - 60, waiting=False)
    slurm.heartbeat_dir(steps[1]).mkdir(parents=True)
    watch = slurm.StepWatch(steps, 2, stall_s=5.0, startup_s=300.0)
    (tmp_path / "job_exit_code").write_text("0\n")  # what the batch script's trap leaves
    result = slurm.wait("42", tmp_path, timeout_s=60.0, watch=watch)
    assert result.ok and result.exit_code == 0
    assert result.stall is None and result.state == "COMPLETED" and not log.exists(), result
    # the last step ended (its srun returned) while the job is still in the queue
    for rank in range(2):
        _beat(slurm.heartbeat_dir(steps[1]), rank, time.time() - 60, waiting=False)
    (slurm.heartbeat_dir(steps[1]) / slurm.ENDED).touch()
    (tmp_path / "slurm-calls.n").unlink()
    assert slurm.wait("42", tmp_path, timeout_s=60.0, watch=watch).stall is None
    (slurm.heartbeat_dir(steps[1]) / slurm.ENDED).unlink()
    (tmp_path / "slurm-calls.n").unlink()
    assert slurm.wait("42", tmp_path, timeout_s=60.0, watch=watch).stall.rank == 0
    watch.clear()
    assert not any(slurm.heartbeat_dir(step).exists() for step in steps)


def test_submit_reports_the_stalled_rank_of_a_cancelled_job(tmp_path, monkeypatch):
    from megatron_ext.runs import submit as submit_module

    from recipe_texts import MINIMAL

    log = _stub_slurm(tmp_path, monkeypatch, running_polls=1000)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(MINIMAL)
    loaded = load(recipe, overrides=["launch.stall_timeout_s=5"])
    run_dir = tmp_path / "run"

    def sbatch(script, env=None):  # the job starts: rank 0 computes, ranks 1-3 wait on it
        beats = run_dir / "logs" / "heartbeat"
        for rank in range(4):
            _beat(beats, rank, time.time() - 60 + rank, waiting=rank > 0)
        return "42"

    monkeypatch.setattr(slurm, "submit", sbatch)
    lines = []
    outcome = submit_module.submit(
        prepare(loaded, megatron_checks=False, check_pickles=False),
        SlurmOptions(),
        run_dir=run_dir,
        echo=lines.append,
    )
    assert outcome.exit_code == 3 and log.read_text() == "scancel 42\n", lines
    first = [line for line in lines if line.startswith("  first failure: ")]
    assert first and first[0].startswith("  first failure: rank 0 stalled at step 7: "), lines
    assert "model.py:3 in forward; rank(s) 1, 2, 3 waiting on a peer" in first[0]
    assert lines[-1].startswith("training failed: rank 0 stalled at step 7 (no progress for 5")
    assert lines[-1].endswith("s); job 42 cancelled")


@pytest.mark.parametrize("restart", [0, 2])
def test_submit_names_the_step_a_frozen_rank_logged_last_not_start_up(
    tmp_path, monkeypatch, restart
):
    """Issue 34 item 16 on the Slurm path: rank 0 froze after its log showed step 3 and its
    heartbeat carries no step (as in the local launcher's test): ``submit --slurm`` says
    "after step 3", as a local run does, never "during start-up". restart 2: a requeued job's
    third start, whose ranks log into ``resumed-2`` (an older segment logged step 9)."""
    from megatron_ext.runs import submit as submit_module

    from recipe_texts import MINIMAL

    log = _stub_slurm(tmp_path, monkeypatch, running_polls=1000)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(MINIMAL)
    # no heartbeat step: the start-up allowance is the limit
    loaded = load(recipe, overrides=["launch.stall_timeout_s=5", "launch.startup_timeout_s=5"])
    run_dir = tmp_path / "run"

    def sbatch(script, env=None):  # rank 0 logged step 3 and froze; ranks 1-3 wait on it
        logs = run_dir / "logs"
        beats = logs / "heartbeat"
        (beats / slurm.START).parent.mkdir(parents=True, exist_ok=True)
        (beats / slurm.START).write_text(f"{restart}\n")
        segment = logs / f"resumed-{restart}" if restart else logs
        segment.mkdir(parents=True, exist_ok=True)
        if restart:
            (logs / "rank-0.log").write_text(" iteration 9/40 | lm loss: 1.0E+00 |\n")
        for step in range(1, 4):
            with open(segment / "rank-0.log", "a") as f:
                f.write(f" [2026-12-03] iteration        {step}/      40 | lm loss: 1.0E+00 |\n")
        now = time.time()
        for rank in range(4):
            _beat(beats, rank, now - 60, waiting=rank > 0)
            record = json.loads((beats / f"rank-{rank}.json").read_text())
            record.update(step=None, beat=now - 60 if rank == 0 else now)  # rank 0 frozen
            (beats / f"rank-{rank}.json").write_text(json.dumps(record))
        return "42"

    monkeypatch.setattr(slurm, "submit", sbatch)
    lines = []
    outcome = submit_module.submit(
        prepare(loaded, megatron_checks=False, check_pickles=False),
        SlurmOptions(),
        run_dir=run_dir,
        echo=lines.append,
    )
    assert outcome.exit_code == 3 and log.read_text() == "scancel 42\n", lines
    assert not any("start-up" in line for line in lines), lines
    first = [line for line in lines if line.startswith("  first failure: ")]
    after = "rank 0 stalled after step 3 (the last iteration line in the logs)"
    assert first and first[0].startswith(f"  first failure: {after}: "), lines
    assert "stopped or frozen" in first[0], first
    assert lines[-1].startswith(f"training failed: {after} (no progress for "), lines


def test_ranks_die_with_a_killed_launcher(job, tmp_path):
    import os
    import signal
    import subprocess

    import psutil

    script = (
        f"import sys; sys.path[:0] = [{str(tmp_path)!r}, {str(REPO_ROOT)!r}]\n"
        "from pathlib import Path\nfrom megatron_ext.launch import local\n"
        f"local.launch(local.LocalJob(module='fake_rank', args=['hang'], nproc=2, "
        f"log_dir=Path({str(tmp_path / 'logs')!r}), cwd=Path({str(tmp_path)!r}), "
        f"env={{'EXTRA': 'x', 'PYTHONPATH': {str(tmp_path)!r}}}))\n"
    )
    # a killed launcher cannot remove its ranks' multiprocessing directory (launch/mp_temp_dir.py):
    # it is left in the test's own directory, not in the system's
    (tmp_path / "tmp").mkdir()
    launcher = subprocess.Popen(
        [sys.executable, "-c", script], env={**os.environ, "TMPDIR": str(tmp_path / "tmp")}
    )
    try:
        started = timing.bound(30)
        deadline = time.monotonic() + started
        while len(psutil.Process(launcher.pid).children()) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        ranks = psutil.Process(launcher.pid).children()
        assert len(ranks) == 2, f"{len(ranks)} ranks after {started:.0f} s"
        os.kill(launcher.pid, signal.SIGKILL)  # no clean-up can run
        launcher.wait()
        gone, alive = psutil.wait_procs(ranks, timeout=timing.bound(10))
        assert not alive, [(p.pid, p.status()) for p in alive]
    finally:
        if launcher.poll() is None:
            launcher.kill()


def test_a_rank_whose_launcher_died_before_the_death_signal_was_armed_kills_itself():
    """A launcher killed between a rank's fork and its prctl sends no parent-death signal (the
    child is an orphan already); the child sees another parent and ends before exec."""
    import functools
    import signal
    import subprocess

    gone_launcher = os.getpid() + 1_000_000  # not our pid: as if the launcher had died
    rank = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        preexec_fn=functools.partial(local._die_with_parent, gone_launcher),
    )
    try:
        assert rank.wait(timeout=timing.bound(10)) == -signal.SIGKILL
    finally:
        if rank.poll() is None:
            rank.kill()


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


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("30", 1800),
        ("10:05", 605),
        ("01:00:00", 3600),
        ("1-00", 86400),
        ("2-01:30:00", 2 * 86400 + 5400),
    ],
)
def test_slurm_time_limits(text, seconds):
    assert slurm.time_limit_seconds(text) == seconds


def test_cpu_sbatch_script_runs_each_phase_as_one_srun_step(tmp_path):
    loaded = load(REPO_ROOT / "recipes/gpt_mhc_pp2_standalone_embedding_loss.yaml")
    job, problems = build_job(
        prepare(loaded, megatron_checks=False, check_pickles=False),
        tmp_path / "run",
        SlurmOptions(partition="debug", time="00:10:00"),
    )
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
    options = SlurmOptions(
        nodes=1,
        account="proj",
        container_image="nvcr.io/x/megatron-ext:1",
        container_mounts=["/data:/data"],
    )
    job, problems = build_job(
        prepare(loaded, megatron_checks=False, check_pickles=False), tmp_path / "run", options
    )
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
    _, problems = build_job(
        prepare(loaded, megatron_checks=False, check_pickles=False), tmp_path, SlurmOptions(nodes=3)
    )
    assert problems == [
        "--nodes / launch.nodes: 8 ranks do not split evenly over 3 node(s); give a --nodes "
        "that divides 8"
    ]
    _, problems = build_job(
        prepare(loaded, megatron_checks=False, check_pickles=False),
        tmp_path,
        SlurmOptions(nodes=2, gpus_per_node=8),
    )
    assert problems[1:] == [
        f"run directory {tmp_path} is node-local" + problems[1].split("local", 1)[1]
    ]
    assert problems[:1] == [
        "--nodes / launch.nodes: 2 node(s) x 8 task(s) per node = 16 tasks, but the recipe has "
        "8 ranks; change --nodes or the tasks per node (--gpus-per-node / "
        "launch.slurm.gpus_per_node)"
    ]
