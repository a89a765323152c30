"""GPT models and layer specs.

``get_gpt_layer_local_spec`` is megatron-core's local spec with norms that also work under
sequence parallelism; ``GPTModel`` is megatron-core's GPTModel whose final norm comes from
the same builder when it is given a local layer spec. Both spec builders take
``enable_mhc_connections``; with it (and ``enable_mhc_connections=True`` in an
``MHCTransformerConfig``) the model carries n mHC residual streams between its layers. ``get_gpt_decoder_block_spec`` is the
MoE/MLA decoder block spec (megatron-core's, same treatment for every layer).
"""

from megatron_ext.models.gpt.gpt_model import GPTModel
from megatron_ext.models.gpt.layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)

__all__ = [
    "GPTModel",
    "get_gpt_decoder_block_spec",
    "get_gpt_layer_local_spec",
    "get_gpt_layer_with_transformer_engine_spec",
]
