"""The lean native mHC sub-layer: two autograd Functions with hand-written backwards.

One mHC sub-layer touches the n·h stream tensor in two places, and each is one Function here,
so autograd never builds expanded copies, zero-filled slice gradients or per-source gradient
sums of n·h tensors:

* :class:`StreamsIn` — everything before the sub-layer: the RMS factor and the one projection
  for all maps (gates already folded into its weight), the sigmoids, the token-last Sinkhorn,
  and the aggregation ``Σ_i h_pre_i x_i``. It returns the sub-layer input and the two maps
  the merge needs, in the activation dtype. Its backward writes the streams' gradient into
  one buffer: the aggregation term (a broadcast product), then the projection term
  (``addmm_``) and the RMS term (``addcmul_``) in place.
* :class:`MergeStreams` — ``H_resᵀ x + h_post ⊗ (y + bias)``: one mixing ``bmm``
  then an in-place broadcast ``addcmul_``; backward is four batched matmuls.

Shapes: streams ``x3 [T, n, h]`` (T = s·b), ``pre`` ``[T, 1, n]``, ``post [T, n, 1]``,
``mix [T, n, n]`` with ``mix[t, i, j] = H_res[t][j, i]`` (the H_resᵀ orientation).
The mapping maths is fp32 (float64 stays float64) whatever the activation dtype.
:mod:`megatron_ext.mhc.reference` has the same maths as plain formulas.
"""

from __future__ import annotations

import torch

from megatron_ext.mhc.birkhoff import birkhoff_backward, birkhoff_forward
from megatron_ext.mhc.sinkhorn import (
    _check_iterations,
    sinkhorn_backward_token_last,
    sinkhorn_forward_token_last,
)
from megatron_ext.mhc.variants import (
    MEGATRON_FORM,
    MapsForm,
    inverse_rms,
    inverse_rms_grad_coefficient,
    softmax_sinkhorn_backward_token_last,
    softmax_sinkhorn_forward_token_last,
)

