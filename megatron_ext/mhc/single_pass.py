"""Single-pass mHC (DeepSeek-V4.1): each sub-layer aggregates its streams with the coefficients
the preceding sub-layer produced.

In the two-pass form every mHC site k reads its streams x_k twice: once to compute its maps
(pre_k, post_k, res_k) and once to aggregate the sub-layer input Σ_j pre_k[j]·x_k[j]. In the
single-pass form the aggregation uses the *previous* site's pre coefficients, so the maps and
the aggregate come from one pass over x_k, and the site's own pre travels on to the next one:

    pre_k, post_k, res_k = maps(x_k)                       # as in two-pass mHC, fp32
    u_k = Σ_j pre_{k-1}[j] · x_k[j]                        # the previous site's coefficients
    x_{k+1} = res_kᵀ · x_k + post_k ⊗ F_k(norm(u_k))
    pre_{-1} = e_0 (one-hot: the first site's input is stream 0, the embedding)
    output = Σ_j pre_last[j] · x_L[j]                      # contraction, no learned head

Sources (public): Megatron-LM PR #7500 "[1/4] CSA2 and single-pass mHC" (config
``mhc_single_pass``, flag ``--mhc-single-pass``, ``SinglePassMHCState.pre_mix``; its unit tests'
oracle follows ``Block.hc_mixes/hc_pre/hc_post`` of the DeepSeek-V4.1-Flash release: the
one-hot initial mix, the shifted pre, the final contraction by the last pre, coefficient maths
in fp32; TP = CP = PP = 1 only); Megatron-LM #7224 (the reference tracker, "initial PP/VPP",
unvalidated); NeMo Automodel PR #3855 (DeepSeek-V4.1-Flash training with single-pass mHC, no
PP); vLLM #56438 (under PP the stage boundary carries the hidden states and the delayed
``pre_mix``).

Choices where the sources are silent or differ from megatron-ext's two-pass mHC:

- The maps are the site's variant (``mhc_variant``). ``deepseek-v4`` and ``glm5`` give
  upstream's single-pass numbers (#7500 computes DeepSeek's maps: ``rsqrt(mean(x²) + eps)``,
  ``σ(·) + ε`` for pre, ``2σ(·)`` for post, ``softmax(-1) + ε`` then a column normalisation
  and ``iterations − 1`` × [row, column], each denominator ``+ ε``); the two are one function
  here, since single pass has no head (GLM-5-Next's mean head and DeepSeek-V4's learned one
  both give way to the last pre). ``megatron`` (the default) runs the same order on the paper's
  maps (RMS factor ``1/(‖x‖/√(nh) + 1e-6)``, pre = σ, exp/clamp Sinkhorn): not a published
  single-pass form. ε is ``hc_eps`` = 1e-6 (upstream's ``--mhc-epsilon`` default), the RMS
  eps is the model's ``layernorm_epsilon``.
- The coefficients stay fp32 between sites and across stages, and the aggregation
  ``Σ_j pre[j]·x[j]`` (a site's input and the final contraction) runs in fp32 and is cast to
  the activation dtype afterwards, as upstream does (identical for fp32 activations).
- Under pipeline parallelism the last site of a stage hands pre_last to the next stage as the
  payload field ``pre_mix`` ([s', b, n] fp32, with its gradient; :mod:`megatron_ext.pipeline.payload`);
  a stage without layers (a standalone embedding stage) forwards e_0.

:func:`megatron_ext.guards.check_mhc_single_pass` refuses what this does not do yet, each with
its reason: the fused kernels, the "mhc" selective recompute and the learned contraction (full
recompute is refused for every mHC model).

Where it runs: GPT's :class:`~megatron_ext.mhc.transformer_block.HyperConnectionTransformerBlock`
and the Hybrid stack (:class:`~megatron_ext.models.hybrid.hybrid_stack.HybridStack`: attention,
MLP, MoE and Mamba layers are all sites), each starting at e_0 where it expands and exchanging
``pre_mix`` at stage edges. MTP: a Hybrid MTP depth's layers are further sites of the chain, its
first site reads the decoder's last pre (the choice and why: :mod:`megatron_ext.models.hybrid.mtp`);
GPT's MTP layers are plain layers on the decoder's contracted output (GPT with mHC contracts
before MTP), so they have no site and single pass only changes the contraction they read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_ext import registry
from megatron_ext.mhc.hyper_connection import _mix_matrices, _post_cols, aggregate_rows
from megatron_ext.mhc.reference import reference_aggregate
from megatron_ext.pipeline.payload import HIDDEN_STATES, PRE_MIX
from megatron_ext.pipeline.payload_wire import unpack


@dataclass
class SinglePassState:
    """One forward's running coefficients: the pre of the latest site ([s, b, n] fp32)."""

    pre_mix: torch.Tensor


