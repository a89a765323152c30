"""The multimodule training entry and its recipe: argument handling and validation without
processes. The recipe's 4-rank CPU run against its golden values is
tests/functional_tests/test_recipes.py (one training run of it per CI, not two)."""

from __future__ import annotations

from pathlib import Path

from megatron_ext.multimodule.train import _parse_args, load_recipe, read_recipe, validate_recipe

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "recipes" / "multimodule_encoder_llm_mhc_pp2.yaml"


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
