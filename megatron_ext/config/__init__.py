"""megatron-ext's configuration: megatron-core's TransformerConfig plus the fields our
features add.

:class:`MHCTransformerConfig` adds upstream Megatron-LM's mHC (manifold-constrained
hyper-connections) fields, with upstream's names and defaults, and validates them before any
model or process group is built. With ``enable_mhc_connections=False`` (the default) it
behaves exactly like ``TransformerConfig``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_ext import guards

# Our entry in TransformerConfig.recompute_modules: output-discarding selective recompute of
# the mHC aggregate / layernorm / bias-dropout-add outputs.
MHC_RECOMPUTE_MODULE = "mhc"


@dataclass
class MHCTransformerConfig(TransformerConfig):
    """TransformerConfig with upstream's mHC fields (see megatron_ext.mhc for the maths)."""

    enable_mhc_connections: bool = False
    """Replace each residual connection with n mHC residual streams."""

    mhc_num_residual_streams: int = 4
    """n, the number of residual streams (the residual is ``[s, b, n*hidden_size]``)."""

    mhc_sinkhorn_iterations: int = 20
    """Sinkhorn-Knopp iterations that make H_res doubly stochastic."""

    mhc_init_gating_factor: float = 0.01
    """Initial value of alpha_pre, alpha_post and alpha_res (the dynamic-part gates)."""

    mhc_recompute_layer_num: Optional[int] = None
    """Layers per mHC recompute block when 'mhc' is in recompute_modules; None makes the
    whole local block one group."""

    mhc_learned_output_contract: bool = False
    """GPT only: contract the n streams before the final layernorm with upstream dev's
    (DeepSeek-V4's) learned contraction, ``learned_output_contract`` with parameters
    ``decoder.hc_head_fn/base/scale``, instead of upstream main's mean. Upstream dev has no
    switch (its GPT always does this); the name is its function's. The Hybrid stack always uses
    the learned contraction, as upstream does."""

    use_fused_mhc: bool = False
    """Run the mHC sub-layer maths through the fused Triton kernels of
    :mod:`megatron_ext.mhc.fused` instead of the lean native path (upstream's name). Needs
    triton and CUDA tensors (or CPU under ``TRITON_INTERPRET=1``), and n <= 8."""

    def __post_init__(self):
        # megatron-core 0.19.2 asserts that every selective recompute_modules entry is one of
        # its own names and would reject "mhc", so hide it from the base validation and put it
        # back afterwards. Work on a copy: the caller's list is not ours to mutate.
        wants_mhc_recompute = (
            self.recompute_modules is not None and MHC_RECOMPUTE_MODULE in self.recompute_modules
        )
        if self.recompute_modules is not None:
            self.recompute_modules = [
                m for m in self.recompute_modules if m != MHC_RECOMPUTE_MODULE
            ]
        super().__post_init__()
        if wants_mhc_recompute:
            self.recompute_modules.append(MHC_RECOMPUTE_MODULE)
        self._validate_mhc()

    @property
    def mhc_recompute_enabled(self) -> bool:
        """True when mHC selective recompute is requested (selective granularity + 'mhc')."""
        return (
            self.recompute_granularity == "selective"
            and MHC_RECOMPUTE_MODULE in (self.recompute_modules or [])
        )

    def _validate_mhc(self) -> None:
        self._validate_mhc_recompute()
        self._validate_fused_mhc()
        if self.enable_mhc_connections:
            self._validate_mhc_values()
            self._reject_mhc_incompatible_features()
            guards.check_mhc_pipeline(self)

    def _validate_mhc_recompute(self) -> None:
        layer_num = self.mhc_recompute_layer_num
        if layer_num is not None and (
            isinstance(layer_num, bool) or not isinstance(layer_num, int) or layer_num < 1
        ):
            raise ValueError(
                f"mhc_recompute_layer_num must be a positive integer or None, got {layer_num!r}"
            )
        if not self.mhc_recompute_enabled:
            if self.enable_mhc_connections:
                warnings.warn(
                    "enable_mhc_connections=True without mHC recompute: each layer keeps its "
                    "n-stream activations. Consider recompute_granularity='selective' with "
                    "'mhc' in recompute_modules."
                )
            return
        if not self.enable_mhc_connections:
            raise ValueError(
                "'mhc' in recompute_modules requires enable_mhc_connections=True; "
                "set enable_mhc_connections=True or remove 'mhc' from recompute_modules"
            )
        if "mlp" in self.recompute_modules:
            raise ValueError(
                "'mhc' and 'mlp' in recompute_modules cannot be used together: they checkpoint "
                "the same MLP path with different mechanisms; remove one of them from "
                f"recompute_modules (got {self.recompute_modules})"
            )
        if self.fine_grained_activation_offloading:
            raise NotImplementedError(
                "'mhc' in recompute_modules does not work with "
                "fine_grained_activation_offloading=True (the recompute hook runs before the "
                "offload backward chunk exists); disable one of them"
            )

    def _validate_fused_mhc(self) -> None:
        if not self.use_fused_mhc:
            return
        if not self.enable_mhc_connections:
            raise ValueError(
                "use_fused_mhc=True requires enable_mhc_connections=True; set "
                "enable_mhc_connections=True or use_fused_mhc=False"
            )
        from megatron_ext.mhc.fused import MAX_FUSED_STREAMS, fused_unavailable_reason

        if self.mhc_num_residual_streams > MAX_FUSED_STREAMS:
            raise ValueError(
                f"use_fused_mhc=True supports mhc_num_residual_streams <= {MAX_FUSED_STREAMS} "
                f"(got {self.mhc_num_residual_streams}); set use_fused_mhc=False"
            )
        import torch

        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        reason = fused_unavailable_reason(device)
        if reason is not None:
            raise ValueError(f"use_fused_mhc=True cannot run here: {reason}; set use_fused_mhc=False")

    def _validate_mhc_values(self) -> None:
        streams = self.mhc_num_residual_streams
        if isinstance(streams, bool) or not isinstance(streams, int) or streams < 1:
            raise ValueError(f"mhc_num_residual_streams must be an integer >= 1, got {streams!r}")
        if self.mhc_sinkhorn_iterations < 1:
            raise ValueError(
                "mhc_sinkhorn_iterations must be >= 1 (the Sinkhorn-Knopp backward relies on "
                f"at least one row normalisation), got {self.mhc_sinkhorn_iterations}"
            )
        if self.mhc_init_gating_factor < 0:
            raise ValueError(
                "mhc_init_gating_factor must be non-negative, got "
                f"{self.mhc_init_gating_factor}"
            )

    def _reject_mhc_incompatible_features(self) -> None:
        if self.recompute_granularity == "full":
            raise NotImplementedError(
                "enable_mhc_connections does not support recompute_granularity='full' yet; use "
                "recompute_granularity='selective' with 'mhc' in recompute_modules, or no recompute"
            )
        if self.inference_fuse_tp_communication:
            raise NotImplementedError(
                "enable_mhc_connections does not support inference_fuse_tp_communication=True "
                "(the fused inference TP path assumes a single-stream residual); set it to False"
            )
        if self.fp32_residual_connection:
            raise NotImplementedError(
                "enable_mhc_connections does not support fp32_residual_connection=True (the "
                "n-stream residual feeds the H_res mixing and must share the activation dtype); "
                "set fp32_residual_connection=False"
            )


__all__ = ["MHCTransformerConfig", "MHC_RECOMPUTE_MODULE"]
