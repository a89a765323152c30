"""What `megatron-ext run` writes and refuses around the ranks, without starting any: secrets
in every override form, golden-value paths a recipe may not aim elsewhere, a full disk
(issue 25 items 5, 6, 9)."""

from __future__ import annotations

import errno
import json

import pytest

from megatron_ext.launch import shell
from megatron_ext.recipes import golden_paths, load
from megatron_ext.recipes.loader import dump
from megatron_ext.recipes.prepare import prepare
from megatron_ext.runs import runner, verdict
from megatron_ext.runs.options import RunOptions

from recipe_texts import MINIMAL

SECRET_VALUES = ("hf_x", "pw-1", "pat-2", "sk-3")


@pytest.mark.parametrize(
    "override",
    [
        "launch.env={HF_TOKEN: hf_x, MY_DB_PASSWD: pw-1, GH_PAT: pat-2, PLAIN: ok}",
        "launch={env: {HF_TOKEN: hf_x, MY_DB_PASSWD: pw-1, GH_PAT: pat-2, PLAIN: ok}}",
        "launch.env.GH_PAT=pat-2",
        "+launch.env.OPENAI_API_KEY=sk-3",
    ],
)
def test_secrets_in_any_override_form_are_not_written(write_recipe, tmp_path, override):
    loaded = load(write_recipe(MINIMAL), overrides=[override])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    verdict.write_summary(
        prepare(loaded, megatron_checks=False, check_pickles=False), run_dir, "passed", [], [], 1.0
    )
    written = (
        runner.command_script(prepare(loaded, megatron_checks=False, check_pickles=False), run_dir)
        + dump(loaded)
        + (run_dir / "summary.json").read_text()
    )
    assert not [v for v in SECRET_VALUES if v in written], written
    assert shell.REDACTED in written
    if "PLAIN" in override:
        assert "PLAIN: ok" in json.loads((run_dir / "summary.json").read_text())["overrides"][0]


def test_secret_names_are_words_not_substrings_of_path():
    for name in ("MY_DB_PASSWD", "GH_PAT", "DB_PASS", "HTTP_AUTH", "AWS_SECRET_ACCESS_KEY"):
        assert shell.is_secret(name), name
    for name in ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "PWD", "OMP_NUM_THREADS", "PASSES"):
        assert not shell.is_secret(name), name


@pytest.mark.parametrize(
    "golden, expected",
    [
        ("/etc/passwd", "ending in .json"),
        ("golden/{nope}.json", "placeholders {name} and {platform}"),
    ],
)
def test_a_golden_values_path_that_is_not_golden_json_is_refused(write_recipe, golden, expected):
    from megatron_ext.recipes.validate import validate

    loaded = load(write_recipe(MINIMAL + f"test: {{golden_values: '{golden}'}}\n"))
    problems = [str(p) for p in validate(loaded, megatron_checks=False).problems]
    assert any("test.golden_values" in p and expected in p for p in problems), problems


def test_write_golden_never_writes_outside_the_recipe_or_over_another_file(write_recipe, tmp_path):
    victim = tmp_path.parent / f"{tmp_path.name}-victim.json"
    victim.write_text('{"not": "golden"}')
    outside = load(write_recipe(MINIMAL + f"test: {{golden_values: '{victim}'}}\n"))
    assert "outside the recipe's directory" in golden_paths.golden_write_problem(outside)
    mine = tmp_path / "golden.json"
    mine.write_text("root:x:0:0")
    inside = load(write_recipe(MINIMAL + "test: {golden_values: golden.json}\n"))
    assert "not golden-value JSON" in golden_paths.golden_write_problem(inside)
    outcome = runner.run(
        prepare(inside, megatron_checks=False),
        RunOptions(run_dir=tmp_path / "run", write_golden=True, megatron_checks=False),
    )
    assert outcome.exit_code == runner.EXIT_INVALID and not (tmp_path / "run").exists()
    assert mine.read_text() == "root:x:0:0" and victim.read_text() == '{"not": "golden"}'


def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device", "runs/x/summary.json")


def test_a_full_disk_ends_in_one_line_not_a_traceback(write_recipe, tmp_path, monkeypatch, capsys):
    recipe = write_recipe(MINIMAL)
    loaded = load(recipe)
    monkeypatch.setattr(runner.Path, "write_text", _disk_full)
    # before any rank: the run directory's files cannot be written
    outcome = runner.run(
        prepare(loaded, megatron_checks=False),
        RunOptions(run_dir=tmp_path / "run", megatron_checks=False),
        echo=print,
    )
    assert outcome.exit_code == runner.EXIT_INVALID and "No space left" in outcome.message
    # after the ranks: the summary cannot be written, the verdict still comes out
    (tmp_path / "run2").mkdir()
    verdict.write_summary(
        prepare(loaded, megatron_checks=False, check_pickles=False),
        tmp_path / "run2",
        "passed",
        [],
        [],
        1.0,
    )
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "No space left on device" in err and "--run-dir" in err
    # anywhere else in the command: one line, exit status of a failed run
    from megatron_ext import cli

    monkeypatch.setattr(runner, "run", _disk_full)
    status = cli.main(["run", str(recipe), "--skip-megatron-checks"])
    err = capsys.readouterr().err.strip()
    assert status == runner.EXIT_TRAINING_FAILED and err.count("\n") == 0, err
    assert err.startswith("megatron-ext run: cannot write runs/x/summary.json: No space left")


@pytest.mark.parametrize(
    "fault, expected",
    [
        ("rank=1,stp=2", "expected rank=R,step=S"),
        ("rank=x,step=2", "must be integers"),
        ("rank=9,step=1", "rank 9 does not exist in a run of 4 ranks"),
        ("rank=1,step=99", "past the run's 8 iterations"),
    ],
)
def test_a_malformed_fault_is_named_before_any_rank_starts(
    write_recipe, monkeypatch, fault, expected
):
    from megatron_ext.launch import faults

    monkeypatch.setenv(faults.FAULT_ENV, fault)
    loaded = load(write_recipe(MINIMAL))
    why = runner.preflight(prepare(loaded, megatron_checks=False, check_pickles=False), print)
    assert why and expected in why and "\n" not in why, why
    monkeypatch.delenv(faults.FAULT_ENV)
    from_recipe = load(
        write_recipe(MINIMAL + f"launch: {{env: {{{faults.FAULT_ENV}: '{fault}'}}}}\n")
    )
    assert expected in runner.preflight(
        prepare(from_recipe, megatron_checks=False, check_pickles=False), print
    )


def test_a_run_directory_in_use_is_refused_before_anything_is_written(write_recipe, tmp_path):
    from megatron_ext.runs import lock as run_lock

    loaded = load(write_recipe(MINIMAL))
    run_dir = tmp_path / "shared-run"
    with run_lock.holding(run_dir):  # another run holds it (flock: per open file, not per pid)
        outcome = runner.run(
            prepare(loaded, megatron_checks=False),
            RunOptions(run_dir=run_dir, megatron_checks=False),
            echo=print,
        )
        assert outcome.exit_code == runner.EXIT_INVALID, outcome
        assert "in use by another megatron-ext run" in outcome.message
        assert sorted(p.name for p in run_dir.iterdir()) == [run_lock.LOCK_NAME]
    with run_lock.holding(run_dir):  # released when the holder ends
        pass
