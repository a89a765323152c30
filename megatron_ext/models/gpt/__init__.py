"""GPT models and layer specs.

``get_gpt_layer_local_spec`` is megatron-core's local spec with norms that also work under
sequence parallelism; ``GPTModel`` is megatron-core's GPTModel whose final norm comes from
the same builder when it is given a local layer spec.
"""

from megatron_ext.models.gpt.gpt_model import GPTModel
from megatron_ext.models.gpt.layer_specs import get_gpt_layer_local_spec

__all__ = ["GPTModel", "get_gpt_layer_local_spec"]
