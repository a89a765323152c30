"""Long runs without Megatron: the launcher turns SIGTERM into the ranks' save signal, the rank
side holds an early stop and routes Slurm's SIGTERM, checkpoints are pruned and cut-short saves
dropped, resumed segments join into one run, the sbatch script requeues with a bound, and
``runs`` / ``compare RUN_A RUN_B --plot`` read run directories (bad input: one line, exit 2)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from megatron_ext.cli import main as cli_main
from megatron_ext.launch import local, slurm, stop_signals
from megatron_ext.recipes import load
from megatron_ext.recipes.prepare import prepare
from megatron_ext.runs import resume as rsm, runner
from megatron_ext.runs.submit import (
    SlurmOptions,
    build_job,
    container_image_problem,
    container_image_warning,
)

from recipe_texts import REPO_ROOT

SAVING_RANK = """
import os, signal, sys, time
out = sys.argv[1]
def save(signum, frame):
    time.sleep(1.5)  # a save takes a while: the launcher's second stop comes during it
    open(os.path.join(out, f"saved-{os.environ['RANK']}"), "w").write(str(signum))
    sys.exit(0)
signal.signal(signal.SIGUSR1, save)
open(os.path.join(out, f"ready-{os.environ['RANK']}"), "w").close()
time.sleep(60)
"""


def test_sigterm_of_the_launcher_asks_every_rank_to_save_once(tmp_path, capfd):
    (tmp_path / "saving_rank.py").write_text(SAVING_RANK)
    job = local.LocalJob(
        module="saving_rank",
        args=[str(tmp_path)],
        nproc=2,
        log_dir=tmp_path / "logs",
        env={"PYTHONPATH": f"{tmp_path}:{REPO_ROOT}"},
        cwd=tmp_path,
        timeout_s=60,
        save_signal=stop_signals.SAVE_SIGNAL,
    )

    def stop_twice():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(list(tmp_path.glob("ready-*"))) < 2:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)  # pending signals are handled in number order: keep this one second
        os.kill(os.getpid(), signal.SIGUSR1)  # a second stop while saving changes nothing

    stopper = threading.Thread(target=stop_twice, daemon=True)

    def outside(*_):  # the handler the launcher must restore (a late signal cannot kill pytest)
        pass

    previous = signal.signal(signal.SIGUSR1, outside)
    try:
        stopper.start()
        result = local.launch(job)
        stopper.join(timeout=30)
        restored = signal.getsignal(signal.SIGUSR1)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert result.stopped_by == signal.SIGTERM and result.returncode == 0, result
    assert sorted(p.name for p in tmp_path.glob("saved-*")) == ["saved-0", "saved-1"]
    assert {p.read_text() for p in tmp_path.glob("saved-*")} == {str(int(signal.SIGUSR1))}
    assert "SIGUSR1 again: already saving and stopping" in capfd.readouterr().err
    assert restored is outside
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_rank_holds_an_early_stop_and_routes_slurms_sigterm(monkeypatch):
    monkeypatch.setenv(stop_signals.ROUTE_ENV, "SIGTERM")
    previous = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}
    try:
        stop_signals.install_rank_handlers(["--exit-signal-handler", "--exit-signal", "SIGUSR1"])
        os.kill(os.getpid(), signal.SIGTERM)  # routed to SIGUSR1, held: Megatron is not ready
        assert stop_signals._pending and stop_signals.redeliver_pending() is None
        got = []
        signal.signal(signal.SIGUSR1, lambda signum, _f: got.append(signum))  # megatron's
        assert stop_signals.redeliver_pending() == signal.SIGUSR1
        assert got == [signal.SIGUSR1] and not stop_signals._pending
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert stop_signals.exit_signal_of(["--exit-signal-handler"]) == signal.SIGTERM
    assert stop_signals.exit_signal_of([]) is None
    with pytest.raises(ValueError, match="unknown signal 'NOPE'"):
        stop_signals.parse_signals("TERM,NOPE")


def _checkpoints(ckpt: Path, iterations: list[int], tracker: int) -> None:
    for i in iterations:
        rsm.iteration_dir(ckpt, i).mkdir(parents=True)
    (ckpt / rsm.TRACKER).write_text(str(tracker))


def test_cut_short_saves_are_dropped_and_old_checkpoints_pruned(tmp_path):
    ckpt = tmp_path / "checkpoints"
    _checkpoints(ckpt, [2, 4, 6, 8], tracker=6)  # iteration 8's save was cut short
    assert rsm.discard_incomplete(ckpt, 8) == [8]
    assert rsm.saved_iterations(ckpt) == [2, 4, 6] and rsm.latest_complete(ckpt) == 6
    assert rsm.prune(ckpt, most_recent_k=2, keep_final=True, final=6) == [2]
    assert rsm.prune(ckpt, most_recent_k=None, keep_final=False, final=6) == [6]
    assert rsm.saved_iterations(ckpt) == [4] and rsm.latest_complete(ckpt) == 4


def _log(path: Path, losses: dict[int, float]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    lines = [f" iteration {s:8d}/      10 | lm loss: {v:.6E} |" for s, v in losses.items()]
    (path / "rank-1.log").write_text("\n".join(lines) + "\n")


def _run_dir(path: Path, losses: dict[int, float], resumed: dict[int, float] = None) -> Path:
    path.mkdir(parents=True)
    (path / "recipe.yaml").write_text("training: {iterations: 10}\n")
    rsm.write_run_record(path, {"recipe": "r.yaml", "platform": "cpu", "resumable": True})
    _log(path / "logs", losses)
    if resumed:
        _log(path / "logs" / "resumed-1", resumed)
    return path


def test_resumed_segments_join_from_their_first_step(tmp_path):
    # the stopped run logged step 4 after its checkpoint at 3; the resume trained it again
    run = _run_dir(tmp_path / "r", {1: 4.0, 2: 3.5, 3: 3.0, 4: 9.9}, {4: 2.5, 5: 2.0})
    assert rsm.next_segment(run) == "resumed-2"
    joined = rsm.read_metrics(run)
    assert joined.metrics["lm loss"] == {1: 4.0, 2: 3.5, 3: 3.0, 4: 2.5, 5: 2.0}
    assert joined.resumed_at == [3] and joined.source == "logs"


def test_runs_lists_and_compare_plots_two_runs(tmp_path, capsys):
    a = _run_dir(tmp_path / "a", {1: 4.0, 2: 3.5, 3: 3.0})
    _run_dir(tmp_path / "b", {1: 4.0, 2: 3.0}, {3: 2.0})
    compared = [{"title": "golden values", "passed": True}]
    (a / "summary.json").write_text(
        json.dumps({"status": "passed", "phases": [], "reports": compared})
    )
    assert cli_main(["runs", "--runs-root", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["NAME", "RECIPE", "STATUS", "STEPS", "LAST", "LOSS", "WHEN"]
    rows = {line.split()[0]: line.split() for line in out[1:]}
    assert rows["a"][2:5] == ["passed", "3/10", "3.000000"]
    assert rows["b"][2:5] == ["incomplete", "3/10", "2.000000"] or rows["b"][2] == "running"
    assert cli_main(["runs", "show", str(tmp_path / "b")]) == 0
    shown = capsys.readouterr().out
    assert "resumed    1 time(s): resumed-1 from step 3" in shown

    png = tmp_path / "cmp.png"
    assert cli_main(["compare", str(a), str(tmp_path / "b"), "--plot", str(png)]) == 0
    table = capsys.readouterr().out
    assert "B resumed after step(s) [2]" in table
    row = next(line.split() for line in table.splitlines() if line.startswith("lm loss"))
    assert row[2:6] == ["3", "1", "0.333333", "3"], row  # steps, max |A-B|, rel, at step
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_and_runs_refuse_bad_input_in_one_line(tmp_path, capsys):
    a = _run_dir(tmp_path / "a", {1: 4.0})
    other = _run_dir(tmp_path / "c", {1: 4.0})
    (other / "logs" / "rank-1.log").write_text(
        " iteration 1/10 | lm loss: 4.0E+00 | grad norm: 1.0 |\n"
    )
    assert cli_main(["compare", str(a), str(tmp_path)]) == 2
    assert cli_main(["compare", str(a), str(other), "--metrics", "grad norm"]) == 2
    assert cli_main(["runs", "show", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == (
        f"megatron-ext compare: golden values {tmp_path} is a directory, not a JSON file"
    )
    assert err[1] == (
        "megatron-ext compare: --metrics ['grad norm']: not logged by both runs (both log "
        "['lm loss'])"
    )
    assert "no such run directory" in err[2] and len(err) == 3


def test_resume_refuses_what_it_cannot_resume(tmp_path, capsys):
    assert cli_main(["run", "--resume", str(tmp_path)]) == runner.EXIT_INVALID
    assert "not a megatron-ext run directory" in capsys.readouterr().out
    run = _run_dir(tmp_path / "done", {1: 4.0})
    (run / "summary.json").write_text(json.dumps({"status": "passed"}))
    assert cli_main(["run", "--resume", str(run)]) == runner.EXIT_INVALID
    assert "the run already finished (status passed)" in capsys.readouterr().out


def test_resumable_recipe_sbatch_script_requeues_with_a_bound(tmp_path):
    loaded = load(
        REPO_ROOT / "recipes/gpt_mhc_pp2_standalone_embedding_loss.yaml",
        overrides=["test.type=regular", "launch.slurm.max_requeues=2"],
    )
    job, problems = build_job(
        prepare(loaded, megatron_checks=False, check_pickles=False),
        tmp_path / "run",
        SlurmOptions(time="00:10:00"),
    )
    assert problems == []
    script = slurm.sbatch_script(job)
    for line in ("#SBATCH --signal=USR1@120", "#SBATCH --requeue", "#SBATCH --open-mode=append"):
        assert line in script
    assert f"export {stop_signals.ROUTE_ENV}=SIGTERM" in script
    # one training step (the other srun: throwaway steps past an earlier start's step ids)
    assert script.count("srun --mpi=none --kill-on-bad-exit") == 1
    assert "--exit-signal SIGUSR1" in script
    assert f"--load {tmp_path}/run/checkpoints" in script, "a restart resumes"
    assert '[ -z "$STOPPED" ] && [ "$RESTART" -lt 2 ]' in script
    assert 'scontrol requeue "$SLURM_JOB_ID"' in script and "exit 75" in script
    # the segment placeholder becomes the restart's segment in the shell
    out_arg = next(w for w in script.split() if "--output=" in w and "rank-%t" in w)
    for _restart, segment in ((0, ""), (2, "resumed-2/")):
        expanded = subprocess.run(
            ["bash", "-c", f'SEGMENT={segment.rstrip("/")}; echo {out_arg}'],
            capture_output=True,
            text=True,
        ).stdout.strip()
        assert expanded.replace("//", "/") == f"--output={tmp_path}/run/logs/{segment}rank-%t.log"


def test_submit_refuses_node_local_run_dirs_and_images_without_megatron_ext(tmp_path):
    loaded = load(REPO_ROOT / "recipes/gpt_tp2_pp2.yaml", "gpu-cluster")
    _, problems = build_job(
        prepare(loaded, megatron_checks=False, check_pickles=False),
        Path("/tmp/run"),
        SlurmOptions(nodes=2, gpus_per_node=4),
    )
    assert problems == [
        "run directory /tmp/run is node-local (under /tmp) but the job spans 2 nodes that must "
        "all see it; pass --run-dir on a shared file system"
    ]
    _, problems = build_job(
        prepare(loaded, megatron_checks=False, check_pickles=False),
        Path("/tmp/run"),
        SlurmOptions(nodes=1),
    )
    assert problems == [], "one node sees its own temporary directory"
    assert "lacks megatron-ext" in container_image_problem("nvcr.io/nvidia/pytorch:25.09-py3")
    assert container_image_problem("registry/megatron-ext:1") is None
    assert container_image_warning("registry/megatron-ext:1") is None
    assert "cannot tell whether" in container_image_warning("registry/llm:1")


@pytest.mark.parametrize("seconds,text", [(7.4, "7s"), (185, "3m05s"), (7620, "2h07m")])
def test_eta_format(seconds, text):
    assert runner.format_eta(seconds) == text


def test_compare_runs_with_different_metric_sets_compares_the_common_ones(tmp_path, capsys):
    """An mHC run logs its statistics, a plain run does not (issue 33, item 8; here the extra
    metric is a grad norm in the log lines): the metrics both logged are compared, the others
    listed; --metrics selects among the common ones."""
    plain = _run_dir(tmp_path / "plain", {1: 4.0, 2: 3.0})
    mhc = _run_dir(tmp_path / "mhc", {1: 4.0, 2: 3.5})
    (mhc / "logs" / "rank-1.log").write_text(
        "".join(
            f" iteration {s}/10 | lm loss: {v:.6E} | grad norm: 0.25 |\n"
            for s, v in ((1, 4.0), (2, 3.5))
        )
    )
    assert cli_main(["compare", str(mhc), str(plain)]) == 0
    out = capsys.readouterr().out
    row = next(line.split() for line in out.splitlines() if line.startswith("lm loss"))
    assert row[2:4] == ["2", "0.5"], row
    assert "present in mhc only (not compared): grad-norm" in out
    assert cli_main(["compare", str(mhc), str(plain), "--metrics", "lm loss"]) == 0
    assert "lm loss" in capsys.readouterr().out
