"""``parallelism.schedule``: the recipe field that chooses ZB-H1, what it becomes on the ranks'
command line, and every recipe it is refused for (one line naming the field and the fix),
all without a process."""

import pytest

from megatron_ext.recipe_flags import conflicts
from megatron_ext.recipes import RecipeError, load
from megatron_ext.recipes.checks import plan_problems
from megatron_ext.recipes.command import describe, megatron_args

from recipe_texts import MINIMAL, REPO_ROOT

TP2_PP2_SP = REPO_ROOT / "recipes/gpt_mhc_tp2_pp2_sp.yaml"
ZB_H1 = "parallelism.schedule=zb-h1"


def _problems(path, *overrides) -> list[str]:
    return [str(p) for p in plan_problems(load(path, "cpu", list(overrides)))]


def _schedule_flag(args: list[str]) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == "--pipeline-schedule"]


def test_zb_h1_reaches_the_command_line_and_1f1b_adds_nothing():
    default = load(TP2_PP2_SP)
    assert default.recipe.parallelism.schedule == "1f1b"
    assert _schedule_flag(megatron_args(default)) == [], "1F1B runs keep their old command"
    zb = load(TP2_PP2_SP, "cpu", [ZB_H1])
    assert _schedule_flag(megatron_args(zb)) == ["zb-h1"]
    assert not plan_problems(zb)
    assert "pp2 dp1 sp zb-h1" in describe(zb)


def test_the_schedule_override_keeps_the_golden_values():
    """ZB-H1 reorders the same computation: the 1F1B golden values judge a zb-h1 run."""
    assert not load(TP2_PP2_SP, "cpu", [ZB_H1]).numerics_overridden
    assert load(TP2_PP2_SP, "cpu", [ZB_H1, "parallelism.pp=4"]).numerics_overridden


def test_an_unknown_schedule_is_a_schema_error():
    with pytest.raises(RecipeError, match=r"parallelism.schedule: must be one of '1f1b', 'zb-h1'"):
        load(TP2_PP2_SP, "cpu", ["parallelism.schedule=zb-v"])


def test_the_flag_in_extra_args_names_the_field():
    (problem,) = conflicts({"--pipeline-schedule": "zb-h1"})
    assert problem.where == "extra_args.--pipeline-schedule"
    assert "parallelism.schedule" in problem.what


# ---- refusals: one per combination ZB-H1 does not run with -------------------------------------
def _only_schedule_problem(problems: list[str], where: str) -> str:
    mine = [p for p in problems if "zb-h1" in p]
    assert len(mine) == 1, problems
    assert mine[0].startswith(f"{where}: "), mine[0]
    assert "\n" not in mine[0]
    return mine[0]


def test_one_stage_is_refused():
    problems = _problems(TP2_PP2_SP, ZB_H1, "parallelism.pp=1")
    line = _only_schedule_problem(problems, "parallelism.schedule")
    assert "needs pp > 1" in line and "parallelism.schedule: 1f1b" in line
    assert _problems(TP2_PP2_SP, "parallelism.pp=1") == [], "the same recipe under 1F1B is fine"


def test_virtual_stages_are_refused():
    recipe = REPO_ROOT / "recipes/gpt_mhc_pp4_vpp2.yaml"
    line = _only_schedule_problem(_problems(recipe, ZB_H1), "parallelism.vpp")
    assert "2 virtual stages" in line and "non-interleaved" in line and "1f1b" in line


def test_virtual_stages_from_a_pipeline_layout_are_refused(write_recipe):
    path = write_recipe(MINIMAL)
    problems = _problems(path, ZB_H1, "model.pipeline_layout=Et|t|t|tL")
    line = _only_schedule_problem(problems, "model.pipeline_layout")
    assert "remove the virtual stages from model.pipeline_layout" in line
    assert _problems(path, ZB_H1, "model.pipeline_layout=Ett|ttL") == [], "one stage per rank"


