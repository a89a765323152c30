"""The mHC variants (``mhc_variant``): how a hyper connection turns the streams into its maps.

Three forms of the same sub-layer update ``x' = H_resᵀ x + H_post ⊗ F(Σ_i H_pre_i x_i)`` with
the same parameters (``mapping_proj.weight`` = fn ``[(2+n)·n, n·h]``, ``bias`` = base,
``alpha_pre/post/res`` = scale), differing only in the maps' formulas:

``megatron`` (upstream Megatron-LM main, Split 1 of PR #3430; today's default)
    ``r = 1 / (‖x‖/√(nh) + 1e-6)``, ``z = r·(W x) ⊙ α + b``, ``H_pre = σ(z_pre)``,
    ``H_post = 2σ(z_post)``, ``H_res = Sinkhorn(exp(z_res − rowmax))``: row then column
    normalisation, ``iterations`` times, sums clamped at 1e-6.

``deepseek-v4`` (DeepSeek-V4; transformers ``models/deepseek_v4/modeling_deepseek_v4.py``,
``DeepseekV4HyperConnection`` / ``DeepseekV4HyperHead``, transformers 5.x)
    ``r = rsqrt(mean(x²) + ε_rms)`` (an unweighted RMSNorm of the flattened n·h streams in fp32,
    ε_rms = the model's RMSNorm eps, here ``layernorm_epsilon``), the same ``z``,
    ``H_pre = σ(z_pre) + ε``, ``H_post = 2σ(z_post)``, ``H_res``: ``softmax(z_res, rows) + ε``,
    then divide by column sums + ε, then ``iterations − 1`` rounds of [rows + ε, columns + ε];
    ε = :data:`HC_EPS` (``hc_eps``). The final head is learned: ``Σ_j (σ(scale·fn_j·RMSNorm(x)
    + base_j) + ε)·x_j`` (``hc_head_fn/base/scale``).

``glm5`` (GLM-5-Next; transformers ``models/glm5_next/modeling_glm5_next.py``,
``Glm5NextTextHyperConnection`` / ``Glm5NextTextHyperHead``)
    The DeepSeek-V4 sub-layer maths exactly; the final head is the plain mean of the streams.

All three mix the residual by H_resᵀ (``mixed_k = Σ_j H_res[j, k] x_j``; transformers'
decoder layer: ``matmul(comb.transpose(-1, -2), hidden_states)``, Automodel #2159).

:class:`MapsForm` carries the per-variant constants into the lean path
(:class:`~megatron_ext.mhc.lean.StreamsIn`) and the reference path
(:mod:`megatron_ext.mhc.reference`); the DeepSeek Sinkhorn is here as a token-last forward
with an analytic backward plus a plain-autograd reference.

``mhc_h_res_method="birkhoff"`` with a DeepSeek variant: the variant's RMS factor and ``+ε`` on
H_pre, and mHC-lite's exact H_res (softmax weights over the n! permutation matrices) in place
of softmax+Sinkhorn: the n! block does not have the n² comb shape, so such a model has no
DeepSeek checkpoint counterpart (the converter refuses it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_ext.errors import ConfigError

VARIANTS = ("megatron", "deepseek-v4", "glm5")
"""The values of ``mhc_variant`` (recipe ``model.mhc.variant``, flag ``--mhc-variant``)."""

DEFAULT_VARIANT = "megatron"

# DeepSeek-V4's and GLM-5-Next's hc_eps (transformers config default 1e-6): added to H_pre,
# to the softmax of the comb logits and to every Sinkhorn denominator, and to the head weights.
HC_EPS = 1e-6

# Token-last layout of the n×n maps: [n (row i), n (column j), T]; a row sum runs over dim 1.
_ROW_DIM, _COL_DIM = 1, 0


@dataclass(frozen=True)
class MapsForm:
    """The constants of one variant's maps.

    ``rms_eps``: None is megatron's ``1/(RMS + 1e-6)``; a float is the DeepSeek
    ``rsqrt(mean(x²) + rms_eps)``. ``pre_eps`` is added to σ(z_pre). ``softmax_sinkhorn``
    selects the DeepSeek Sinkhorn (softmax + ε, column first, ε in every denominator).
    """

    rms_eps: float | None = None
    pre_eps: float = 0.0
    softmax_sinkhorn: bool = False


MEGATRON_FORM = MapsForm()


def uses_deepseek_maps(variant: str) -> bool:
    """True for the variants with DeepSeek-V4's sub-layer maths (deepseek-v4 and glm5)."""
    return variant in ("deepseek-v4", "glm5")


