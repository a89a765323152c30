"""mHC parameter names, megatron-ext <-> transformers / the DeepSeek release
(megatron_ext.checkpoint.hc_names, ``convert-checkpoint --mhc-names``): a deepseek-v4 GPT's
state dict converted to transformers names loads (strictly) into transformers'
``DeepseekV4HyperConnection`` / ``DeepseekV4HyperHead`` modules, which then compute what our
modules compute; their state dict converted back loads into our model and equals the
original; every conversion and its inverse give back the input exactly; Hybrid layers pair
up; what has no counterpart is refused."""

import pytest
import torch

from megatron_ext.checkpoint.convert import ConversionError
from megatron_ext.checkpoint.hc_names import from_mhc_names, to_mhc_names
from megatron_ext.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_ext.testing.configs import small_config
from megatron_ext.testing.distributed import model_parallel

pytestmark = pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC recompute")

N, H, LAYERS = 4, 16, 2


def _gpt(seed=0):
    config = small_config(
        num_layers=LAYERS,
        hidden_size=H,
        num_attention_heads=2,
        enable_mhc_connections=True,
        mhc_num_residual_streams=N,
        mhc_variant="deepseek-v4",
        layernorm_epsilon=1e-6,
    )
    torch.manual_seed(seed)
    model = GPTModel(
        config, get_gpt_layer_local_spec(enable_mhc_connections=True), 32, max_sequence_length=8
    )
    with torch.no_grad():  # distinct values everywhere, so a swapped name shows
        for name, param in model.named_parameters():
            if "hyper_connection" in name or "hc_head" in name:
                param.copy_(torch.randn(param.shape) * 0.5 + 0.1)
    return model


def _transformers_mhc():
    """transformers' mHC modules under the names of its DeepseekV4Model."""
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
        DeepseekV4HyperConnection,
        DeepseekV4HyperHead,
    )

    config = DeepseekV4Config(hidden_size=H, hc_mult=N, rms_norm_eps=1e-6)
    layers = torch.nn.ModuleList()
    for _ in range(LAYERS):
        layer = torch.nn.Module()
        layer.attn_hc = DeepseekV4HyperConnection(config)
        layer.ffn_hc = DeepseekV4HyperConnection(config)
        layers.append(layer)
    container = torch.nn.Module()
    container.layers = layers
    container.hc_head = DeepseekV4HyperHead(config)
    return container


def _tensors(state_dict):
    """The tensors of a state dict (megatron adds None ``_extra_state`` entries)."""
    return {k: v.detach().clone() for k, v in state_dict.items() if isinstance(v, torch.Tensor)}


def _mhc_only(state_dict):
    return {k: v for k, v in state_dict.items() if "hyper_connection" in k or "hc_head" in k}


