"""Small TransformerConfigs for CPU tests and benches."""

from __future__ import annotations

import warnings
from typing import Any

import torch

# What a CPU run needs switched: CPU weight init, and none of the CUDA-only fused kernels.
CPU_SAFE_FIELDS: dict[str, Any] = dict(
    use_cpu_initialization=True,
    bias_dropout_fusion=False,
    bias_activation_fusion=False,
    masked_softmax_fusion=False,
    persist_layer_norm=False,
    gradient_accumulation_fusion=False,
    apply_rope_fusion=False,
)


def small_config(config_class: type | None = None, **fields: Any):
    """A config (``MHCTransformerConfig`` unless given) with dropout off, fp32 and
    :data:`CPU_SAFE_FIELDS`; ``fields`` override any of them. mHC's advice to turn on
    recompute is muted: tests choose recompute explicitly."""
    from megatron_ext.config import MHCTransformerConfig

    kwargs: dict[str, Any] = dict(
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32, **CPU_SAFE_FIELDS
    )
    kwargs.update(fields)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return (config_class or MHCTransformerConfig)(**kwargs)
