"""mHC (manifold-constrained hyper-connections) maths.

This package owns the three pieces of mHC and nothing else: expanding the residual into n
streams (:func:`expand_streams`), the per-sub-layer hyper connection that computes and applies
H_pre, H_post and the doubly-stochastic H_res (:class:`HyperConnectionModule`,
:func:`bias_dropout_add_streams`, :func:`sinkhorn_knopp`), and contracting the streams back
(:func:`contract_mean`, :func:`learned_contract`). The sub-layer maths runs on the lean native
path (:mod:`megatron_ext.mhc.lean`, the default and the reference) or, with
``use_fused_mhc=True``, as Triton kernels (:mod:`megatron_ext.mhc.fused`). Layers, specs and
pipeline plumbing live elsewhere.
"""

from megatron_ext.mhc.hyper_connection import (
    HyperConnectionModule,
    aggregate,
    bias_dropout_add_streams,
    contract_mean,
    expand_output,
    expand_streams,
    learned_contract,
    mix_residual,
)
from megatron_ext.mhc.sinkhorn import SinkhornKnopp, sinkhorn_knopp, sinkhorn_reference

__all__ = [
    "HyperConnectionModule",
    "SinkhornKnopp",
    "aggregate",
    "bias_dropout_add_streams",
    "contract_mean",
    "expand_output",
    "expand_streams",
    "learned_contract",
    "mix_residual",
    "sinkhorn_knopp",
    "sinkhorn_reference",
]
