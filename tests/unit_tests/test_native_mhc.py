"""megatron_ext.native_mhc: what the installed megatron-core's own mHC does, read from the code.

0.19.2 has none of it. A 0.20 build owns the config fields, the layer's hyper-connection
submodules and the block's expansion; whether its schedules size n streams is cross-checked
by behaviour: exactly the build whose config accepts native mHC at PP 2 (#4946) does."""

import dataclasses

import torch

from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

from megatron_ext import native_mhc as native, registry
from megatron_ext.mhc.transformer_layer import layer_fields_without_hyper_connections
from megatron_ext.runtime.config_fields import CPU_SAFE_FIELDS


def test_0192_has_no_native_mhc_and_020_has_it():
    answers = (
        native.config_declares_mhc(),
        native.layer_submodules_declare_hyper_connections(),
        native.block_expands_streams(),
    )
    if registry.megatron_core_version() == "0.19.2":
        assert answers == (False, False, False) and not native.schedules_size_streams()
    else:
        assert answers == (True, True, True)


def test_schedules_size_streams_where_the_config_lets_native_mhc_pipeline():
    if not native.config_declares_mhc():  # 0.19.2: no native mHC, nothing sized for it
        assert not native.schedules_size_streams()
        return
    try:
        TransformerConfig(
            num_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            enable_mhc_connections=True,
            pipeline_model_parallel_size=2,
            pipeline_dtype=torch.float32,
            **CPU_SAFE_FIELDS,
        )
        accepts_pipeline = True
    except NotImplementedError:
        accepts_pipeline = False
    assert native.schedules_size_streams() == accepts_pipeline


def test_layer_fields_leave_the_hyper_connections_to_the_mhc_submodules():
    fields = layer_fields_without_hyper_connections(TransformerLayerSubmodules())
    declared = {f.name for f in dataclasses.fields(TransformerLayerSubmodules)}
    assert set(fields) == declared - set(native.HYPER_CONNECTION_SUBMODULES)
