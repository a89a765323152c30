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
DeepSeek-V4-style weights load. (The rest follows main: the exp/clamp Sinkhorn and no +1e-6 on
H_pre, so numerics match DeepSeek-V4 closely but not bit for bit.)

Precision: the mapping maths (RMS factor, projection, sigmoids, Sinkhorn) runs in fp32 even
for bf16 activations, and the maps are returned in fp32. Aggregation and mixing also
accumulate in fp32 and cast back to the activation dtype.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.transformer.module import MegatronModule

from megatron_ext.mhc.sinkhorn import sinkhorn_knopp

# Added to the RMS of the stream vector (outside the sqrt, as upstream) before inverting it.
_RMS_EPS = 1e-6


def _math(tensor: torch.Tensor) -> torch.Tensor:
    """The mapping maths' precision: fp32 for bf16/fp16/fp32 tensors; float64 stays float64
    (so the whole module can be gradchecked)."""
    return tensor if tensor.dtype == torch.float64 else tensor.float()


def _split_streams(x: torch.Tensor, n: int) -> torch.Tensor:
    """View ``[..., n*h]`` as ``[..., n, h]``."""
    if x.shape[-1] % n != 0:
        raise ValueError(
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
) -> torch.Tensor:
    """DeepSeek-V4's learned contraction ``[s, b, n*h] -> [s, b, h]`` (upstream dev's
    ``learned_output_contract``), computed in fp32 and returned in ``x``'s dtype.

    ``head_fn [n, n*h]``, ``head_base [n]``, ``head_scale [1]``; ``eps`` is the layernorm eps.
    At init (base 0) the weights are about 0.5, so this is about 0.5·Σx_i, not the mean.
    """
    x32 = _math(x)
    rho = torch.rsqrt(x32.square().mean(dim=-1, keepdim=True) + eps)
    logits = torch.nn.functional.linear(x32, _math(head_fn)) * rho
    weights = torch.sigmoid(logits * _math(head_scale) + _math(head_base)) + eps
    contracted = (weights.unsqueeze(-1) * _split_streams(x32, n)).sum(dim=-2)
    return contracted.to(x.dtype)


# ----------------------------------------------------------------------------- applying the maps


def aggregate(x: torch.Tensor, h_pre: torch.Tensor) -> torch.Tensor:
    """Sub-layer input ``Σ_i h_pre_i · x_i``: ``[s,b,n*h], [s,b,n] -> [s,b,h]``."""
    streams = _math(_split_streams(x, h_pre.shape[-1]))
    combined = (_math(h_pre).unsqueeze(-1) * streams).sum(dim=-2)
    return combined.to(x.dtype)


def mix_residual(x: torch.Tensor, h_res: torch.Tensor) -> torch.Tensor:
    """H_resᵀ mixing, ``mixed_i = Σ_j H_res[j, i] · x_j``.

    ``[s,b,n*h], [s,b,n,n] -> [s,b,n*h]``; see the module docstring for why the transpose.
    """
    streams = _math(_split_streams(x, h_res.shape[-1]))
    mixed = torch.matmul(_math(h_res).transpose(-1, -2), streams)
    return _merge_streams(mixed).to(x.dtype)


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
    out_with_bias: Tuple[torch.Tensor, Optional[torch.Tensor]],
    dropout_p: float,
    training: bool,
) -> torch.Tensor:
    """``mix_residual(residual, h_res) + dropout(h_post ⊗ (y + bias))`` -> ``[s, b, n*h]``.

    Runs through megatron-core's own bias-dropout-add with the n-stream tensors as its ``x``
    and ``residual``, so dropout masks are drawn per stream element, as upstream does.
    """
    y, bias = out_with_bias
    mixed = mix_residual(residual, h_res)
    expanded_bias = None if bias is None else expand_output(bias, h_post)
    bias_dropout_add = get_bias_dropout_add(training, fused=False)
    return bias_dropout_add((expand_output(y, h_post), expanded_bias), mixed, dropout_p)


