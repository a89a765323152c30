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


VALIDATION_LINES = [
    " validation loss at iteration 4 | lm loss value: 5.000000E+00 | lm loss PPL: 1.4E+02 |",
    " iteration        4/       4 | lm loss: 5.100000E+00 |",
    " validation loss at iteration 4 on validation set | lm loss value: 5.200000E+00 |",
    " validation loss at iteration 4 on test set | lm loss value: 5.300000E+00 |",
]


def test_the_test_loss_is_its_own_metric():
    """Item 4: the test loss was only a console line; TensorBoard holds it under
    "lm loss validation" beside the in-loop and final validation of the same step."""
    from megatron_ext.runs import metrics as met

    logged = met.parse_lines(VALIDATION_LINES)
    assert logged["lm loss validation"] == {4: 5.0} and logged["lm loss test"] == {4: 5.3}
    assert met.with_validation(["lm loss"], logged) == [
        "lm loss",
        "lm loss validation",
        "lm loss test",
    ]
    tensorboard = {"lm loss": {4: 5.1}, "lm loss validation": {4: 5.0}}
    joined = met.with_test_loss_from_logs(tensorboard, logged)
    assert joined["lm loss validation"] == {4: 5.0} and joined["lm loss test"] == {4: 5.3}
    # a run that validated never: TensorBoard's only point at that step is the test loss
    only_test = met.parse_lines(VALIDATION_LINES[1:2] + VALIDATION_LINES[3:])
    joined = met.with_test_loss_from_logs({"lm loss validation": {4: 5.3}}, only_test)
    assert "lm loss validation" not in joined and joined["lm loss test"] == {4: 5.3}
    assert met.final_losses(logged)["lm loss test"] == {"step": 4, "value": 5.3}


def test_runs_show_names_the_validation_and_test_losses(tmp_path):
    from megatron_ext.runs import listing

    summary = {
        "status": "passed",
        "losses": {"lm loss test": {"step": 4, "value": 5.3}, "lm loss validation": "junk"},
    }
    assert listing.evaluation_lines(summary) == ["test loss  5.300000 (step 4, 'lm loss test')"]


def test_compare_plots_say_dotted_resumed_only_for_a_resumed_run():
    """Item 7 (part): "(dotted: resumed)" was in the title of runs never resumed."""
    from megatron_ext.runs.side_by_side import RunCurves, plot_title

    fresh, other = RunCurves("a", {}, []), RunCurves("b", {}, [])
    assert plot_title(fresh, other) == "a vs b"
    assert plot_title(fresh, RunCurves("b", {}, [4])) == "a vs b (dotted: resumed)"
