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


def _stacked(per_layer: dict) -> dict:
    """torch_dist's GPT keys: ``decoder.layers.<i>.<name>`` stacked into ``decoder.layers.<name>``."""
    stacked: dict[str, list] = {}
    out = {}
    for key, value in per_layer.items():
        parts = key.split(".")
        if key.startswith("decoder.layers.") and parts[2].isdigit():
            stacked.setdefault(".".join(parts[:2] + parts[3:]), []).append((int(parts[2]), value))
        else:
            out[key] = value
    for key, layers in stacked.items():
        out[key] = torch.stack([v for _, v in sorted(layers, key=lambda item: item[0])])
    return out


@pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC recompute")
@pytest.mark.parametrize("names", ["transformers", "deepseek"])
def test_mhc_names_on_a_torch_dist_input_round_trip_exactly(tmp_path, names, capsys):
    """``convert-checkpoint --mhc-names`` on a torch_dist directory (a deepseek-v4 GPT's
    stacked weights, an optimizer moment, extra and common state): ``--format torch`` writes
    the weights under the other names, per layer; converting that back gives every weight
    exactly. A torch_dist output is refused in one line naming --format torch."""
    from megatron_ext import cli
    from megatron_ext.models.gpt import GPTModel, get_gpt_layer_local_spec
    from megatron_ext.testing.configs import small_config
    from megatron_ext.testing.distributed import model_parallel

    with model_parallel():
        config = small_config(
            num_layers=2,
            hidden_size=8,
            num_attention_heads=2,
            enable_mhc_connections=True,
            mhc_num_residual_streams=4,
            mhc_variant="deepseek-v4",
        )
        spec = get_gpt_layer_local_spec(enable_mhc_connections=True)
        model = GPTModel(config, spec, 16, max_sequence_length=4)
        torch.manual_seed(5)
        weights = {
            k: torch.randn(v.shape) for k, v in model.state_dict().items() if "_extra" not in k
        }
    stacked = _stacked(weights)
    hc = next(k for k in stacked if "hyper_connection" in k)
    state = {
        **stacked,
        f"optimizer.state.exp_avg.{hc}": torch.randn(stacked[hc].shape),
        "decoder.layers.mlp.linear_fc1._extra_state/shard_0_1": [None],
        "common_state/shard_0_1": [{"iteration": 3}],
    }
    source = str(_save(tmp_path / "ours", state, iteration=3))
    base = ["convert-checkpoint", "--model", "gpt", "--mhc-names", names]
    assert cli.main([*base, "--to", "upstream", source, str(tmp_path / "refused")]) == 2
    refusal = capsys.readouterr().err.strip()
    assert "\n" not in refusal and "--format torch" in refusal, refusal
    up = str(tmp_path / "up.pt")
    assert cli.main([*base, "--to", "upstream", "--format", "torch", source, up]) == 0
    renamed = torch.load(up, weights_only=True)
    assert not any("hyper_connection" in k for k in renamed), sorted(renamed)
    assert not any(k.startswith("optimizer.") for k in renamed)
    back_path = str(tmp_path / "back.pt")
    assert cli.main([*base, "--to", "megatron-ext", up, back_path]) == 0
    back = torch.load(back_path, weights_only=True)
    assert back.keys() == weights.keys()
    for key, value in weights.items():
        assert torch.equal(back[key], value), key


def test_our_own_checkpoint_converts_to_our_names_for_its_format_only(tmp_path, capsys):
    """Issue 41, item 9: megatron-ext's own torch_dist checkpoint, `--to megatron-ext --format
    torch`, was refused with "an upstream Hybrid mHC layer holds only hyper_connection.* ...";
    it is a format change: the keys are written unchanged, and a note says so."""
    from megatron_ext.cli import main as cli_main

    source = _save(tmp_path / "ours")
    out = tmp_path / "w.pt"
    assert (
        cli_main(
            [
                "convert-checkpoint",
                str(source),
                str(out),
                "--model",
                "hybrid",
                "--to",
                "megatron-ext",
                "--format",
                "torch",
            ]
        )
        == 0
    )
    printed = capsys.readouterr()
    assert "already has megatron-ext's Hybrid names" in printed.out
    assert "GPT" not in printed.out + printed.err and "non-mHC" not in printed.out + printed.err
    plain = torch.load(out, weights_only=True)
    weights = {
        k: v
        for k, v in HYBRID.items()
        if not k.startswith(("optimizer.", "common_state")) and "/shard_" not in k
    }
    assert plain.keys() == weights.keys()
    assert all(torch.equal(plain[k], v) for k, v in weights.items())
    # torch_dist -> torch_dist keeps every key (optimizer state too)
    convert.convert_path(str(source), str(tmp_path / "same"), "hybrid", "megatron-ext", "dev")
    same, _ = torch_dist.read(tmp_path / "same")
    assert same.keys() == HYBRID.keys()


def test_an_upstream_checkpoint_to_upstream_is_kept_and_not_called_gpt(tmp_path):
    source = _save(tmp_path / "ours")
    convert.convert_path(str(source), str(tmp_path / "up"), "hybrid", "upstream", "pr6401")
    notes = convert.convert_path(
        str(tmp_path / "up"), str(tmp_path / "up.pt"), "hybrid", "upstream", "dev", "torch"
    )
    assert any("already has upstream Megatron-LM's Hybrid names" in n for n in notes)
    plain = torch.load(tmp_path / "up.pt", weights_only=True)
    assert "decoder.layers.1.inner_layer.mlp.linear_fc1.weight" in plain
    assert "decoder.layers.1.hyper_connection.bias" in plain
    # a renaming that has work to do carries no such note
    notes = convert.convert_path(
        str(source), str(tmp_path / "o.pt"), "hybrid", "upstream", "dev", "torch"
    )
    assert not any("already has" in n for n in notes)
