"""Parity checks of the fused mHC kernels (:mod:`megatron_ext.mhc.fused`) against the lean
native path, shared by the CPU interpreter tests (tiny sizes, ``TRITON_INTERPRET=1`` in a
subprocess) and the ``gpu`` tests (real sizes on CUDA).

Each check runs the lean and the fused Function on the same inputs, backpropagates the same
random output gradients and asserts every output and gradient close. Tolerances (max abs error
relative to the lean value's max magnitude, floor 1): fp32 :data:`FP32_TOLERANCE` (the two
sum in different orders); bf16 :data:`BF16_TOLERANCE`, i.e. a few bf16 ulps (the lean path
rounds some intermediate products to bf16 where the kernels keep fp32).
"""

from __future__ import annotations

import torch

FP32_TOLERANCE = 2e-5
BF16_TOLERANCE = 3e-2


def tolerance(dtype: torch.dtype) -> float:
    return FP32_TOLERANCE if dtype == torch.float32 else BF16_TOLERANCE


def assert_close(ours: torch.Tensor, lean: torch.Tensor, dtype: torch.dtype, what: str) -> float:
    """Max abs error of ``ours`` against ``lean``, asserted within the dtype's tolerance."""
    ours, lean = ours.double(), lean.double()
    scale = lean.abs().max().clamp_min(1.0)
    error = (ours - lean).abs().max().item()
    assert error <= tolerance(dtype) * scale, (
        f"{what} ({dtype}): fused vs lean max error {error:.3g} (scale {scale:.3g}, "
        f"tolerance {tolerance(dtype)})"
    )
    return error


def _randn(shape, seed, device, dtype=torch.float32, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator) * scale).to(device=device, dtype=dtype)


def _run(fn, inputs, seed):
    """Outputs and input gradients of ``fn(*inputs)`` for seeded random output gradients."""
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    outputs = fn(*leaves)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    grads = [_randn(o.shape, seed + k, o.device, o.dtype) for k, o in enumerate(outputs)]
    torch.autograd.backward(outputs, grads)
    return [o.detach() for o in outputs], [leaf.grad for leaf in leaves]


def check_streams_in(device, dtype, tokens, n, hidden, iterations=20) -> dict:
    """:class:`FusedStreamsIn` vs :class:`StreamsIn`: aggregate, post, mix and the gradients
    of the streams, the gated weight and the bias."""
    from megatron_ext.mhc.fused import FusedStreamsIn
    from megatron_ext.mhc.lean import StreamsIn

    width = n * n + 2 * n
    inputs = (
        _randn((tokens, n, hidden), 0, device, dtype),
        _randn((width, n * hidden), 1, device, scale=(n * hidden) ** -0.5 * 2),
        _randn((width,), 2, device, scale=0.5),
    )
    lean = _run(lambda *a: StreamsIn.apply(*a, n, iterations), inputs, seed=10)
    fused = _run(lambda *a: FusedStreamsIn.apply(*a, n, iterations), inputs, seed=10)
    names = ["aggregate", "post", "mix", "grad x", "grad weight", "grad bias"]
    return {
        name: assert_close(ours, ref, dtype, f"streams_in {name}")
        # Without a bias there is no "grad bias": the names outnumber the tensors by one.
        for name, ours, ref in zip(names, fused[0] + fused[1], lean[0] + lean[1], strict=False)
    }


def check_merge(device, dtype, tokens, n, hidden, with_bias=True) -> dict:
    """:class:`FusedMerge` (no dropout) vs :class:`MergeStreams` on ``y + bias``."""
    from megatron_ext.mhc.fused import FusedMerge
    from megatron_ext.mhc.lean import MergeStreams

    inputs = [
        _randn((tokens, n, n), 3, device, dtype, scale=0.5),
        _randn((tokens, n, hidden), 4, device, dtype),
        _randn((tokens, n), 5, device, dtype),
        _randn((tokens, hidden), 6, device, dtype),
        _randn((hidden,), 7, device, dtype),
    ]
    if not with_bias:
        inputs = inputs[:4]

    def lean_merge(mix, x3, post, y, bias=None):
        written = y if bias is None else y + bias
        return MergeStreams.apply(mix, x3, post.unsqueeze(-1), written.unsqueeze(1))

    def fused_merge(mix, x3, post, y, bias=None):
        return FusedMerge.apply(mix, x3, post, y, bias, 0.0)

    lean = _run(lean_merge, inputs, seed=20)
    fused = _run(fused_merge, inputs, seed=20)
    names = ["out", "grad mix", "grad x", "grad post", "grad y", "grad bias"]
    return {
        name: assert_close(ours, ref, dtype, f"merge {name}")
        # Without a bias there is no "grad bias": the names outnumber the tensors by one.
        for name, ours, ref in zip(names, fused[0] + fused[1], lean[0] + lean[1], strict=False)
    }


def check_merge_dropout(device, tokens, n, hidden, p=0.3) -> None:
    """Dropout in :class:`FusedMerge`: the forward's mask (read off the output) drops about
    ``p`` of the elements, scales the rest by 1/(1-p), and backward uses the same mask."""
    from megatron_ext.mhc.fused import FusedMerge

    mix = _randn((tokens, n, n), 3, device, scale=0.5)
    x3 = _randn((tokens, n, hidden), 4, device)
    post = _randn((tokens, n), 5, device).abs() + 0.5
    y = (_randn((tokens, hidden), 6, device).abs() + 0.5).requires_grad_()
    out = FusedMerge.apply(mix, x3, post, y, None, p)
    update = out - torch.bmm(mix, x3)
    expected = post.unsqueeze(-1) * y.detach().unsqueeze(1) / (1 - p)
    kept = (update - expected).abs() < 1e-4 * expected.abs().max()
    dropped = update.abs() < 1e-5
    assert bool((kept ^ dropped).all()), "dropout: every element is either kept (scaled) or zero"
    fraction = dropped.double().mean().item()
    assert abs(fraction - p) < 4 * (p * (1 - p) / dropped.numel()) ** 0.5 + 1e-3, fraction
    grad = _randn(out.shape, 8, device)
    out.backward(grad)
    expected_grad = (post.unsqueeze(-1) * kept * grad).sum(dim=1) / (1 - p)
    torch.testing.assert_close(y.grad, expected_grad, rtol=1e-5, atol=1e-5)


__all__ = [
    "BF16_TOLERANCE",
    "FP32_TOLERANCE",
    "assert_close",
    "check_merge",
    "check_merge_dropout",
    "check_streams_in",
]
