"""The mHC transformer layer on its own: shapes, attention-only and MLP-only layers (as a
HybridModel builds them), MoE MLPs, and every guard the layer, the
block, the model and the spec builders raise (type + the field named in the message)."""

import dataclasses

import pytest
import torch

from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megatron_ext.errors import ConfigError, SpecError
from megatron_ext.mhc import HyperConnectionModule
from megatron_ext.mhc.transformer_block import HyperConnectionTransformerBlock
from megatron_ext.mhc.transformer_layer import HyperConnectionTransformerLayer
from megatron_ext.models.gpt import (
    GPTModel,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron_ext.models.gpt.layer_specs import transformer_engine_available
from megatron_ext.models.norms import LocalNorm
from megatron_ext.testing.configs import small_config
from megatron_ext.testing.distributed import model_parallel

pytestmark = pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC recompute")

N, H, S, B = 2, 8, 5, 2


def _config(**overrides):
    fields = dict(
        num_layers=2,
        hidden_size=H,
        num_attention_heads=2,
        enable_mhc_connections=True,
        mhc_num_residual_streams=N,
    )
    return small_config(**{**fields, **overrides})


def _spec(**submodule_changes):
    spec = get_gpt_layer_local_spec(enable_mhc_connections=True)
    return dataclasses.replace(
        spec, submodules=dataclasses.replace(spec.submodules, **submodule_changes)
    )


def _layer(spec=None, config=None, seed=0, **kwargs):
    torch.manual_seed(seed)
    return build_module(spec or _spec(), config=config or _config(), layer_number=1, **kwargs)


def _streams(seed=1):
    return torch.randn(
        S, B, N * H, generator=torch.Generator().manual_seed(seed), requires_grad=True
    )


def _mask():
    return torch.triu(torch.ones(1, 1, S, S, dtype=torch.bool), diagonal=1)


ATTENTION_ONLY = dict(pre_mlp_layernorm=IdentityOp, mlp=IdentityOp, mlp_bda=IdentityFuncOp)
MLP_ONLY = dict(input_layernorm=IdentityOp, self_attention=IdentityOp, self_attn_bda=IdentityFuncOp)


# ----------------------------------------------------------------------------- behaviour


def test_layer_maps_n_streams_to_n_streams_and_every_parameter_gets_a_gradient():
    with model_parallel():
        layer = _layer()
        x = _streams()
        output, context = layer(x, attention_mask=_mask())
        output.square().sum().backward()
    assert output.shape == (S, B, N * H) and output._base is None and context is None
    for name, param in layer.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


def test_identity_sublayers_have_no_hyper_connection_and_pass_streams_through():
    with model_parallel():
        attention_only = _layer(_spec(**ATTENTION_ONLY))
        mlp_only = _layer(_spec(**MLP_ONLY))
    assert attention_only.mlp_hyper_connection is None
    assert mlp_only.self_attention_hyper_connection is None
    assert not any("mlp" in name for name, _ in attention_only.named_parameters())
    assert not any("attention" in name for name, _ in mlp_only.named_parameters())


def test_attention_only_then_mlp_only_equals_one_full_layer():
    """What a HybridModel does with '*' and '-' layers: the same maths as one full layer."""
    with model_parallel():
        full = _layer()
        attention_only = _layer(_spec(**ATTENTION_ONLY))
        mlp_only = _layer(_spec(**MLP_ONLY))
        state = full.state_dict()
        attention_only.load_state_dict(
            {k: v for k, v in state.items() if k in attention_only.state_dict()}
        )
        mlp_only.load_state_dict({k: v for k, v in state.items() if k in mlp_only.state_dict()})
        x = _streams()
        expected, _ = full(x, attention_mask=_mask())
        middle, _ = attention_only(x, attention_mask=_mask())
        output, _ = mlp_only(middle, attention_mask=_mask())
    torch.testing.assert_close(output, expected, rtol=0, atol=0)


def _moe_config(**overrides):
    return _config(
        num_moe_experts=2,
        moe_router_topk=2,
        moe_token_dispatcher_type="alltoall",
        moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=False,
        add_bias_linear=False,
        **overrides,
    )


def test_moe_mlp_is_wrapped_in_a_gpt_mhc_layer():
    with model_parallel():
        spec = get_gpt_layer_local_spec(num_experts=2, enable_mhc_connections=True)
        layer = _layer(spec, _moe_config())
        output, _ = layer(_streams(), attention_mask=_mask())
    assert layer.is_moe_layer and output.shape == (S, B, N * H)
    assert layer.mlp_hyper_connection is not None


def test_moe_mlp_is_accepted_when_built_for_hybrid():
    with model_parallel():
        spec = get_gpt_layer_local_spec(num_experts=2, enable_mhc_connections=True)
        spec = dataclasses.replace(spec, params={**spec.params, "allow_moe_mlp": True})
        layer = _layer(spec, _moe_config())
        output, _ = layer(_streams(), attention_mask=_mask())
    assert layer.is_moe_layer and output.shape == (S, B, N * H)


# ----------------------------------------------------------------------------- guards: layer


class _ResidualReturningNorm(torch.nn.Module):
    """A norm that also returns its input, as fused-residual norms do."""

    def __init__(self, config, hidden_size, eps=1e-5):
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden_size, eps=eps)

    def forward(self, x):
        return self.norm(x), x


