"""Malformed input to compare and schedule ends in one line naming the argument and the fix,
exit 1 or 2, never a traceback, a false PASSED or minutes of work (issue 25 items 10, 11, 13).
The commands run in-process through ``megatron_ext.cli.main``."""

from __future__ import annotations

import json
import time

import pytest

from megatron_ext import cli

GOLDEN = {
    "lm loss": {"start_step": 1, "end_step": 2, "step_interval": 1, "values": {"1": 5.0, "2": 4.0}}
}


def _cli(capsys, *argv):
    try:
        status = cli.main(list(argv))
    except SystemExit as exc:  # argparse's usage errors
        status = exc.code
    out = capsys.readouterr()
    return status, out.out, out.err


def _one_line_error(err: str, *words: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and "Traceback" not in err, err
    assert all(word in lines[-1] for word in words), err


@pytest.fixture
def golden(tmp_path):
    path = tmp_path / "golden.json"
    path.write_text(json.dumps(GOLDEN))
    return path


def test_compare_with_nothing_to_compare_does_not_pass(capsys, tmp_path, golden):
    status, out, err = _cli(capsys, "compare", str(golden), str(golden), "--metrics", "bogus")
    assert status == 2 and "PASSED" not in out
    _one_line_error(err, "'bogus'", "lm loss")
    # a metric both sides hold but no rule checks (Megatron's rules leave it unchecked)
    other = {"mem": GOLDEN["lm loss"]}
    (tmp_path / "m.json").write_text(json.dumps(other))
    status, out, err = _cli(capsys, "compare", str(tmp_path / "m.json"), str(tmp_path / "m.json"))
    assert status == 1 and "PASSED" not in out
    _one_line_error(err, "nothing was compared", "--metrics")
    status, out, _ = _cli(capsys, "compare", str(golden), str(golden))
    assert status == 0 and "PASSED" in out  # the same file against itself still passes


@pytest.mark.parametrize("rtol", ["-1", "nan", "inf", "x"])
def test_compare_refuses_a_tolerance_that_is_not_a_finite_nonnegative_number(capsys, golden, rtol):
    status, _, err = _cli(capsys, "compare", str(golden), str(golden), f"--rtol={rtol}")
    assert status == 2
    _one_line_error(err, "--rtol", rtol)


def test_compare_names_a_json_that_nests_too_deeply(capsys, tmp_path, golden):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    status, _, err = _cli(capsys, "compare", str(golden), str(deep))
    assert status == 2
    _one_line_error(err, "deep.json", "nests too deeply")


def test_schedule_refuses_sizes_it_cannot_draw_quickly(capsys):
    start = time.monotonic()
    status, _, err = _cli(capsys, "schedule", "--pp", "10000", "--microbatches", "10000000")
    assert status == 2 and time.monotonic() - start < 5
    _one_line_error(err, "--microbatches", "fewer micro-batches")
    status, out, _ = _cli(capsys, "schedule", "--pp", "4", "--microbatches", "1000")
    assert status == 0 and "bubble" in out and time.monotonic() - start < 60


@pytest.mark.parametrize("plot", ["/nonexistent/x.png", "{tmp}", "{tmp}/x.txt"])
def test_schedule_checks_the_plot_path_before_any_work(capsys, tmp_path, plot):
    path = plot.format(tmp=tmp_path)
    status, _, err = _cli(capsys, "schedule", "--pp", "2", "--microbatches", "4", "--plot", path)
    assert status == 2
    _one_line_error(err, "--plot", path)
