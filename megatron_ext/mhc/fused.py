"""Fused Triton kernels for one mHC sub-layer (``use_fused_mhc=True``).

This module owns the Triton form of the two places where an mHC sub-layer touches the n·h
stream tensor. It computes exactly what the lean native path
(:mod:`megatron_ext.mhc.lean`, the fallback and the reference) computes, with the same
inputs and outputs, so :class:`~megatron_ext.mhc.HyperConnectionModule` swaps one for the
other:

* :class:`FusedStreamsIn` — everything before the sub-layer, three kernels:

  1. ``_maps_kernel``: one pass over each token's n·h vector computing its squared norm and
     its projection ``x Wᵀ`` (an in-kernel ``tl.dot`` against the gated weight, K = n²+2n
     padded to a power of two), then ``z = r · xWᵀ + bias``, ``H_pre = σ(z_pre)``,
     ``H_post = 2σ(z_post)``; ``z`` keeps the Sinkhorn logits.
  2. ``_sinkhorn_kernel``: the exp/clamp Sinkhorn of :mod:`megatron_ext.mhc.sinkhorn` on a
     block of tokens, each n×n matrix (n ≤ 8, padded to a power of two) held in registers;
     writes ``mix = H_resᵀ`` in the activation dtype. ``_sinkhorn_backward_kernel`` saves
     nothing from the forward but the logits: to walk back through iteration k it re-runs
     iterations 0..k-1 from M0 in registers (O(iterations²) cheap register work instead of
     O(iterations) stored matrices).
  3. ``_aggregate_kernel``: ``Σ_i h_pre_i x_i``.

  Backward: the Sinkhorn kernel above, ``_aggregate_backward_kernel`` (``dL/dh_pre``, a
  reduction over h), a few ``[T, n²+2n]`` element-wise ops in torch (sigmoid and RMS
  derivatives: tiny), the weight gradient as one torch matmul (``gpᵀ x``: a GEMM, which
  torch already does well), and ``_streams_grad_kernel`` which writes the streams' gradient
  in one pass: aggregation term + projection term (``tl.dot``) + RMS term.

* :class:`FusedMerge` — ``H_resᵀ x + dropout(H_post ⊗ (y + bias))`` in one pass
  (``_merge_kernel``): the n×n mix, the H_post expansion of output and bias, and the
  dropout-add, with the dropout mask drawn by Philox (``tl.rand``) from a seed and the
  element index, so backward (``_merge_backward_kernel``) regenerates it instead of storing
  it. The dropout draws differ from torch's, so fused and native agree exactly only without
  dropout.

Precision: the mapping maths is fp32; the big passes load the activation dtype, accumulate in
fp32 and round once on store (the lean path rounds some intermediate products in bf16, so in
bf16 the two agree to bf16 tolerance, not bitwise).

Where it runs: CUDA tensors, or CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``
set before triton is first imported; the parity tests do that in a subprocess).
:func:`check_fused_supported` says why not otherwise. Triton is imported lazily: importing
this module never needs it.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os

import torch

from megatron_ext.errors import ConfigError
from megatron_ext.mhc.lean import RMS_EPS

# Lower bound on every Sinkhorn row/column sum (as megatron_ext.mhc.sinkhorn).
_MIN_DENOMINATOR = 1e-6
# The largest n the register-resident Sinkhorn handles.
MAX_FUSED_STREAMS = 8


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def fused_unavailable_reason(device: torch.device | None = None) -> str | None:
    """Why the fused kernels cannot run (None when they can): no triton, or a device that is
    neither CUDA nor the CPU under the interpreter."""
    # find_spec, not import: importing triton costs seconds and must come after
    # TRITON_INTERPRET is set.
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install triton)"
    if device is not None and device.type != "cuda" and not triton_interpreting():
        return (
            f"the fused mHC kernels run on CUDA tensors (got {device.type}); on CPU only under "
            "Triton's interpreter (TRITON_INTERPRET=1 set before triton is imported)"
        )
    return None


def check_fused_supported(tensor: torch.Tensor, n: int) -> None:
    reason = fused_unavailable_reason(tensor.device)
    if reason is None and n > MAX_FUSED_STREAMS:
        reason = f"the fused Sinkhorn holds n x n in registers for n <= {MAX_FUSED_STREAMS}"
    if reason is not None:
        raise RuntimeError(f"use_fused_mhc=True cannot run here: {reason}; set use_fused_mhc=False")


def check_fused_available(num_streams: int) -> None:
    """Whether ``use_fused_mhc=True`` can run here, before anything is built (the guard
    :func:`megatron_ext.guards.check_fused_mhc` asks it): at most :data:`MAX_FUSED_STREAMS`
    streams, and triton with CUDA (or the CPU under the interpreter)."""
    if num_streams > MAX_FUSED_STREAMS:
        raise ConfigError(
            f"use_fused_mhc=True supports mhc_num_residual_streams <= {MAX_FUSED_STREAMS} "
            f"(got {num_streams}); set use_fused_mhc=False"
        )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    reason = fused_unavailable_reason(device)
    if reason is not None:
        raise ConfigError(f"use_fused_mhc=True cannot run here: {reason}; set use_fused_mhc=False")


def _pow2(value: int) -> int:
    return 1 << max(0, (value - 1).bit_length())


@functools.cache
def _kernels():
    """The kernels, imported (and so triton imported) on first use."""
    from megatron_ext.mhc import _fused_kernels as k

    return dict(
        maps=k.maps_kernel,
        sinkhorn=k.sinkhorn_kernel,
        sinkhorn_backward=k.sinkhorn_backward_kernel,
        aggregate=k.aggregate_kernel,
        aggregate_backward=k.aggregate_backward_kernel,
        streams_grad=k.streams_grad_kernel,
        merge=k.merge_kernel,
        merge_backward=k.merge_backward_kernel,
    )


# Tile sizes. tl.dot needs every side >= 16; the token blocks of the register-heavy kernels
# are small on GPU so an n x n x BH product fits in registers. The interpreter runs programs one
# after another with numpy, so it gets bigger token blocks (fewer programs; still several per
# test tensor, so the block offsets are exercised).
_GPU_TILES = dict(
    dot_tokens=16, dot_cols=64, sinkhorn_tokens=64, stream_tokens=4, stream_hidden=128
)
_INTERPRETER_TILES = dict(
    dot_tokens=16, dot_cols=64, sinkhorn_tokens=16, stream_tokens=16, stream_hidden=64
)


def _tiles() -> dict:
    return _INTERPRETER_TILES if triton_interpreting() else _GPU_TILES


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class FusedStreamsIn(torch.autograd.Function):
    """``FusedStreamsIn.apply(x3, gated_weight, bias, n, iterations)``: the same inputs and
    outputs as :class:`~megatron_ext.mhc.lean.StreamsIn` (``aggregate [T, 1, h]``,
    ``post [T, n, 1]``, ``mix [T, n, n]``, maps in ``x3``'s dtype), through Triton."""

    @staticmethod
    def forward(ctx, x3, gated_weight, bias, n: int, iterations: int):
        kernels, tiles = _kernels(), _tiles()
        tokens, _, hidden = x3.shape
        x3 = x3.contiguous()
        weight = gated_weight.float().contiguous()
        bias = bias.float().contiguous()
        width, nh = weight.shape[0], n * hidden
        f32 = dict(device=x3.device, dtype=torch.float32)
        z = torch.empty(tokens, width, **f32)
        projected = torch.empty(tokens, width, **f32)
        pre = torch.empty(tokens, n, **f32)
        post = torch.empty(tokens, n, **f32)
        norm = torch.empty(tokens, **f32)
        inv_rms = torch.empty(tokens, **f32)
        dot_tokens, dot_cols = tiles["dot_tokens"], tiles["dot_cols"]
        kernels["maps"][(_cdiv(tokens, dot_tokens),)](
            x3,
            weight,
            bias,
            z,
            projected,
            pre,
            post,
            norm,
            inv_rms,
            tokens,
            nh,
            width,
            RMS_EPS,
            1.0 / math.sqrt(nh),
            N=n,
            KP=max(16, _pow2(width)),
            BT=dot_tokens,
            BC=dot_cols,
        )
        mix = torch.empty(tokens, n, n, device=x3.device, dtype=x3.dtype)
        kernels["sinkhorn"][(_cdiv(tokens, tiles["sinkhorn_tokens"]),)](
            z,
            mix,
            tokens,
            width,
            iterations,
            _MIN_DENOMINATOR,
            N=n,
            NP=_pow2(n),
            BT=tiles["sinkhorn_tokens"],
        )
        aggregated = torch.empty(tokens, 1, hidden, device=x3.device, dtype=x3.dtype)
        bt, bh = tiles["stream_tokens"], tiles["stream_hidden"]
        kernels["aggregate"][(_cdiv(tokens, bt), _cdiv(hidden, bh))](
            x3,
            pre,
            aggregated,
            tokens,
            hidden,
            N=n,
            NP=_pow2(n),
            BT=bt,
            BH=bh,
        )
        ctx.save_for_backward(x3, weight, z, projected, pre, post, norm, inv_rms)
        ctx.n, ctx.iterations = n, iterations
        return aggregated, post.to(x3.dtype).unsqueeze(-1), mix

    @staticmethod
    def backward(ctx, grad_aggregated, grad_post, grad_mix):
        kernels, tiles = _kernels(), _tiles()
        x3, weight, z, projected, pre, post, norm, inv_rms = ctx.saved_tensors
        n, iterations = ctx.n, ctx.iterations
        tokens, _, hidden = x3.shape
        width, nh = weight.shape[0], n * hidden
        grad_z = torch.zeros(tokens, width, device=x3.device, dtype=torch.float32)
        if grad_mix is not None:
            kernels["sinkhorn_backward"][(_cdiv(tokens, tiles["sinkhorn_tokens"]),)](
                z,
                grad_mix.contiguous(),
                grad_z,
                tokens,
                width,
                iterations,
                _MIN_DENOMINATOR,
                N=n,
                NP=_pow2(n),
                BT=tiles["sinkhorn_tokens"],
            )
        grad_aggregated = grad_aggregated.reshape(tokens, hidden).contiguous()
        grad_pre = torch.empty(tokens, n, device=x3.device, dtype=torch.float32)
        kernels["aggregate_backward"][(_cdiv(tokens, tiles["stream_tokens"]),)](
            x3,
            grad_aggregated,
            grad_pre,
            tokens,
            hidden,
            N=n,
            NP=_pow2(n),
            BT=tiles["stream_tokens"],
            BH=tiles["stream_hidden"],
        )
        # The [T, n²+2n] glue (sigmoid and RMS derivatives) is a handful of tiny ops.
        grad_z[:, :n] = grad_pre * pre * (1.0 - pre)
        if grad_post is not None:
            gate = post * 0.5
            grad_z[:, n : 2 * n] = grad_post.reshape(tokens, n).float() * 2.0 * gate * (1 - gate)
        grad_bias = grad_z.sum(dim=0)
        grad_projected = grad_z * inv_rms.unsqueeze(-1)
        grad_inv_rms = (grad_z * projected).sum(dim=-1)
        grad_norm = grad_inv_rms * (-inv_rms * inv_rms / math.sqrt(nh))
        coefficient = torch.where(norm > 0, grad_norm / norm, torch.zeros_like(norm))
        grad_x = torch.empty_like(x3)
        dot_tokens, dot_cols = tiles["dot_tokens"], tiles["dot_cols"]
        kernels["streams_grad"][(_cdiv(tokens, dot_tokens), _cdiv(nh, dot_cols))](
            x3,
            grad_aggregated,
            pre,
            grad_projected,
            weight,
            coefficient.contiguous(),
            grad_x,
            tokens,
            hidden,
            width,
            N=n,
            KP=max(16, _pow2(width)),
            BT=dot_tokens,
            BC=dot_cols,
        )
        # The weight gradient is a plain GEMM: left to torch.
        grad_weight = torch.mm(grad_projected.t(), x3.reshape(tokens, nh).float())
        return grad_x, grad_weight, grad_bias, None, None


class FusedMerge(torch.autograd.Function):
    """``FusedMerge.apply(mix, x3, post, y, bias, dropout_p) -> [T, n, h]``:
    ``Σ_j mix[i, j] x_j + dropout(post_i (y + bias))`` in one pass; ``y [T, h]``,
    ``bias [h]`` or None, ``post [T, n]``."""

    @staticmethod
    def forward(ctx, mix, x3, post, y, bias, dropout_p: float):
        kernels, tiles = _kernels(), _tiles()
        tokens, n, hidden = x3.shape
        if dropout_p > 0 and tokens * n * hidden >= 2**31:
            raise RuntimeError("fused mHC dropout indexes elements with int32: tensor too large")
        mix, x3, post, y = (t.contiguous() for t in (mix, x3, post, y))
        seed = torch.randint(0, 2**31 - 1, (1,), device=x3.device, dtype=torch.int32)
        has_bias = bias is not None
        bias_arg = bias.contiguous() if has_bias else y
        out = torch.empty_like(x3)
        bt, bh = tiles["stream_tokens"], tiles["stream_hidden"]
        kernels["merge"][(_cdiv(tokens, bt), _cdiv(hidden, bh))](
            mix,
            x3,
            post,
            y,
            bias_arg,
            seed,
            out,
            tokens,
            hidden,
            float(dropout_p),
            N=n,
            NP=_pow2(n),
            BT=bt,
            BH=bh,
            HAS_BIAS=has_bias,
            DROPOUT=dropout_p > 0,
        )
        ctx.save_for_backward(mix, x3, post, y, bias_arg, seed)
        ctx.has_bias, ctx.dropout_p = has_bias, dropout_p
        ctx.bias_dtype = bias.dtype if has_bias else None
        return out

    @staticmethod
    def backward(ctx, grad):
        kernels, tiles = _kernels(), _tiles()
        mix, x3, post, y, bias_arg, seed = ctx.saved_tensors
        tokens, n, hidden = x3.shape
        grad_x = torch.empty_like(x3)
        grad_y = torch.empty(tokens, hidden, device=x3.device, dtype=torch.float32)
        grad_mix = torch.empty(tokens, n, n, device=x3.device, dtype=torch.float32)
        grad_post = torch.empty(tokens, n, device=x3.device, dtype=torch.float32)
        kernels["merge_backward"][(_cdiv(tokens, tiles["stream_tokens"]),)](
            grad.contiguous(),
            mix,
            x3,
            post,
            y,
            bias_arg,
            seed,
            grad_x,
            grad_y,
            grad_mix,
            grad_post,
            tokens,
            hidden,
            float(ctx.dropout_p),
            N=n,
            NP=_pow2(n),
            BT=tiles["stream_tokens"],
            BH=tiles["stream_hidden"],
            HAS_BIAS=ctx.has_bias,
            DROPOUT=ctx.dropout_p > 0,
        )
        grad_bias = grad_y.sum(dim=0).to(ctx.bias_dtype) if ctx.has_bias else None
        return (
            grad_mix.to(mix.dtype),
            grad_x,
            grad_post.to(post.dtype),
            grad_y.to(y.dtype),
            grad_bias,
            None,
        )


def fused_streams_in(x3, gated_weight, bias, n: int, iterations: int, method: str = "sinkhorn"):
    """:class:`FusedStreamsIn` after checking it can run here (Sinkhorn only: the config
    refuses ``mhc_h_res_method="birkhoff"`` with ``use_fused_mhc``)."""
    if method != "sinkhorn":
        raise ConfigError(
            f"the fused mHC kernels implement mhc_h_res_method='sinkhorn' only, got {method!r}; "
            "set use_fused_mhc=False"
        )
    check_fused_supported(x3, n)
    return FusedStreamsIn.apply(x3, gated_weight, bias, n, iterations)


def fused_merge_rows(mix, residual, post_col, y, bias, *, dropout_p=0.0, training=False):
    """The fused counterpart of :func:`megatron_ext.mhc.hyper_connection.merge_rows`: same
    arguments, ``[s, b, n*h]`` out; dropout applies only when training."""
    n = mix.shape[-1]
    check_fused_supported(residual, n)
    hidden = residual.shape[-1] // n
    x3 = residual.reshape(-1, n, hidden)
    post = post_col.reshape(-1, n)
    p = float(dropout_p) if training else 0.0
    merged = FusedMerge.apply(mix, x3, post, y.reshape(-1, hidden), bias, p)
    return merged.view(residual.shape)


__all__ = [
    "FusedMerge",
    "FusedStreamsIn",
    "MAX_FUSED_STREAMS",
    "check_fused_available",
    "check_fused_supported",
    "fused_merge_rows",
    "fused_streams_in",
    "fused_unavailable_reason",
]
