"""The expert grid (expert TP x EP x PP; expert TP defaults to TP) is checked beside the dense
grid, and imported MoE cases get the smallest world both admit (issue 33, item 5)."""

from __future__ import annotations

import pytest

from megatron_ext.parallel_plan import ParallelPlan
from megatron_ext.recipes import load
from megatron_ext.recipes.checks import plan_problems

from recipe_texts import write_case

MOE = {"--num-experts": 4, "--expert-model-parallel-size": 2}


def _megatron_expert_grid_accepts(tp, pp, cp, ep, etp, world) -> bool:
    """megatron-core's own arithmetic (initialize_model_parallel): the dense grid divides the
    world and so does etp * ep * pp, etp defaulting to tp."""
    etp = tp if etp is None else etp
    return world % (tp * pp * cp) == 0 and world % (etp * ep * pp) == 0


@pytest.mark.parametrize(
    "tp, pp, cp, ep, etp",
    [
        (2, 2, 1, 2, None),
        (2, 2, 1, 2, 1),
        (2, 2, 1, 4, None),
        (1, 2, 1, 4, None),
        (2, 1, 2, 2, None),
        (4, 1, 1, 2, 2),
        (1, 1, 1, 3, None),
        (2, 2, 1, 1, 4),
    ],
)
def test_the_smallest_dp_is_the_smallest_world_both_grids_divide(tp, pp, cp, ep, etp):
    plan = ParallelPlan(tp=tp, pp=pp, cp=cp, ep=ep, etp=etp)
    dp = plan.smallest_expert_dp
    worlds = [tp * pp * cp * d for d in range(1, 65)]
    accepted = [w for w in worlds if _megatron_expert_grid_accepts(tp, pp, cp, ep, etp, w)]
    assert tp * pp * cp * dp == accepted[0]
    for d in range(1, dp + 1):
        problems = ParallelPlan(tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, dp_size=d).problems()
        assert (not any(p.where == "ep" for p in problems)) == (d == dp)


def test_upstreams_tp2_pp2_ep2_case_gets_dp_2_and_says_why(tmp_path):
    """Megatron-LM's moe/gpt3_mcore_tp2_pp2_ep2_te_4experts2parallel shape: with dp 1 every
    rank failed with 'world_size (4) is not divisible by ... (8)'."""
    loaded = load(write_case(tmp_path, MOE))
    assert (loaded.recipe.parallelism.dp, loaded.recipe.world_size) == (2, 8)
    assert [str(p) for p in plan_problems(loaded) if "parallelism" in str(p)] == []
    assert any("dp 2: the smallest whose world the expert grid" in n for n in loaded.notes)


def test_an_explicit_expert_tp_of_1_keeps_dp_1(tmp_path):
    loaded = load(write_case(tmp_path, {**MOE, "--expert-tensor-parallel-size": 1}))
    assert (loaded.recipe.parallelism.dp, loaded.recipe.world_size) == (1, 4)


def test_the_expert_grid_note_is_for_moe_cases_only(tmp_path):
    dense = load(write_case(tmp_path, name="dense"))
    assert any(n.startswith("world size 4 = tp * pp * cp * dp") for n in dense.notes)
    assert not any("expert" in n for n in dense.notes), dense.notes


def test_a_recipe_with_too_small_a_world_is_refused_in_one_line(tmp_path):
    loaded = load(write_case(tmp_path, MOE), "cpu", ["parallelism.dp=1"])
    problems = [str(p) for p in plan_problems(loaded) if p.where == "parallelism.ep"]
    assert problems == [
        "parallelism.ep: world size 4 is not divisible by the expert grid etp=tp(2) * ep(2) * "
        "pp(2) = 8 (megatron's expert tensor parallelism defaults to tp); set parallelism.dp to "
        "a multiple of 2 (world size 8), or change ep"
    ]


def test_distributed_optimizer_instances_get_a_dp_they_divide(tmp_path, monkeypatch):
    """Upstream's gpt3_mcore_te_tp2_pp1_multi_dist_optimizer_instances validated at dp 1, then
    every rank failed: megatron-core asserts dp * cp divisible by the optimizer instances."""
    args = {
        "--tensor-model-parallel-size": 2,
        "--pipeline-model-parallel-size": 1,
        "--use-distributed-optimizer": True,
        "--num-distributed-optimizer-instances": 2,
    }
    import importlib.util

    real_find_spec = importlib.util.find_spec
    with_einops = lambda name, *a: object() if name == "einops" else real_find_spec(name, *a)  # noqa: E731
    monkeypatch.setattr(importlib.util, "find_spec", with_einops)
    loaded = load(write_case(tmp_path, args))
    assert loaded.recipe.parallelism.dp == 2 and loaded.recipe.world_size == 4
    assert any("distributed optimizer instances divide" in n for n in loaded.notes)
    assert not plan_problems(loaded)
    too_few = [
        str(p)
        for p in plan_problems(load(write_case(tmp_path, args), overrides=["parallelism.dp=1"]))
    ]
    assert too_few == [
        "parallelism.dp: dp(1) * cp(1) = 1 is not divisible by "
        "--num-distributed-optimizer-instances (2); set parallelism.dp to a multiple of 2, or "
        "lower the instances"
    ], too_few
    # and megatron-core builds the instances' groups with einops (every rank failed without)
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "einops" else real_find_spec(name, *a),
    )
    (missing,) = plan_problems(loaded)
    assert missing.where == "extra_args.--num-distributed-optimizer-instances"
    assert "einops, which is not importable here" in missing.what
