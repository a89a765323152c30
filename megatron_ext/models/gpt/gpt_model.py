"""megatron-core's GPTModel with a decoder whose final norm works under sequence parallelism."""

from __future__ import annotations

from typing import Any

from megatron.core.models.gpt.gpt_model import GPTModel as _CoreGPTModel
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import BaseTransformerLayer
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core import parallel_state

from megatron_ext.models.norms import LocalNorm


def _decoder_block_spec(config, layer_spec, vp_stage, pg_collection) -> Any:
    """Expand a layer spec into this stage's block spec, as megatron-core does, but with the
    final norm from the same builder as the layers' norms when those are local."""
    if not (isinstance(layer_spec, ModuleSpec) and issubclass(layer_spec.module, BaseTransformerLayer)):
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


class GPTModel(_CoreGPTModel):
    """megatron-core's GPTModel; same constructor, same parameters and outputs."""

    def __init__(self, config, transformer_layer_spec, *args: Any, **kwargs: Any) -> None:
        spec = _decoder_block_spec(
            config, transformer_layer_spec, kwargs.get("vp_stage"), kwargs.get("pg_collection")
        )
        super().__init__(config, spec, *args, **kwargs)