def maps_form(variant: str, rms_eps: float) -> MapsForm:
    """The :class:`MapsForm` of ``variant``; ``rms_eps`` is the model's RMSNorm eps."""
    if variant not in VARIANTS:
        raise ConfigError(f"mhc_variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    if not uses_deepseek_maps(variant):
        return MEGATRON_FORM
    return MapsForm(rms_eps=float(rms_eps), pre_eps=HC_EPS, softmax_sinkhorn=True)


def head_weight_eps(variant: str, rms_eps: float) -> float:
    """What the learned head adds to its sigmoid weights: DeepSeek-V4's hc_eps, or (megatron
    variant, upstream dev's ``learned_output_contract``) the layernorm eps it also normalises
    with."""
    return HC_EPS if uses_deepseek_maps(variant) else rms_eps


def contracts_by_mean(variant: str) -> bool:
    """GLM-5-Next's head is the plain mean of the streams (no hc_head parameters)."""
    return variant == "glm5"


# ----------------------------------------------------------------------------- the RMS factor


def inverse_rms(norm: torch.Tensor, width: int, form: MapsForm) -> torch.Tensor:
    """The RMS factor r from ``norm = ‖x‖₂`` over the ``width`` = n·h flattened streams."""
    if form.rms_eps is None:
        return torch.reciprocal(norm / math.sqrt(width) + 1e-6)
    return torch.rsqrt(norm.square() / width + form.rms_eps)


def inverse_rms_grad_coefficient(
    grad_inv_rms: torch.Tensor, norm: torch.Tensor, inv_rms: torch.Tensor, width: int, form
) -> torch.Tensor:
    """c with dL/dx (through r) = c · x, per token.

    megatron: r = 1/(‖x‖/√w + ε) so dr/dx = −r²/(√w ‖x‖)·x (0 for an all-zero token, as
    torch's norm backward); DeepSeek: r = (‖x‖²/w + ε)^(−1/2) so dr/dx = −r³/w · x.
    """
    if form.rms_eps is None:
        grad_norm = grad_inv_rms * (-inv_rms * inv_rms / math.sqrt(width))
        return torch.where(norm > 0, grad_norm / norm, torch.zeros_like(norm))
    return grad_inv_rms * (-(inv_rms**3) / width)


# ----------------------------------------------------------------------------- DeepSeek Sinkhorn


def _check_iterations(iterations: int) -> None:
    if iterations < 1:
        raise ConfigError(
            f"the DeepSeek-V4 Sinkhorn needs iterations >= 1, got {iterations}; "
            "set mhc_sinkhorn_iterations to a positive integer (DeepSeek-V4: 20)"
        )


def _step_dims(iterations: int) -> list[int]:
    """The sum axis of each normalisation: a column first, then ``iterations − 1`` × [row,
    column] (``hc_sinkhorn_iters`` counts the first column normalisation as one round)."""
    return [_COL_DIM] + [_ROW_DIM, _COL_DIM] * (iterations - 1)


def softmax_sinkhorn_forward_token_last(logits: torch.Tensor, iterations: int):
    """``(H [n, n, T], softmax [n, n, T])`` from token-last comb logits ``[n, n, T]``."""
    _check_iterations(iterations)
    soft = torch.softmax(logits.contiguous(), dim=_ROW_DIM)
    m = soft + HC_EPS
    for dim in _step_dims(iterations):
        m = m / (m.sum(dim=dim, keepdim=True) + HC_EPS)
    return m, soft


def softmax_sinkhorn_backward_token_last(
    grad: torch.Tensor, soft: torch.Tensor, iterations: int
) -> torch.Tensor:
    """dL/dlogits ``[n, n, T]`` from dL/dH: the loop is re-run from the saved softmax keeping
    each step's output y = x/(s+ε) and denominator, then walked back with
    ``dx = (g − Σ_dim g·y) / (s+ε)``, and through the softmax ``dz = p(g − Σ_row g·p)``."""
    dims = _step_dims(iterations)
    outputs, denominators, m = [], [], soft + HC_EPS
    for dim in dims:
        denominator = m.sum(dim=dim, keepdim=True) + HC_EPS
        m = m / denominator
        outputs.append(m)
        denominators.append(denominator)
    for dim, output, denominator in zip(
        reversed(dims), reversed(outputs), reversed(denominators), strict=True
    ):
        grad = (grad - (grad * output).sum(dim=dim, keepdim=True)) / denominator
    return soft * (grad - (grad * soft).sum(dim=_ROW_DIM, keepdim=True))


class SoftmaxSinkhornTokenLast(torch.autograd.Function):
    """``apply(logits [n, n, T], iterations) -> H [n, n, T]`` (DeepSeek-V4's comb); saves
    only the softmax."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, iterations: int) -> torch.Tensor:
        projected, soft = softmax_sinkhorn_forward_token_last(logits, iterations)
        ctx.save_for_backward(soft)
        ctx.iterations = iterations
        return projected

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (soft,) = ctx.saved_tensors
        return softmax_sinkhorn_backward_token_last(grad_output, soft, ctx.iterations), None


def softmax_sinkhorn_reference(logits: torch.Tensor, iterations: int) -> torch.Tensor:
    """DeepSeek-V4's comb for ``[..., n, n]`` logits (rows = last axis) through plain
    autograd: the ground truth for the analytic backward."""
    _check_iterations(iterations)
    m = torch.softmax(logits, dim=-1) + HC_EPS
    m = m / (m.sum(dim=-2, keepdim=True) + HC_EPS)
    for _ in range(iterations - 1):
        m = m / (m.sum(dim=-1, keepdim=True) + HC_EPS)
        m = m / (m.sum(dim=-2, keepdim=True) + HC_EPS)
    return m


__all__ = [
    "DEFAULT_VARIANT",
    "HC_EPS",
    "MEGATRON_FORM",
    "MapsForm",
    "SoftmaxSinkhornTokenLast",
    "VARIANTS",
    "contracts_by_mean",
    "head_weight_eps",
    "inverse_rms",
    "inverse_rms_grad_coefficient",
    "maps_form",
    "softmax_sinkhorn_backward_token_last",
    "softmax_sinkhorn_forward_token_last",
    "softmax_sinkhorn_reference",
    "uses_deepseek_maps",
]
