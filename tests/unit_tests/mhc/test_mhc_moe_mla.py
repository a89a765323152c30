"""GPT MoE and MLA with mHC on one rank: the decoder block spec pretrain_gpt builds MoE models
from (every layer an mHC layer, dense/MoE by moe_layer_freq, local norms), the MLA config with
the mHC fields, and GPT MTP with mHC at PP=1 (plain MTP layers on the contracted decoder
output, as upstream PR #4945 builds them). Multi-rank equivalence: tests/unit_tests/
pipeline/test_mhc_moe_mla_{2,4}ranks.py."""

import pytest
import torch

from megatron.core.models.gpt import gpt_layer_specs as core_specs
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from megatron_ext.config import MHCMLATransformerConfig, MHCTransformerConfig
from megatron_ext.mhc.hyper_connection import aggregate
from megatron_ext.mhc.transformer_layer import HyperConnectionTransformerLayer
from megatron_ext.models.gpt import GPTModel, get_gpt_decoder_block_spec, get_gpt_layer_local_spec
from megatron_ext.models.norms import LocalNorm
from megatron_ext.testing.configs import small_config
from megatron_ext.testing.distributed import model_parallel

MLA = dict(q_lora_rank=16, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8)
MOE = dict(
    num_moe_experts=4,
    moe_router_topk=2,
    moe_layer_freq=[0, 1, 1],
    moe_shared_expert_intermediate_size=32,
    moe_aux_loss_coeff=0.01,
    moe_token_dispatcher_type="alltoall",
    add_bias_linear=False,
)


def _config(config_class=MHCTransformerConfig, **fields):
    fields = dict(
        dict(num_layers=3, hidden_size=32, num_attention_heads=4, enable_mhc_connections=True),
        **fields,
    )
    return small_config(config_class, **fields)


def _batch(s=16, b=2, vocab=64):
    tokens = torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(0))
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    return tokens, torch.arange(s).expand(b, s), mask


def test_mla_config_carries_the_mhc_fields_and_mla_defaults():
    config = _config(MHCMLATransformerConfig, **MLA, mhc_num_residual_streams=2)
    assert isinstance(config, MHCTransformerConfig)
    assert config.multi_latent_attention and config.rope_type == "yarn"
    assert config.enable_mhc_connections and config.mhc_num_residual_streams == 2
    with pytest.raises(ValueError, match="mhc_sinkhorn_iterations"):
        _config(MHCMLATransformerConfig, **MLA, mhc_sinkhorn_iterations=0)


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_moe_block_spec_gives_every_layer_n_streams_and_trains(mla):
    config_class, extra = (MHCMLATransformerConfig, MLA) if mla else (MHCTransformerConfig, {})
    with model_parallel(seed=1):
        config = _config(config_class, **MOE, **extra)
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
        assert spec.layer_norm is LocalNorm
        assert all(s.module is HyperConnectionTransformerLayer for s in spec.layer_specs)
        model = GPTModel(
            config, spec, vocab_size=64, max_sequence_length=16, position_embedding_type="rope"
        )
        layers = model.decoder.layers
        assert [isinstance(layer.mlp, MoELayer) for layer in layers] == [False, True, True]
        assert all(layer.mlp_hyper_connection is not None for layer in layers)
        assert isinstance(layers[0].self_attention, MLASelfAttention) == mla
        tokens, positions, mask = _batch()
        model(tokens, positions, mask, labels=tokens).sum().backward()
    connection = layers[1].mlp_hyper_connection.mapping_proj.weight
    assert connection.grad is not None and connection.grad.abs().sum() > 0
    assert layers[1].mlp.router.weight.grad.abs().sum() > 0


def test_block_spec_without_mhc_is_megatrons_with_local_norms():
    with model_parallel():
        config = _config(**MOE)
        spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine=False, enable_mhc_connections=False
        )
    assert [s.module.__name__ for s in spec.layer_specs] == ["TransformerLayer"] * 3
    assert spec.layer_specs[1].submodules.pre_mlp_layernorm is LocalNorm


@pytest.mark.parametrize("single_pass", [False, True], ids=["two_pass", "single_pass"])
def test_gpt_mtp_with_mhc_at_pp1_trains_on_the_contracted_stream(single_pass):
    """PP=1: the decoder contracts its streams before the final norm; the MTP layers are plain
    layers on that output (an mHC MTP layer is refused, see test_mhc_layer.py, and PP>1 by
    guards.check_gpt_mhc_mtp). Single pass: the contraction is by the last site's pre (0.09
    away from the mean here), which therefore gets a gradient from the MTP loss too."""
    seen = {}
    with model_parallel(seed=1):
        config = _config(mtp_num_layers=1, num_layers=2, mhc_single_pass=single_pass)
        mtp = core_specs.get_gpt_mtp_block_spec(
            config, get_gpt_layer_local_spec(), use_transformer_engine=False
        )
        model = GPTModel(
            config,
            get_gpt_layer_local_spec(enable_mhc_connections=True),
            vocab_size=64,
            max_sequence_length=16,
            position_embedding_type="rope",
            mtp_block_spec=mtp,
        )
        last = model.decoder.layers[-1]
        last.register_forward_hook(lambda m, args, out: seen.update(out=out[0]))
        connection = last.mlp_hyper_connection  # the decoder's last site
        maps = connection.compute_mappings

        def recorded_maps(streams):
            seen["last_maps"] = maps(streams)
            return seen["last_maps"]

        connection.compute_mappings = recorded_maps
        model.decoder.final_layernorm.register_forward_pre_hook(
            lambda m, args: seen.update(contracted=args[0])
        )
        tokens, positions, mask = _batch()
        model(tokens, positions, mask, labels=tokens).sum().backward()
        if single_pass:
            last_pre = seen["last_maps"][0]
            torch.testing.assert_close(seen["contracted"], aggregate(seen["out"], last_pre))
    assert model.mtp.layers[0].eh_proj.weight.grad.abs().sum() > 0
