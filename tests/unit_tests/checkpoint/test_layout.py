"""``run --resume RUN parallelism.*=V training.iterations=N``: which overrides a resume takes,
what a layout change adds to Megatron's flags, and how it is recorded and shown."""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

from megatron_ext.checkpoint import layout
from megatron_ext.recipes.loader import load

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "gpt_mhc_tp2_pp2_sp.yaml"


def _recipe(*overrides):
    return load(RECIPE, "cpu", ["test.type=regular", *overrides]).recipe


def test_only_parallelism_and_iterations_can_change_on_a_resume():
    assert layout.override_problem(["parallelism.pp=4", "training.iterations=9"]) is None
    problem = layout.override_problem(["parallelism.tp=1", "model.hidden_size=8"])
    assert problem and "'model.hidden_size=8'" in problem and "checkpoint.load" in problem


def test_a_layout_change_is_named_field_by_field():
    before = _recipe()
    after = _recipe("parallelism.tp=1", "parallelism.pp=4", "parallelism.sp=false")
    change = layout.changed(before, after)
    assert change == {"tp": [2, 1], "pp": [2, 4], "sp": [True, False]}
    assert layout.describe(change) == "tp 2 -> 1, pp 2 -> 4, sp True -> False"
    assert layout.changed(before, _recipe("training.iterations=20")) == {}


def test_a_layout_change_that_changes_the_world_size_says_so():
    """Issue 41, item 10: ``parallelism.pp=4`` on a PP2 resume doubles the ranks (dp is kept);
    the layout-change line said only "pp 2 -> 4"."""
    before = _recipe()
    after = _recipe("parallelism.pp=4")
    assert after.world_size == 2 * before.world_size
    change = layout.changed(before, after)
    assert change == {"pp": [2, 4], "world": [before.world_size, after.world_size]}
    assert layout.describe(change) == f"pp 2 -> 4, world {before.world_size} -> 8 ranks"
    assert layout.shown({"layout_changes": [{"at_iteration": 3, "changed": change}]}) == [
        f"layout     changed at iteration 3: pp 2 -> 4, world {before.world_size} -> 8 ranks"
    ]


def test_the_resume_flags_keep_the_saved_padded_vocabulary(monkeypatch, tmp_path):
    saved = argparse.Namespace(padded_vocab_size=256, tensor_model_parallel_size=2)
    monkeypatch.setattr(layout.start_from, "saved_args", lambda root: saved)
    after = _recipe("parallelism.tp=1", "parallelism.pp=4", "parallelism.sp=false")
    assert layout.resume_args(tmp_path, after, True) == [
        "--override-opt_param-scheduler",
        "--no-load-rng",
        "--make-vocab-size-divisible-by",
        "256",
    ]
    assert layout.resume_args(tmp_path, _recipe(), False) == ["--override-opt_param-scheduler"]


def test_the_change_is_recorded_in_run_json_and_shown(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"recipe": "r.yaml"}))
    layout.record(tmp_path, {"pp": [2, 4]}, 40)
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["layout_changes"] == [{"at_iteration": 40, "changed": {"pp": [2, 4]}}]
    assert layout.shown(record) == ["layout     changed at iteration 40: pp 2 -> 4"]


def test_a_finished_run_continues_only_past_its_last_checkpoint(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("8")
    assert not layout.finished_run_continues(tmp_path, _recipe("training.iterations=8"))
    assert layout.finished_run_continues(tmp_path, _recipe("training.iterations=9"))


def test_an_expert_parallel_change_across_one_is_refused_in_one_line():
    """EP 2 -> 1 (or 1 -> 2) changes how many optimizers megatron chains: refused, naming the
    field and the way out; EP 2 -> 4 and other changes pass (tests/unit_tests/checkpoint/
    test_resharding_4ranks.py loads EP2 -> EP1 weights and continues EP2 layouts)."""
    before = _recipe("parallelism.tp=1", "parallelism.pp=1", "parallelism.sp=false")
    problem = layout.change_problem(_recipe_ep(before, 2), _recipe_ep(before, 1))
    assert problem and "\n" not in problem
    assert problem.startswith("parallelism.ep 2 -> 1") and "checkpoint.load_optim: false" in problem
    assert layout.change_problem(_recipe_ep(before, 1), _recipe_ep(before, 2))
    assert layout.change_problem(_recipe_ep(before, 2), _recipe_ep(before, 4)) is None
    assert layout.change_problem(_recipe(), _recipe("parallelism.pp=4")) is None


def _recipe_ep(recipe, ep: int):
    changed = copy.deepcopy(recipe)
    changed.parallelism.ep = ep
    return changed


def test_a_hybrid_pipeline_change_is_refused_in_one_line_naming_the_way_out():
    """The '|' marks of a Hybrid pattern are its stages: a resume at another PP would need
    another pattern (a model change), so it is refused naming the field and checkpoint.load
    (which accepts the re-split pattern: start_from compares patterns without '|')."""
    hybrid = Path(RECIPE).parent / "hybrid_mhc_tp2_pp2_mtp.yaml"
    before = load(hybrid, "cpu", ["test.type=regular"]).recipe
    after = copy.deepcopy(before)
    after.parallelism.pp = 4
    problem = layout.change_problem(before, after)
    assert problem and "\n" not in problem and problem.startswith("parallelism.pp 2 -> 4")
    assert "model.hybrid_layer_pattern" in problem and "checkpoint.load" in problem
    after = copy.deepcopy(before)
    after.parallelism.tp = 1
    after.parallelism.sp = False
    assert layout.change_problem(before, after) is None
