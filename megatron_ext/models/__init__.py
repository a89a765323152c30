"""Model classes and layer specs: megatron-core's GPT (and, with mHC, Hybrid) models as
megatron-ext builds them, with local specs that run on CPU under every parallelism."""
