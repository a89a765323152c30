"""megatron-ext's configuration: megatron-core's TransformerConfig plus the fields our
features add.

:class:`MHCTransformerConfig` adds upstream Megatron-LM's mHC (manifold-constrained
hyper-connections) fields, with upstream's names and defaults (declared once, in
:data:`megatron_ext.mhc_flags.MHC_DEFAULTS`, which the recipe schema reads too), and validates them before any
model or process group is built. With ``enable_mhc_connections=False`` (the default) it
behaves exactly like ``TransformerConfig``.

:class:`MHCMLATransformerConfig` is the same fields on megatron-core's
``MLATransformerConfig`` (multi-latent attention: q/kv LoRA ranks, rope/nope head dims, YaRN),
which is what ``pretrain_gpt --multi-latent-attention`` builds.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from megatron_ext import guards, native_mhc as native
from megatron_ext.mhc_flags import MHC_DEFAULTS

# Our entry in TransformerConfig.recompute_modules: output-discarding selective recompute of
# the mHC aggregate / layernorm / bias-dropout-add outputs.
MHC_RECOMPUTE_MODULE = "mhc"


@dataclass
class MHCTransformerConfig(TransformerConfig):
    """TransformerConfig with upstream's mHC fields (see megatron_ext.mhc for the maths)."""

    enable_mhc_connections: bool = MHC_DEFAULTS["enable_mhc_connections"]  # type: ignore[assignment]
    """Replace each residual connection with n mHC residual streams."""

    mhc_num_residual_streams: int = MHC_DEFAULTS["mhc_num_residual_streams"]  # type: ignore[assignment]
    """n, the number of residual streams (the residual is ``[s, b, n*hidden_size]``)."""

    mhc_sinkhorn_iterations: int = MHC_DEFAULTS["mhc_sinkhorn_iterations"]  # type: ignore[assignment]
    """Sinkhorn-Knopp iterations that make H_res doubly stochastic."""

    mhc_h_res_method: str = MHC_DEFAULTS["mhc_h_res_method"]  # type: ignore[assignment]
    """How H_res is made doubly stochastic: "sinkhorn" (Sinkhorn-Knopp on n² logits, upstream's
    method) or "birkhoff" (mHC-lite: softmax weights over the n! permutation matrices, exactly
    doubly stochastic; the projection's res block is then n! wide). Not an upstream field."""

    mhc_init_gating_factor: float = MHC_DEFAULTS["mhc_init_gating_factor"]  # type: ignore[assignment]
    """Initial value of alpha_pre, alpha_post and alpha_res (the dynamic-part gates)."""

    mhc_recompute_layer_num: int | None = MHC_DEFAULTS["mhc_recompute_layer_num"]  # type: ignore[assignment]
    """Layers per mHC recompute block when 'mhc' is in recompute_modules; None makes the
    whole local block one group."""

    mhc_learned_output_contract: bool = MHC_DEFAULTS["mhc_learned_output_contract"]  # type: ignore[assignment]
    """GPT only: contract the n streams before the final layernorm with upstream dev's
    (DeepSeek-V4's) learned contraction, ``learned_output_contract`` with parameters
    ``decoder.hc_head_fn/base/scale``, instead of upstream main's mean. Upstream dev has no
    switch (its GPT always does this); the name is its function's. The Hybrid stack always uses
    the learned contraction, as upstream does."""

    mhc_single_pass: bool = MHC_DEFAULTS["mhc_single_pass"]  # type: ignore[assignment]
    """DeepSeek-V4.1's single-pass mHC (upstream's name, Megatron-LM #7500): each sub-layer
    aggregates with the previous sub-layer's coefficients (megatron_ext.mhc.single_pass)."""

    use_fused_mhc: bool = MHC_DEFAULTS["use_fused_mhc"]  # type: ignore[assignment]
    """Run the mHC sub-layer maths through the fused Triton kernels of
    :mod:`megatron_ext.mhc.fused` instead of the lean native path (upstream's name). Needs
    triton and CUDA tensors (or CPU under ``TRITON_INTERPRET=1``), and n <= 8."""

    mhc_variant: str = MHC_DEFAULTS["mhc_variant"]  # type: ignore[assignment]
    """The maps' formulas (megatron_ext.mhc.variants): "megatron" (upstream main's), "deepseek-v4"
    (DeepSeek-V4's exact maps and learned hc_head) or "glm5" (the same maps, mean head)."""

    pipeline_schedule: str = "1f1b"
    """The pipeline schedule: "1f1b" (megatron's) or "zb-h1" (zero bubble: the local specs'
    linears defer their weight gradients, megatron_ext.pipeline.wgrad). Not an upstream field
    (megatron-core 0.19.2's delay_wgrad_compute requires overlap_moe_expert_parallel_comm)."""

    pipeline_schedule_file: str | None = None
    """With pipeline_schedule "zb-h1": a schedule text (megatron_ext.schedules.text: one line
    per rank, F0 B0 W0 ...) whose order the ZB-H1 runtime executes instead of the built one,
    after the same checks (dependencies, P2P pairing, peak in-flight). None: the built order."""

    def __post_init__(self):
        # megatron-core 0.19.2 asserts that every selective recompute_modules entry is one of
        # its own names and would reject "mhc", so hide it from the base validation and put it
        # back afterwards. Work on a copy: the caller's list is not ours to mutate.
        # (TransformerConfig is Any to the type checker: megatron-core ships no stubs.)
        requested: list[str] | None = getattr(self, "recompute_modules")  # noqa: B009 (mypy)
        wants_mhc_recompute = requested is not None and MHC_RECOMPUTE_MODULE in requested
        if requested is not None:
            self.recompute_modules = [m for m in requested if m != MHC_RECOMPUTE_MODULE]
        self._validate_base_without_native_mhc()
        if wants_mhc_recompute:
            self.recompute_modules.append(MHC_RECOMPUTE_MODULE)
        self._validate_mhc()
        guards.check_pipeline_schedule(self)
        guards.check_moe_bias(self)

    def _validate_base_without_native_mhc(self) -> None:
        """TransformerConfig's own validation. Where megatron-core declares the mHC fields
        itself (its native mHC, :func:`megatron_ext.native_mhc.config_declares_mhc`), that
        validation would judge megatron-ext's mHC by upstream's limits (no PP > 1, no MTP, no
        full recompute): it runs with mHC hidden, and megatron-ext's guards (run next) judge
        every mHC setting, upstream's checks among them, with megatron-ext's messages."""
        enabled = self.enable_mhc_connections
        hide = enabled and native.config_declares_mhc()
        if hide:
            self.enable_mhc_connections = False
        try:
            super().__post_init__()
        finally:
            if hide:
                self.enable_mhc_connections = enabled

    @property
    def mhc_recompute_enabled(self) -> bool:
        """True when mHC selective recompute is requested (selective granularity + 'mhc')."""
        return self.recompute_granularity == "selective" and MHC_RECOMPUTE_MODULE in (
            self.recompute_modules or []
        )

    def _validate_mhc(self) -> None:
        # The rules live in megatron_ext.guards (one list of every guard).
        guards.check_mhc_recompute(self)
        if self.enable_mhc_connections:
            # Before the fused check, so birkhoff + fused names birkhoff's reason.
            guards.check_mhc_h_res_method(self)
            guards.check_mhc_variant(self)
        guards.check_fused_mhc(self)
        if self.enable_mhc_connections:
            guards.check_mhc_values(self)
            guards.check_mhc_features(self)
            guards.check_mhc_layer_features(self)
            guards.check_mhc_pipeline(self)
        guards.check_mhc_single_pass(self)


@dataclass
class MHCMLATransformerConfig(MLATransformerConfig, MHCTransformerConfig):
    """megatron-core's MLATransformerConfig with upstream's mHC fields.

    MLA comes first so that its defaults (multi_latent_attention=True, RMSNorm, YaRN) win over
    TransformerConfig's, which MHCTransformerConfig's dataclass fields repeat. Both bases'
    ``__post_init__`` run (MLA's, then ours, then TransformerConfig's), so MLA's checks and the
    mHC guards all apply. ``isinstance`` of either base holds, which is
    what megatron's MLA attention and our mHC layers test."""


__all__ = ["MHCMLATransformerConfig", "MHCTransformerConfig", "MHC_RECOMPUTE_MODULE"]
