"""The multimodule training entry and its recipe: argument handling and validation without
processes. The recipe's 4-rank CPU run against its golden values is
tests/functional_tests/test_recipes.py (one training run of it per CI, not two)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_ext.pretrain_multimodule import HONOURED_FLAGS, _parse_args, load_recipe
from megatron_ext.recipes import load
from megatron_ext.recipes.command import RECIPE_PLACEHOLDER, megatron_args
from megatron_ext.recipes.multimodule import num_microbatches, plan_of, validate_recipe

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "recipes" / "multimodule_encoder_llm_mhc_pp2.yaml"


def test_the_recipe_is_valid_without_starting_anything():
    assert validate_recipe(str(RECIPE), world_size=4) == []
    recipe = load_recipe(str(RECIPE))
    plan = plan_of(recipe, world_size=4)
    assert num_microbatches(recipe, plan) == 4
    assert plan.micro_batch_size("vision_encoder", 2) == 1  # fan-in: DP 2 -> DP 1


@pytest.mark.parametrize("method", ["sinkhorn", "birkhoff"])
def test_the_language_model_may_log_mhc_stats_with_either_h_res_method(method):
    """model.modules.llm.mhc.log_stats is honoured by this entry (no longer refused), with
    either H_res method; the runner then records the gains (mhc_report)."""
    from megatron_ext.runs import mhc_report

    overrides = [
        "model.modules.llm.mhc.log_stats=true",
        f"model.modules.llm.mhc.h_res_method={method}",
    ]
    assert validate_recipe(str(RECIPE), overrides, world_size=4) == []
    recipe = load_recipe(str(RECIPE), overrides)
    assert recipe.logs_mhc_stats
    assert "mhc/forward_gain" in mhc_report.recorded_names(recipe.logs_mhc_stats, ["lm loss"])
    assert not load_recipe(str(RECIPE), ["model.modules.llm.mhc.log_stats=false"]).logs_mhc_stats


def test_the_entry_refuses_zb_h1_it_would_ignore():
    """Started directly (not through `megatron-ext run`, which validates), the entry would run
    its 1F1B across the grids whatever parallelism.schedule says: one line naming the field."""
    with pytest.raises(ValueError, match=r"^parallelism.schedule: zb-h1 is not available for mul"):
        load_recipe(str(RECIPE), ["parallelism.schedule=zb-h1"])
    assert load_recipe(str(RECIPE), ["parallelism.schedule=1f1b"]).parallelism.schedule == "1f1b"


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
    assert recipe.training.lr == 0.003  # YAML's '3e-3' string is coerced


# A projector between the encoder (ranks 0-1) and the language model (now ranks 3-4).
PROJECTOR = [
    "model.modules.proj={kind: projector, first_rank: 2, hidden_size: 64}",
    "model.modules.llm.first_rank=3",
    "launch.nproc=5",
    "model.topology={vision_encoder: [proj], proj: [llm]}",
]

# Accepted by the plan but failing or training wrong after ranks start: (overrides, the
# one-line error's text). Each must be reported by validate, before anything is built.
ACCEPTED_BUT_WRONG = [
    (
        ["model.modules.vision_encoder.output_ndim=2"],
        "vision_encoder.output_ndim=2 contradicts flatten_output=False",
    ),
    (["model.modules.llm.mhc.num_residual_streams=0"], "mhc.num_residual_streams=0 must be >= 1"),
    (["model.modules.llm.mhc.fused=true"], "mhc.fused=True is not supported by megatron_ext"),
    (
        ["model.modules.llm.hidden_size=32"],
        "bridge vision_encoder -> llm: 'vision_encoder' hands on hidden_size 64 but 'llm' "
        "takes hidden_size 32; set model.modules.vision_encoder.hidden_size=32 or "
        "model.modules.llm.hidden_size=64",
    ),
    (
        [
            "model.modules.vision_encoder.hidden_size=128",
            "model.modules.vision_encoder.flatten_output=true",
        ],
        "'vision_encoder' hands on hidden_size 128 but 'llm' takes hidden_size 64",
    ),
    (
        PROJECTOR + ["model.modules.proj.hidden_size=32"],
        "bridge vision_encoder -> proj: 'vision_encoder' hands on hidden_size 64 but 'proj'",
    ),
    (
        PROJECTOR
        + ["model.modules.llm.hidden_size=32", "model.modules.vision_encoder.hidden_size=32"],
        "bridge proj -> llm: 'proj' hands on hidden_size 64 but 'llm' takes hidden_size 32",
    ),
    (
        ["model.modules.vision_encoder.mhc.enabled=true"],
        "model.modules.vision_encoder.mhc.enabled: only the language_model builds mHC",
    ),
    (
        ["model.modules.llm.num_layers=3"],
        "model.modules.llm.num_layers=3 does not divide over its pp=2",
    ),
    (
        ["model.modules.llm.num_attention_heads=5"],
        "hidden_size=64 is not a multiple of num_attention_heads=5",
    ),
    (
        ["model.modules.llm.tp=2", "launch.nproc=6", "model.modules.llm.num_attention_heads=1"],
        "model.modules.llm.num_attention_heads=1 does not split over tp=2",
    ),
    (
        ["model.modules.vision_encoder.patch_dim=0"],
        "model.modules.vision_encoder.patch_dim=0 must be >= 1",
    ),
    (["model.modules.llm.hidden_size=0"], "model.modules.llm.hidden_size=0 must be >= 1"),
    (
        ["model.modules.vision_encoder.image_lengths=[8, 0]"],
        "image_lengths=[8, 0] must be a non-empty list",
    ),
    (
        ["model.modules.vision_encoder.image_lengths=[]"],
        "image_lengths=[] must be a non-empty list",
    ),
]


@pytest.mark.parametrize("overrides, expected", ACCEPTED_BUT_WRONG, ids=lambda v: str(v)[:40])
def test_validate_rejects_modules_that_fail_after_ranks_start(overrides, expected):
    problems = validate_recipe(str(RECIPE), overrides, world_size=None)
    assert any(expected in p for p in problems), problems
    assert all("\n" not in p for p in problems)


def test_matching_widths_through_a_projector_and_flattened_output_are_valid():
    assert validate_recipe(str(RECIPE), PROJECTOR, world_size=None) == []
    flat = ["model.modules.vision_encoder.flatten_output=true"]
    assert validate_recipe(str(RECIPE), flat, world_size=None) == []
    flat.append("model.modules.vision_encoder.output_ndim=2")
    assert validate_recipe(str(RECIPE), flat, world_size=None) == []


GPT_WITHOUT_TRAINING = """
version: 1
model: {type: gpt, num_layers: 2, hidden_size: 64, num_attention_heads: 4, seq_length: 32}
launch: {nproc: 1}
"""


def _flag_values(args: list[str]) -> dict[str, str]:
    return {flag: args[args.index(flag) + 1] for flag in HONOURED_FLAGS if flag in args}


def test_both_paths_resolve_every_shared_training_field_identically(tmp_path):
    """With no training section, the multi-module entry trains with what a single-model
    entry is given: the schema's defaults, through the runner's Megatron flags (once the
    entry's own defaults disagreed: weight_decay 0.0 against the schema's 0.01)."""
    gpt = tmp_path / "gpt.yaml"
    gpt.write_text(GPT_WITHOUT_TRAINING)
    single = _flag_values(megatron_args(load(str(gpt))))
    text = RECIPE.read_text()
    multi = tmp_path / "multimodule.yaml"
    multi.write_text(text[: text.index("training:")] + text[text.index("data:") :])
    loaded = load(str(multi))
    assert _flag_values(megatron_args(loaded)) == single
    command = [str(multi) if a == RECIPE_PLACEHOLDER else a for a in megatron_args(loaded)]
    args, overrides, _ = _parse_args(command)  # as the runner starts the entry
    resolved = load_recipe(args.recipe, overrides).training
    assert set(single) == set(HONOURED_FLAGS)  # every field the entry reads is compared
    for flag, (kind, field) in HONOURED_FLAGS.items():
        assert getattr(resolved, field) == kind(single[flag]), field
        assert getattr(load_recipe(str(multi)).training, field) == kind(single[flag]), field
