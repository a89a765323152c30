"""Issue 34, "nothing lost, nothing executed": a run directory, a checkpoint tracker, a recipe's
environment and an output path used carelessly or with hostile intent. Each test reproduces
one finding of the issue (the base run: gpt_tp2_pp2 at tp=1 for 40 iterations, saving every
iteration, stopped after iteration 3) and checks that nothing is lost and nothing runs.
No rank is started: the step that would train is replaced by one that fails the test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_ext.recipes import load
from megatron_ext.recipes.prepare import RunDirRecipes, prepare
from megatron_ext.runs import lock as run_lock, resume as rsm, runner, verdict
from megatron_ext.runs.options import RunOptions

from recipe_texts import REPO_ROOT

BASE = REPO_ROOT / "recipes" / "gpt_tp2_pp2.yaml"
BASE_OVERRIDES = ["parallelism.tp=1", "training.iterations=40", "checkpoint.save_interval=1"]


@pytest.fixture
def no_training(monkeypatch):
    """Fail the test if a rank would be started."""

    def train(*args, **kwargs):
        raise AssertionError("training started")

    monkeypatch.setattr(runner, "_run_phases", train)


def _stopped_run(tmp_path: Path, saved=(1, 2, 3, 4), tracker: str | None = "3") -> Path:
    """A run directory as the base run leaves it when stopped after iteration 3 (iteration 4's
    save cut short unless the tracker says otherwise)."""
    run_dir = tmp_path / "R"
    runner.write_run_files(
        prepare(load(BASE, "cpu", BASE_OVERRIDES), megatron_checks=False, check_pickles=False),
        run_dir,
    )
    (run_dir / "summary.json").write_text(json.dumps({"status": "stopped"}))
    ckpt = rsm.checkpoint_dir(run_dir)
    for iteration in saved:
        rsm.iteration_dir(ckpt, iteration).mkdir(parents=True)
        torch.save({"weights": torch.ones(2)}, rsm.iteration_dir(ckpt, iteration) / "common.pt")
    if tracker is not None:
        (ckpt / rsm.TRACKER).write_text(tracker)
    return run_dir


def _saved(run_dir: Path) -> list[int]:
    return rsm.saved_iterations(rsm.checkpoint_dir(run_dir))


# ---- item 2: a tracker that is not an iteration deletes nothing ---------------------------------
@pytest.mark.parametrize("tracker", ["banana", "release", "0", "", "-1", "3.0"])
def test_resume_refuses_a_tracker_that_is_not_an_iteration_and_deletes_nothing(
    tmp_path, tracker, no_training
):
    run_dir = _stopped_run(tmp_path, tracker=tracker)
    lines: list[str] = []
    outcome = runner.resume_run(
        run_dir, RunDirRecipes(), RunOptions(megatron_checks=False), echo=lines.append
    )
    assert outcome.exit_code == runner.EXIT_INVALID
    assert _saved(run_dir) == [1, 2, 3, 4]
    assert (rsm.iteration_dir(rsm.checkpoint_dir(run_dir), 4) / "common.pt").is_file()
    assert len(lines) == 1 and rsm.TRACKER in lines[0] and "nothing was changed" in lines[0]
    assert not any("removed" in line for line in lines)


def test_resume_refuses_a_tracker_naming_a_missing_checkpoint(tmp_path, no_training):
    run_dir = _stopped_run(tmp_path, tracker="99")  # issue 34 item 16: was FileNotFoundError
    lines: list[str] = []
    outcome = runner.resume_run(
        run_dir, RunDirRecipes(), RunOptions(megatron_checks=False), echo=lines.append
    )
    assert outcome.exit_code == runner.EXIT_INVALID and _saved(run_dir) == [1, 2, 3, 4]
    assert "names iteration 99" in lines[0] and "iter_0000099" in lines[0]


def test_resume_never_deletes_a_linked_or_foreign_iteration(tmp_path, no_training):
    run_dir = _stopped_run(tmp_path, saved=(1, 2, 3))
    ckpt = rsm.checkpoint_dir(run_dir)
    elsewhere = tmp_path / "precious"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("x")
    rsm.iteration_dir(ckpt, 4).symlink_to(elsewhere)
    lines: list[str] = []
    assert (
        runner.resume_run(run_dir, RunDirRecipes(), echo=lines.append).exit_code
        == runner.EXIT_INVALID
    )
    assert (elsewhere / "keep").is_file() and "not a save of this run" in lines[0]
    rsm.iteration_dir(ckpt, 4).unlink()
    rsm.iteration_dir(ckpt, 41).mkdir()  # past the run's 40 iterations
    assert (
        runner.resume_run(run_dir, RunDirRecipes(), echo=lines.append).exit_code
        == runner.EXIT_INVALID
    )
    assert rsm.iteration_dir(ckpt, 41).is_dir()


def test_resume_removes_only_the_save_cut_short_and_names_it(tmp_path, monkeypatch):
    run_dir = _stopped_run(tmp_path)  # tracker 3, iteration 4 cut short
    started = []
    monkeypatch.setattr(runner, "_run_phases", lambda *a, **k: started.append(k) or "trained")
    lines: list[str] = []
    assert (
        runner.resume_run(
            run_dir, RunDirRecipes(), RunOptions(megatron_checks=False), echo=lines.append
        )
        == "trained"
    )
    assert _saved(run_dir) == [1, 2, 3]
    assert any("cut short while saving: iteration(s) [4]" in line for line in lines)
    assert any("resuming from the checkpoint at iteration 3" in line for line in lines)


# ---- item 3: --resume holds the run directory's lock before it touches anything -----------------
def test_resume_of_a_live_run_is_refused_before_it_touches_anything(tmp_path, no_training):
    run_dir = _stopped_run(tmp_path)  # iteration 4: the live run's save in progress
    before = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.name != ".lock")
    lines: list[str] = []
    with run_lock.holding(run_dir):  # the live run (or a first resume)
        outcome = runner.resume_run(
            run_dir, RunDirRecipes(), RunOptions(megatron_checks=False), echo=lines.append
        )
    assert outcome.exit_code == runner.EXIT_INVALID
    assert lines and "in use by another megatron-ext run" in lines[0]
    after = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.name != ".lock")
    assert after == before and _saved(run_dir) == [1, 2, 3, 4]


# ---- item 4: a run directory holding a run is refused -------------------------------------------
@pytest.mark.parametrize("status", ["passed", "mismatch", "training-failed", "stopped"])
def test_run_into_a_directory_holding_a_run_is_refused(tmp_path, status, no_training):
    run_dir = _stopped_run(tmp_path)
    (run_dir / "summary.json").write_text(json.dumps({"status": status}))
    (run_dir / "metrics.json").write_text('{"lm loss": {"values": {"1": 9.5}}}')
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    loaded = load(BASE, "cpu", [*BASE_OVERRIDES, "training.lr=0.0002"])
    lines: list[str] = []
    outcome = runner.run(
        prepare(loaded, megatron_checks=False),
        RunOptions(run_dir=run_dir, megatron_checks=False),
        echo=lines.append,
    )
    assert outcome.exit_code == runner.EXIT_INVALID
    refusal = [line for line in lines if line.startswith("cannot run:")]
    assert len(refusal) == 1 and f"status {status}" in refusal[0]
    assert "another --run-dir" in refusal[0]
    assert ("--resume" in refusal[0]) == (status != "training-failed")
    assert ("training.iterations=N" in refusal[0]) == (status in ("passed", "mismatch"))
    after = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.name != ".lock"}
    assert after == {p: b for p, b in before.items() if p.name != ".lock"}


# ---- item 6: an output that is not a regular file is never replaced -----------------------------
def test_convert_checkpoint_never_replaces_a_device_fifo_or_link(tmp_path, capsys):
    import os
    import stat

    import torch

    from megatron_ext.cli import main as cli_main

    source = tmp_path / "in.pt"
    torch.save({"decoder.layers.0.mlp.weight": torch.ones(1)}, source)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)  # stands in for /dev/full: replacing a real device node here would harm
    precious = tmp_path / "precious.pt"
    precious.write_bytes(b"keep")
    link = tmp_path / "link.pt"
    link.symlink_to(precious)
    args = ["convert-checkpoint", str(source), "--model", "gpt", "--to", "upstream"]
    for output, kind in ((fifo, "a FIFO"), (link, "a symbolic link")):
        assert cli_main([*args[:2], str(output), *args[2:]]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and kind in err and str(output) in err, err
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and link.is_symlink()
    assert precious.read_bytes() == b"keep"
    # /dev/full itself is only examined here, never written (the test may run as root)
    from megatron_ext.files import output_problem

    assert "/dev/full exists and is a device" in output_problem("/dev/full")


# ---- item 5: environment keys that load code --------------------------------------------------
def _code_dir(tmp_path: Path) -> tuple[Path, Path]:
    code = tmp_path / "code"
    code.mkdir()
    marker = tmp_path / "code-ran"
    (code / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    return code, marker


@pytest.mark.parametrize(
    "key", ["PYTHONPATH", "LD_PRELOAD", "PYTHONSTARTUP", "PYTHONHOME", "BASH_ENV", "ENV"]
)
def test_validate_refuses_a_code_loading_environment_key_unless_allowed(tmp_path, key, capsys):
    from megatron_ext.cli import main as cli_main

    code, _ = _code_dir(tmp_path)
    args = ["validate", str(BASE), f"launch.env.{key}={code}", "--skip-megatron-checks"]
    assert cli_main([*args, "--platform", "cpu"]) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and f"launch.env.{key}" in out[0] and f"--allow-env {key}" in out[0]
    assert cli_main([*args, "--platform", "cpu", "--allow-env", key]) == 0
    assert cli_main([*args, "--platform", "cpu", "--allow-env", "OTHER"]) == 2


def test_run_with_pythonpath_sitecustomize_starts_no_rank(tmp_path, no_training):
    code, marker = _code_dir(tmp_path)
    loaded = load(BASE, "cpu", [*BASE_OVERRIDES, f"launch.env.PYTHONPATH={code}"])
    lines: list[str] = []
    outcome = runner.run(
        prepare(loaded, megatron_checks=False),
        RunOptions(run_dir=tmp_path / "R", megatron_checks=False),
        echo=lines.append,
    )
    assert outcome.exit_code == runner.EXIT_INVALID and not marker.exists()
    assert any("launch.env.PYTHONPATH" in line and "--allow-env" in line for line in lines)
    assert not (tmp_path / "R").exists()


def test_an_imported_case_with_code_loading_env_vars_is_refused(tmp_path, capsys):
    import yaml

    from megatron_ext.cli import main as cli_main

    code, _ = _code_dir(tmp_path)
    case = tmp_path / "gpt" / "gpt3_case"
    case.mkdir(parents=True)
    source = REPO_ROOT / "tests/functional_tests/test_cases/gpt/gpt3_mcore_tp2_pp2_cpu"
    doc = yaml.safe_load((source / "model_config.yaml").read_text())
    doc["ENV_VARS"] = {**(doc.get("ENV_VARS") or {}), "LD_PRELOAD": str(code / "x.so")}
    (case / "model_config.yaml").write_text(yaml.safe_dump(doc))
    out = tmp_path / "imported.yaml"
    assert cli_main(["import", str(case), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "ENV_VARS.LD_PRELOAD" in err and "--allow-env LD_PRELOAD" in err and not out.exists()
    # the test case run directly is a recipe like any other: refused the same way
    lines = []
    loaded = load(case / "model_config.yaml", "cpu")
    assert (
        runner.preflight(prepare(loaded, megatron_checks=False, check_pickles=False), lines.append)
        is not None
    )
    assert any("launch.env.LD_PRELOAD" in line for line in lines)


@pytest.mark.parametrize("value", ['"a\\0b"', '"\\0"'])
def test_a_nul_in_an_environment_value_is_refused_by_validate(tmp_path, value):
    # item 11: it passed validate, then run crashed in subprocess.Popen
    from megatron_ext.recipes.validate import validate

    loaded = load(BASE, "cpu", [*BASE_OVERRIDES, f"launch.env.SOME_FLAG={value}"])
    assert "\x00" in loaded.recipe.launch.env["SOME_FLAG"]
    problems = [str(p) for p in validate(loaded, megatron_checks=False).problems]
    assert len(problems) == 1 and "NUL" in problems[0] and "SOME_FLAG" in problems[0]


# ---- item 7: secrets ---------------------------------------------------------------------------
ESCAPED_SECRETS = [
    'launch.env={"HF_\\x54OKEN": hf_abc123}',
    'launch.env={"WANDB_API_\\x4bEY": w_k9}',
]


def test_a_secret_name_written_with_yaml_escapes_is_redacted_everywhere(tmp_path):
    loaded = load(BASE, "cpu", [*BASE_OVERRIDES, *ESCAPED_SECRETS])
    assert loaded.recipe.launch.env["HF_TOKEN"] == "hf_abc123"  # YAML unescaped the names
    run_dir = tmp_path / "R"
    runner.write_run_files(prepare(loaded, megatron_checks=False, check_pickles=False), run_dir)
    verdict.write_summary(
        prepare(loaded, megatron_checks=False, check_pickles=False), run_dir, "stopped", [], [], 1.0
    )
    for name in ("command.sh", "recipe.yaml", "run.json", "summary.json"):
        text = (run_dir / name).read_text()
        assert "hf_abc123" not in text and "w_k9" not in text, name


@pytest.mark.parametrize(
    "override",
    [
        "launch.env={HF_TOKEN: [hf_abc]}",
        "launch.env.HF_TOKEN={a: hf_abc}",
        'launch.env={"HF_\\x54OKEN": [hf_abc]}',
        "launch.env={HF_TOKEN: [hf_abc",  # not YAML: the parser's message quotes the text
    ],
)
def test_an_error_line_never_echoes_a_secret_value(override):
    from megatron_ext.recipes import RecipeError
    from megatron_ext.recipes.validate import validate

    try:
        lines = [str(p) for p in validate(load(BASE, "cpu", [override]), False).problems]
    except RecipeError as exc:
        lines = [str(p) for p in exc.problems]
    assert lines and not any("hf_abc" in line for line in lines), lines


def test_resume_gives_the_ranks_the_exported_secret_not_the_redacted_text(tmp_path, monkeypatch):
    run_dir = tmp_path / "R"
    loaded = load(BASE, "cpu", [*BASE_OVERRIDES, "launch.env.HF_TOKEN=hf_first"])
    runner.write_run_files(prepare(loaded, megatron_checks=False, check_pickles=False), run_dir)
    (run_dir / "summary.json").write_text(json.dumps({"status": "stopped"}))
    envs = []
    monkeypatch.setattr(
        runner,
        "_run_phases",
        lambda request, *a, **k: envs.append(dict(request.launch.environment)),
    )
    monkeypatch.delenv("HF_TOKEN", raising=False)
    lines: list[str] = []
    outcome = runner.resume_run(
        run_dir, RunDirRecipes(), RunOptions(megatron_checks=False), echo=lines.append
    )
    assert outcome.exit_code == runner.EXIT_INVALID and not envs
    assert len(lines) == 1 and "export HF_TOKEN" in lines[0]
    monkeypatch.setenv("HF_TOKEN", "hf_exported")
    runner.resume_run(
        run_dir, RunDirRecipes(), RunOptions(megatron_checks=False), echo=lines.append
    )
    assert envs and envs[0]["HF_TOKEN"] == "hf_exported"


# ---- item 8: a stop signal after training ended does not fail a finished run --------------------
FINISHED_RANK = """
import os, sys, time
from megatron_ext.launch import heartbeat
heartbeat.start(int(os.environ["RANK"]))
heartbeat.finished()  # training returned: Megatron's save handler is gone
open(os.path.join(sys.argv[1], f"done-{os.environ['RANK']}"), "w").close()
time.sleep(3)  # tearing down
"""


def test_sigterm_after_every_rank_finished_keeps_the_run_a_success(tmp_path):
    import os
    import signal
    import threading
    import time

    from megatron_ext.launch import local, stop_signals

    (tmp_path / "finished_rank.py").write_text(FINISHED_RANK)
    job = local.LocalJob(
        module="finished_rank",
        args=[str(tmp_path)],
        nproc=2,
        log_dir=tmp_path / "logs",
        env={"PYTHONPATH": f"{tmp_path}:{REPO_ROOT}"},
        cwd=tmp_path,
        timeout_s=60,
        save_signal=stop_signals.SAVE_SIGNAL,
    )

    def stop_when_done():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(list(tmp_path.glob("done-*"))) < 2:
            time.sleep(0.02)
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGTERM)

    stopper = threading.Thread(target=stop_when_done, daemon=True)
    stopper.start()
    result = local.launch(job)
    stopper.join(timeout=30)
    assert result.stopped_by == signal.SIGTERM
    assert result.returncode == 0 and result.rank_codes == {0: 0, 1: 0}, result


def test_a_rank_ended_by_the_save_signal_after_the_final_checkpoint_is_no_failure(
    tmp_path, monkeypatch
):
    import signal

    from megatron_ext.launch import local

    loaded = load(BASE, "cpu", [*BASE_OVERRIDES, "training.iterations=4"])
    run_dir = tmp_path / "R"
    runner.write_run_files(prepare(loaded, megatron_checks=False, check_pickles=False), run_dir)
    ckpt = rsm.checkpoint_dir(run_dir)
    rsm.iteration_dir(ckpt, 4).mkdir(parents=True)
    (ckpt / rsm.TRACKER).write_text("4")
    killed = local.LaunchResult(
        -signal.SIGUSR1, 1, 1.0, {0: 0, 1: -signal.SIGUSR1}, stopped_by=signal.SIGTERM
    )
    monkeypatch.setattr(local, "launch", lambda job, on_line=None: killed)
    monkeypatch.setattr(runner, "finalize", lambda *a, **k: "finalized")
    lines: list[str] = []
    got = runner._run_phases(
        prepare(loaded, megatron_checks=False, check_pickles=False),
        run_dir,
        [],
        0.0,
        RunOptions(compare_golden=False),
        lines.append,
    )
    assert got == "finalized", lines
    assert any("after the final checkpoint: the run is complete" in line for line in lines)


# ---- item 9: multi-module recipes get the same field checks -------------------------------------
MULTIMODULE = REPO_ROOT / "recipes" / "multimodule_encoder_llm_mhc_pp2.yaml"


@pytest.mark.parametrize(
    "override,where",
    [
        ("model.hidden_dropout=1.5", "model.hidden_dropout: is a probability"),
        ("model.hidden_dropout=017", "model.hidden_dropout: is a probability"),  # YAML octal
        ("model.attention_dropout=-0.1", "model.attention_dropout: is a probability"),
        ("extra_args.--bogus-flag=1", "extra_args.--bogus-flag: the multi-module entry"),
    ],
)
def test_multimodule_recipes_get_the_field_checks_of_every_recipe(override, where, capsys):
    from megatron_ext.cli import main as cli_main

    assert cli_main(["validate", str(MULTIMODULE), override, "--platform", "cpu"]) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and where in out[0], out


def test_the_multimodule_recipe_itself_still_validates(capsys):
    from megatron_ext.cli import main as cli_main

    assert cli_main(["validate", str(MULTIMODULE), "--platform", "cpu"]) == 0


# ---- item 10: whitespace in the run or working directory never becomes an #SBATCH option ------
@pytest.mark.parametrize("name", ["a --wrap=x", "my runs", "q'uote", 'd"q'])
def test_a_run_directory_with_whitespace_never_reaches_an_sbatch_header(
    tmp_path, name, monkeypatch
):
    from megatron_ext.launch import shell, slurm
    from megatron_ext.runs.submit import SlurmOptions, build_job

    loaded = load(BASE, "cpu", BASE_OVERRIDES)
    run_dir = tmp_path / name / "R"
    job, problems = build_job(
        prepare(loaded, megatron_checks=False, check_pickles=False), run_dir, SlurmOptions(nodes=1)
    )
    assert job is None and len(problems) == 1 and "run directory" in problems[0]
    assert "#SBATCH" in problems[0] and "\n" not in problems[0]
    good, problems = build_job(
        prepare(loaded, megatron_checks=False, check_pickles=False),
        tmp_path / "R",
        SlurmOptions(nodes=1),
    )
    assert problems == [] and "#SBATCH --output=" in slurm.sbatch_script(good)
    good.run_dir = run_dir  # the script itself never holds a split header either
    with pytest.raises(shell.UnsafeValueError, match="run directory"):
        slurm.sbatch_script(good)
    (tmp_path / name).mkdir()
    monkeypatch.chdir(tmp_path / name)  # the working directory becomes --chdir
    _, problems = build_job(
        prepare(loaded, megatron_checks=False, check_pickles=False),
        tmp_path / "R2",
        SlurmOptions(nodes=1),
    )
    assert len(problems) == 1 and "working directory" in problems[0]


# ---- item 15: a full disk keeps the previous summary and says so in words ---------------------
def test_a_full_disk_leaves_the_previous_summary_whole_and_names_the_cause(
    tmp_path, monkeypatch, capsys
):
    import errno

    loaded = load(BASE, "cpu", BASE_OVERRIDES)
    run_dir = tmp_path / "R"
    runner.write_run_files(prepare(loaded, megatron_checks=False, check_pickles=False), run_dir)
    verdict.write_summary(
        prepare(loaded, megatron_checks=False, check_pickles=False), run_dir, "stopped", [], [], 1.0
    )
    before = (run_dir / "summary.json").read_text()
    real_write_text = Path.write_text

    def full_disk(self, text, *args, **kwargs):  # opened (truncated), then ENOSPC on write
        real_write_text(self, "")
        raise OSError(errno.ENOSPC, "")  # the kernel's errno, no message of its own

    monkeypatch.setattr(Path, "write_text", full_disk)
    verdict.write_summary(
        prepare(loaded, megatron_checks=False, check_pickles=False), run_dir, "passed", [], [], 2.0
    )
    monkeypatch.undo()
    assert (run_dir / "summary.json").read_text() == before
    assert sorted(p.name for p in run_dir.iterdir() if p.name.startswith(".summary")) == []
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "No space left on device" in err, err


# ---- item 13: one corrupt run directory never breaks `runs` / `runs show` ---------------------
def _listed_run(root: Path, name: str, iterations="10", summary=None, metrics=None) -> None:
    run_dir = root / name
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "recipe.yaml").write_text(f"training: {{iterations: {iterations}}}\n")
    rsm.write_run_record(run_dir, {"recipe": "r.yaml", "platform": "cpu", "resumable": True})
    if summary is not None:
        (run_dir / "summary.json").write_text(summary)
    if metrics is not None:
        (run_dir / "metrics.json").write_text(metrics)
    line = " iteration        1/      10 | lm loss: 4.000000E+00 |\n"
    (run_dir / "logs" / "rank-0.log").write_text(line)


def test_runs_lists_every_run_beside_corrupt_ones_and_prints_no_escapes(tmp_path, capsys):
    from megatron_ext.cli import main as cli_main

    huge = '{"lm loss": {"start_step": 1, "end_step": 1, "step_interval": 1, "values": {"1": '
    _listed_run(tmp_path, "good", summary=json.dumps({"status": "passed"}))
    _listed_run(tmp_path, "inf-iterations", iterations=".inf")
    _listed_run(tmp_path, "deep-json", summary="[" * 100_000 + "]" * 100_000)
    _listed_run(
        tmp_path, "huge-metric", summary='{"status": "passed"}', metrics=huge + "9" * 400 + "}}}"
    )
    _listed_run(
        tmp_path,
        "ansi",
        summary=json.dumps(
            {"status": "\x1b[31mpassed\x1b]0;x\x07", "phases": "no", "reports": [{"title": "\x1b"}]}
        ),
    )
    assert cli_main(["runs", "--runs-root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\\x1b[31mpassed" in out
    listed = [line.split()[0] for line in out.splitlines()[1:]]
    assert sorted(listed) == ["ansi", "deep-json", "good", "huge-metric", "inf-iterations"]
    for name in listed:
        assert cli_main(["runs", "show", str(tmp_path / name)]) == 0
        assert "\x1b" not in capsys.readouterr().out


# ---- item 14: compare never passes on a missing metric or on inf --------------------------------
def _golden(path: Path, values: dict, name: str = "lm loss") -> Path:
    steps = sorted(int(s) for s in values)
    block = {"start_step": steps[0], "end_step": steps[-1], "step_interval": 1}
    path.write_text(json.dumps({name: {**block, "values": values}}).replace('"inf"', "Infinity"))
    return path


def test_compare_fails_a_missing_metric_and_inf_and_reads_a_huge_golden_in_one_line(
    tmp_path, capsys
):
    from megatron_ext.cli import main as cli_main

    golden = _golden(tmp_path / "golden.json", {"1": 4.0, "2": 3.5})
    no_loss = _golden(tmp_path / "run.json", {"1": 5, "2": 6}, name="num-zeros")
    assert cli_main(["compare", str(no_loss), str(golden)]) == 1
    assert "lm loss         missing" in capsys.readouterr().out
    infinite = _golden(tmp_path / "inf.json", {"1": "inf", "2": "inf"})
    assert cli_main(["compare", str(infinite), str(infinite)]) == 1
    assert "PASSED" not in capsys.readouterr().out
    huge = tmp_path / "huge.json"
    huge.write_text('{"lm loss": {"values": {"1": 1' + "0" * 400 + "}}}")
    assert cli_main(["compare", str(golden), str(huge)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "huge.json is not golden-value JSON" in err


# ---- item 17: nonsense refused in one line -----------------------------------------------------
@pytest.mark.parametrize(
    "args,expected",
    [
        (["--hidden", "-64", "--seq", "4", "--micro-batch-size", "1"], "--hidden -64"),
        (["--dtype-bytes", "-2"], "--dtype-bytes -2"),
        (["--mhc-streams", "0"], "--mhc-streams 0"),
        (["--mhc-streams", "-4"], "--mhc-streams -4"),
        (["--schedule", "zb-h1", "--pp", "1"], "--schedule zb-h1 --pp 1"),
    ],
)
def test_schedule_refuses_nonsense_sizes_in_one_line(args, expected, capsys):
    from megatron_ext.cli import main as cli_main

    base = ["schedule", "--microbatches", "4"] + ([] if "--pp" in args else ["--pp", "2"])
    assert cli_main([*base, *args]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and expected in captured.err and not captured.out


def test_validate_and_import_refuse_nonsense_numbers_in_one_line(tmp_path, capsys):
    import yaml

    from megatron_ext.cli import main as cli_main

    huge = "model.hidden_size=" + "9" * 5000
    assert cli_main(["validate", str(BASE), huge, "--platform", "cpu"]) == 2
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "model.hidden_size=999" in out and "Traceback" not in out
    recompute = REPO_ROOT / "recipes" / "gpt_mhc_tp2_pp2_sp.yaml"
    big = f"model.mhc.recompute_layer_num={2**63}"
    assert cli_main(["validate", str(recompute), big, "--platform", "cpu"]) == 2
    assert "model.mhc.recompute_layer_num" in capsys.readouterr().out
    source = REPO_ROOT / "tests/functional_tests/test_cases/gpt/gpt3_mcore_tp2_pp2_cpu"
    doc = yaml.safe_load((source / "model_config.yaml").read_text())
    doc["MODEL_ARGS"]["--pipeline-model-parallel-size"] = -2
    case = tmp_path / "gpt" / "case"
    case.mkdir(parents=True)
    (case / "model_config.yaml").write_text(yaml.safe_dump(doc))
    assert cli_main(["import", str(case)]) == 2
    captured = capsys.readouterr()
    assert "world size -4" not in captured.out + captured.err
    assert "parallelism.pp: -2 is not a parallel size" in captured.err


# ---- item 16: messages -----------------------------------------------------------------------
def test_a_sigterm_before_the_ranks_start_is_reported_and_summarised(tmp_path, monkeypatch):
    import os
    import signal

    from megatron_ext.launch import local

    def unhandled(signum, frame):  # main let SIGTERM kill the process: exit 143, no word
        raise AssertionError("SIGTERM reached the default handler")

    def stop_now(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's stop, before any rank starts
        return None

    monkeypatch.setattr(local, "LocalJob", stop_now)
    monkeypatch.setattr(local, "launch", lambda *a, **k: pytest.fail("a rank was started"))
    previous = signal.signal(signal.SIGTERM, unhandled)
    lines: list[str] = []
    try:
        loaded = load(BASE, "cpu", BASE_OVERRIDES)
        with pytest.raises(KeyboardInterrupt) as stopped:
            runner.run(
                prepare(loaded, megatron_checks=False),
                RunOptions(run_dir=tmp_path / "R", megatron_checks=False),
                echo=lines.append,
            )
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert getattr(stopped.value, "signum", None) == signal.SIGTERM
    assert json.loads((tmp_path / "R" / "summary.json").read_text())["status"] == "interrupted"
    assert any("stopped by SIGTERM" in line for line in lines)


# ---- item 12: prepare-data ends in one line on hostile input ------------------------------------
def _prepare_data(tmp_path: Path, lines: list[str], *extra, vocab: str = "128", workers="1"):
    from megatron_ext.cli import main as cli_main

    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text("\n".join(lines) + "\n")
    args = ["prepare-data", "--input", str(jsonl), "--tokenizer-type", "NullTokenizer"]
    args += ["--vocab-size", vocab, "--workers", workers]
    if "--output-prefix" not in extra:
        args += ["--output-prefix", str(tmp_path / "out" / "data")]
    return cli_main([*args, *map(str, extra)])


@pytest.mark.parametrize(
    "lines,extra,expected",
    [
        (['{"text": ' + "[" * 100_000 + "]" * 100_000 + "}"], {}, "nested too deeply"),
        (['{"text": "1", "n": ' + "7" * 100_000 + "}"], {}, "not readable JSON"),
        (['{"text": "5 70000"}'], {"vocab": "128"}, "token id 70000 is outside"),
        (['{"text": "1"}'], {"vocab": "0"}, "--vocab-size 0"),
        (['{"text": "1"}'], {"vocab": "-5"}, "--vocab-size -5"),
        (['{"text": "1"}'], {"workers": "1000"}, "--workers 1000"),
        (['{"../../x": "1"}'], {"extra": ["--json-keys", "../../x"]}, "--json-keys '../../x'"),
    ],
)
def test_prepare_data_refuses_hostile_input_in_one_line(tmp_path, capsys, lines, extra, expected):
    options = {k: v for k, v in extra.items() if k != "extra"}
    rc = _prepare_data(tmp_path, lines, *extra.get("extra", []), **options)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err and expected in err[-1], err[-3:]
    assert "Traceback" not in "\n".join(err)
    assert not (tmp_path / "x").exists() and not (tmp_path.parent / "x").exists()


def test_prepare_data_refuses_a_file_as_output_directory_or_example(tmp_path, capsys):
    from megatron_ext.cli import main as cli_main

    (tmp_path / "FILE").write_text("not a directory")
    rc = _prepare_data(tmp_path, ['{"text": "1"}'], "--output-prefix", tmp_path / "FILE" / "x")
    assert rc == 2 and "is a file, not a directory" in capsys.readouterr().err
    assert cli_main(["prepare-data", "--example", str(tmp_path / "FILE")]) == 2
    assert "--example" in capsys.readouterr().err


def test_prepare_data_bounds_the_line_size(tmp_path, capsys, monkeypatch):
    from megatron_ext.data import input_limits

    monkeypatch.setattr(input_limits, "MAX_LINE_BYTES", 1024)  # stands in for 16 MiB
    rc = _prepare_data(tmp_path, ['{"text": "' + "1 " * 2000 + '"}'])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and "in.jsonl:1: a line of more than" in err[-1], err[-2:]


# ---- issue 40, item 5: a run directory's own entries resolve inside it --------------------------
@pytest.mark.parametrize("entry", ["checkpoints", "logs", "checkpoints/" + rsm.TRACKER])
def test_resume_refuses_a_run_whose_entries_lead_into_another_run(tmp_path, entry, no_training):
    """`R/checkpoints -> OTHER/checkpoints`: the resume used to delete OTHER's cut-short save and
    rewrite its tracker without OTHER's lock. Now refused, OTHER unchanged."""
    other = _stopped_run(tmp_path)  # tracker 3, iteration 4 cut short
    mine = _stopped_run(tmp_path / "mine")
    link = mine / entry
    (link.parent).mkdir(parents=True, exist_ok=True)
    if link.is_dir():
        import shutil

        shutil.rmtree(link)
    else:
        link.unlink(missing_ok=True)
    link.symlink_to(other / entry)
    (other / "logs").mkdir(exist_ok=True)
    before = sorted(p.name for p in rsm.checkpoint_dir(other).iterdir())
    lines: list[str] = []
    outcome = runner.resume_run(
        mine, RunDirRecipes(), RunOptions(megatron_checks=False), echo=lines.append
    )
    assert outcome.exit_code == runner.EXIT_INVALID
    assert len(lines) == 1 and "leads outside the run directory" in lines[0], lines
    assert sorted(p.name for p in rsm.checkpoint_dir(other).iterdir()) == before
    assert (rsm.checkpoint_dir(other) / rsm.TRACKER).read_text() == "3"


def test_a_new_run_refuses_a_linked_checkpoints_directory(tmp_path, no_training):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run_dir = tmp_path / "R"
    run_dir.mkdir()
    (run_dir / "checkpoints").symlink_to(elsewhere)
    with pytest.raises(run_lock.RunDirectoryEscapes, match="checkpoints leads outside"):
        with run_lock.holding(run_dir):
            pass
    (run_dir / "checkpoints").unlink()
    (run_dir / run_lock.LOCK_NAME).unlink()  # the first try's own lock file
    (run_dir / run_lock.LOCK_NAME).symlink_to(elsewhere / "lock")
    with pytest.raises(run_lock.RunDirectoryBusy):
        with run_lock.holding(run_dir):
            pass
    assert not (elsewhere / "lock").exists()
