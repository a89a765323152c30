"""mHC checkpoints between upstream Megatron-LM (PR #6401 / dev Hybrid layout) and megatron-ext.

Upstream's Hybrid keys are built from upstream's code structure: HyperConnectionHybridLayer
holds ``hyper_connection`` (a HyperConnectionModule: mapping_proj.weight, alpha_pre, alpha_post,
alpha_res, bias) and the plain layer as ``inner_layer``; the stack holds ``hc_head_fn/base/scale``.
The plain layer's own keys are megatron-core's (a model built without mHC)."""

import pytest
import torch

from megatron_ext.checkpoint import convert
from megatron_ext.models.hybrid import HybridModel, get_hybrid_stack_local_spec
from megatron_ext.testing.configs import small_config
from megatron_ext.testing.distributed import model_parallel
from megatron_ext.testing.equivalence import TrainPlan, make_microbatches

pytestmark = pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC recompute")

PLAN = TrainPlan()
PATTERN = "*-*-"  # attention-only and MLP-only layers
UPSTREAM_HC_PARAMS = ("mapping_proj.weight", "alpha_pre", "alpha_post", "alpha_res", "bias")


def _hybrid(mhc: bool, seed: int) -> HybridModel:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    config = small_config(
        num_layers=len(PATTERN),
        hidden_size=PLAN.hidden_size,
        num_attention_heads=PLAN.num_attention_heads,
        enable_mhc_connections=mhc,
        mhc_num_residual_streams=4,
    )
    return HybridModel(
        config,
        get_hybrid_stack_local_spec(enable_mhc_connections=mhc),
        vocab_size=PLAN.vocab_size,
        max_sequence_length=PLAN.seq_length,
        hybrid_layer_pattern=PATTERN,
    )


def _upstream_keys(plain: dict) -> set[str]:
    """PR #6401's Hybrid mHC keys for the layers of ``plain`` (a non-mHC model's state dict)."""
    keys = set()
    for key in plain:
        head, sep, rest = key.partition("decoder.layers.")
        if not sep:
            keys.add(key)
            continue
        index, _, inner = rest.partition(".")
        keys.add(f"{head}decoder.layers.{index}.inner_layer.{inner}")
        keys.update(
            f"{head}decoder.layers.{index}.hyper_connection.{p}" for p in UPSTREAM_HC_PARAMS
        )
    keys.update(f"decoder.hc_head_{p}" for p in ("fn", "base", "scale"))
    return keys


def _logits(model: HybridModel) -> torch.Tensor:
    batch = make_microbatches(PLAN, 0)[0]
    with torch.no_grad():
        return model(batch["tokens"], batch["position_ids"], batch["attention_mask"])


def test_hybrid_checkpoints_convert_both_ways_with_equal_outputs():
    with model_parallel():
        plain = {
            k: v
            for k, v in _hybrid(mhc=False, seed=1).state_dict().items()
            if "_extra_state" not in k
        }
        ours_model = _hybrid(mhc=True, seed=2)
        ours = ours_model.state_dict()

        upstream = convert.hybrid_to_upstream(ours)
        assert {k for k in upstream if "_extra_state" not in k} == _upstream_keys(plain)
        for key, value in upstream.items():
            if ".inner_layer." in key and "_extra_state" not in key:
                assert value.shape == plain[key.replace(".inner_layer.", ".")].shape, key

        # Upstream -> ours loads strictly into a differently seeded model and computes the same.
        other = _hybrid(mhc=True, seed=3)
        assert not torch.equal(_logits(other), _logits(ours_model))
        other.load_state_dict(convert.hybrid_from_upstream(upstream), strict=True)
        torch.testing.assert_close(_logits(other), _logits(ours_model), rtol=0, atol=0)
        back = convert.hybrid_from_upstream(upstream)
        assert back.keys() == ours.keys() and all(
            torch.equal(back[k], ours[k]) for k in ours if isinstance(ours[k], torch.Tensor)
        )


def test_a_mamba_layer_keeps_its_mixer_hyper_connection():
    ours = {
        "decoder.layers.0.norm.weight": 1,
        "decoder.layers.0.mixer.in_proj.weight": 2,
        "decoder.layers.0.mixer_hyper_connection.alpha_res": 3,
    }
    upstream = convert.hybrid_to_upstream(ours)
    assert upstream == {
        "decoder.layers.0.inner_layer.norm.weight": 1,
        "decoder.layers.0.inner_layer.mixer.in_proj.weight": 2,
        "decoder.layers.0.hyper_connection.alpha_res": 3,
    }
    assert convert.hybrid_from_upstream(upstream) == ours


def test_layouts_that_are_not_hybrid_mhc_are_refused_by_layer():
    gpt_like = {
        "decoder.layers.0.self_attention_hyper_connection.bias": 0,
        "decoder.layers.0.mlp_hyper_connection.bias": 0,
    }
    with pytest.raises(convert.ConversionError, match=r"decoder\.layers\.0\..*exactly one"):
        convert.hybrid_to_upstream(gpt_like)
    with pytest.raises(convert.ConversionError, match="inner_layer"):
        convert.hybrid_from_upstream({"decoder.layers.0.hyper_connection.bias": 0})


def test_the_cli_converts_a_megatron_torch_checkpoint_and_notes_mains_orientation(tmp_path, capsys):
    from megatron_ext.cli import main

    checkpoint = {
        "model": {
            "decoder.layers.0.mlp.linear_fc1.weight": torch.ones(2),
            "decoder.layers.0.mlp_hyper_connection.bias": torch.zeros(3),
        },
        "iteration": 7,
    }
    torch.save(checkpoint, tmp_path / "in.pt")
    assert (
        main(
            [
                "convert-checkpoint",
                str(tmp_path / "in.pt"),
                str(tmp_path / "up.pt"),
                "--model",
                "hybrid",
                "--to",
                "upstream",
            ]
        )
        == 0
    )
    converted = torch.load(tmp_path / "up.pt", weights_only=False)
    assert converted["iteration"] == 7
    assert set(converted["model"]) == {
        "decoder.layers.0.inner_layer.mlp.linear_fc1.weight",
        "decoder.layers.0.hyper_connection.bias",
    }
    assert (
        main(
            [
                "convert-checkpoint",
                str(tmp_path / "in.pt"),
                str(tmp_path / "gpt.pt"),
                "--model",
                "gpt",
                "--to",
                "megatron-ext",
                "--source",
                "main",
            ]
        )
        == 0
    )
    assert "H_res" in capsys.readouterr().out


def test_mtp_hyper_connections_are_left_alone_with_a_note():
    notes = convert.notes_for(
        "dev", "hybrid", {"mtp.layers.0.mtp_model_layer.hyper_connection.bias": 0}
    )
    assert any("MTP" in note and "not converted" in note for note in notes)
    assert (
        convert.notes_for("pr6401", "hybrid", {"decoder.layers.0.hyper_connection.bias": 0}) == []
    )
