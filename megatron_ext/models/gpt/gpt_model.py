"""megatron-core's GPTModel with a decoder whose final norm works under sequence parallelism,
and, with ``config.enable_mhc_connections``, n mHC residual streams between its layers."""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_model import GPTModel as _CoreGPTModel
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import BaseTransformerLayer, TransformerLayer

from megatron_ext import guards, native_mhc as native
from megatron_ext.mhc.transformer_block import (
    HyperConnectionTransformerBlock,
    check_layers_support_mhc,
)
from megatron_ext.mhc.transformer_layer import run_attention_then_mlp
from megatron_ext.models.norms import LocalNorm


def _decoder_block_spec(config, layer_spec, vp_stage, pg_collection) -> Any:
    """Expand a layer spec into this stage's block spec, as megatron-core does, but with the
    final norm from the same builder as the layers' norms when those are local."""
    if not (
        isinstance(layer_spec, ModuleSpec) and issubclass(layer_spec.module, BaseTransformerLayer)
    ):
        return layer_spec
    layer_norm_spec = layer_spec.submodules.input_layernorm
    if layer_norm_spec not in (LocalNorm, WrappedTorchNorm):
        return layer_spec  # Apex/TE specs: megatron-core's own final norm already fits.
    pp_rank = (
        pg_collection.pp.rank()
        if pg_collection is not None
        else parallel_state.get_pipeline_model_parallel_rank()
    )
    num_layers = get_num_layers_to_build(config, vp_stage, pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * num_layers, layer_norm=LocalNorm)


def _layer_specs(spec: Any) -> list:
    """The layer specs a decoder spec (layer spec, block submodules or block spec) builds."""
    if isinstance(spec, TransformerBlockSubmodules):
        return list(spec.layer_specs or [])
    if (
        isinstance(spec, ModuleSpec)
        and isinstance(spec.module, type)
        and issubclass(spec.module, TransformerBlock)
    ):
        return _layer_specs(spec.submodules)
    return [spec]


class ContractedStreamTransformerLayer(TransformerLayer):
    """megatron-core's TransformerLayer as an MTP layer of an mHC GPTModel: it runs after the
    decoder contracted the n streams, on the single stream, exactly as TransformerLayer does.

    Where megatron-core has native mHC, its TransformerLayer refuses an mHC config (its
    ``__init__`` without ``supports_mhc_connections``, its ``forward`` by an assert), although
    such a layer never sees the streams; this class says so and runs the same two steps."""

    supports_mhc_connections: bool = True

    def forward(self, *args: Any, **kwargs: Any):
        return run_attention_then_mlp(self, *args, **kwargs)


def _on_contracted_stream(spec: Any) -> Any:
    """``spec`` (an MTP block spec, its submodules, lists of them) with every plain
    TransformerLayer replaced by :class:`ContractedStreamTransformerLayer`."""
    if isinstance(spec, ModuleSpec):
        module = (
            ContractedStreamTransformerLayer if spec.module is TransformerLayer else spec.module
        )
        return dataclasses.replace(
            spec, module=module, submodules=_on_contracted_stream(spec.submodules)
        )
    if isinstance(spec, list):
        return [_on_contracted_stream(item) for item in spec]
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        fields = [f.name for f in dataclasses.fields(spec) if f.init]
        return dataclasses.replace(
            spec, **{name: _on_contracted_stream(getattr(spec, name)) for name in fields}
        )
    return spec


class GPTModel(_CoreGPTModel):
    """megatron-core's GPTModel; same constructor, same parameters and outputs.

    With ``config.enable_mhc_connections=True`` the layer spec must build mHC layers
    (``get_gpt_layer_local_spec(enable_mhc_connections=True)``; checked before anything is
    built) and the decoder is a :class:`HyperConnectionTransformerBlock`: it expands the
    embedding output into n streams and contracts them before the final layernorm.
    """

    def __init__(self, config, transformer_layer_spec, *args: Any, **kwargs: Any) -> None:
        spec = _decoder_block_spec(
            config, transformer_layer_spec, kwargs.get("vp_stage"), kwargs.get("pg_collection")
        )
        mhc = bool(getattr(config, "enable_mhc_connections", False))
        if mhc:
            guards.check_gpt_mhc_mtp(config)
            check_layers_support_mhc(config, _layer_specs(spec), "the GPTModel layer spec")
            if kwargs.get("mtp_block_spec") is not None and native.config_declares_mhc():
                kwargs["mtp_block_spec"] = _on_contracted_stream(kwargs["mtp_block_spec"])
        super().__init__(config, spec, *args, **kwargs)
        if mhc:
            # megatron-core's GPTModel builds a plain TransformerBlock with no way to choose
            # the class; give the block its mHC behaviour in place (nothing is rebuilt).
            HyperConnectionTransformerBlock.adopt(self.decoder)
