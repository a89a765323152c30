"""Checkpoints that travel (issue 31), on real checkpoints saved by tiny runs (mHC GPT, PP=2,
dropout 0):

- ``convert-checkpoint`` turns a torch_dist checkpoint into upstream-named torch_dist and back
  exactly (every tensor and object), and the converted checkpoint loads: a run started from it
  with ``checkpoint.load`` continues with the source run's losses, bit for bit;
- ``checkpoint.finetune`` starts at iteration 0 from the loaded weights: its first loss equals
  the source run's loss on the same batch through the same weights;
- soak (MEGATRON_EXT_SOAK=1): ``checkpoint.load_optim: false`` continues the iteration with a
  fresh optimizer; ``run --resume RUN parallelism.tp=1 parallelism.pp=4`` continues a TP2xPP2+SP
  run with the losses of a same-layout continuation (fp32 tolerance stated below).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
NO_DROPOUT = ["model.hidden_dropout=0", "model.attention_dropout=0", "test.type=regular"]
SMALL = ["recipes/gpt_mhc_tp2_pp2_sp.yaml", "parallelism.tp=1", "parallelism.sp=false"]
SOAK = pytest.mark.skipif(
    os.environ.get("MEGATRON_EXT_SOAK") != "1", reason="soak tier (MEGATRON_EXT_SOAK=1)"
)
# Another TP / PP reassociates fp32 sums (TP splits matmul reductions, gradient all-reduce order
# changes): a few ulps per step, growing with the steps trained after the change.
LAYOUT_RTOL = 1e-4


def _cli(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-m", "megatron_ext.cli", *args],
        cwd=REPO_ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=900,
    )
    return done


def _ok(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return done.stdout


def _losses(run_dir: Path) -> dict[str, float]:
    return json.loads((run_dir / "metrics.json").read_text())["lm loss"]["values"]


def _train(run_dir: Path, *overrides: str, recipe=SMALL) -> dict[str, float]:
    _ok(
        _cli(
            "run",
            *recipe,
            *NO_DROPOUT,
            *overrides,
            "--run-dir",
            str(run_dir),
            "--no-compare",
            "--skip-megatron-checks",
        )
    )
    return _losses(run_dir)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> tuple[Path, dict[str, float]]:
    """4 iterations of the mHC GPT at PP=2, checkpoints at iterations 2 and 4."""
    run_dir = tmp_path_factory.mktemp("travel") / "A"
    losses = _train(run_dir, "training.iterations=4", "checkpoint.save_interval=2")
    return run_dir, losses


def _same(a, b) -> bool:
    """Equal value and type, all the way down (tensors and arrays by dtype and content)."""
    import numpy as np

    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(map(_same, a, b))
    if hasattr(a, "__dict__") and not isinstance(a, type):
        return _same(vars(a), vars(b))
    return bool(a == b)


def test_a_converted_torch_dist_checkpoint_round_trips_exactly_and_continues_the_run(
    source, tmp_path
):
    from megatron_ext.checkpoint import torch_dist

    run_dir, losses = source
    iteration = run_dir / "checkpoints" / "iter_0000002"
    upstream, back = tmp_path / "upstream", tmp_path / "back"
    for what, to, out in ((iteration, "upstream", upstream), (upstream, "megatron-ext", back)):
        _ok(_cli("convert-checkpoint", str(what), str(out), "--model", "gpt", "--to", to))
    original, _ = torch_dist.read(iteration)
    returned, _ = torch_dist.read(back)
    assert original.keys() == returned.keys()
    assert [k for k in original if not _same(original[k], returned[k])] == []
    assert any(k.startswith("optimizer.state.exp_avg.") for k in returned)

    continued = _train(
        tmp_path / "B", "training.iterations=4", f"checkpoint.load={back}"
    )  # iteration and optimizer continue: the source run's own losses
    assert continued == {k: v for k, v in losses.items() if int(k) > 2}, (continued, losses)


def test_finetune_starts_at_iteration_zero_and_its_first_loss_is_the_sources_on_that_batch(
    source, tmp_path
):
    """Fine-tuning from the source's iteration-2 checkpoint with iterations 1 and 2 skipped
    (Megatron's --iterations-to-skip consumes their batches untrained): its first loss, at
    iteration 3, is the forward of the loaded weights on the source's third batch, which is
    exactly the source run's own loss there (logged before its update; dropout 0). The skip
    applies only because the iteration restarted at 0 (a resumed run would start at 2)."""
    run_dir, losses = source
    tuned = _train(
        tmp_path / "C",
        "training.iterations=3",
        f"checkpoint.load={run_dir / 'checkpoints' / 'iter_0000002'}",
        "checkpoint.finetune=true",
        "extra_args.--iterations-to-skip=[1, 2]",
    )
    assert list(tuned) == ["3"], tuned
    assert tuned["3"] == losses["3"], (tuned, losses)  # not the fresh model's: its own weights
    logs = [
        p.read_text(errors="replace") for p in sorted((tmp_path / "C" / "logs").glob("rank-*.log"))
    ]
    assert "successfully loaded checkpoint" in logs[0]
    # the last stage logs the iteration line: 2 x 8 samples consumed untrained
    assert "skipped samples:           16" in logs[-1], logs[-1][-3000:]


@SOAK
def test_load_optim_false_continues_the_iteration_with_a_fresh_optimizer(source, tmp_path):
    run_dir, losses = source
    fresh = _train(
        tmp_path / "D",
        "training.iterations=4",
        f"checkpoint.load={run_dir / 'checkpoints' / 'iter_0000002'}",
        "checkpoint.load_optim=false",
    )
    assert fresh["3"] == losses["3"]  # the same weights on the same batch
    assert fresh["4"] != losses["4"]  # another update: Adam's moments started over


@SOAK
def test_resume_under_another_layout_matches_a_same_layout_continuation(tmp_path):
    recipe = ["recipes/gpt_mhc_tp2_pp2_sp.yaml"]
    first = tmp_path / "tp2pp2"
    _train(first, "training.iterations=4", recipe=recipe)
    same, moved = tmp_path / "same", tmp_path / "moved"
    shutil.copytree(first, same)
    shutil.copytree(first, moved)
    _ok(_cli("run", "--resume", str(same), "training.iterations=8", "--no-compare"))
    out = _ok(
        _cli(
            "run",
            "--resume",
            str(moved),
            "parallelism.tp=1",
            "parallelism.pp=4",
            "parallelism.sp=false",
            "training.iterations=8",
            "--no-compare",
        )
    )
    assert "layout change at iteration 4: tp 2 -> 1, pp 2 -> 4, sp True -> False" in out, out
    expected, got = _losses(same), _losses(moved)
    assert sorted(map(int, got)) == list(range(1, 9))
    for step in map(str, range(5, 9)):
        assert abs(got[step] - expected[step]) <= LAYOUT_RTOL * abs(expected[step]), (step, got)
    record = json.loads((moved / "run.json").read_text())
    assert record["layout_changes"][0]["changed"]["pp"] == [2, 4]
    shown = _ok(_cli("runs", "show", str(moved)))
    assert "layout     changed at iteration 4: tp 2 -> 1, pp 2 -> 4" in shown
