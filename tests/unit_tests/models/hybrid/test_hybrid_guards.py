"""Every refusal of megatron-ext's Hybrid model and specs: its exception type, and a message
naming what to change."""

import dataclasses

import pytest

from megatron.core.models.hybrid.hybrid_block import HybridStack as CoreHybridStack
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_ext import guards
from megatron_ext.models.hybrid import (
    HybridModel,
    HybridStack,
    HyperConnectionMTPLayer,
    get_hybrid_stack_local_spec,
    get_hybrid_stack_with_transformer_engine_spec,
)
from megatron_ext.models.hybrid.layer_specs import mamba_ssm_available, transformer_engine_available
from megatron_ext.models.hybrid.mamba_layer import HyperConnectionMambaLayer
from megatron_ext.models.norms import LocalNorm
from megatron_ext.testing.configs import small_config
from megatron_ext.testing.distributed import model_parallel

pytestmark = pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC recompute")


def _config(mhc=True, **fields):
    settings = dict(
        num_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        enable_mhc_connections=mhc,
        mhc_num_residual_streams=2,
    )
    settings.update(fields)
    return small_config(**settings)


def _model(config, spec, pattern, **kwargs):
    return HybridModel(
        config, spec, vocab_size=32, max_sequence_length=8, hybrid_layer_pattern=pattern, **kwargs
    )


def test_mhc_needs_megatron_ext_hybrid_stack():
    spec = get_hybrid_stack_local_spec(enable_mhc_connections=True)
    core_spec = ModuleSpec(module=CoreHybridStack, submodules=spec.submodules)
    with model_parallel(), pytest.raises(ValueError, match="hybrid_stack_spec"):
        _model(_config(), core_spec, "*-")


def test_mhc_with_a_plain_layer_spec_is_refused_before_building():
    with (
        model_parallel(),
        pytest.raises(ValueError, match="enable_mhc_connections=True.*get_hybrid_stack_local_spec"),
    ):
        _model(_config(), get_hybrid_stack_local_spec(enable_mhc_connections=False), "*-")


def test_plain_layer_spec_with_an_mhc_config_flag_off_is_fine():
    with model_parallel():
        model = _model(_config(mhc=False), get_hybrid_stack_local_spec(), "*-")
        assert not hasattr(model.decoder, "hc_head_fn")


@pytest.mark.skipif(mamba_ssm_available(), reason="mamba_ssm is installed here")
def test_mamba_symbol_without_mamba_ssm_names_the_symbol():
    with model_parallel(), pytest.raises(NotImplementedError, match=r"'M' \(Mamba\).*mamba_ssm"):
        _model(_config(mhc=False), get_hybrid_stack_local_spec(), "M*")


@pytest.mark.skipif(mamba_ssm_available(), reason="mamba_ssm is installed here")
def test_mamba_symbol_with_mhc_without_mamba_ssm_is_refused_before_building(monkeypatch):
    from megatron_ext.models.hybrid import hybrid_stack

    def never_built(*args, **kwargs):
        raise AssertionError("the stack was built")

    monkeypatch.setattr(hybrid_stack.HybridStack, "__init__", never_built)
    with model_parallel(), pytest.raises(NotImplementedError, match=r"'M' \(Mamba\).*mamba_ssm"):
        _model(_config(), get_hybrid_stack_local_spec(enable_mhc_connections=True), "M*")


@pytest.mark.parametrize("symbol", ["G", "D"])
def test_symbols_without_a_local_spec_name_the_symbol(symbol):
    with model_parallel(), pytest.raises(NotImplementedError, match=f"'{symbol}'"):
        _model(_config(mhc=False), get_hybrid_stack_local_spec(), f"{symbol}-")


def test_standalone_mtp_flag_is_refused_with_mhc():
    config = _config(mtp_num_layers=1)
    config.mtp_standalone = True  # what a pipeline layout placing MTP on its own stage sets
    with (
        model_parallel(),
        pytest.raises(guards.UnsupportedCombinationError, match="mtp_standalone"),
    ):
        _model(config, get_hybrid_stack_local_spec(enable_mhc_connections=True), "*-/*-")


def test_mtp_chunk_without_post_process_is_refused_with_mhc():
    """A chunk holding the MTP layers but not the final norm and loss (post_process)."""
    with model_parallel(), pytest.raises(guards.UnsupportedCombinationError, match="post_process"):
        _model(
            _config(mtp_num_layers=1),
            get_hybrid_stack_local_spec(enable_mhc_connections=True),
            "*-/*-",
            post_process=False,
        )


