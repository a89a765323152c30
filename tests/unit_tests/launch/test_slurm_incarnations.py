"""Issue 40 item 7: a requeued Slurm job's start never takes a step id an earlier start used
(Slurm numbers steps from 0 in every start and resends a lost node's queued kill of JOB.0 to
whatever JOB.0 is then), and ``submit`` says why the job's LAST start ended.

The batch script runs with bash against stub ``srun``/``scontrol`` that number steps the way
Slurm does (0, 1, ... afresh in each start); the real cluster is the soak test's
(``functional_tests/test_slurm_multinode.py``)."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

from megatron_ext.launch import faults, slurm

SRUN = """#!/bin/bash
# Slurm's step ids: 0, 1, ... in each start of the job
COUNTER="$STUB_DIR/next-${SLURM_RESTART_COUNT:-0}"
ID=$(cat "$COUNTER" 2>/dev/null || echo 0)
echo $((ID + 1)) > "$COUNTER"
for word in "$@"; do
  if [ "$word" = printenv ]; then echo "${SLURM_RESTART_COUNT:-0} $ID skip" >> "$STUB_DIR/steps"; echo "$ID"; exit 0; fi
done
echo "${SLURM_RESTART_COUNT:-0} $ID train" >> "$STUB_DIR/steps"
"""
SCONTROL = """#!/bin/bash
case "$1 $2" in
  "show hostnames") echo node1; echo node2 ;;
  requeue*) echo requeued >> "$STUB_DIR/requeues" ;;
esac
"""


def _job(tmp_path: Path) -> slurm.SlurmJob:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    return slurm.SlurmJob(
        name="r",
        run_dir=run_dir,
        steps=[slurm.Step("train", "megatron_ext.pretrain_gpt", ["--x"], run_dir / "logs")],
        nodes=2,
        tasks_per_node=2,
        device="cpu",
        workdir=tmp_path,
        python="python",
        requeue=slurm.Requeue(run_dir / "checkpoints", final_iteration=40, max_requeues=3),
    )


def _start(script: Path, stubs: Path, restart: int | None) -> str:
    env = {
        **os.environ,
        "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}",
        "STUB_DIR": str(stubs),
        "SLURM_JOB_ID": "77",
        "SLURM_JOB_NODELIST": "node[1-2]",
    }
    env.pop("SLURM_RESTART_COUNT", None)
    if restart is not None:
        env["SLURM_RESTART_COUNT"] = str(restart)
    done = subprocess.run(
        ["bash", str(script)], env=env, capture_output=True, text=True, timeout=60
    )
    return done.stdout + done.stderr


def test_each_start_of_a_requeued_job_trains_on_a_step_id_no_earlier_start_used(tmp_path):
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, body in (("srun", SRUN), ("scontrol", SCONTROL)):
        (stubs / name).write_text(body)
        (stubs / name).chmod((stubs / name).stat().st_mode | stat.S_IEXEC)
    job = _job(tmp_path)
    script = tmp_path / "sbatch.sh"
    script.write_text(slurm.sbatch_script(job))
    outputs = [_start(script, stubs, restart) for restart in (None, 1, 2, 3)]
    steps = [line.split() for line in (stubs / "steps").read_text().splitlines()]
    trained = {int(r): int(i) for r, i, kind in steps if kind == "train"}
    assert trained == {0: 0, 1: 1, 2: 2, 3: 3}, steps  # one training step per start
    # every start's training step id is new; the ids before it were throwaway steps
    for restart, step_id in trained.items():
        skipped = sorted(int(i) for r, i, kind in steps if int(r) == restart and kind == "skip")
        assert skipped == list(range(step_id)), (restart, steps)
        assert f"(step id {step_id})" in outputs[restart], outputs[restart]
    assert "step ids 0-2 were used by an earlier start of the job: skipped" in outputs[3]
    assert (job.run_dir / f"{slurm.STEP_IDS_FILE}77").read_text().strip() == "4"


def test_a_job_without_requeue_runs_no_throwaway_step(tmp_path):
    job = _job(tmp_path)
    job.requeue = None
    assert "printenv SLURM_STEP_ID" not in slurm.sbatch_script(job)


def _marker(rank: int, when: float, error: str) -> str:
    return f"{faults.MARKER} rank={rank} time={when} where=x.py:1 in f error={error}\n"


def test_submit_reports_why_the_last_start_ended_not_the_first(tmp_path):
    from megatron_ext.runs.submit import _echo_first_failure

    job = _job(tmp_path)
    logs = job.run_dir / "logs"
    (logs / "resumed-1").mkdir(parents=True)
    (logs / "rank-0.log").write_text(_marker(0, 1.0, "RuntimeError: Gloo connectFullMesh failed"))
    out = job.run_dir / "slurm-77.out"
    out.write_text(
        "[megatron-ext] start 1 (restart count 0) on node[1-2]\n"
        "srun: error: node1: tasks 0-1: Exited with exit code 1\n"
        "[megatron-ext] start 2 (restart count 1) on node[1-2]\n"
        "srun: error: node2: tasks 2-3: Terminated\n"
    )
    lines: list[str] = []
    _echo_first_failure(job, "77", lines.append)
    assert lines == [
        "  last start (start 2 of the job, restart count 1): "
        "srun: error: node2: tasks 2-3: Terminated"
    ]
    (logs / "resumed-1" / "rank-3.log").write_text(_marker(3, 9.0, "ValueError: bad step"))
    lines.clear()
    _echo_first_failure(job, "77", lines.append)
    assert len(lines) == 1 and "ValueError: bad step" in lines[0] and "Gloo" not in lines[0]
    assert "start 2 of the job" in lines[0]
