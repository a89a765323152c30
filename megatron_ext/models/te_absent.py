"""Fixes for megatron-core code that breaks when Transformer Engine is absent (CPU runs).

megatron-core 0.20's ``MultiTokenPredictionLayer.__init__`` asks
``is_inference_column_parallel_linear(module)``, an ``isinstance`` against the
inference-optimised linears. Without Transformer Engine those classes derive from TE's
stand-ins and are not classes at all, so ``isinstance`` raises ``TypeError`` and every MTP
layer fails to build. No module can be such a linear then, so the answer is ``False``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def inference_linear_check_without_te(original: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """``is_inference_column_parallel_linear`` that answers ``False`` where the inference
    linears are not classes (Transformer Engine absent), the original's answer otherwise."""
    from megatron.core.tensor_parallel import inference_layers

    def is_inference_column_parallel_linear(module: Any) -> bool:
        linears = (
            inference_layers.InferenceColumnParallelLinear,
            inference_layers.InferenceLayerNormColumnParallelLinear,
        )
        if not all(isinstance(linear, type) for linear in linears):
            return False
        return original(module)

    return is_inference_column_parallel_linear


__all__ = ["inference_linear_check_without_te"]
