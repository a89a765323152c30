"""The straightforward mHC sub-layer maths, kept as the reference for the lean path.

This is the implementation megatron-ext shipped before the lean path: every map computed in
fp32 from an fp32 copy of the streams, aggregation / mixing / write-back as separate
broadcasts, megatron's bias-dropout-add on the expanded n-stream tensors, and the Sinkhorn
of :func:`~megatron_ext.mhc.sinkhorn.sinkhorn_reference` (plain autograd through every
iteration). It is slow (many passes over the n·h tensor) but each line is one formula. The DeepSeek-V4
maps (``mhc_variant`` "deepseek-v4" / "glm5", :mod:`megatron_ext.mhc.variants`) are written
here as transformers' ``DeepseekV4HyperConnection`` states them: an unweighted RMSNorm of the
flattened streams, ``scale·(fn·x̂) + base``, σ + ε, 2σ, softmax + ε and the ε Sinkhorn.

Tests compare :class:`~megatron_ext.mhc.HyperConnectionModule`'s lean path (and the fused
kernels) against it, and ``HyperConnectionModule.use_reference_path = True`` makes a layer
run it, so whole layers and models can be compared too.
"""

from __future__ import annotations

import math

import torch

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

from megatron_ext.mhc.birkhoff import birkhoff_reference, h_res_width
from megatron_ext.mhc.sinkhorn import sinkhorn_reference
from megatron_ext.mhc.variants import softmax_sinkhorn_reference

_RMS_EPS = 1e-6


def _math(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.dtype == torch.float64 else tensor.float()


def _split(x: torch.Tensor, n: int) -> torch.Tensor:
    return x.view(*x.shape[:-1], n, x.shape[-1] // n)


def _merge(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])


def reference_mappings(module, x: torch.Tensor):
    """``(h_pre [s,b,n], h_post [s,b,n], h_res [s,b,n,n])`` in fp32 for ``module``'s params."""
    n = module.n
    form = module.maps_form
    x32 = _math(x)
    if form.rms_eps is None:
        inv_rms = 1.0 / (x32.norm(dim=-1, keepdim=True) / math.sqrt(x32.shape[-1]) + _RMS_EPS)
    else:  # DeepSeek-V4: x̂ = x · rsqrt(mean(x²) + eps), an RMSNorm without a weight
        inv_rms = torch.rsqrt(x32.square().mean(dim=-1, keepdim=True) + form.rms_eps)
    projected = torch.nn.functional.linear(x32, _math(module.mapping_proj.weight))
    alpha = torch.cat(
        [
            _math(module.alpha_pre).expand(n),
            _math(module.alpha_post).expand(n),
            _math(module.alpha_res).expand(h_res_width(n, module.h_res_method)),
        ]
    )
    z = inv_rms * projected * alpha + _math(module.bias)
    h_pre = torch.sigmoid(z[..., :n]) + form.pre_eps
    h_post = 2.0 * torch.sigmoid(z[..., n : 2 * n])
    if module.h_res_method == "birkhoff":
        return h_pre, h_post, birkhoff_reference(z[..., 2 * n :], n)
    res_logits = z[..., 2 * n :].reshape(*z.shape[:-1], n, n)
    if form.softmax_sinkhorn:
        return h_pre, h_post, softmax_sinkhorn_reference(res_logits, module.sinkhorn_iterations)
    return h_pre, h_post, sinkhorn_reference(res_logits, module.sinkhorn_iterations)


def reference_aggregate(x: torch.Tensor, h_pre: torch.Tensor) -> torch.Tensor:
    streams = _math(_split(x, h_pre.shape[-1]))
    return (_math(h_pre).unsqueeze(-1) * streams).sum(dim=-2).to(x.dtype)


def reference_mix_residual(x: torch.Tensor, h_res: torch.Tensor) -> torch.Tensor:
    streams = _math(_split(x, h_res.shape[-1]))
    mixed = torch.matmul(_math(h_res).transpose(-1, -2), streams)
    return _merge(mixed).to(x.dtype)


def reference_expand_output(y: torch.Tensor, h_post: torch.Tensor) -> torch.Tensor:
    return _merge(_math(h_post).unsqueeze(-1) * _math(y).unsqueeze(-2)).to(y.dtype)


def reference_bias_dropout_add_streams(
    h_res: torch.Tensor,
    residual: torch.Tensor,
    h_post: torch.Tensor,
    out_with_bias: tuple[torch.Tensor, torch.Tensor | None],
    dropout_p: float,
    training: bool,
) -> torch.Tensor:
    y, bias = out_with_bias
    mixed = reference_mix_residual(residual, h_res)
    expanded_bias = None if bias is None else reference_expand_output(bias, h_post)
    bias_dropout_add = get_bias_dropout_add(training, fused=False)
    return bias_dropout_add((reference_expand_output(y, h_post), expanded_bias), mixed, dropout_p)


__all__ = [
    "reference_aggregate",
    "reference_bias_dropout_add_streams",
    "reference_expand_output",
    "reference_mappings",
    "reference_mix_residual",
]
