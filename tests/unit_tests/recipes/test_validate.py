"""`validate`: Megatron's own argument checks, the config's checks and megatron-ext's guards,
run in this process for rank 0 of the recipe's world, with no process group."""

import argparse
import os
import sys

import pytest

from megatron_ext.recipes import load
from megatron_ext.recipes.validate import validate

from recipe_texts import MINIMAL, REPO_ROOT


def _check(path, overrides=(), platform="cpu"):
    return validate(load(path, platform, list(overrides)))


@pytest.mark.parametrize(
    "name",
    [
        "gpt_tp2_pp2",
        "gpt_mhc_tp2_pp2_sp",
        "gpt_mhc_pp4_vpp2",
        "gpt_mhc_pp2_standalone_embedding_loss",
    ],
)
def test_shipped_gpt_recipes_pass_every_check(name):
    result = _check(REPO_ROOT / f"recipes/{name}.yaml")
    assert result.ok, result.problems


def test_validation_leaves_argv_and_environment_as_they_were(write_recipe):
    argv, env = list(sys.argv), dict(os.environ)
    _check(write_recipe(MINIMAL))
    assert sys.argv == argv and dict(os.environ) == env


@pytest.mark.parametrize(
    "overrides, where, message",
    [
        # megatron-ext's guard, reached through the real MHCTransformerConfig of the parsed flags
        (
            ["model.mhc.enabled=true", "model.mtp_num_layers=1", "model.position_embedding=rope"],
            "guard",
            "GPTModel does not support mtp_num_layers=1 with enable_mhc_connections",
        ),
        # MHCTransformerConfig's own validation
        (
            ["model.mhc.enabled=true", "model.mhc.init_gating_factor=-1"],
            "config (MHCTransformerConfig)",
            "mhc_init_gating_factor must be non-negative",
        ),
        # ... unless the entry's flag checks catch a size below 1 first (the same one-line error
        # python -m megatron_ext.pretrain_gpt gives)
        (
            ["model.mhc.enabled=true", "model.mhc.sinkhorn_iterations=0"],
            "megatron arguments",
            "--mhc-sinkhorn-iterations must be at least 1, got 0",
        ),
        (
            [
                "model.mhc.enabled=true",
                "model.mhc.recompute=true",
                "extra_args.--recompute-modules=[mhc, mlp]",
            ],
            "config (MHCTransformerConfig)",
            "'mhc' and 'mlp' in recompute_modules cannot be used together",
        ),
        # Megatron's validate_args
        (["training.min_lr=0.1", "training.lr=0.01"], "megatron validate_args", ""),
        # Megatron's parser
        (
            ["extra_args.--no-such-flag=true"],
            "megatron arguments",
            "unrecognized arguments: --no-such-flag",
        ),
        (  # a mistyped flag gets the one it was meant to be (issue 25 item 19)
            ["extra_args.--atention-dropout=0.1"],
            "megatron arguments",
            "unrecognized arguments: --atention-dropout 0.1; --atention-dropout: did you mean "
            "--attention-dropout?",
        ),
    ],
)
def test_megatron_level_problems_are_reported_with_their_stage(
    write_recipe, overrides, where, message
):
    result = _check(write_recipe(MINIMAL), overrides)
    assert len(result.problems) == 1, result.problems
    problem = result.problems[0]
    assert problem.where == where and message in problem.what, problem


def test_megatron_checks_run_only_when_the_plan_is_sound(write_recipe):
    result = _check(write_recipe(MINIMAL), ["parallelism.pp=3", "extra_args.--no-such-flag=true"])
    assert [p.where for p in result.problems] == ["model.num_layers"]


def test_hybrid_recipes_validate_before_their_entry_exists():
    for name in ("hybrid_mhc_tp2_pp2_mtp", "hybrid_mhc_tp1_pp2_vpp2_empty_mtp"):
        result = _check(REPO_ROOT / f"recipes/{name}.yaml")
        assert result.ok, result.problems


def test_gpu_platforms_are_judged_without_this_machines_missing_libraries():
    result = _check(REPO_ROOT / "recipes/gpt_mhc_tp2_pp2_sp.yaml", platform="gpu-cluster")
    assert result.ok, result.problems
    result = _check(
        REPO_ROOT / "recipes/gpt_tp2_pp2.yaml",
        ["model.mhc.enabled=true", "model.mtp_num_layers=1", "model.position_embedding=rope"],
        platform="gpu-cluster",
    )
    assert [p.where for p in result.problems] == ["guard"], "guards still run for GPU recipes"


def test_mhc_flags_without_enable_mhc_connections_are_rejected(tmp_path):
    """--mhc-* would be silently ignored without --enable-mhc-connections."""
    from megatron_ext.launch.training import mhc_flags_without_mhc

    recipe = tmp_path / "r.yaml"
    recipe.write_text(MINIMAL + "extra_args: {--mhc-sinkhorn-iterations: 5}\n")
    problems = [str(p) for p in validate(load(recipe)).problems]
    # A schema-managed flag in extra_args is refused before Megatron's parser sees it.
    assert problems == [
        "extra_args.--mhc-sinkhorn-iterations: is set by model.mhc.sinkhorn_iterations; "
        "set that field instead (the flag would override it)"
    ], problems
    on = argparse.Namespace(enable_mhc_connections=True)
    off = argparse.Namespace(enable_mhc_connections=False)
    assert mhc_flags_without_mhc(["--mhc-num-residual-streams=2"], on) is None
    assert "--mhc-num-residual-streams" in mhc_flags_without_mhc(
        ["--mhc-num-residual-streams=2"], off
    )
    assert mhc_flags_without_mhc(["--hidden-size", "8"], off) is None
