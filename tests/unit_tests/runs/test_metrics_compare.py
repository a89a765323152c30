"""Megatron log lines -> golden-value JSON, and Megatron's comparison rules."""

import json
import math

import pytest

from megatron_ext.runs import golden as cmp, metrics as met

LINE = (
    " [2026-11-30 00:50:45.636798] iteration        6/      10 | consumed samples:           48 |"
    " elapsed time per iteration (ms): 212.7 | learning rate: 1.000000E-03 | global batch size:"
    "     8 | lm loss: 4.371172E+00 | mtp_1 loss: 4.901000E+00 | loss scale: 1.0 | grad norm: 1.556"
    " | num zeros: 3.0 | number of skipped iterations:   0 | number of nan iterations:   0 |"
)


def test_an_iteration_line_becomes_named_metrics():
    step, total, values = met.parse_iteration_line(LINE)
    assert (step, total) == (6, 10)
    assert values == {
        "iteration-time": 0.2127,
        "learning-rate": 1e-3,
        "lm loss": 4.371172,
        "mtp_1 loss": 4.901,
        "grad-norm": 1.556,
        "num-zeros": 3.0,
    }
    assert (
        met.parse_iteration_line(" validation loss at iteration 5 | lm loss value: 4.3E+00 |")
        is None
    )


def test_golden_json_has_megatrons_layout_and_round_trips(tmp_path):
    lines = [LINE.replace("iteration        6/", f"iteration        {i}/") for i in (1, 2, 3)]
    metrics = met.parse_lines(lines)
    path = met.write_golden(tmp_path / "g.json", metrics, ["lm loss", "num-zeros"])
    data = json.loads(path.read_text())
    assert list(data) == ["lm loss", "num-zeros"]
    assert data["lm loss"] == {
        "start_step": 1,
        "end_step": 3,
        "step_interval": 1,
        "values": {"1": 4.371172, "2": 4.371172, "3": 4.371172},
    }
    assert met.read_golden(path)["num-zeros"] == {1: 3.0, 2: 3.0, 3: 3.0}


def test_the_last_rank_log_with_iteration_lines_is_read(tmp_path):
    (tmp_path / "rank-0.log").write_text("nothing here\n")
    (tmp_path / "rank-1.log").write_text(LINE + "\n")
    assert met.parse_run_logs(tmp_path)["lm loss"] == {6: 4.371172}


def _series(values, start=1):
    return {start + i: v for i, v in enumerate(values)}


def test_megatron_rules_exact_and_approximate():
    golden = {"lm loss": _series([4.0, 3.0, 2.0])}
    rules = cmp.rules_for(["lm loss"], "gpu", {})
    assert rules["lm loss"] == cmp.Rule(deterministic=True, rtol=0.05)
    same = cmp.compare({"lm loss": _series([4.0, 3.0, 2.0])}, golden, rules)
    assert same.passed and [r.check for r in same.results] == ["exact", "approximate rtol=0.05"]
    close = cmp.compare({"lm loss": _series([4.0, 3.01, 2.0])}, golden, rules)
    exact, approx = close.results
    assert not exact.passed and exact.failing == [2] and approx.passed
    assert not close.passed, "the exact check fails the comparison"
    assert cmp.compare(
        {"lm loss": _series([4.0, 3.01, 2.0])}, golden, rules, approximate_only=True
    ).passed


def test_megatron_lets_one_step_in_a_hundred_fail_the_approximate_check():
    golden = {"lm loss": _series([1.0] * 10)}
    rule = {"lm loss": cmp.Rule(rtol=0.05)}
    one_off = _series([1.0] * 9 + [2.0])
    assert cmp.compare({"lm loss": one_off}, golden, rule).passed
    two_off = _series([1.0] * 8 + [2.0, 2.0])
    assert not cmp.compare({"lm loss": two_off}, golden, rule).passed
    strict = {"lm loss": cmp.Rule(rtol=0.05, max_failing_steps=0)}
    assert not cmp.compare({"lm loss": one_off}, golden, strict).passed


