"""Model classes and layer specs: megatron-core's GPT (and, with mHC, Hybrid) models as
megatron-ext builds them, with local specs that run on CPU under every parallelism."""

# Public through its subpackages: megatron_ext.models.gpt and megatron_ext.models.hybrid.
__all__: list[str] = []