# Added to the RMS of the stream vector (outside the sqrt, as upstream) before inverting it.
RMS_EPS = 1e-6


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class StreamsIn(torch.autograd.Function):
    """``StreamsIn.apply(x3, gated_weight, bias, n, iterations, method="sinkhorn", form) ->
    (aggregate [T, 1, h], post [T, n, 1], mix [T, n, n])``.

    ``gated_weight`` is ``mapping_proj.weight`` scaled row-wise by the gates (fp32),
    ``bias`` the static part of the maps (fp32). ``method`` is ``mhc_h_res_method``: the H_res
    logits ``z[:, 2n:]`` are n² Sinkhorn logits or n! Birkhoff weights' logits
    (:mod:`megatron_ext.mhc.birkhoff`; ``iterations`` is then unused). ``form`` is the
    variant's :class:`~megatron_ext.mhc.variants.MapsForm` (RMS factor, ε on H_pre, Sinkhorn).
    """

    @staticmethod
    def forward(
        ctx,
        x3,
        gated_weight,
        bias,
        n: int,
        iterations: int,
        method: str = "sinkhorn",
        form: MapsForm = MEGATRON_FORM,
    ):
        birkhoff = method == "birkhoff"
        if not birkhoff:
            _check_iterations(iterations)
        tokens, _, hidden = x3.shape
        x32 = x3.reshape(tokens, n * hidden).to(_math_dtype(x3.dtype))
        norm = torch.linalg.vector_norm(x32, dim=-1, keepdim=True)
        inv_rms = inverse_rms(norm, n * hidden, form)
        # x @ Wᵀ with Wᵀ made contiguous first: CPU GEMMs with a 24-wide side run faster.
        projected = torch.mm(x32, gated_weight.t().contiguous())
        z = torch.addcmul(bias, projected, inv_rms)
        pre_gate = torch.sigmoid(z[:, :n])
        post_gate = torch.sigmoid(z[:, n : 2 * n])
        if birkhoff:
            # H rows-major [T, n*n] -> [T, j, i]: mix[t, i, j] = H[t][j, i].
            res, m0 = birkhoff_forward(z[:, 2 * n :], n)
            mix = res.view(-1, n, n).transpose(1, 2).to(x3.dtype).contiguous()
        elif form.softmax_sinkhorn:
            logits = z[:, 2 * n :].t().reshape(n, n, -1)
            res, m0 = softmax_sinkhorn_forward_token_last(logits, iterations)
            mix = res.permute(2, 1, 0).to(x3.dtype).contiguous()
        else:
            res, m0 = sinkhorn_forward_token_last(z[:, 2 * n :].t().reshape(n, n, -1), iterations)
            mix = res.permute(2, 1, 0).to(x3.dtype).contiguous()

        dtype = x3.dtype
        pre_row = (pre_gate + form.pre_eps).to(dtype).unsqueeze(1)
        aggregated = torch.bmm(pre_row, x3)
        post = (post_gate * 2.0).to(dtype).unsqueeze(-1)

        # m0: Sinkhorn's M0, the DeepSeek Sinkhorn's softmax, or the Birkhoff weights.
        ctx.save_for_backward(x3, gated_weight, norm, inv_rms, projected, pre_gate, post_gate, m0)
        ctx.iterations, ctx.birkhoff, ctx.form = iterations, birkhoff, form
        return aggregated, post, mix

    @staticmethod
    def backward(ctx, grad_aggregated, grad_post, grad_mix):
        x3, gated_weight, norm, inv_rms, projected, pre_gate, post_gate, m0 = ctx.saved_tensors
        form = ctx.form
        tokens, n, hidden = x3.shape
        math_dtype = gated_weight.dtype

        # Aggregation: d pre = g · x_iᵀ per token; d x starts as pre_i · g (the accumulator).
        grad_aggregated = grad_aggregated.reshape(tokens, 1, hidden)
        grad_pre = torch.bmm(grad_aggregated, x3.transpose(1, 2)).squeeze(1).to(math_dtype)
        grad_x3 = (pre_gate + form.pre_eps).to(x3.dtype).unsqueeze(-1) * grad_aggregated

        # Maps -> logits z = [pre | post | res]; sigmoid' = s(1-s), pre = s (+ε), post = 2·s.
        grad_z_pre = grad_pre * pre_gate * (1.0 - pre_gate)
        if grad_post is None:
            grad_z_post = torch.zeros_like(post_gate)
        else:
            grad_post = grad_post.reshape(tokens, n).to(math_dtype)
            grad_z_post = grad_post * 2.0 * post_gate * (1.0 - post_gate)
        if grad_mix is None:
            width = m0.shape[-1] if ctx.birkhoff else n * n
            grad_z_res = torch.zeros(tokens, width, dtype=math_dtype, device=x3.device)
        elif ctx.birkhoff:
            grad_h = grad_mix.to(math_dtype).transpose(1, 2).reshape(tokens, n * n)
            grad_z_res = birkhoff_backward(grad_h, m0, n)
        elif form.softmax_sinkhorn:
            grad_res = grad_mix.to(math_dtype).permute(2, 1, 0).contiguous()
            grad_z_res = softmax_sinkhorn_backward_token_last(grad_res, m0, ctx.iterations)
            grad_z_res = grad_z_res.reshape(n * n, tokens).t()
        else:
            grad_res = grad_mix.to(math_dtype).permute(2, 1, 0).contiguous()
            grad_z_res = sinkhorn_backward_token_last(grad_res, m0, ctx.iterations)
            grad_z_res = grad_z_res.reshape(n * n, tokens).t()
        grad_z = torch.cat([grad_z_pre, grad_z_post, grad_z_res], dim=1)

        # z = projected · inv_rms + bias, projected = x Wᵀ, inv_rms = r(‖x‖) of the variant.
        grad_bias = grad_z.sum(dim=0)
        grad_projected = grad_z * inv_rms
        grad_inv_rms = (grad_z * projected).sum(dim=-1, keepdim=True)
        x32 = x3.reshape(tokens, n * hidden).to(math_dtype)
        grad_weight = torch.mm(grad_projected.t().contiguous(), x32)
        rms_coefficient = inverse_rms_grad_coefficient(
            grad_inv_rms, norm, inv_rms, n * hidden, form
        )

        grad_x = grad_x3.view(tokens, n * hidden)
        if grad_x.dtype == math_dtype:
            grad_x.addmm_(grad_projected, gated_weight)
            grad_x.addcmul_(x32, rms_coefficient)
        else:  # bf16/fp16 streams: the mapping term in fp32, added once in the stream dtype
            mapping_term = torch.addcmul(
                torch.mm(grad_projected, gated_weight), x32, rms_coefficient
            )
            grad_x.add_(mapping_term.to(grad_x.dtype))
        return grad_x3, grad_weight, grad_bias, None, None, None, None


class MergeStreams(torch.autograd.Function):
    """``MergeStreams.apply(mix, x3, post, written) -> [T, n, h]``:
    ``mixed_i = Σ_j mix[i, j] x_j`` plus ``post_i · written`` (``written [T, 1, h]`` is
    ``y + bias``)."""

    @staticmethod
    def forward(ctx, mix, x3, post, written):
        merged = torch.bmm(mix, x3)
        merged.addcmul_(post, written)
        ctx.save_for_backward(mix, x3, post, written)
        return merged

    @staticmethod
    def backward(ctx, grad):
        mix, x3, post, written = ctx.saved_tensors
        grad = grad.contiguous()
        need = ctx.needs_input_grad
        grad_mix = torch.bmm(grad, x3.transpose(1, 2)) if need[0] else None
        grad_x3 = torch.bmm(mix.transpose(1, 2), grad) if need[1] else None
        grad_post = torch.bmm(grad, written.transpose(1, 2)) if need[2] else None
        grad_written = torch.bmm(post.transpose(1, 2), grad) if need[3] else None
        return grad_mix, grad_x3, grad_post, grad_written


__all__ = ["MergeStreams", "RMS_EPS", "StreamsIn"]
