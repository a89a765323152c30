"""``checkpoint.load``: which checkpoint a directory names, and the refusals made before any
rank starts from the checkpoint's own args (issue 31: another model shape, mHC stream count,
H_res method or vocabulary; one line each naming the field and both values)."""

from __future__ import annotations

import argparse
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner

from megatron_ext.checkpoint import preload, start_from
from megatron_ext.recipes.loader import load

REPO_ROOT = Path(__file__).resolve().parents[3]
RECIPE = REPO_ROOT / "recipes" / "gpt_mhc_tp2_pp2_sp.yaml"
SAVED = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_layers=4,
    enable_mhc_connections=True,
    mhc_num_residual_streams=4,
    mhc_h_res_method="sinkhorn",
    vocab_size=128,
    tokenizer_type="NullTokenizer",
    padded_vocab_size=256,
    tensor_model_parallel_size=2,
)


def _checkpoint(root, iteration=4, **changes):
    """A megatron.training-like torch_dist save: a tensor and the common-state byte item."""
    args = argparse.Namespace(**{**SAVED, **changes})
    state = {
        "embedding.word_embeddings.weight": torch.zeros(256, 64),
        "common_state/shard_0_1": [{"args": args, "iteration": iteration}],
    }
    directory = root / f"iter_{iteration:07d}"
    dcp.save(
        state,
        checkpoint_id=str(directory),
        planner=DefaultSavePlanner(flatten_state_dict=False),
        no_dist=True,
    )
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return root


def _recipe(*overrides):
    return load(RECIPE, "cpu", ["test.type=regular", *overrides]).recipe


def test_a_run_directory_a_root_and_an_iteration_resolve_to_what_megatron_loads(tmp_path):
    root = _checkpoint(tmp_path / "run" / "checkpoints")
    assert start_from.resolve(tmp_path / "run") == start_from.Source(root.resolve(), None)
    assert start_from.resolve(root) == start_from.Source(root.resolve(), None)
    assert start_from.resolve(root / "iter_0000004") == start_from.Source(root.resolve(), 4)
    with pytest.raises(start_from.StartFromError, match="is not a checkpoint"):
        start_from.resolve(tmp_path)
    recipe = _recipe(f"checkpoint.load={root / 'iter_0000004'}", "checkpoint.finetune=true")
    assert start_from.megatron_args(recipe)[:5] == [
        "--load",
        str(root.resolve()),
        "--ckpt-step",
        "4",
        "--finetune",
    ]


def test_a_matching_checkpoint_passes(tmp_path):
    root = _checkpoint(tmp_path / "ckpt")
    assert start_from.problems(_recipe(f"checkpoint.load={root}")) == []


@pytest.mark.parametrize(
    "override, saved, field",
    [
        ("model.mhc.num_residual_streams=3", {}, "model.mhc.num_residual_streams is 3 here but 4"),
        ("model.mhc.h_res_method=birkhoff", {}, "model.mhc.h_res_method is 'birkhoff' here but"),
        ("model.hidden_size=128", {}, "model.hidden_size is 128 here but 64"),
        ("data.tokenizer.vocab_size=100", {}, "data.tokenizer.vocab_size is 100 here but 128"),
        (None, {"mhc_num_residual_streams": 2}, "num_residual_streams is 4 here but 2"),
    ],
)
def test_each_mismatch_is_one_line_naming_both_values(tmp_path, override, saved, field):
    root = _checkpoint(tmp_path / "ckpt", **saved)
    recipe = _recipe(f"checkpoint.load={root}", *([override] if override else []))
    found = start_from.problems(recipe)
    assert len(found) == 1 and field in found[0] and "\n" not in found[0], found
    assert found[0].startswith("checkpoint.load: ")


def test_the_checkpoint_args_are_read_safely(tmp_path):
    root = _checkpoint(tmp_path / "ckpt")
    metadata = root / "iter_0000004" / ".metadata"
    metadata.write_bytes(pickle.dumps(_Payload(tmp_path / "ran")))
    recipe = _recipe(f"checkpoint.load={root}")
    assert "pathlib.Path.touch" in (preload.pickle_problem(recipe) or "")
    assert "pathlib.Path.touch" in start_from.problems(recipe)[0]
    assert not (tmp_path / "ran").exists()


def test_finetune_without_load_is_refused():
    assert start_from.problems(_recipe("checkpoint.finetune=true")) == [
        "checkpoint.finetune: applies to checkpoint.load, which is not set; set it"
    ]


def test_a_tp_change_keeps_the_saved_padded_vocabulary():
    args = argparse.Namespace(**SAVED)
    assert start_from.vocab_args(args, tp=1) == ["--make-vocab-size-divisible-by", "256"]
    assert start_from.vocab_args(args, tp=2) == []


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        from pathlib import Path

        return (Path.touch, (Path(self.marker),))


# ---- issue 40, item 8: the layout changes run --resume refuses, refused through checkpoint.load
def _moe_checkpoint(root, optimizer=True):
    """An EP2 save: its args, and (``optimizer``) an optimizer state item."""
    args = argparse.Namespace(**{**SAVED, "expert_model_parallel_size": 2})
    state = {
        "embedding.word_embeddings.weight": torch.zeros(256, 64),
        "common_state/shard_0_1": [{"args": args, "iteration": 4}],
    }
    if optimizer:
        state["optimizer.state.exp_avg.embedding.word_embeddings.weight"] = torch.zeros(256, 64)
    dcp.save(
        state,
        checkpoint_id=str(root / "iter_0000004"),
        planner=DefaultSavePlanner(flatten_state_dict=False),
        no_dist=True,
    )
    (root / "latest_checkpointed_iteration.txt").write_text("4")
    return root


def test_an_ep_change_with_optimizer_state_is_refused_as_resume_refuses_it(tmp_path):

    root = _moe_checkpoint(tmp_path / "ckpt")
    found = start_from.problems(_recipe(f"checkpoint.load={root}"))  # ep=1 here
    assert len(found) == 1 and "\n" not in found[0], found
    assert found[0].startswith("checkpoint.load: parallelism.ep 2 -> 1: ")
    same_rule = start_from.ep_change_problem(2, 1, "X")
    assert same_rule and found[0].split(": ", 1)[1].startswith(same_rule.split("; keep")[0])
    assert (
        start_from.problems(_recipe(f"checkpoint.load={root}", "checkpoint.load_optim=false")) == []
    )
    assert start_from.problems(_recipe(f"checkpoint.load={root}", "checkpoint.finetune=true")) == []
    plain = _moe_checkpoint(tmp_path / "no-optimizer", optimizer=False)
    assert start_from.problems(_recipe(f"checkpoint.load={plain}")) == []


def test_validate_and_dry_run_refuse_the_ep_change_before_any_rank(tmp_path, capsys):
    from megatron_ext import cli

    root = _moe_checkpoint(tmp_path / "ckpt")
    common = [str(RECIPE), "--platform", "cpu", "test.type=regular", f"checkpoint.load={root}"]
    assert cli.main(["validate", *common, "--skip-megatron-checks"]) == 2
    out = capsys.readouterr().out
    assert "checkpoint.load: parallelism.ep 2 -> 1" in out, out
    code = cli.main(["run", *common, "--dry-run", "--run-dir", str(tmp_path / "R")])
    out = capsys.readouterr().out
    assert code == 2 and "checkpoint.load: parallelism.ep 2 -> 1" in out, out
    assert not (tmp_path / "R").exists()