def initial_pre_mix(streams: torch.Tensor, n: int) -> torch.Tensor:
    """e_0 for every token: ``[s, b, n]`` fp32, the first site aggregates stream 0."""
    pre = torch.zeros(*streams.shape[:-1], n, dtype=torch.float32, device=streams.device)
    pre[..., 0] = 1.0
    return pre


def start_single_pass(
    owner, hidden_states: torch.Tensor | None, layers, input_tensor_seam: str
) -> SinglePassState:
    """The coefficients a stage starts with, handed to each of its ``layers``' sites: e_0
    where ``owner`` (a GPT block or Hybrid stack) expands the streams, the payload's
    ``pre_mix`` where it receives them (the received wire is unpacked and ``owner``'s
    ``input_tensor``, megatron's seam ``input_tensor_seam``, becomes its hidden states)."""
    if owner.pre_process:
        assert hidden_states is not None
        pre_mix = initial_pre_mix(hidden_states, owner.num_residual_streams)
    else:
        fields = unpack(owner.payload, owner.input_tensor)
        registry.assign(owner, "input_tensor", fields[HIDDEN_STATES], input_tensor_seam)
        pre_mix = fields[PRE_MIX]
    state = SinglePassState(pre_mix)
    for layer in layers:
        layer.single_pass_state = state
    return state


def aggregate_in_fp32(streams: torch.Tensor, pre_mix: torch.Tensor) -> torch.Tensor:
    """``Σ_j pre[j]·x[j]``: ``[s,b,n*h], [s,b,n] -> [s,b,h]`` computed in fp32 (float64 stays
    float64) and cast to the streams' dtype, as upstream's single pass aggregates."""
    compute = torch.promote_types(streams.dtype, torch.float32)
    pre_rows = pre_mix.reshape(-1, 1, pre_mix.shape[-1]).to(compute)
    return aggregate_rows(streams.to(compute), pre_rows).to(streams.dtype)


def single_pass_site(connection, streams: torch.Tensor, state: SinglePassState):
    """One site: ``(sub-layer input [s, b, h], post, res)`` with post and res in the form the
    connection's ``merge_fn`` takes; ``state.pre_mix`` becomes this site's pre."""
    h_pre, h_post, h_res = connection.compute_mappings(streams)
    if connection.use_reference_path:
        layer_input = reference_aggregate(streams, state.pre_mix)
        post, res = h_post, h_res
    else:
        layer_input = aggregate_in_fp32(streams, state.pre_mix)
        post, res = _post_cols(h_post, streams.dtype), _mix_matrices(h_res, streams.dtype)
    state.pre_mix = h_pre
    return layer_input, post, res


def contract_with_pre_mix(streams: torch.Tensor, state: SinglePassState) -> torch.Tensor:
    """``[s, b, n*h] -> [s, b, h]`` by the last site's coefficients (in fp32)."""
    return aggregate_in_fp32(streams, state.pre_mix)


__all__ = [
    "SinglePassState",
    "aggregate_in_fp32",
    "contract_with_pre_mix",
    "initial_pre_mix",
    "single_pass_site",
    "start_single_pass",
]
