"""``python -m megatron_ext.pretrain_gpt`` trains a PP=2 mHC GPT on CPU end to end.

One pytest process launches torchrun with 2 ranks (one per pipeline stage) and reads
megatron's own log lines. It checks the whole path: the CPU runtime, Megatron's argument
parsing with our defaults, the model provider, mock data, the 1F1B schedule over gloo,
the loss function and the optimizer.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

from megatron_ext.launch import CPU_DEMO_ARGS

REPO_ROOT = Path(__file__).resolve().parents[2]
TRAIN_ITERS = 6
TIMEOUT_S = 240

# megatron's per-iteration line (printed by the last pipeline stage), e.g.
#  "... iteration        6/      10 | consumed samples: ... | lm loss: 4.371172E+00 | ..."
ITERATION_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.]+E[+-]\d+) \|")


def _run_pretrain_gpt(extra_args: list[str]) -> subprocess.CompletedProcess:
    # fmt: off
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone",  # a free rendezvous port, so parallel test runs do not collide
        "--nproc_per_node", "2",
        "-m", "megatron_ext.pretrain_gpt",
        *CPU_DEMO_ARGS,
        *extra_args,
    ]
    # fmt: on
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",  # the CPU runtime, even on a machine with a GPU
        "OMP_NUM_THREADS": "1",  # two ranks on two cores
    }
    return subprocess.run(
        command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )


def _lm_loss_by_iteration(log: str) -> dict[int, float]:
    return {int(it): float(loss) for it, loss in ITERATION_LINE.findall(log)}


def test_mhc_pp2_vpp2_with_recompute_trains_through_megatron_training_loop():
    """mHC under the interleaved schedule, driven by megatron.training.pretrain with upstream's
    flag spellings: 4 residual streams, 2 virtual stages per rank, eager 'mhc' recompute.

    The demo's flags (CPU_DEMO_ARGS) plus mHC: the plain PP=2 GPT path through this entry is what
    every GPT recipe runs (tests/functional_tests/test_recipes.py), against golden values."""
    # fmt: off
    result = _run_pretrain_gpt(
        [
            "--train-iters", str(TRAIN_ITERS), "--eval-interval", "3",
            "--enable-mhc-connections", "--mhc-num-residual-streams", "4",
            "--num-layers-per-virtual-pipeline-stage", "1",
            "--recompute-granularity", "selective", "--recompute-modules", "mhc",
            "--mhc-recompute-layer-num", "1",
        ]
    )
    # fmt: on
    log = result.stdout + result.stderr
    assert result.returncode == 0, f"torchrun exited with {result.returncode}:\n{log[-6000:]}"
    assert re.search(r"enable_mhc_connections \.+ True", log), (
        "the mHC flag did not reach Megatron's args"
    )
    losses = _lm_loss_by_iteration(log)
    assert sorted(losses) == list(range(1, TRAIN_ITERS + 1)), (
        f"expected an lm loss line for each of iterations 1..{TRAIN_ITERS}, got {sorted(losses)}"
    )
    # The untrained model is nearly uniform over the 128-token vocabulary.
    assert abs(losses[1] - math.log(128)) < 0.1, losses
    # Compare first and last only: megatron logs the mean of iterations 1 and 2 on the
    # second line (it does not reset its accumulators after the first logged iteration).
    assert losses[TRAIN_ITERS] < losses[1], losses
    assert "validation loss at iteration 3" in log
