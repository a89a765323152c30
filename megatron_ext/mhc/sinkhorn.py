"""Sinkhorn-Knopp projection of n×n logits onto doubly-stochastic matrices.

mHC constrains each residual-mixing matrix H_res to the Birkhoff polytope (rows and columns
sum to one), so mixing the n residual streams neither amplifies nor attenuates the signal.
This module implements upstream Megatron-LM main's form of the projection:

    M0 = exp(logits - rowmax(logits))
    repeat `iterations` times: divide by row sums, then by column sums (each clamped >= 1e-6)

Memory: autograd through the unrolled loop would keep 2·iterations intermediate n×n tensors
per token. The autograd.Function below saves only M0 and re-runs the (cheap) loop in backward.
"""

from __future__ import annotations

import torch

# Lower bound on every row/column sum; keeps a fully underflowed row from dividing by zero.
_MIN_DENOMINATOR = 1e-6


def _check_iterations(iterations: int) -> None:
    if iterations < 1:
        # The backward below drops the gradient through rowmax(logits); that is exact only
        # because the first row normalisation cancels any per-row scale of M0.
        raise ValueError(
            f"Sinkhorn-Knopp needs iterations >= 1, got {iterations}; "
            "set mhc_sinkhorn_iterations to a positive integer (upstream default 20)"
        )


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for bf16/fp16 inputs; float64 stays float64 (used by gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


def _exp_shifted(logits: torch.Tensor) -> torch.Tensor:
    """M0 = exp(logits - rowmax): positive, with at least one 1 per row, so no overflow."""
    return torch.exp(logits - logits.amax(dim=-1, keepdim=True))


def _normalise(m0: torch.Tensor, iterations: int) -> torch.Tensor:
    """Alternate row and column normalisation of a positive ``[..., n, n]`` matrix."""
    m = m0
    for _ in range(iterations):
        m = m / m.sum(dim=-1, keepdim=True).clamp_min(_MIN_DENOMINATOR)
        m = m / m.sum(dim=-2, keepdim=True).clamp_min(_MIN_DENOMINATOR)
    return m


def sinkhorn_reference(logits: torch.Tensor, iterations: int) -> torch.Tensor:
    """The same projection as plain differentiable torch ops (keeps every iteration).

    Used by tests as the ground truth for :class:`SinkhornKnopp`'s backward.
    """
    _check_iterations(iterations)
    compute = logits.to(_compute_dtype(logits.dtype))
    return _normalise(_exp_shifted(compute), iterations).to(logits.dtype)


class SinkhornKnopp(torch.autograd.Function):
    """``SinkhornKnopp.apply(logits [..., n, n], iterations) -> doubly-stochastic [..., n, n]``.

    Computed in fp32 (or wider) whatever the input dtype; returned in the input dtype.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, iterations: int) -> torch.Tensor:
        _check_iterations(iterations)
        m0 = _exp_shifted(logits.to(_compute_dtype(logits.dtype)))
        # Only M0 is kept; the loop's intermediates are recomputed in backward.
        ctx.save_for_backward(m0)
        ctx.iterations = iterations
        ctx.input_dtype = logits.dtype
        return _normalise(m0, iterations).to(logits.dtype)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (m0,) = ctx.saved_tensors
        with torch.enable_grad():
            m0_leaf = m0.detach().requires_grad_(True)
            projected = _normalise(m0_leaf, ctx.iterations)
            (grad_m0,) = torch.autograd.grad(projected, m0_leaf, grad_output.to(m0.dtype))
        # d exp(l - c)/dl = exp(l - c); the rowmax shift c contributes nothing because the
        # output is invariant to scaling a row of M0 (first step is a row normalisation).
        grad_logits = grad_m0 * m0
        return grad_logits.to(ctx.input_dtype), None


def sinkhorn_knopp(logits: torch.Tensor, iterations: int) -> torch.Tensor:
    """Project ``[..., n, n]`` logits onto doubly-stochastic matrices (memory-lean backward)."""
    return SinkhornKnopp.apply(logits, iterations)
