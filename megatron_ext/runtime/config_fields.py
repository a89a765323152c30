"""TransformerConfig fields a CPU run needs switched, for product and test configs alike."""

from __future__ import annotations

from typing import Any

# CPU weight init, and none of the CUDA-only fused kernels.
CPU_SAFE_FIELDS: dict[str, Any] = dict(
    use_cpu_initialization=True,
    bias_dropout_fusion=False,
    bias_activation_fusion=False,
    masked_softmax_fusion=False,
    persist_layer_norm=False,
    gradient_accumulation_fusion=False,
    apply_rope_fusion=False,
)
