"""A failed resume is named by its real reason and by one rank everywhere (issue 25 item 15):
torch's CheckpointException carries every rank's traceback in one message; the marker line
shows the first failing rank's own error (the size mismatch and its key), and the launcher's
line, the summary and the "first failure" all name the rank that reported first."""

from __future__ import annotations

import io
import traceback

from megatron_ext.launch import faults, local


def _checkpoint_exception():
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        raise RuntimeError(
            "Error(s) in loading state_dict: Size mismatch between saved torch.Size([64]) and "
            "current torch.Size([32]) for key decoder.layers.0.mlp.linear_fc1.weight\\nmore"
        )
    except RuntimeError as exc:
        wrapped = (exc, traceback.extract_tb(exc.__traceback__))  # torch's per-rank pair
    return CheckpointException(
        "CheckpointException ranks:dict_keys([1, 0])", {1: wrapped, 0: wrapped}
    )


def test_a_checkpoint_exception_is_reported_by_its_first_ranks_own_error():
    exc = _checkpoint_exception()
    stream = io.StringIO()
    try:
        raise exc
    except BaseException as raised:  # torch: CheckpointException(BaseException)
        line = faults.report_failure(raised, stream)
    assert "\n" not in line
    error = line.split(" error=", 1)[1]
    assert error.startswith("CheckpointException (checkpoint rank 0): RuntimeError: "), error
    assert "Size mismatch" in error and "decoder.layers.0.mlp.linear_fc1.weight" in error, error
    assert "Traceback" not in error and len(error) <= 600


def test_the_launcher_names_the_rank_that_reported_first(tmp_path):
    """Rank 1 reported the error first; rank 0 exited first (its launcher saw it first)."""
    job = local.LocalJob(module="m", args=[], nproc=2, log_dir=tmp_path)
    tmp_path.mkdir(exist_ok=True)
    for rank, when in ((0, 200.0), (1, 100.0)):
        (tmp_path / f"rank-{rank}.log").write_text(
            f"{faults.MARKER} rank={rank} time={when} where=start-up, x.py:1 in f "
            f"error=RuntimeError: from rank {rank}\n"
        )
    result = local.LaunchResult(returncode=1, failed_rank=0, seconds=1.0, rank_codes={0: 1, 1: 1})
    assert local.failing_rank(job, result) == 1
    assert local.failure_summary(job, result).startswith("rank 1 failed at start-up")


def test_a_rank_that_failed_before_the_marker_is_named_by_its_last_log_line(tmp_path):
    """Megatron's argument check fails before megatron-ext's failure marker exists: the rank's
    last log line is the error, and the summary says so (issue 33, item 7)."""
    job = local.LocalJob(module="m", args=[], nproc=2, log_dir=tmp_path)
    (tmp_path / "rank-0.log").write_text("building...\n")
    (tmp_path / "rank-1.log").write_text(
        "Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
        "AssertionError: FSDP requires CUDA_DEVICE_MAX_CONNECTIONS > 1 or unset.\n\n"
    )
    result = local.LaunchResult(returncode=1, failed_rank=1, seconds=1.0, rank_codes={0: 1, 1: 1})
    summary = local.failure_summary(job, result)
    assert summary.endswith(
        "(its log ends: AssertionError: FSDP requires CUDA_DEVICE_MAX_CONNECTIONS > 1 or unset.)"
    ), summary
    (tmp_path / "rank-1.log").write_text("iteration 3 done\n")
    assert local.failure_summary(job, result).endswith("(no error reported in its log)")


def test_a_ranks_own_refusal_is_named_by_its_last_log_line(tmp_path):
    """A rank refuses with ``SystemExit("error: --load: ...")`` (megatron_ext.launch.training)
    before the failure marker: the summary quotes it, not "no error reported" (issue 34 item 16)."""
    job = local.LocalJob(module="m", args=[], nproc=2, log_dir=tmp_path)
    (tmp_path / "rank-0.log").write_text("building...\n")
    (tmp_path / "rank-1.log").write_text(
        "error: --load: latest_checkpointed_iteration.txt says 99, but iter_0000099 is missing\n"
    )
    result = local.LaunchResult(returncode=1, failed_rank=1, seconds=1.0, rank_codes={0: 1, 1: 1})
    summary = local.failure_summary(job, result)
    assert summary.endswith(
        "(its log ends: error: --load: latest_checkpointed_iteration.txt says 99, but "
        "iter_0000099 is missing)"
    ), summary
