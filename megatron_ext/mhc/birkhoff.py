"""mHC-lite's H_res: an exact convex combination of permutation matrices (Birkhoff–von Neumann).

Sinkhorn-Knopp (:mod:`megatron_ext.mhc.sinkhorn`) only approaches the Birkhoff polytope; after
20 iterations the row sums of H_res can be off by 6e-2 at logit scale 5. mHC-lite (arXiv
2601.05732) builds H_res inside the polytope by construction: the projection emits one logit per
permutation of the n streams, a softmax turns them into weights, and

    H_res = Σ_k w_k P_k,    w = softmax(logits),    P_k the k-th n×n permutation matrix

is doubly stochastic up to rounding (every P_k is, and the weights sum to one), so the composite
residual gain of any product of such matrices is exactly 1.

Shapes. With ``mhc_h_res_method="birkhoff"`` the projection's H_res block is ``n!`` wide instead
of ``n²``: ``mapping_proj.weight [2n + n!, n*h]`` and ``bias [2n + n!]`` (columns ``[0:n]`` pre,
``[n:2n]`` post, ``[2n:]`` one logit per permutation, in :func:`itertools.permutations` order of
``range(n)``; permutation ``p`` puts a 1 at ``P[i, p[i]]``). n is limited to
:data:`MAX_BIRKHOFF_STREAMS`: the width grows as n! (n=7 would be 5040 columns per sub-layer).

Backward is analytic: ``dw = dH · P`` (one matmul against the fixed permutation table), then the
softmax's ``dz = w ⊙ (dw − Σ w·dw)``.
"""

from __future__ import annotations

import itertools
import math
from functools import cache

import torch

from megatron_ext.errors import ConfigError

# Largest n allowed: the H_res logits are n! wide (n=6: 720; n=7 would be 5040 per sub-layer).
MAX_BIRKHOFF_STREAMS = 6

H_RES_METHODS = ("sinkhorn", "birkhoff")


def check_birkhoff_streams(n: int) -> None:
    """``mhc_h_res_method='birkhoff'`` holds n! logits per sub-layer: at most
    :data:`MAX_BIRKHOFF_STREAMS` streams (the guard
    :func:`megatron_ext.guards.check_mhc_h_res_method` asks it)."""
    if n > MAX_BIRKHOFF_STREAMS:
        raise ConfigError(
            f"mhc_h_res_method='birkhoff' supports mhc_num_residual_streams <= "
            f"{MAX_BIRKHOFF_STREAMS} (got {n}: its H_res logits are n! = {math.factorial(n)} "
            "projection columns per sub-layer); use fewer streams or mhc_h_res_method='sinkhorn'"
        )


def h_res_width(n: int, method: str) -> int:
    """How many projection columns produce H_res: n² for sinkhorn, n! for birkhoff."""
    return math.factorial(n) if method == "birkhoff" else n * n


@cache
def _permutation_table_cpu(n: int) -> torch.Tensor:
    perms = list(itertools.permutations(range(n)))
    table = torch.zeros(len(perms), n, n, dtype=torch.float64)
    for k, perm in enumerate(perms):
        table[k, torch.arange(n), torch.tensor(perm)] = 1.0
    return table.reshape(len(perms), n * n)


def permutation_table(n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """``[n!, n*n]``: row k is the k-th permutation matrix flattened row-major (``i*n + j``)."""
    return _permutation_table_cpu(n).to(device=device, dtype=dtype)


def birkhoff_forward(logits: torch.Tensor, n: int):
    """``(H [T, n*n] row-major, weights [T, n!])`` from logits ``[T, n!]`` (compute dtype)."""
    weights = torch.softmax(logits, dim=-1)
    return weights @ permutation_table(n, weights.dtype, weights.device), weights


def birkhoff_backward(grad_h: torch.Tensor, weights: torch.Tensor, n: int) -> torch.Tensor:
    """dL/dlogits ``[T, n!]`` from dL/dH ``[T, n*n]`` (row-major) and the saved weights."""
    grad_w = grad_h @ permutation_table(n, weights.dtype, weights.device).t()
    return weights * (grad_w - (grad_w * weights).sum(dim=-1, keepdim=True))


class BirkhoffMix(torch.autograd.Function):
    """``BirkhoffMix.apply(logits [..., n!], n) -> H_res [..., n, n]`` with the analytic
    backward; computed in fp32 (float64 stays float64) and returned in the logits' dtype."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, n: int) -> torch.Tensor:
        compute = logits.to(torch.promote_types(logits.dtype, torch.float32))
        flat = compute.reshape(-1, logits.shape[-1])
        h, weights = birkhoff_forward(flat, n)
        ctx.save_for_backward(weights)
        ctx.n, ctx.input_dtype = n, logits.dtype
        return h.reshape(*logits.shape[:-1], n, n).to(logits.dtype)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (weights,) = ctx.saved_tensors
        grad = grad_output.to(weights.dtype).reshape(weights.shape[0], -1)
        grad_logits = birkhoff_backward(grad, weights, ctx.n)
        shape = (*grad_output.shape[:-2], weights.shape[-1])
        return grad_logits.reshape(shape).to(ctx.input_dtype), None


def birkhoff_mix(logits: torch.Tensor, n: int) -> torch.Tensor:
    """``[..., n!]`` logits -> doubly-stochastic ``[..., n, n]`` (mHC-lite's H_res)."""
    if logits.shape[-1] != math.factorial(n):
        raise ValueError(
            f"birkhoff H_res needs n! = {math.factorial(n)} logits for n={n}, "
            f"got {logits.shape[-1]}"
        )
    return BirkhoffMix.apply(logits, n)


def birkhoff_reference(logits: torch.Tensor, n: int) -> torch.Tensor:
    """The same mapping through plain autograd (ground truth for tests)."""
    compute = logits.to(torch.promote_types(logits.dtype, torch.float32))
    weights = torch.softmax(compute, dim=-1)
    table = permutation_table(n, weights.dtype, weights.device)
    return (weights @ table).reshape(*logits.shape[:-1], n, n).to(logits.dtype)


__all__ = [
    "BirkhoffMix",
    "H_RES_METHODS",
    "MAX_BIRKHOFF_STREAMS",
    "birkhoff_backward",
    "birkhoff_forward",
    "birkhoff_mix",
    "birkhoff_reference",
    "check_birkhoff_streams",
    "h_res_width",
    "permutation_table",
]
