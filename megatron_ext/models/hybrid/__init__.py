"""Hybrid models (megatron-core's HybridModel: Mamba / attention / MLP / MoE layers from a
pattern such as ``"*-E*-|*-E*-/*-"``), with mHC residual streams when the config enables them.

* :class:`HybridModel` is megatron-core 0.19.2's HybridModel (same constructor). With
  ``enable_mhc_connections=False`` it behaves exactly like megatron-core's given the same spec.
* :func:`get_hybrid_stack_local_spec` runs anywhere (torch-only modules, sequence-parallel
  safe norms; Mamba only with ``mamba_ssm``); :func:`get_hybrid_stack_with_transformer_engine_spec`
  is megatron-core's TE spec. Both take ``enable_mhc_connections``, which turns every layer
  into its mHC version (:class:`HybridHyperConnectionLayer`, :class:`HyperConnectionMambaLayer`).
* With mHC the stack (:class:`HybridStack`) expands into n streams where ``pre_process``,
  carries ``[s, b, n*h]`` across every pipeline segment (``|``) and virtual chunk, and
  contracts with a learned contraction (``decoder.hc_head_*``) before the final norm where
  ``post_process``. Hybrid MTP (after ``/``) runs on the final chunk over the streams
  (:mod:`megatron_ext.models.hybrid.mtp`).
"""

from megatron_ext.models.hybrid.hybrid_model import HybridModel
from megatron_ext.models.hybrid.hybrid_stack import HybridStack, HybridStackSubmodules
from megatron_ext.models.hybrid.layer_specs import (
    HybridHyperConnectionLayer,
    get_hybrid_stack_local_spec,
    get_hybrid_stack_with_transformer_engine_spec,
)
from megatron_ext.models.hybrid.mamba_layer import HyperConnectionMambaLayer
from megatron_ext.models.hybrid.mtp import (
    HyperConnectionMTPBlock,
    HyperConnectionMTPLayer,
    HyperConnectionMTPLayerSubmodules,
)

__all__ = [
    "HybridHyperConnectionLayer",
    "HybridModel",
    "HybridStack",
    "HybridStackSubmodules",
    "HyperConnectionMambaLayer",
    "HyperConnectionMTPBlock",
    "HyperConnectionMTPLayer",
    "HyperConnectionMTPLayerSubmodules",
    "get_hybrid_stack_local_spec",
    "get_hybrid_stack_with_transformer_engine_spec",
]