@pytest.mark.parametrize("field", ["input_layernorm", "pre_mlp_layernorm"])
def test_tuple_returning_norms_are_rejected(field):
    with model_parallel():
        layer = _layer(_spec(**{field: _ResidualReturningNorm}))
        with pytest.raises(
            ValueError, match=rf"{field} that returns an \(output, residual\) tuple"
        ):
            layer(_streams(), attention_mask=_mask())


def test_cross_attention_hyper_connection_is_rejected():
    with model_parallel(), pytest.raises(SpecError, match="cross_attention_hyper_connection"):
        _layer(_spec(cross_attention_hyper_connection=HyperConnectionModule))


def test_cross_attention_is_rejected():
    spec = get_gpt_layer_local_spec(enable_mhc_connections=True)
    with model_parallel(), pytest.raises(NotImplementedError, match="cross_attention=IdentityOp"):
        _layer(_spec(cross_attention=spec.submodules.self_attention))


@pytest.mark.parametrize("field", ["self_attention_hyper_connection", "mlp_hyper_connection"])
def test_a_present_sublayer_needs_its_hyper_connection(field):
    with model_parallel(), pytest.raises(SpecError, match=rf"no {field}; set {field}="):
        _layer(_spec(**{field: IdentityOp}))


def test_a_layer_with_neither_sublayer_is_rejected():
    with model_parallel(), pytest.raises(SpecError, match="neither self_attention nor mlp"):
        _layer(_spec(**ATTENTION_ONLY, **MLP_ONLY))


def test_mhc_layer_needs_mhc_enabled_in_the_config():
    with model_parallel(), pytest.raises(ConfigError, match="enable_mhc_connections=True"):
        _layer(config=_config(enable_mhc_connections=False))


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(cuda_graph_impl="local"), "cuda_graph_impl"),
        (
            dict(fine_grained_activation_offloading=True, offload_modules=["attn_norm"]),
            "offload_modules",
        ),
        (dict(mlp_chunks_for_training=2), "mlp_chunks_for_training"),
    ],
)
def test_unqualified_features_are_rejected(overrides, field):
    with model_parallel(), pytest.raises(NotImplementedError, match=field):
        _layer(config=_config(**overrides))


def test_mtp_layers_are_rejected():
    with model_parallel(), pytest.raises(NotImplementedError, match="mtp_num_layers=None"):
        _layer(is_mtp_layer=True)


# ------------------------------------------------------------------ guards: model, block, specs


def test_plain_layer_spec_with_mhc_enabled_is_rejected_before_anything_is_built(monkeypatch):
    from megatron.core.models.gpt.gpt_model import GPTModel as CoreGPTModel

    def must_not_build(*args, **kwargs):
        raise AssertionError("the model was built before the spec was checked")

    monkeypatch.setattr(CoreGPTModel, "__init__", must_not_build)
    with (
        model_parallel(),
        pytest.raises(
            ValueError,
            match=r"enable_mhc_connections=True, but .*TransformerLayer.*"
            r"get_gpt_layer_local_spec\(enable_mhc_connections=True\)",
        ),
    ):
        GPTModel(_config(), get_gpt_layer_local_spec(), vocab_size=16, max_sequence_length=S)


def test_plain_layers_in_a_block_spec_are_rejected_too():
    block_spec = TransformerBlockSubmodules(
        layer_specs=[
            get_gpt_layer_local_spec(enable_mhc_connections=True),
            get_gpt_layer_local_spec(),
        ],
        layer_norm=LocalNorm,
    )
    with model_parallel(), pytest.raises(ValueError, match="enable_mhc_connections"):
        GPTModel(_config(), block_spec, vocab_size=16, max_sequence_length=S)


def test_last_stage_without_final_layernorm_is_rejected():
    with model_parallel(), pytest.raises(SpecError, match="post_layer_norm=True"):
        HyperConnectionTransformerBlock(
            _config(), get_gpt_layer_local_spec(enable_mhc_connections=True), post_layer_norm=False
        )


def test_mhc_recompute_with_extracted_layers_is_rejected():
    config = _config(recompute_granularity="selective", recompute_modules=["mhc"])
    with model_parallel():
        model = GPTModel(
            config,
            get_gpt_layer_local_spec(enable_mhc_connections=True),
            vocab_size=16,
            max_sequence_length=S,
        )
        with pytest.raises(NotImplementedError, match="recompute_modules"):
            model.decoder(torch.randn(S, B, H), _mask(), extract_layer_indices={0})


@pytest.mark.parametrize("enable_mhc_connections", [False, True])
def test_transformer_engine_spec_needs_transformer_engine(enable_mhc_connections):
    """Without TE: a clear ImportError. With TE: megatron-core's TE spec (mHC layer if asked)."""
    if not transformer_engine_available():
        with pytest.raises(ImportError, match="transformer_engine.*get_gpt_layer_local_spec"):
            get_gpt_layer_with_transformer_engine_spec(
                enable_mhc_connections=enable_mhc_connections
            )
        return
    spec = get_gpt_layer_with_transformer_engine_spec(enable_mhc_connections=enable_mhc_connections)
    if enable_mhc_connections:
        assert spec.module is HyperConnectionTransformerLayer
        assert spec.submodules.self_attention_hyper_connection is HyperConnectionModule
        assert spec.submodules.mlp_hyper_connection is HyperConnectionModule
    else:
        assert not getattr(spec.module, "supports_mhc_connections", False)
