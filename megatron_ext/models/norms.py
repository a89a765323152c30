"""A torch LayerNorm/RMSNorm builder that, unlike megatron-core's WrappedTorchNorm, works
under sequence parallelism.

Under SP each tensor-parallel rank normalises its own slice of the sequence, so the norm's
weights receive partial gradients; megatron's finalize_model_grads sums the gradients of
parameters marked ``sequence_parallel`` over the TP group. Apex's FusedLayerNorm and TE's
norms already do this; this builder is what our local specs use when neither is present.
"""

from __future__ import annotations

import torch

from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_ext.errors import ConfigError


def _norm_class(normalization: str) -> type[torch.nn.Module]:
    classes = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
    if normalization not in classes:
        raise ConfigError(
            f"normalization={normalization!r} is not supported by megatron-ext's local norm; "
            f"use one of {sorted(classes)}"
        )
    return classes[normalization]


class LocalNorm:
    """Builds ``torch.nn.LayerNorm`` or ``torch.nn.RMSNorm`` (from ``config.normalization``)
    with the constructor megatron-core's layer specs call norms with."""

    # A factory returning the torch norm, not a LocalNorm: megatron's specs name a class.
    def __new__(  # type: ignore[misc]
        cls,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ) -> torch.nn.Module:
        if config.layernorm_zero_centered_gamma or config.persist_layer_norm:
            raise ConfigError(
                "layernorm_zero_centered_gamma and persist_layer_norm need Apex or Transformer "
                "Engine norms; set both to False to use the local torch norm"
            )
        norm = _norm_class(config.normalization)(normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            # Read by finalize_model_grads: sum this parameter's grad over TP under SP.
            # megatron's attribute on parameters, which torch's Parameter type does not declare
            param.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]
        return norm