# ----------------------------------------------------------------------------- the module


class HyperConnectionModule(MegatronModule):
    """Computes one sub-layer's mHC maps from the n-stream residual.

    Built as ``HyperConnectionModule(config, layer_number)``; a layer owns two (attention
    and MLP). Parameter names match upstream so checkpoints line up:

    * ``mapping_proj``: ``Linear(n*h, n*n + 2n, bias=False)``; output columns ``[0:n]`` pre,
      ``[n:2n]`` post, ``[2n:]`` res (row-major n×n).
    * ``alpha_pre``, ``alpha_post``, ``alpha_res`` ``[1]``: gates on the dynamic part.
    * ``bias`` ``[n*n + 2n]``: the static part of all three maps.

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

    def __init__(self, config, layer_number: int):
        super().__init__(config=config)
        self.layer_number = layer_number
        self.n = config.mhc_num_residual_streams
        self.hidden_size = config.hidden_size
        self.sinkhorn_iterations = config.mhc_sinkhorn_iterations

        n, stream_width = self.n, self.n * self.hidden_size
        self.mapping_proj = torch.nn.Linear(stream_width, n * n + 2 * n, bias=False)
        gate = config.mhc_init_gating_factor
        self.alpha_pre = torch.nn.Parameter(torch.full((1,), gate))
        self.alpha_post = torch.nn.Parameter(torch.full((1,), gate))
        self.alpha_res = torch.nn.Parameter(torch.full((1,), gate))
        self.bias = torch.nn.Parameter(torch.zeros(n * n + 2 * n))

        if config.perform_initialization:
            torch.nn.init.xavier_uniform_(self.mapping_proj.weight)
        for param in self.parameters():
            # Read by finalize_model_grads: sum this parameter's grad over TP under SP.
            setattr(param, "sequence_parallel", config.sequence_parallel)

    def _alpha_vector(self) -> torch.Tensor:
        """``[alpha_pre]*n ++ [alpha_post]*n ++ [alpha_res]*n²`` in fp32."""
        n = self.n
        return torch.cat(
            [
                _math(self.alpha_pre).expand(n),
                _math(self.alpha_post).expand(n),
                _math(self.alpha_res).expand(n * n),
            ]
        )

    def _mapping_logits(self, x: torch.Tensor) -> torch.Tensor:
        """``z = r · (W x) ⊙ alpha + bias`` in fp32, with ``r = 1 / (RMS(x) + 1e-6)``."""
        x32 = _math(x)
        rms = x32.norm(dim=-1, keepdim=True) / math.sqrt(x32.shape[-1])
        inv_rms = 1.0 / (rms + _RMS_EPS)
        projected = torch.nn.functional.linear(x32, _math(self.mapping_proj.weight))
        return inv_rms * projected * self._alpha_vector() + _math(self.bias)

    def compute_mappings(
        self, x: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [s,b,n*h] -> (h_pre [s,b,n], h_post [s,b,n], h_res [s,b,n,n])``, all fp32."""
        n = self.n
        z = self._mapping_logits(x)
        h_pre = torch.sigmoid(z[..., :n])
        h_post = 2.0 * torch.sigmoid(z[..., n : 2 * n])
        res_logits = z[..., 2 * n :].reshape(*z.shape[:-1], n, n)
        h_res = sinkhorn_knopp(res_logits, self.sinkhorn_iterations)
        return h_pre, h_post, h_res

    def forward(
        self, hidden_states: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[s,b,n*h] -> (sub-layer input [s,b,h], h_res [s,b,n,n], h_post [s,b,n])``."""
        # Upcast once: the mapping maths and the aggregation both read the fp32 streams.
        x32 = _math(hidden_states)
        h_pre, h_post, h_res = self.compute_mappings(x32)
        return aggregate(x32, h_pre).to(hidden_states.dtype), h_res, h_post
