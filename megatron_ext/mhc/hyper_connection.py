"""mHC residual streams: expand, the per-sub-layer hyper connection, contract.

Layout. Between layers the residual is one flattened ``[s, b, n*h]`` tensor, stream-major:
stream i occupies channels ``[i*h, (i+1)*h)``. Every op here views it as ``[s, b, n, h]``.
The wrapped sub-layer (attention or MLP) still sees and returns an ordinary ``[s, b, h]``.

One sub-layer update (x = the n streams, F = attention or MLP):

    x_next = H_resᵀ · x + H_post ⊗ F(Σ_i H_pre_i · x_i)

with per-token maps H_pre ∈ (0,1)ⁿ, H_post ∈ (0,2)ⁿ and a doubly-stochastic H_res (n×n),
all produced by :class:`HyperConnectionModule` from the streams themselves.

Residual-mixing orientation: H_resᵀ, i.e. ``mixed_i = Σ_j H_res[j, i] · x_j``. Upstream
Megatron-LM main (Split 1 of PR #3430) uses H_res·x; the newer upstream code (PR #6401 and the
``dev`` branch, "Align mHC H_res residual mixing orientation") switched to H_resᵀ for parity
with DeepSeek-V4's Hugging Face reference. Both are doubly stochastic, so the manifold
constraint holds either way, but they are different functions of the same logits and
checkpoints do not transfer between them. We follow the orientation of newer upstream and of
the published DeepSeek-V4 weights: no megatron-core release ships mHC yet (0.19.2 has none),
so main's orientation has no released checkpoints to stay compatible with, while H_resᵀ lets
DeepSeek-V4-style weights load. (With the default ``mhc_variant="megatron"`` the rest follows
main: the exp/clamp Sinkhorn and no +1e-6 on H_pre, so numerics match DeepSeek-V4 closely but
not bit for bit; ``mhc_variant="deepseek-v4"`` or ``"glm5"`` computes DeepSeek-V4's maps
exactly, see :mod:`megatron_ext.mhc.variants`.)

Precision: the mapping maths (RMS factor, projection, sigmoids, Sinkhorn) runs in fp32 even
for bf16 activations (:meth:`HyperConnectionModule.compute_mappings` returns fp32 maps). The
big steps (aggregation, mixing, write-back) take the maps cast to the activation dtype, as
upstream's fused path does, and run as batched matmuls that accumulate in fp32; they never
copy the n·h streams to fp32.

Speed (the lean path): one projection for all maps with the gates folded into its weight, a
token-last Sinkhorn with an analytic backward, aggregation as one batched matmul, and the
merge as one mixing matmul plus one in-place rank-1 update. :mod:`megatron_ext.mhc.reference`
keeps the straightforward formulas as the reference.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.transformer.module import MegatronModule

from megatron_ext.errors import ConfigError
from megatron_ext.mhc import stats
from megatron_ext.mhc.birkhoff import birkhoff_mix, h_res_width
from megatron_ext.mhc.lean import MergeStreams, StreamsIn
from megatron_ext.mhc.reference import (
    reference_aggregate,
    reference_bias_dropout_add_streams,
    reference_mappings,
)
from megatron_ext.mhc.sinkhorn import sinkhorn_token_last
from megatron_ext.mhc.variants import (
    DEFAULT_VARIANT,
    SoftmaxSinkhornTokenLast,
    inverse_rms,
    maps_form,
)


def _math(tensor: torch.Tensor) -> torch.Tensor:
    """The mapping maths' precision: fp32 for bf16/fp16/fp32 tensors; float64 stays float64
    (so the whole module can be gradchecked)."""
    return tensor if tensor.dtype == torch.float64 else tensor.float()


def _split_streams(x: torch.Tensor, n: int) -> torch.Tensor:
    """View ``[..., n*h]`` as ``[..., n, h]``."""
    if x.shape[-1] % n != 0:
        raise ConfigError(
            f"last dim {x.shape[-1]} of the n-stream tensor is not divisible by "
            f"mhc_num_residual_streams={n}"
        )
    return x.view(*x.shape[:-1], n, x.shape[-1] // n)


def _merge_streams(x: torch.Tensor) -> torch.Tensor:
    """``[..., n, h]`` -> ``[..., n*h]``."""
    return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])


# ----------------------------------------------------------------------------- expand / contract


def expand_streams(x: torch.Tensor, n: int) -> torch.Tensor:
    """``[s, b, h] -> [s, b, n*h]``: every stream starts as a (contiguous) copy of ``x``.

    Upstream: ``HyperConnectionModule.input_expand``, applied after the embedding.
    """
    return x.repeat(*([1] * (x.dim() - 1)), n)


def contract_mean(x: torch.Tensor, n: int) -> torch.Tensor:
    """``[s, b, n*h] -> [s, b, h]``: mean over streams (upstream main's ``output_contract``)."""
    return _split_streams(x, n).mean(dim=-2)


def learned_contract(
    x: torch.Tensor,
    head_fn: torch.Tensor,
    head_base: torch.Tensor,
    head_scale: torch.Tensor,
    n: int,
    eps: float,
    weight_eps: float | None = None,
) -> torch.Tensor:
    """DeepSeek-V4's learned contraction ``[s, b, n*h] -> [s, b, h]`` (upstream dev's
    ``learned_output_contract``), computed in fp32 and returned in ``x``'s dtype.

    ``head_fn [n, n*h]``, ``head_base [n]``, ``head_scale [1]``; ``eps`` is the layernorm eps
    of the RMS norm, ``weight_eps`` what is added to the sigmoid weights (default ``eps``, as
    upstream dev; DeepSeek-V4's ``hc_eps`` for ``mhc_variant="deepseek-v4"``).
    At init (base 0) the weights are about 0.5, so this is about 0.5·Σx_i, not the mean.
    """
    x32 = _math(x)
    rho = torch.rsqrt(x32.square().mean(dim=-1, keepdim=True) + eps)
    logits = torch.nn.functional.linear(x32, _math(head_fn)) * rho
    added = eps if weight_eps is None else weight_eps
    weights = torch.sigmoid(logits * _math(head_scale) + _math(head_base)) + added
    contracted = (weights.unsqueeze(-1) * _split_streams(x32, n)).sum(dim=-2)
    return contracted.to(x.dtype)


# ----------------------------------------------------------------------------- applying the maps
#
# The lean forms work on token-major batches of tiny matrices: the streams as ``[T, n, h]``
# (T = s·b, a view), the maps as ``pre_row [T, 1, n]``, ``post_col [T, n, 1]`` and
# ``mix [T, n, n]`` (``mix[t, i, j] = H_res[t][j, i]``, i.e. already transposed), all in the
# activation dtype. Each big step is then one batched matmul over the n·h tensor, with no
# expanded copies and no fp32 copies of the streams.


def _token_streams(x: torch.Tensor, n: int) -> torch.Tensor:
    """``[..., n*h] -> [T, n, h]`` (a view for contiguous ``x``)."""
    width = x.shape[-1]
    if width % n != 0:
        raise ConfigError(
            f"last dim {width} of the n-stream tensor is not divisible by "
            f"mhc_num_residual_streams={n}"
        )
    return x.reshape(-1, n, width // n)


def aggregate_rows(x: torch.Tensor, pre_row: torch.Tensor) -> torch.Tensor:
    """Sub-layer input ``Σ_i h_pre_i · x_i`` as one batched matmul:
    ``[s,b,n*h], pre_row [T,1,n] -> [s,b,h]``."""
    streams = _token_streams(x, pre_row.shape[-1])
    return torch.bmm(pre_row, streams).view(*x.shape[:-1], streams.shape[-1])


def merge_rows(
    mix: torch.Tensor,
    residual: torch.Tensor,
    post_col: torch.Tensor,
    y: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    dropout_p: float = 0.0,
    training: bool = False,
) -> torch.Tensor:
    """``H_resᵀ · residual + dropout(H_post ⊗ (y + bias))`` -> ``[s, b, n*h]``.

    Without dropout this is :class:`~megatron_ext.mhc.lean.MergeStreams`: the mixing ``bmm``
    writes the output, then the rank-1 ``h_post ⊗ (y + bias)`` is added in place, so neither
    the expanded output nor the expanded bias is ever materialised. With dropout (training,
    ``dropout_p > 0``) the expansion goes through megatron's bias-dropout-add, one mask
    element per stream element, exactly as :func:`bias_dropout_add_streams` does.
    """
    n = mix.shape[-1]
    if training and dropout_p > 0:
        h_post = post_col.reshape(*y.shape[:-1], n)
        h_res = mix.transpose(-1, -2).reshape(*y.shape[:-1], n, n)
        return _dropout_merge(h_res, residual, h_post, y, bias, dropout_p)
    streams = _token_streams(residual, n)
    written = y if bias is None else y + bias
    merged = MergeStreams.apply(mix, streams, post_col, written.reshape(-1, 1, streams.shape[-1]))
    return merged.view(residual.shape)


def _dropout_merge(h_res, residual, h_post, y, bias, dropout_p):
    """The n-stream bias-dropout-add through megatron's own (unfused) implementation."""
    mixed = mix_residual(residual, h_res)
    expanded_bias = None if bias is None else expand_output(bias, h_post)
    bias_dropout_add = get_bias_dropout_add(True, fused=False)
    return bias_dropout_add((expand_output(y, h_post), expanded_bias), mixed, dropout_p)


def _pre_rows(h_pre: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return h_pre.reshape(-1, 1, h_pre.shape[-1]).to(dtype)


def _post_cols(h_post: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return h_post.reshape(-1, h_post.shape[-1], 1).to(dtype)


def _mix_matrices(h_res: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[..., n, n] -> [T, n, n]`` transposed and contiguous (a batch stride of 1 would make
    CPU ``bmm`` fall back to one matmul per token)."""
    n = h_res.shape[-1]
    return h_res.reshape(-1, n, n).transpose(-1, -2).to(dtype).contiguous()


def aggregate(x: torch.Tensor, h_pre: torch.Tensor) -> torch.Tensor:
    """Sub-layer input ``Σ_i h_pre_i · x_i``: ``[s,b,n*h], [s,b,n] -> [s,b,h]``.

    The maps are cast to ``x``'s dtype (as upstream's fused path does); the matmul
    accumulates in fp32 either way.
    """
    return aggregate_rows(x, _pre_rows(h_pre, x.dtype))


def mix_residual(x: torch.Tensor, h_res: torch.Tensor) -> torch.Tensor:
    """H_resᵀ mixing, ``mixed_i = Σ_j H_res[j, i] · x_j``.

    ``[s,b,n*h], [s,b,n,n] -> [s,b,n*h]``; see the module docstring for why the transpose.
    """
    streams = _token_streams(x, h_res.shape[-1])
    return torch.bmm(_mix_matrices(h_res, x.dtype), streams).view(x.shape)


def expand_output(y: torch.Tensor, h_post: torch.Tensor) -> torch.Tensor:
    """Write the sub-layer output back to every stream, scaled: stream i = ``h_post_i · y``.

    ``y`` is ``[s, b, h]`` or a bias ``[h]``; ``h_post`` is ``[s, b, n]``. Returns
    ``[s, b, n*h]`` in ``y``'s dtype.
    """
    scaled = _math(h_post).unsqueeze(-1) * _math(y).unsqueeze(-2)
    return _merge_streams(scaled).to(y.dtype)


def bias_dropout_add_streams(
    h_res: torch.Tensor,
    residual: torch.Tensor,
    h_post: torch.Tensor,
    out_with_bias: tuple[torch.Tensor, torch.Tensor | None],
    dropout_p: float,
    training: bool,
) -> torch.Tensor:
    """``mix_residual(residual, h_res) + dropout(h_post ⊗ (y + bias))`` -> ``[s, b, n*h]``.

    With dropout it runs through megatron-core's own bias-dropout-add with the n-stream
    tensors as its ``x`` and ``residual``, so dropout masks are drawn per stream element, as
    upstream does; without, it is :func:`merge_rows`.
    """
    y, bias = out_with_bias
    if training and dropout_p > 0:
        return _dropout_merge(h_res, residual, h_post, y, bias, dropout_p)
    dtype = residual.dtype
    return merge_rows(_mix_matrices(h_res, dtype), residual, _post_cols(h_post, dtype), y, bias)


# ----------------------------------------------------------------------------- the module


def keep_fp32_when_halving(fn):
    """Wrap an ``nn.Module._apply`` function so fp32 tensors are not cast to bf16/fp16."""

    def apply(tensor):
        result = fn(tensor)
        if tensor.dtype == torch.float32 and result.dtype in (torch.bfloat16, torch.float16):
            return tensor.to(device=result.device)
        return result

    return apply


# The learned contraction's parameters, owned by the module that contracts (a GPT
# HyperConnectionTransformerBlock, a HybridStack, a Hybrid MTP layer).
HC_HEAD_PARAMETERS = ("hc_head_fn", "hc_head_base", "hc_head_scale")


# For the type checker a mixin is the nn.Module it is mixed into; at runtime it adds no base
# (the module's own megatron base class brings nn.Module, after the mixin in the MRO).
_ModuleMixin = torch.nn.Module if TYPE_CHECKING else object


class KeepsHCHeadFP32(_ModuleMixin):  # type: ignore[misc,valid-type]
    """Mixin for a module that owns ``hc_head_*`` parameters directly: a cast to bf16/fp16
    leaves those fp32 (as :meth:`HyperConnectionModule._apply` does for the maps' parameters;
    upstream: ``mark_keep_in_fp32``). Only those tensors (and their grads) are exempt; the
    module's children and any other own tensor are cast as usual. Put it before the
    ``nn.Module`` base."""

    def _apply(self, fn, recurse=True):
        heads = [getattr(self, name, None) for name in HC_HEAD_PARAMETERS]
        keep = {id(t) for p in heads if p is not None for t in (p, p.grad) if t is not None}
        if not keep:
            return super()._apply(fn, recurse)
        if recurse:
            for child in self.children():
                child._apply(fn)
        halving_safe = keep_fp32_when_halving(fn)

        def apply(tensor):
            return halving_safe(tensor) if id(tensor) in keep else fn(tensor)

        return super()._apply(apply, recurse=False)


class HyperConnectionModule(MegatronModule):
    """Computes one sub-layer's mHC maps from the n-stream residual.

    Built as ``HyperConnectionModule(config, layer_number)``; a layer owns two (attention
    and MLP). Parameter names match upstream so checkpoints line up:

    * ``mapping_proj``: ``Linear(n*h, n*n + 2n, bias=False)``; output columns ``[0:n]`` pre,
      ``[n:2n]`` post, ``[2n:]`` res (row-major n×n).
    * ``alpha_pre``, ``alpha_post``, ``alpha_res`` ``[1]``: gates on the dynamic part.
    * ``bias`` ``[n*n + 2n]``: the static part of all three maps.

    With ``mhc_h_res_method="birkhoff"`` (mHC-lite, :mod:`megatron_ext.mhc.birkhoff`) the same
    parameters have an n!-wide res block instead of n²: ``mapping_proj`` ``Linear(n*h, n! + 2n)``
    and ``bias [n! + 2n]``, columns ``[2n:]`` one logit per permutation matrix (softmax
    weights), so a checkpoint of one method does not load into the other.

    ``mhc_variant`` (:mod:`megatron_ext.mhc.variants`) picks the maps' formulas: "megatron"
    (upstream main's), or "deepseek-v4" / "glm5" (DeepSeek-V4's, whose ``fn``, ``base`` and
    ``scale`` are ``mapping_proj.weight``, ``bias`` and ``[alpha_pre, alpha_post, alpha_res]``).

    The parameters are replicated across tensor parallelism. Under sequence parallelism each
    TP rank sees a different slice of tokens, so they carry ``sequence_parallel=True`` and
    megatron's ``finalize_model_grads`` sums their gradients over TP.
    """

    # Upstream spellings of the block-level helpers.
    input_expand = staticmethod(expand_streams)
    output_contract = staticmethod(contract_mean)
    # Applying the maps needs no parameters; n is read from the maps' shapes.
    aggregate = staticmethod(aggregate)
    mix_residual = staticmethod(mix_residual)
    expand_output = staticmethod(expand_output)
    # True runs the straightforward formulas of megatron_ext.mhc.reference instead of the
    # lean path (tests compare the two; set it on an instance or on the class).
    use_reference_path: bool = False

    def __init__(self, config, layer_number: int):
        super().__init__(config=config)
        self.layer_number = layer_number
        self.n = config.mhc_num_residual_streams
        self.hidden_size = config.hidden_size
        self.sinkhorn_iterations = config.mhc_sinkhorn_iterations
        # mHC statistics (megatron_ext.mhc.stats): the owner names the sub-layer; the
        # creation index orders a layer's connections (attention before MLP).
        self.stats_sublayer = "hc"
        self.stats_order = stats.next_creation_index()
        # "sinkhorn" (n² logits, Sinkhorn-Knopp) or "birkhoff" (n! logits, mHC-lite).
        self.h_res_method = getattr(config, "mhc_h_res_method", "sinkhorn")
        # use_fused_mhc: the Triton kernels of megatron_ext.mhc.fused replace the lean path.
        self.use_fused = bool(getattr(config, "use_fused_mhc", False))
        # "megatron", "deepseek-v4" or "glm5": the formulas of the maps (variants.MapsForm).
        self.mhc_variant = getattr(config, "mhc_variant", DEFAULT_VARIANT)
        self.maps_form = maps_form(self.mhc_variant, config.layernorm_epsilon)

        n, stream_width = self.n, self.n * self.hidden_size
        width = 2 * n + h_res_width(n, self.h_res_method)
        # Its weight gradient stays in B under the zero-bubble schedule (not deferred by
        # megatron_ext.pipeline.wgrad): the output is n^2 + 2n numbers per token, so its GEMM
        # is 2*n*h*(n^2+2n) FLOPs a token; a layer's two come to 16/h of its linears' 24*h^2
        # at n=4 (0.4 % at h=4096), and deferring would keep the n*h-wide input alive to W.
        self.mapping_proj = torch.nn.Linear(stream_width, width, bias=False)
        gate = config.mhc_init_gating_factor
        self.alpha_pre = torch.nn.Parameter(torch.full((1,), gate))
        self.alpha_post = torch.nn.Parameter(torch.full((1,), gate))
        self.alpha_res = torch.nn.Parameter(torch.full((1,), gate))
        self.bias = torch.nn.Parameter(torch.zeros(width))

        if config.perform_initialization:
            torch.nn.init.xavier_uniform_(self.mapping_proj.weight)
        for param in self.parameters():
            # Read by finalize_model_grads: sum this parameter's grad over TP under SP.
            param.sequence_parallel = config.sequence_parallel

    def _apply(self, fn, recurse=True):
        """Keep the five mHC parameters fp32 when the model is cast to bf16/fp16.

        megatron's ``Float16Module`` casts the whole model with ``module.bfloat16()``; upstream
        (PR #6401, dev) exempts the mHC parameters with ``mark_keep_in_fp32``, which
        megatron-core 0.19.2 does not have. Here a cast from fp32 to a 16-bit dtype leaves
        this module's tensors fp32 (device moves still apply), so the maps are computed from
        fp32 weights, megatron's DDP gives them fp32 gradient buffers and the optimizer steps
        them in fp32.
        """
        return super()._apply(keep_fp32_when_halving(fn), recurse)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """Refuse, with the fix, a checkpoint made with the other ``mhc_h_res_method``: its
        res block is n² (sinkhorn) or n! (birkhoff) wide, which torch would only report as a
        size mismatch."""
        saved = state_dict.get(prefix + "bias")
        if saved is not None and saved.shape != self.bias.shape:
            method = _method_of_width(saved.shape[0], self.n)
            if method is not None and method != self.h_res_method:
                raise RuntimeError(
                    f"{prefix}bias: the checkpoint was trained with mhc_h_res_method={method!r} "
                    f"(its H_res block is {saved.shape[0] - 2 * self.n} wide) but this model "
                    f"uses {self.h_res_method!r}; load it with --mhc-h-res-method {method} "
                    f"(recipe model.mhc.h_res_method: {method})"
                )
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _alpha_vector(self) -> torch.Tensor:
        """``[alpha_pre]*n ++ [alpha_post]*n ++ [alpha_res]*n²`` in fp32."""
        n = self.n
        return torch.cat(
            [
                _math(self.alpha_pre).expand(n),
                _math(self.alpha_post).expand(n),
                _math(self.alpha_res).expand(h_res_width(n, self.h_res_method)),
            ]
        )

    def _mapping_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """``z = r · (W x) ⊙ alpha + bias`` ``[T, n²+2n]`` in fp32, ``r`` the variant's RMS
        factor (megatron ``1 / (RMS(x) + 1e-6)``, DeepSeek ``rsqrt(mean(x²) + eps)``).

        One projection produces all three maps; the gates are folded into its weight.
        """
        x32 = _math(tokens)  # no copy for fp32 streams; the fp32 mapping maths for bf16
        gated_weight = self.gated_weight()
        norm = torch.linalg.vector_norm(x32, dim=-1, keepdim=True)
        inv_rms = inverse_rms(norm, x32.shape[-1], self.maps_form)
        projected = torch.nn.functional.linear(x32, gated_weight)
        return torch.addcmul(_math(self.bias), projected, inv_rms)

    def _token_maps(self, x: torch.Tensor):
        """``(h_pre [T, n], h_post [T, n], H_res token-last [n, n, T])`` in fp32."""
        n = self.n
        z = self._mapping_logits(x.reshape(-1, x.shape[-1]))
        h_pre = torch.sigmoid(z[:, :n]) + self.maps_form.pre_eps
        h_post = torch.sigmoid(z[:, n : 2 * n]) * 2.0
        if self.h_res_method == "birkhoff":
            # [T, n, n] -> token-last [n, n, T], the layout Sinkhorn returns.
            return h_pre, h_post, birkhoff_mix(z[:, 2 * n :], n).permute(1, 2, 0)
        # Sinkhorn runs token-last: [T, n*n] -> [n, n, T] (it copies this view contiguous).
        res_logits = z[:, 2 * n :].t().reshape(n, n, -1)
        if self.maps_form.softmax_sinkhorn:
            return (
                h_pre,
                h_post,
                SoftmaxSinkhornTokenLast.apply(res_logits, self.sinkhorn_iterations),
            )
        return h_pre, h_post, sinkhorn_token_last(res_logits, self.sinkhorn_iterations)

    def compute_mappings(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [s,b,n*h] -> (h_pre [s,b,n], h_post [s,b,n], h_res [s,b,n,n])``, all fp32."""
        self._record_sample(x)
        if self.use_reference_path:
            return reference_mappings(self, x)
        n, lead = self.n, x.shape[:-1]
        h_pre, h_post, h_res = self._token_maps(x)
        h_res = h_res.permute(2, 0, 1).reshape(*lead, n, n)
        return h_pre.view(*lead, n), h_post.view(*lead, n), h_res

    def _record_sample(self, x: torch.Tensor) -> None:
        recorder = stats.recorder()
        if recorder is not None:
            recorder.capture(self, x)

    def gated_weight(self) -> torch.Tensor:
        """``mapping_proj.weight`` with each row scaled by its gate (fp32): the gates folded
        into the one projection instead of scaling every token's logits."""
        return _math(self.mapping_proj.weight) * self._alpha_vector().unsqueeze(-1)

    def streams_in(self, x: torch.Tensor):
        """Maps and aggregation in one pass (:class:`~megatron_ext.mhc.lean.StreamsIn`):
        ``[s,b,n*h] -> (sub-layer input [s,b,h], post [T,n,1], mix [T,n,n])``, the maps in
        ``x``'s dtype and in the form :func:`merge_rows` takes."""
        self._record_sample(x)
        n = self.n
        streams = _token_streams(x, n)
        streams_in = StreamsIn.apply
        if self.use_fused:
            from megatron_ext.mhc.fused import fused_streams_in as streams_in
        # The fused kernels compute the megatron variant only (guards refuse the others).
        form = (self.maps_form,) if not self.use_fused else ()
        aggregated, post, mix = streams_in(
            streams,
            self.gated_weight(),
            _math(self.bias),
            n,
            self.sinkhorn_iterations,
            self.h_res_method,
            *form,
        )
        return aggregated.view(*x.shape[:-1], streams.shape[-1]), post, mix

    @property
    def merge_fn(self):
        """``f(res, residual, post, y, bias, *, dropout_p, training) -> [s, b, n*h]``."""
        if self.use_reference_path:
            return _reference_merge
        if self.use_fused:
            from megatron_ext.mhc.fused import fused_merge_rows

            return fused_merge_rows
        return merge_rows

    def forward(
        self, hidden_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[s,b,n*h] -> (sub-layer input [s,b,h], h_res [s,b,n,n], h_post [s,b,n])``."""
        h_pre, h_post, h_res = self.compute_mappings(hidden_states)
        aggregate_with = reference_aggregate if self.use_reference_path else aggregate
        return aggregate_with(hidden_states, h_pre), h_res, h_post


def _method_of_width(width: int, n: int) -> str | None:
    """Which ``mhc_h_res_method`` a ``2n + res``-wide bias belongs to (None: neither)."""
    for method in ("sinkhorn", "birkhoff"):
        if width == 2 * n + h_res_width(n, method):
            return method
    return None


def _reference_merge(h_res, residual, h_post, y, bias, *, dropout_p=0.0, training=False):
    return reference_bias_dropout_add_streams(
        h_res, residual, h_post, (y, bias), dropout_p, training
    )
