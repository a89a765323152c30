"""Issue 41: the path a new user walks with their own corpus. Unit-level checks of what a run
remembers and reports; the walk itself (README, prepare-data, run) is
tests/functional_tests/test_own_data.py. No rank is started here."""

from __future__ import annotations

import json

import pytest

from megatron_ext.recipes import load
from megatron_ext.recipes.prepare import RunDirRecipes, prepare
from megatron_ext.runs import options as run_options, resume as rsm, runner
from megatron_ext.runs.options import RunOptions

from recipe_texts import REPO_ROOT

BASE = REPO_ROOT / "recipes" / "gpt_tp2_pp2.yaml"
OVERRIDES = ["parallelism.tp=1", "training.iterations=8"]


def _stopped(tmp_path, options: RunOptions):
    run_dir = tmp_path / "R"
    request = prepare(load(BASE, "cpu", OVERRIDES), megatron_checks=False, check_pickles=False)
    runner.write_run_files(request, run_dir, options=options)
    (run_dir / "summary.json").write_text(json.dumps({"status": "stopped"}))
    rsm.checkpoint_dir(run_dir).mkdir(parents=True)
    return run_dir


@pytest.mark.parametrize(
    ("started", "resumed", "compares"),
    [
        (RunOptions(compare_golden=False), RunOptions(), False),  # kept
        (RunOptions(compare_golden=False), RunOptions(force_compare=True), True),  # --compare
        (RunOptions(), RunOptions(compare_golden=False), False),  # --no-compare on resume
        (RunOptions(), RunOptions(), True),
    ],
)
def test_the_options_a_run_started_with_survive_its_resume(
    tmp_path, monkeypatch, started, resumed, compares
):
    """Item 3: ``run --no-compare``, stopped, then ``run --resume`` compared again (FAILED)."""
    run_dir = _stopped(tmp_path, started)
    record = json.loads((run_dir / rsm.RUN_FILE).read_text())
    assert record["options"]["compare_golden"] is started.compare_golden
    seen = []
    monkeypatch.setattr(runner, "_run_phases", lambda *a, **k: seen.append(a[4]) or "trained")
    resumed = RunOptions(**{**resumed.__dict__, "megatron_checks": False})
    assert runner.resume_run(run_dir, RunDirRecipes(), resumed, echo=lambda _: None) == "trained"
    assert seen[0].compare_golden is compares


def test_a_record_without_options_takes_the_command_line():
    given = RunOptions(compare_golden=False, megatron_checks=False)
    assert run_options.for_resume(None, given) == RunOptions(
        compare_golden=False, megatron_checks=False
    )
    assert run_options.for_resume({"compare_golden": "no"}, RunOptions()).compare_golden