def test_the_converted_state_dict_loads_into_transformers_and_back():
    with model_parallel():
        model = _gpt()
        ours = _tensors(model.state_dict())
        converted = to_mhc_names(_mhc_only(ours), "transformers")
        theirs = _transformers_mhc()
        theirs.load_state_dict(converted, strict=True)  # every name, every shape

        # the loaded modules compute what ours compute, site by site and the head
        x = torch.randn(3, 2, N * H)
        for index, layer in enumerate(model.decoder.layers):
            for ours_site, their_site in (
                (layer.self_attention_hyper_connection, theirs.layers[index].attn_hc),
                (layer.mlp_hyper_connection, theirs.layers[index].ffn_hc),
            ):
                aggregated, h_res, h_post = ours_site(x)
                post, comb, collapsed = their_site(x.view(3, 2, N, H))
                torch.testing.assert_close(aggregated, collapsed, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(h_post, post, rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(h_res, comb, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(
            model.decoder.contract_streams(x),
            theirs.hc_head(x.view(3, 2, N, H)),
            rtol=1e-5,
            atol=1e-5,
        )

        back = from_mhc_names(theirs.state_dict(), "transformers")
        fresh = _gpt(seed=1)
        fresh.load_state_dict({**fresh.state_dict(), **back}, strict=True)
    assert set(back) == set(_mhc_only(ours))
    for name, value in fresh.state_dict().items():
        if name in back:
            assert torch.equal(value, ours[name]), name


@pytest.mark.parametrize("names", ["transformers", "deepseek"])
def test_conversion_and_its_inverse_are_exact(names):
    with model_parallel():
        state = _tensors(_gpt().state_dict())
    converted = to_mhc_names(state, names)
    back = from_mhc_names(converted, names)
    assert set(back) == set(state)
    assert all(torch.equal(back[k], state[k]) for k in state)
    site = "decoder.layers.1.mlp_hyper_connection."
    if names == "deepseek":
        assert torch.equal(converted["layers.1.hc_ffn_fn"], state[site + "mapping_proj.weight"])
        assert torch.equal(converted["layers.1.hc_ffn_base"], state[site + "bias"])
        assert torch.equal(converted["hc_head_scale"], state["decoder.hc_head_scale"])
        scale = converted["layers.1.hc_ffn_scale"]
    else:
        assert torch.equal(converted["hc_head.hc_fn"], state["decoder.hc_head_fn"])
        scale = converted["layers.1.ffn_hc.scale"]
    alphas = [state[site + a] for a in ("alpha_pre", "alpha_post", "alpha_res")]
    assert torch.equal(scale, torch.cat(alphas))
    # only the mHC parameters were renamed
    untouched = [k for k in state if "hyper_connection" not in k and "hc_head" not in k]
    assert untouched and all(converted[k] is state[k] for k in untouched)


def _site(layer, sub, width=24):
    prefix = f"decoder.layers.{layer}.{sub}_hyper_connection."
    return {
        prefix + "mapping_proj.weight": torch.full((width, 8), float(layer)),
        prefix + "bias": torch.full((width,), float(layer)),
        prefix + "alpha_pre": torch.tensor([1.0 + layer]),
        prefix + "alpha_post": torch.tensor([2.0 + layer]),
        prefix + "alpha_res": torch.tensor([3.0 + layer]),
    }


def test_hybrid_attention_and_mlp_layers_pair_into_release_layers():
    state = {**_site(0, "self_attention"), **_site(1, "mlp"), **_site(2, "self_attention")}
    state.update(_site(3, "mlp"))
    converted = to_mhc_names(state, "deepseek", model="hybrid")
    assert (
        converted["layers.1.hc_attn_base"][0] == 2.0 and converted["layers.1.hc_ffn_base"][0] == 3
    )
    back = from_mhc_names(converted, "deepseek", model="hybrid")
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)


def test_what_has_no_release_counterpart_is_refused():
    with pytest.raises(ConversionError, match="only alternating attention and MLP/MoE"):
        to_mhc_names({**_site(0, "mlp"), **_site(1, "self_attention")}, "deepseek", "hybrid")
    with pytest.raises(ConversionError, match="birkhoff"):
        to_mhc_names(_site(0, "mlp", width=8 + 24), "transformers")  # n=4: 2n + 4!
    with pytest.raises(ConversionError, match="missing alpha_res"):
        partial = _site(0, "mlp")
        del partial["decoder.layers.0.mlp_hyper_connection.alpha_res"]
        to_mhc_names(partial, "deepseek")


def test_the_cli_writes_release_names_and_reads_them_back(tmp_path, capsys):
    from megatron_ext.cli import main

    state = {**_site(0, "self_attention"), **_site(0, "mlp"), "embedding.weight": torch.ones(2)}
    torch.save({"model": state, "iteration": 3}, tmp_path / "in.pt")
    common = ["--model", "gpt", "--mhc-names", "deepseek"]
    out, back = str(tmp_path / "release.pt"), str(tmp_path / "back.pt")
    assert (
        main(["convert-checkpoint", str(tmp_path / "in.pt"), out, "--to", "upstream", *common]) == 0
    )
    release = torch.load(out, weights_only=True)["model"]
    assert sorted(release) == sorted(
        ["embedding.weight"]
        + [f"layers.0.hc_{s}_{p}" for s in ("attn", "ffn") for p in ("fn", "base", "scale")]
    )
    assert main(["convert-checkpoint", out, back, "--to", "megatron-ext", *common]) == 0
    restored = torch.load(back, weights_only=True)
    assert restored["iteration"] == 3
    assert set(restored["model"]) == set(state)
    assert all(torch.equal(restored["model"][k], state[k]) for k in state)