def test_cpu_rules_are_a_tight_relative_tolerance():
    rules = cmp.rules_for(["lm loss", "num-zeros", "iteration-time", "mtp_1 loss"], "cpu", {})
    assert rules["lm loss"] == cmp.Rule(rtol=1e-4, max_failing_steps=0)
    assert rules["mtp_1 loss"] == rules["lm loss"]
    assert not rules["iteration-time"].checked, "machine speed is recorded, not judged"
    golden = {"lm loss": _series([4.854350, 4.803205])}
    loss_only = {"lm loss": rules["lm loss"]}
    assert cmp.compare({"lm loss": _series([4.854351, 4.803205])}, golden, loss_only).passed
    report = cmp.compare({"lm loss": _series([4.854350, 4.80400])}, golden, loss_only)
    assert not report.passed
    worst = report.results[0].worst
    assert worst.step == 2 and worst.rel_diff == pytest.approx(0.000795 / 4.803205, rel=1e-3)
    assert "worst step 2: 4.804 vs golden 4.803205" in report.lines()[1]


def test_recipe_tolerances_replace_fields_of_the_default():
    rules = cmp.rules_for(["lm loss"], "cpu", {"lm loss": {"rtol": 1e-2}})
    assert rules["lm loss"] == cmp.Rule(rtol=1e-2, max_failing_steps=0)


def test_iteration_time_compares_the_median_of_the_steady_window():
    golden = {"iteration-time": _series([9.0] * 4 + [0.20] * 6)}
    actual = {"iteration-time": _series([1.0] * 4 + [0.205, 0.2, 0.21, 0.2, 5.0, 0.2])}
    report = cmp.compare(actual, golden, {"iteration-time": cmp.Rule(rtol=0.05)})
    assert report.passed, report.lines()
    assert "median of steps 5-10" in report.lines()[1]


def test_missing_metrics_fail_with_a_reason():
    report = cmp.compare(
        {"lm loss": {1: 1.0}},
        {"num-zeros": {1: 0.0}},
        {"lm loss": cmp.Rule(rtol=0.1), "num-zeros": cmp.Rule(rtol=0.1)},
    )
    assert not report.passed
    assert [r.detail for r in report.results] == [
        "not in the golden values (regenerate them)",
        "not logged by this run",
    ]
    short = cmp.compare(
        {"lm loss": {1: 1.0}},
        {"lm loss": {1: 1.0, 2: 1.0}},
        {"lm loss": cmp.Rule(rtol=0.1, max_failing_steps=0)},
    )
    assert not short.passed and short.results[0].failing == [2], "a step the run did not log fails"


def test_steps_the_run_never_logged_are_named_not_printed_as_inf():
    """Issue 41, item 2: a golden step the run did not log read ``worst step 2: inf vs golden``."""
    golden = {"lm loss": {1: 7.0, 2: 6.775013, 3: 6.5}}
    for rule in (cmp.Rule(rtol=1e-4, max_failing_steps=0), cmp.Rule(deterministic=True)):
        report = cmp.compare({"lm loss": {1: 7.0, 3: 6.6}}, golden, {"lm loss": rule})
        text = "\n".join(report.lines())
        assert not report.passed and "inf" not in text, text
        assert "worst step 3" in text and "1 golden step(s) not logged by the run: 2" in text


def test_nan_never_matches():
    report = cmp.compare(
        {"lm loss": {1: math.nan}}, {"lm loss": {1: math.nan}}, {"lm loss": cmp.Rule(rtol=0.1)}
    )
    assert not report.passed


def test_resume_is_exact_except_megatrons_two_iteration_mean():
    continuous = {
        "lm loss": _series([5.0, 4.8, 4.6, 4.4, 4.2, 4.0]),
        "num-zeros": _series([1, 2, 3, 4, 5, 6]),
    }
    # A resumed process prints its second line as the mean of its first two iterations.
    resumed = {"lm loss": {4: 4.4, 5: 4.3, 6: 4.0}, "num-zeros": {4: 4, 5: 5, 6: 6}}
    report = cmp.compare_resume(continuous, resumed, 3, ["lm loss", "num-zeros", "iteration-time"])
    assert report.passed, report.lines()
    resumed["lm loss"][6] = 4.0000001
    report = cmp.compare_resume(continuous, resumed, 3, ["lm loss"])
    assert not report.passed and report.results[0].failing == [6]
    assert "vs uninterrupted" in report.lines()[1]


def test_report_serialises_for_summary_json():
    report = cmp.compare(
        {"lm loss": {1: 1.0}}, {"lm loss": {1: 1.0}}, {"lm loss": cmp.Rule(rtol=0.1)}
    )
    data = json.loads(json.dumps(report.to_dict()))
    assert data["passed"] and data["results"][0]["worst"]["rel_diff"] == 0.0
