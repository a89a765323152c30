"""A run whose loss or gradients go NaN is named by the NaN and leaves no checkpoint of it
(issue 40 item 13).

Megatron's default ``--rerun-mode validate_results`` meets a NaN by rerunning the step, saving a
checkpoint of the NaN state and exiting with 16, which the launcher reported as ``rank 1 exited
with 16 (no error reported in its log)``. megatron-ext's entries default to ``disabled``: the NaN
raises at once (no checkpoint) and the failure marker names it. A run that asks for
``validate_results`` itself is still named by the NaN megatron logged before exiting.

Megatron's own RerunStateMachine writes every message tested here, not a copy of its text."""

from __future__ import annotations

import argparse
import io
import logging
import sys

import pytest
import torch

from megatron.core import rerun_state_machine as rerun

from megatron_ext.launch import faults, local, training as launch

LOSS_CHECK = "found NaN in local forward loss calculation"  # megatron_ext.training_steps


@pytest.fixture
def no_cuda_device(monkeypatch):
    # megatron's messages name torch.cuda.current_device(); this machine may have none
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def _parsed_rerun_mode(monkeypatch, argv: list[str]) -> str:
    from megatron.training import arguments as megatron_arguments

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
    provide = launch._with_parser_defaults([], launch.run_defaults())
    args: argparse.Namespace = megatron_arguments.parse_args(provide)
    return args.rerun_mode


def test_entries_stop_on_a_nan_without_megatrons_checkpoint_of_it(monkeypatch, no_cuda_device):
    mode = _parsed_rerun_mode(monkeypatch, [])
    assert mode == "disabled"
    machine = rerun.RerunStateMachine(mode=rerun.RerunMode(mode))
    # megatron's train_step saves only when this says so; disabled never does
    assert machine.should_checkpoint_and_exit() == (False, False, 0)
    machine.state = rerun.RerunState.INITIAL_RUN
    with pytest.raises(RuntimeError) as raised:  # ends the rank at once: no rerun, no save
        machine.validate_result(
            torch.tensor(float("nan")), torch.isnan, message=LOSS_CHECK, fatal=True
        )
    line = faults.describe_error(raised.value)
    assert line.startswith("RuntimeError: NaN in training"), line
    assert LOSS_CHECK in line and "training.lr" in line, line


def test_an_explicit_rerun_mode_still_wins(monkeypatch):
    assert _parsed_rerun_mode(monkeypatch, ["--rerun-mode", "validate_results"]) == (
        "validate_results"
    )


def _megatron_log_of_a_nan(monkeypatch, value: float) -> str:
    """What megatron's validate_results mode logs on a rejected loss, before exit 16."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    rerun.logger.addHandler(handler)
    try:
        machine = rerun.RerunStateMachine(mode=rerun.RerunMode.VALIDATE_RESULTS)
        machine.state = rerun.RerunState.INITIAL_RUN
        machine.first_iteration_complete = True  # megatron checks from the second step on
        machine.current_iteration = 4  # megatron names the step counting from 1: #5
        check = torch.isnan if value != value else torch.isinf
        machine.validate_result(torch.tensor(value), check, message=LOSS_CHECK, fatal=True)
    finally:
        rerun.logger.removeHandler(handler)
    return stream.getvalue()


@pytest.mark.parametrize("value, what", [(float("nan"), "NaN"), (float("inf"), "Inf")])
def test_megatrons_exit_16_is_named_by_the_nan_it_logged(tmp_path, monkeypatch, value, what):
    logged = _megatron_log_of_a_nan(monkeypatch, value)
    assert logged.strip(), "megatron logged nothing: the test would pass on any summary"
    job = local.LocalJob(module="m", args=[], nproc=2, log_dir=tmp_path)
    (tmp_path / "rank-0.log").write_text(" iteration        1/      10 | lm loss: 1.0E+01\n")
    (tmp_path / "rank-1.log").write_text(
        " iteration        1/      10 | lm loss: 1.0E+01\n" + logged + "Saving a checkpoint\n"
    )
    result = local.LaunchResult(
        returncode=16, failed_rank=1, seconds=1.0, rank_codes={0: 16, 1: 16}
    )
    summary = local.failure_summary(job, result)
    assert summary.startswith(f"rank 1 exited with 16 ({what} in training at iteration 5 "), summary
    assert LOSS_CHECK in summary and "training.lr" in summary and "\n" not in summary, summary


def test_a_log_without_a_nan_is_not_named_by_one(tmp_path):
    job = local.LocalJob(module="m", args=[], nproc=2, log_dir=tmp_path)
    (tmp_path / "rank-0.log").write_text("ok\n")
    # a finite rejected result (a spiky loss) is no NaN
    (tmp_path / "rank-1.log").write_text(
        "Unexpected result 93.5 on rank 1 at iteration #4 invocation #1 (message='Spiky loss')\n"
    )
    result = local.LaunchResult(returncode=16, failed_rank=1, seconds=1.0, rank_codes={0: 0, 1: 16})
    assert local.failure_summary(job, result) == (
        "rank 1 exited with 16 (no error reported in its log)"
    )
