"""Small TransformerConfigs for CPU tests and benches."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from megatron_ext.runtime.config_fields import CPU_SAFE_FIELDS


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
