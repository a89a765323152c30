"""``python -m megatron_ext.pretrain_hybrid`` trains a pipelined Hybrid mHC model on CPU end to
end through ``megatron.training.pretrain`` (2 ranks launched by torchrun from this process):
pipeline segments and virtual stages from the pattern, an empty intermediate chunk, MoE,
an MTP depth on the last chunk and eager 'mhc' recompute.

Soak only (MEGATRON_EXT_SOAK=1): CI trains the same features through `megatron-ext run
recipes/hybrid_mhc_tp1_pp2_vpp2_empty_mtp.yaml` (tests/functional_tests/test_recipes.py), which
runs this entry with pattern "*E|*-||/*-" (VPP2, an empty intermediate chunk, an MoE layer with
all-to-all dispatch, an empty last chunk with MTP), one-group mHC recompute and evaluation at
iteration 3, against golden values and an exact ckpt-resume: one 2-rank training less in CI.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext.launch import CPU_DEMO_ARGS
from megatron_ext.testing import timing

REPO_ROOT = Path(__file__).resolve().parents[4]
TRAIN_ITERS = 6
TIMEOUT_S = 300
ITERATION_LINE = re.compile(
    r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.]+E[+-]\d+) \|.*?mtp_1 loss: ([0-9.]+E[+-]\d+)"
)


@pytest.mark.skipif(
    os.environ.get("MEGATRON_EXT_SOAK") != "1",
    reason="soak only: CI trains these features in the hybrid_mhc_tp1_pp2_vpp2_empty_mtp recipe",
)
def test_pp2_vpp2_hybrid_mhc_with_moe_mtp_and_recompute_trains_on_cpu():
    # fmt: off
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "megatron_ext.pretrain_hybrid", *CPU_DEMO_ARGS,
        "--train-iters", str(TRAIN_ITERS), "--eval-interval", "3",
        # 4 segments on 2 ranks: 2 virtual stages each; rank 1's first chunk is empty.
        "--hybrid-layer-pattern", "*-||*E|*-/*-",
        "--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear",
        "--moe-token-dispatcher-type", "alltoall", "--position-embedding-type", "rope",
        "--enable-mhc-connections", "--mhc-num-residual-streams", "4",
        "--recompute-granularity", "selective", "--recompute-modules", "mhc",
        "--mhc-recompute-layer-num", "1",
    ]
    # fmt: on
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        command,
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timing.bound(TIMEOUT_S),
    )
    log = result.stdout + result.stderr
    assert result.returncode == 0, f"torchrun exited with {result.returncode}:\n{log[-6000:]}"
    assert re.search(r"virtual_pipeline_model_parallel_size \.+ 2", log), "no virtual stages"
    assert "mtp.layers.0.h_proj.weight" in log and "decoder.hc_head_fn" in log
    found = {int(it): (float(lm), float(mtp)) for it, lm, mtp in ITERATION_LINE.findall(log)}
    assert sorted(found) == list(range(1, TRAIN_ITERS + 1)), sorted(found)
    # The untrained model is nearly uniform over the 128-token vocabulary.
    assert abs(found[1][0] - math.log(128)) < 0.1 and abs(found[1][1] - math.log(128)) < 0.1, found
    assert found[TRAIN_ITERS][0] < found[1][0] and found[TRAIN_ITERS][1] < found[1][1], found
    assert "validation loss at iteration 3" in log
