"""The multimodule training entry and its recipe: argument handling, validation without
processes, and a 4-rank CPU run of recipes/multimodule_encoder_llm_mhc_pp2.yaml whose lm loss
must match the golden values below (rtol 1e-4, the CPU platform's rule for lm loss)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext.multimodule.train import _parse_args, load_recipe, read_recipe, validate_recipe

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "recipes" / "multimodule_encoder_llm_mhc_pp2.yaml"

# `python -m megatron_ext.multimodule.train recipes/multimodule_encoder_llm_mhc_pp2.yaml` on
# 4 CPU ranks (gloo), iterations 1..10.
GOLDEN_LM_LOSS = [4.887043, 4.751647, 4.723333, 4.591566, 4.459458,
                  4.360923, 4.347781, 4.288584, 4.144219, 3.969752]
ITERATION_LINE = re.compile(r"\biteration\s+(\d+)/\s*(\d+)\s*\|.*\| lm loss: ([0-9.E+-]+) \|")


def test_the_recipe_is_valid_without_starting_anything():
    assert validate_recipe(str(RECIPE), world_size=4) == []
    mm = read_recipe(load_recipe(str(RECIPE)), world_size=4)
    assert mm.num_microbatches() == 4
    assert mm.plan.micro_batch_size("vision_encoder", 2) == 1  # fan-in: DP 2 -> DP 1


def test_validation_reports_plan_problems_of_overrides():
    problems = validate_recipe(str(RECIPE), ["model.modules.llm.first_rank=1"], world_size=4)
    assert any("overlap on rank 1, but 'vision_encoder' feeds 'llm'" in p for p in problems)
    problems = validate_recipe(str(RECIPE), ["training.global_batch_size=7"], world_size=4)
    assert any("global_batch_size (7) must be a multiple" in p for p in problems)


def test_arguments_recipe_overrides_and_megatron_flags():
    args, overrides, ignored = _parse_args(
        [str(RECIPE), "training.iterations=3", "--lr", "0.01", "--min-lr", "0.0", "--mock-data"]
    )
    assert args.recipe == str(RECIPE)
    assert overrides == ["training.iterations=3", "training.lr=0.01"]
    assert ignored == ["--min-lr", "--mock-data"]
    args, overrides, _ = _parse_args(["--recipe", str(RECIPE), "--train-iters", "5"])
    assert args.recipe == str(RECIPE) and overrides == ["training.iterations=5"]
    recipe = load_recipe(str(RECIPE), ["training.lr=3e-3"])
    assert read_recipe(recipe, 4).training.lr == 0.003  # YAML's '3e-3' string is coerced


@pytest.mark.skipif(sys.platform != "linux", reason="launches 4 local ranks")
def test_the_recipe_trains_on_cpu_with_golden_values():
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env.pop("WORLD_SIZE", None)
    torchrun = Path(sys.executable).with_name("torchrun")
    result = subprocess.run(
        [str(torchrun), "--standalone", "--nproc_per_node", "4", "--local-ranks-filter", "3",
         "-m", "megatron_ext.multimodule.train", str(RECIPE)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    losses = {}
    for line in result.stdout.splitlines():
        match = ITERATION_LINE.search(line)
        if match:
            losses[int(match.group(1))] = float(match.group(3))
    assert sorted(losses) == list(range(1, 11)), result.stdout[-2000:]
    for step, golden in enumerate(GOLDEN_LM_LOSS, start=1):
        assert losses[step] == pytest.approx(golden, rel=1e-4), (step, losses[step], golden)
