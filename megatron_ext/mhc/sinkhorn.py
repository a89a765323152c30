"""Sinkhorn-Knopp projection of n×n logits onto doubly-stochastic matrices.

mHC constrains each residual-mixing matrix H_res to the Birkhoff polytope (rows and columns
sum to one), so mixing the n residual streams neither amplifies nor attenuates the signal.
This module implements upstream Megatron-LM main's form of the projection:

    M0 = exp(logits - rowmax(logits))
    repeat `iterations` times: divide by row sums, then by column sums (each clamped >= 1e-6)

The rowmax shift keeps exp from overflowing and the clamp keeps an underflowed row or column
from dividing by zero, so extreme logits give finite values and gradients.

Speed. The matrices are tiny (n <= 8) and there is one per token, so the cost is the number
of tensor ops, not arithmetic. The fast form works *token-last*: ``[n, n, T]``, so every row
or column sum is a vectorised reduction over long contiguous token rows instead of a
reduction over a 4-element innermost dim. Its backward is analytic: it re-runs the (cheap)
forward loop keeping each step's output and sum, then walks back through
``d(x/s) = (g - Σ g·y) / s`` per step. No ``torch.autograd.grad`` call, no ``.item()``, so
``torch.compile`` sees no graph break. Memory: forward saves only M0 (as upstream does); the
loop's intermediates exist only transiently inside backward.

:func:`sinkhorn_reference` is the same maths through plain autograd; tests use it as ground
truth.
"""

from __future__ import annotations

import torch

from megatron_ext.errors import ConfigError

# Lower bound on every row/column sum; keeps a fully underflowed row from dividing by zero.
_MIN_DENOMINATOR = 1e-6

# Token-last layout: [n (row i), n (column j), T]. A row sum runs over dim 1, a column sum
# over dim 0.
_ROW_DIM, _COL_DIM = 1, 0


