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

Choices where the sources are silent or differ from megatron-ext's mHC:

- The maps are megatron-ext's megatron variant (:class:`~megatron_ext.mhc.HyperConnectionModule`:
  RMS factor 1/(‖x‖/√(nh) + 1e-6), pre = σ, post = 2σ, res by Sinkhorn or Birkhoff, H_resᵀ
  mixing), not DeepSeek-V4's (rsqrt(mean + eps), pre = σ + eps, softmax-first Sinkhorn): the
  single-pass order of operations is independent of how a site computes its maps.
- The coefficients stay fp32 between sites and across stages; the aggregation casts them to
  the activation dtype, as megatron-ext's two-pass aggregation does (the V4.1 reference
  aggregates in fp32; identical for fp32 activations).
- Under pipeline parallelism the last site of a stage hands pre_last to the next stage as the
  payload field ``pre_mix`` ([s', b, n] fp32, with its gradient; :mod:`megatron_ext.pipeline.payload`);
  a stage without layers (a standalone embedding stage) forwards e_0.

:func:`megatron_ext.guards.check_mhc_single_pass` refuses what this does not do yet, each with
its reason: the fused kernels, the "mhc" selective recompute, the learned contraction and a
DeepSeek variant (full recompute is refused for every mHC model).

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

from megatron_ext.mhc.hyper_connection import _mix_matrices, _post_cols, aggregate
from megatron_ext.mhc.reference import reference_aggregate


@dataclass
class SinglePassState:
    """One forward's running coefficients: the pre of the latest site ([s, b, n] fp32)."""

    pre_mix: torch.Tensor


def initial_pre_mix(streams: torch.Tensor, n: int) -> torch.Tensor:
    """e_0 for every token: ``[s, b, n]`` fp32, the first site aggregates stream 0."""
    pre = torch.zeros(*streams.shape[:-1], n, dtype=torch.float32, device=streams.device)
    pre[..., 0] = 1.0
    return pre


def single_pass_site(connection, streams: torch.Tensor, state: SinglePassState):
    """One site: ``(sub-layer input [s, b, h], post, res)`` with post and res in the form the
    connection's ``merge_fn`` takes; ``state.pre_mix`` becomes this site's pre."""
    h_pre, h_post, h_res = connection.compute_mappings(streams)
    if connection.use_reference_path:
        layer_input = reference_aggregate(streams, state.pre_mix)
        post, res = h_post, h_res
    else:
        layer_input = aggregate(streams, state.pre_mix)
        post, res = _post_cols(h_post, streams.dtype), _mix_matrices(h_res, streams.dtype)
    state.pre_mix = h_pre
    return layer_input, post, res


def contract_with_pre_mix(streams: torch.Tensor, state: SinglePassState) -> torch.Tensor:
    """``[s, b, n*h] -> [s, b, h]`` by the last site's coefficients."""
    return aggregate(streams, state.pre_mix)


__all__ = ["SinglePassState", "contract_with_pre_mix", "initial_pre_mix", "single_pass_site"]
