"""convert-checkpoint on torch_dist directories (synthetic DCP saves with Hybrid mHC keys; the
real-checkpoint round trip is tests/functional_tests/test_checkpoint_travel.py): names and
optimizer moments renamed together, an exact round trip, --format torch, and one-line
refusals (hostile pickles, by-buffer optimizer state, torch -> torch_dist, a used output)."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner

from megatron_ext.checkpoint import convert, torch_dist

HYBRID = {
    "decoder.layers.0.self_attention.linear_qkv.weight": torch.arange(12.0).reshape(3, 4),
    "decoder.layers.0.self_attention_hyper_connection.mapping_proj.weight": torch.ones(2, 4),
    "decoder.layers.1.mlp.linear_fc1.weight": torch.full((2, 4), 3.0),
    "decoder.layers.1.mlp_hyper_connection.bias": torch.zeros(2),
    "optimizer.state.exp_avg.decoder.layers.1.mlp_hyper_connection.bias": torch.ones(2),
    "decoder.layers.1.mlp.linear_fc1._extra_state/shard_0_1": [None],
    "common_state/shard_0_1": [{"iteration": 7}],
}


def _save(root: Path, state=HYBRID, iteration=7) -> Path:
    directory = root / f"iter_{iteration:07d}"
    dcp.save(
        dict(state),
        checkpoint_id=str(directory),
        planner=DefaultSavePlanner(flatten_state_dict=False),
        no_dist=True,
    )
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return root


def test_hybrid_keys_and_their_optimizer_state_round_trip_exactly(tmp_path):
    source = _save(tmp_path / "ours")
    convert.convert_path(str(source), str(tmp_path / "up"), "hybrid", "upstream", "pr6401")
    upstream, _ = torch_dist.read(tmp_path / "up")
    assert "decoder.layers.1.hyper_connection.bias" in upstream
    assert "optimizer.state.exp_avg.decoder.layers.1.hyper_connection.bias" in upstream
    assert "decoder.layers.1.inner_layer.mlp.linear_fc1._extra_state/shard_0_1" in upstream
    assert (tmp_path / "up" / "latest_checkpointed_iteration.txt").read_text() == "7"
    convert.convert_path(
        str(tmp_path / "up"), str(tmp_path / "back"), "hybrid", "megatron-ext", "dev"
    )
    back, _ = torch_dist.read(tmp_path / "back")
    assert back.keys() == HYBRID.keys()
    for key, value in HYBRID.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(back[key], value), key
        else:
            assert back[key] == value, key


def test_format_torch_writes_a_plain_state_dict_of_the_weights(tmp_path):
    source = _save(tmp_path / "ours")
    notes = convert.convert_path(
        str(source), str(tmp_path / "w.pt"), "hybrid", "upstream", "pr6401", "torch"
    )
    plain = torch.load(tmp_path / "w.pt", weights_only=True)
    assert not any(k.startswith("optimizer.") or "/shard_" in k for k in plain)
    assert torch.equal(
        plain["decoder.layers.0.inner_layer.self_attention.linear_qkv.weight"],
        HYBRID["decoder.layers.0.self_attention.linear_qkv.weight"],
    )
    assert any("weights only" in n for n in notes)


def test_refusals_are_one_line(tmp_path):
    source = _save(tmp_path / "ours")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("")
    with pytest.raises(convert.ConversionError, match="exists and is not an empty directory"):
        convert.convert_path(str(source), str(tmp_path / "used"), "gpt", "upstream", "dev")
    state = {**HYBRID, "optimizer.distributed.dp_group_idx_0.param": torch.ones(3)}
    buffered = _save(tmp_path / "buffered", state)
    with pytest.raises(convert.ConversionError, match="stored by buffer"):
        convert.convert_path(str(buffered), str(tmp_path / "o1"), "hybrid", "upstream", "dev")
    torch.save({"decoder.layers.0.mlp.weight": torch.ones(1)}, tmp_path / "m.pt")
    with pytest.raises(convert.ConversionError, match="writing torch_dist from it is not"):
        convert.convert_path(
            str(tmp_path / "m.pt"), str(tmp_path / "o2"), "gpt", "upstream", "dev", "torch_dist"
        )
    marker = tmp_path / "ran"
    (source / "iter_0000007" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(convert.ConversionError) as refused:
        convert.convert_path(str(source), str(tmp_path / "o3"), "gpt", "upstream", "dev")
    assert "pathlib.Path.touch" in str(refused.value) and "\n" not in str(refused.value)
    assert not marker.exists() and not (tmp_path / "o3").exists()


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))
