"""mHC (manifold-constrained hyper-connections) maths.

This package owns the three pieces of mHC and nothing else: expanding the residual into n
streams (:func:`expand_streams`), the per-sub-layer hyper connection that computes and applies
H_pre, H_post and the doubly-stochastic H_res (:class:`HyperConnectionModule`,
:func:`bias_dropout_add_streams`, :func:`sinkhorn_knopp`), and contracting the streams back
(:func:`contract_mean`, :func:`learned_contract`). The sub-layer maths runs on the lean native
path (:mod:`megatron_ext.mhc.lean`, the default and the reference) or, with
``use_fused_mhc=True``, as Triton kernels (:mod:`megatron_ext.mhc.fused`). Layers, specs and
pipeline plumbing live elsewhere. The formulas' pieces that only tests and benchmarks call
(``aggregate``, ``mix_residual``, ``expand_output``, ``sinkhorn_reference``) stay in their modules.
"""

from megatron_ext.mhc.hyper_connection import (
    HyperConnectionModule,
    bias_dropout_add_streams,
    contract_mean,
    expand_streams,
    learned_contract,
)
from megatron_ext.mhc.sinkhorn import SinkhornKnopp, sinkhorn_knopp

__all__ = [
    "HyperConnectionModule",
    "SinkhornKnopp",
    "bias_dropout_add_streams",
    "contract_mean",
    "expand_streams",
    "learned_contract",
    "sinkhorn_knopp",
]