def test_mhc_mtp_with_a_single_stream_mtp_layer_spec_is_refused():
    spec = get_hybrid_stack_local_spec(enable_mhc_connections=True)
    mtp_spec = spec.submodules.mtp_block_spec
    plain_layer = ModuleSpec(
        module=MultiTokenPredictionLayer, submodules=mtp_spec.submodules.layer_specs[0].submodules
    )
    mtp_spec = dataclasses.replace(
        mtp_spec, submodules=dataclasses.replace(mtp_spec.submodules, layer_specs=[plain_layer])
    )
    spec = dataclasses.replace(
        spec, submodules=dataclasses.replace(spec.submodules, mtp_block_spec=mtp_spec)
    )
    with (
        model_parallel(),
        pytest.raises(ValueError, match="mtp_block_spec.*HyperConnectionMTPLayer"),
    ):
        _model(_config(mtp_num_layers=1), spec, "*-/*-")


def test_mhc_mtp_layer_without_per_stream_projections_is_refused():
    spec = get_hybrid_stack_local_spec(enable_mhc_connections=True)
    layer = spec.submodules.mtp_block_spec.submodules.layer_specs[0]
    layer = dataclasses.replace(
        layer, submodules=dataclasses.replace(layer.submodules, h_proj=None)
    )
    with model_parallel(), pytest.raises(ValueError, match="h_proj"):
        HyperConnectionMTPLayer(
            _config(mtp_num_layers=1),
            layer.submodules,
            mtp_layer_pattern="-",
            hybrid_submodules=spec.submodules,
            pg_collection=_pg_collection(),
        )


def test_mhc_mtp_layer_outside_a_hybrid_model_is_refused():
    spec = get_hybrid_stack_local_spec(enable_mhc_connections=True)
    layer = spec.submodules.mtp_block_spec.submodules.layer_specs[0]
    with (
        model_parallel(),
        pytest.raises(ValueError, match="mtp_layer_pattern and hybrid_submodules"),
    ):
        HyperConnectionMTPLayer(
            _config(mtp_num_layers=1), layer.submodules, pg_collection=_pg_collection()
        )


def test_mhc_post_process_stack_without_final_norm_is_refused():
    spec = get_hybrid_stack_local_spec(enable_mhc_connections=True)
    with model_parallel(), pytest.raises(ValueError, match="post_layer_norm=True"):
        HybridStack(
            _config(),
            spec.submodules,
            layer_type_list=["-"],
            post_layer_norm=False,
            pg_collection=_pg_collection(),
        )


@pytest.mark.skipif(transformer_engine_available(), reason="Transformer Engine is installed here")
@pytest.mark.parametrize("mhc", [False, True])
def test_transformer_engine_spec_needs_transformer_engine(mhc):
    with pytest.raises(ImportError, match="transformer_engine.*get_hybrid_stack_local_spec"):
        get_hybrid_stack_with_transformer_engine_spec(enable_mhc_connections=mhc)


def test_local_spec_final_norm_and_projections_are_local():
    spec = get_hybrid_stack_local_spec(enable_mhc_connections=True)
    assert spec.module is HybridStack and spec.submodules.final_norm is LocalNorm
    layer = spec.submodules.mtp_block_spec.submodules.layer_specs[0]
    assert layer.module is HyperConnectionMTPLayer
    assert (
        layer.submodules.e_proj is ColumnParallelLinear
        and layer.submodules.h_proj is ColumnParallelLinear
    )


def _pg_collection():
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection.use_mpu_process_groups()


@pytest.mark.parametrize("mhc", [False, True])
def test_transformer_engine_spec_structure(monkeypatch, mhc):
    """The TE spec is only assembled here (its modules need Transformer Engine to build)."""
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TENorm

    from megatron_ext.models.hybrid import HybridHyperConnectionLayer, layer_specs

    monkeypatch.setattr(layer_specs, "transformer_engine_available", lambda: True)
    spec = get_hybrid_stack_with_transformer_engine_spec(enable_mhc_connections=mhc)
    assert spec.module is HybridStack and spec.submodules.final_norm is TENorm
    layer_classes = {
        getattr(spec.submodules, field).module
        for field in ("attention_layer", "mlp_layer", "moe_layer")
    }
    mtp_layer = spec.submodules.mtp_block_spec.submodules.layer_specs[0]
    if mhc:
        assert layer_classes == {HybridHyperConnectionLayer}
        assert spec.submodules.moe_layer.params == {"allow_moe_mlp": True}
        assert mtp_layer.module is HyperConnectionMTPLayer
        assert mtp_layer.submodules.e_proj is TEColumnParallelLinear
        assert spec.submodules.mamba_layer.module is HyperConnectionMambaLayer
        # Megatron's TE spec builds these symbols from TransformerLayers: mHC layers too.
        for field in ("gdn_layer", "dsa_layer", "mla_layer"):
            assert getattr(spec.submodules, field).module is HybridHyperConnectionLayer
    else:
        assert HybridHyperConnectionLayer not in layer_classes
        assert mtp_layer.module is MultiTokenPredictionLayer