def test_virtual_stages_from_hybrid_segments_are_refused():
    recipe = REPO_ROOT / "recipes/hybrid_mhc_tp1_pp2_vpp2_empty_mtp.yaml"
    _only_schedule_problem(_problems(recipe, ZB_H1), "model.hybrid_layer_pattern")


def test_a_multimodule_recipe_is_refused():
    recipe = REPO_ROOT / "recipes/multimodule_encoder_llm_mhc_pp2.yaml"
    line = _only_schedule_problem(_problems(recipe, ZB_H1), "parallelism.schedule")
    assert "multimodule" in line and "parallelism.schedule: 1f1b" in line


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--overlap-moe-expert-parallel-comm", "true"),
        ("--cuda-graph-impl", "local"),
        ("--enable-cuda-graph", "true"),
        ("--external-cuda-graph", "true"),
    ],
)
def test_extra_args_zb_h1_does_not_run_with_are_refused(write_recipe, flag, value):
    path = write_recipe(MINIMAL + f"extra_args: {{{flag}: {value}}}\n")
    line = _only_schedule_problem(_problems(path, ZB_H1), f"extra_args.{flag}")
    assert "remove it or set parallelism.schedule: 1f1b" in line
    assert not [p for p in _problems(path) if flag in p and "zb-h1" in p]


# ---- parallelism.schedule_file: a ZB-H1 order given as text ------------------------------------
ZB_TEXT = "F0 F1 B0 W0 F2 B1 W1 F3 B2 B3 W2 W3\nF0 B0 F1 W0 B1 F2 B2 W1 F3 B3 W2 W3\n"


def _with_order(tmp_path, text: str, *overrides: str):
    (tmp_path / "order.txt").write_text(text)
    recipe = tmp_path / "tp2_pp2_sp.yaml"
    recipe.write_text(TP2_PP2_SP.read_text())
    return load(recipe, "cpu", ["parallelism.schedule_file=order.txt", *overrides])


def test_a_schedule_file_reaches_the_ranks_relative_to_the_recipe(tmp_path):
    loaded = _with_order(tmp_path, ZB_TEXT, ZB_H1)
    assert not plan_problems(loaded)
    args = megatron_args(loaded)
    flag = args.index("--pipeline-schedule-file")
    assert args[flag + 1] == str(tmp_path / "order.txt")


def test_a_bad_schedule_file_is_refused_naming_the_field_rank_and_token(tmp_path):
    over_the_peak = ZB_TEXT.replace("F0 F1 B0 W0 F2", "F0 F1 F2 B0 W0", 1)
    problems = _problems_of(_with_order(tmp_path, over_the_peak, ZB_H1))
    assert problems == [
        "parallelism.schedule_file: order.txt: rank 0, token 3 'F2': 3 micro-batches in flight "
        "(activations held until their W), more than the limit of 2 (pp, 1F1B's first stage); "
        "run a W earlier"
    ]
    (missing,) = _problems_of(_with_order(tmp_path, ZB_TEXT.rsplit(" ", 1)[0], ZB_H1))
    assert missing.startswith("parallelism.schedule_file: order.txt: rank 1: 'W3' is missing")
    # the recipe's plan decides: 8 micro-batches at global batch 16
    (fewer,) = _problems_of(_with_order(tmp_path, ZB_TEXT, ZB_H1, "training.global_batch_size=16"))
    assert "rank 0: 'F4' is missing" in fewer


def test_a_schedule_file_needs_zb_h1(tmp_path):
    (problem,) = _problems_of(_with_order(tmp_path, ZB_TEXT))
    assert problem.startswith("parallelism.schedule_file: only ZB-H1 runs an order given as text")


def test_the_schedule_file_flag_in_extra_args_names_the_field():
    (problem,) = conflicts({"--pipeline-schedule-file": "order.txt"})
    assert "parallelism.schedule_file" in problem.what


def _problems_of(loaded) -> list[str]:
    return [str(p) for p in plan_problems(loaded)]