def _check_iterations(iterations: int) -> None:
    if iterations < 1:
        # The backward below drops the gradient through rowmax(logits); that is exact only
        # because the first row normalisation cancels any per-row scale of M0.
        raise ConfigError(
            f"Sinkhorn-Knopp needs iterations >= 1, got {iterations}; "
            "set mhc_sinkhorn_iterations to a positive integer (upstream default 20)"
        )


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for bf16/fp16 inputs; float64 stays float64 (used by gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


def _exp_shifted(logits: torch.Tensor, row_dim: int = -1) -> torch.Tensor:
    """M0 = exp(logits - rowmax): positive, with at least one 1 per row, so no overflow."""
    return torch.exp(logits - logits.amax(dim=row_dim, keepdim=True))


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


# ----------------------------------------------------------------------------- token-last core


def _normalise_token_last(m0: torch.Tensor, iterations: int) -> torch.Tensor:
    """Alternate row/column normalisation of ``[n, n, T]``."""
    m = m0
    for _ in range(iterations):
        for dim in (_ROW_DIM, _COL_DIM):
            m = m / m.sum(dim=dim, keepdim=True).clamp_min_(_MIN_DENOMINATOR)
    return m


def sinkhorn_forward_token_last(logits: torch.Tensor, iterations: int):
    """``(H [n, n, T], M0)`` from token-last logits ``[n, n, T]`` (compute dtype in, out).

    The logits are made contiguous first: a transposed view of ``[T, n*n]`` logits keeps the
    token dim strided, every op below would inherit that layout, and the loop would run ~3×
    slower (measured in a layer: the point of working token-last is contiguous token rows).
    """
    m0 = _exp_shifted(logits.contiguous(), row_dim=_ROW_DIM)
    return _normalise_token_last(m0, iterations), m0


def sinkhorn_backward_token_last(
    grad: torch.Tensor, m0: torch.Tensor, iterations: int
) -> torch.Tensor:
    """dL/dlogits ``[n, n, T]`` from dL/dH, re-running the loop from the saved M0.

    Each step is y = x / s with s = max(Σ_dim x, eps), so dx = g / s - [s > eps] · Σ_dim(g·y) / s
    (clamp_min passes no gradient where it clamped). The re-run writes every step's
    (clamped) sum into one buffer, so 1/s and -[s > eps]/s are two ops for all steps.
    """
    n, _, tokens = m0.shape
    steps = 2 * iterations
    sums = m0.new_empty(steps, n, tokens)
    outputs, m = [], m0
    for step in range(steps):
        dim = _ROW_DIM if step % 2 == 0 else _COL_DIM
        total = sums[step].unsqueeze(dim)
        torch.sum(m, dim=dim, keepdim=True, out=total)
        m = m / total.clamp_min_(_MIN_DENOMINATOR)
        outputs.append(m)
    inverse = sums.reciprocal()
    # A sum exactly at eps counts as clamped here (autograd's clamp would pass it): immaterial.
    through_sum = inverse.mul_(sums > _MIN_DENOMINATOR).neg_()
    inverse = sums.reciprocal_()
    for step in reversed(range(steps)):
        dim = _ROW_DIM if step % 2 == 0 else _COL_DIM
        weighted = (grad * outputs[step]).sum(dim=dim, keepdim=True)
        weighted.mul_(through_sum[step].unsqueeze(dim))
        grad = torch.addcmul(weighted, grad, inverse[step].unsqueeze(dim))
    # d exp(l - c)/dl = exp(l - c); the rowmax shift c contributes nothing because the output
    # is invariant to scaling a row of M0 (the first step is a row normalisation).
    return grad.mul_(m0)


class SinkhornTokenLast(torch.autograd.Function):
    """``SinkhornTokenLast.apply(logits [n, n, T], iterations) -> H [n, n, T]``, in the
    logits' dtype (callers pass fp32 or float64). Saves only M0."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, iterations: int) -> torch.Tensor:
        projected, m0 = sinkhorn_forward_token_last(logits, iterations)
        ctx.save_for_backward(m0)
        ctx.iterations = iterations
        return projected

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (m0,) = ctx.saved_tensors
        # The first step of the walk back allocates a fresh tensor; the input is not written.
        return sinkhorn_backward_token_last(grad_output, m0, ctx.iterations), None


def sinkhorn_token_last(logits: torch.Tensor, iterations: int) -> torch.Tensor:
    """Project token-last logits ``[n, n, T]`` (row i, column j, token t)."""
    _check_iterations(iterations)
    return SinkhornTokenLast.apply(logits, iterations)


# ----------------------------------------------------------------------------- [..., n, n] API


class SinkhornKnopp(torch.autograd.Function):
    """``SinkhornKnopp.apply(logits [..., n, n], iterations) -> doubly-stochastic [..., n, n]``.

    Computed in fp32 (or wider) whatever the input dtype; returned in the input dtype. Runs
    the token-last core; the result is contiguous ``[..., n, n]``.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, iterations: int) -> torch.Tensor:
        _check_iterations(iterations)
        *batch, n, n_cols = logits.shape
        token_last = logits.to(_compute_dtype(logits.dtype)).reshape(-1, n, n_cols)
        token_last = token_last.permute(1, 2, 0).contiguous()
        projected, m0 = sinkhorn_forward_token_last(token_last, iterations)
        ctx.save_for_backward(m0)
        ctx.iterations = iterations
        ctx.input_dtype = logits.dtype
        return projected.permute(2, 0, 1).reshape(*batch, n, n_cols).to(logits.dtype)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (m0,) = ctx.saved_tensors
        n, n_cols, _ = m0.shape
        grad = grad_output.to(m0.dtype).reshape(-1, n, n_cols).permute(1, 2, 0).contiguous()
        grad_logits = sinkhorn_backward_token_last(grad, m0, ctx.iterations)
        grad_logits = grad_logits.permute(2, 0, 1).reshape(grad_output.shape)
        return grad_logits.to(ctx.input_dtype), None


def sinkhorn_knopp(logits: torch.Tensor, iterations: int) -> torch.Tensor:
    """Project ``[..., n, n]`` logits onto doubly-stochastic matrices (memory-lean backward)."""
    return SinkhornKnopp.apply(logits, iterations)
