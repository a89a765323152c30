"""Layer specs for GPT: megatron-core's, with, in the local spec, the local norm (which works
under sequence parallelism) and the context-parallel core attention
(:class:`~megatron_ext.models.context_parallel.ContextParallelDotProductAttention`, which is
megatron's ``DotProductAttention`` at CP=1) swapped in and, with
``enable_mhc_connections=True``, the mHC layer and its two hyper connections.

:func:`get_gpt_decoder_block_spec` is megatron-core's MoE decoder block spec (dense and MoE
layers interleaved by ``moe_layer_freq``, MLA where the config asks for it) with the same
treatment for every layer, so a MoE/MLA GPT carries the n streams through every layer."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from megatron.core import tensor_parallel
from megatron.core.models.gpt import gpt_layer_specs as upstream
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_ext.mhc.hyper_connection import HyperConnectionModule
from megatron_ext.mhc.transformer_layer import (
    HyperConnectionTransformerLayer,
    HyperConnectionTransformerLayerSubmodules,
    layer_fields_without_hyper_connections,
)
from megatron_ext.models.context_parallel import ContextParallelDotProductAttention
from megatron_ext.models.linears import RowParallelLinear
from megatron_ext.models.norms import LocalNorm
from megatron_ext.pipeline.wgrad import DEFERRABLE_LINEARS

# megatron-core's local modules that refuse a parallelism, and ours that do not:
# its torch-norm builder refuses SP, its DotProductAttention refuses CP; and its linears, whose
# weight gradient ours can defer (the zero-bubble schedule's W; megatron's exactly when
# config.pipeline_schedule is "1f1b"). The row-parallel one also lets MoE experts have a bias
# at EP=1 (megatron_ext.models.linears).
LOCAL_MODULE_SWAPS: dict[type, type] = {
    WrappedTorchNorm: LocalNorm,
    DotProductAttention: ContextParallelDotProductAttention,
    **DEFERRABLE_LINEARS,
    tensor_parallel.RowParallelLinear: RowParallelLinear,
}

# Submodule fields that megatron's MLA checks against its own linear classes by identity
# (``in [..., ColumnParallelLinear]``): they keep megatron's linear (weight gradient in B).
KEEP_MEGATRON_LINEAR = frozenset(
    {"linear_q_down_proj", "linear_kv_down_proj", "linear_qkv_down_proj"}
)


def with_local_modules(value: Any, field_name: str = "") -> Any:
    """``value`` (a spec, submodules dataclass or module) with LOCAL_MODULE_SWAPS applied,
    recursively."""
    if isinstance(value, type) and value in LOCAL_MODULE_SWAPS:
        if field_name in KEEP_MEGATRON_LINEAR and value in DEFERRABLE_LINEARS:
            return value
        return LOCAL_MODULE_SWAPS[value]
    if isinstance(value, ModuleSpec):
        return dataclasses.replace(
            value,
            module=with_local_modules(value.module, field_name),
            submodules=with_local_modules(value.submodules),
        )
    if isinstance(value, functools.partial):  # e.g. MLP.as_mlp_submodule(submodules=...)
        keywords = {k: with_local_modules(v, k) for k, v in value.keywords.items()}
        return functools.partial(value.func, *value.args, **keywords)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {
            f.name: with_local_modules(getattr(value, f.name), f.name)
            for f in dataclasses.fields(value)
        }
        return dataclasses.replace(value, **changes)
    return value


def with_hyper_connections(spec: ModuleSpec) -> ModuleSpec:
    """A TransformerLayer spec turned into the same layer with mHC residual streams:
    the module becomes :class:`HyperConnectionTransformerLayer` and the attention and MLP
    each get a :class:`HyperConnectionModule`. Every other submodule is kept."""
    if not (isinstance(spec, ModuleSpec) and spec.module is TransformerLayer):
        raise TypeError(
            f"with_hyper_connections expects a ModuleSpec of megatron-core's TransformerLayer, "
            f"got {spec!r}"
        )
    fields = layer_fields_without_hyper_connections(spec.submodules)
    submodules = HyperConnectionTransformerLayerSubmodules(
        **fields,
        self_attention_hyper_connection=HyperConnectionModule,
        mlp_hyper_connection=HyperConnectionModule,
    )
    return dataclasses.replace(spec, module=HyperConnectionTransformerLayer, submodules=submodules)


def get_gpt_layer_local_spec(*, enable_mhc_connections: bool = False, **kwargs: Any) -> ModuleSpec:
    """megatron-core's ``get_gpt_layer_local_spec`` (same keyword arguments), safe under
    sequence and context parallelism; ``enable_mhc_connections=True`` gives the mHC layer
    (config must enable mHC too)."""
    spec = with_local_modules(upstream.get_gpt_layer_local_spec(**kwargs))
    return with_hyper_connections(spec) if enable_mhc_connections else spec


def transformer_engine_available() -> bool:
    from megatron.core.extensions.transformer_engine import HAVE_TE

    return bool(HAVE_TE)


def get_gpt_layer_with_transformer_engine_spec(
    *, enable_mhc_connections: bool = False, **kwargs: Any
) -> ModuleSpec:
    """megatron-core's ``get_gpt_layer_with_transformer_engine_spec`` (same keyword
    arguments); ``enable_mhc_connections=True`` gives the mHC layer. Needs Transformer Engine."""
    if not transformer_engine_available():
        raise ImportError(
            "get_gpt_layer_with_transformer_engine_spec needs transformer_engine, which does not "
            "import here; install Transformer Engine, or use "
            "get_gpt_layer_local_spec(enable_mhc_connections=...) instead"
        )
    spec = upstream.get_gpt_layer_with_transformer_engine_spec(**kwargs)
    return with_hyper_connections(spec) if enable_mhc_connections else spec


def _decoder_layer_spec(layer_spec: ModuleSpec, local: bool, mhc: bool) -> ModuleSpec:
    """One of megatron-core's decoder layer specs with our local modules and mHC applied."""
    spec = with_local_modules(layer_spec) if local else layer_spec
    return with_hyper_connections(spec) if mhc else spec


def get_gpt_decoder_block_spec(
    config,
    use_transformer_engine: bool,
    normalization: str | None = None,
    qk_l2_norm: bool | None = False,
    vp_stage: int | None = None,
    pp_rank: int | None = None,
    *,
    enable_mhc_connections: bool | None = None,
) -> TransformerBlockSubmodules:
    """megatron-core's ``get_gpt_decoder_block_spec`` (same arguments; what ``pretrain_gpt``
    builds MoE decoders from: dense and MoE layers by ``config.moe_layer_freq``, shared
    experts, MLA by ``config.multi_latent_attention``) with, for the local implementation,
    our sequence/context-parallel-safe modules in every layer and as the final norm, and with
    mHC (default: ``config.enable_mhc_connections``) every layer an mHC layer."""
    if enable_mhc_connections is None:
        enable_mhc_connections = bool(getattr(config, "enable_mhc_connections", False))
    if use_transformer_engine and not transformer_engine_available():
        raise ImportError(
            "get_gpt_decoder_block_spec(use_transformer_engine=True) needs transformer_engine, "
            "which does not import here; pass use_transformer_engine=False for local layers"
        )
    block = upstream.get_gpt_decoder_block_spec(
        config,
        use_transformer_engine=use_transformer_engine,
        normalization=normalization,
        qk_l2_norm=qk_l2_norm,
        vp_stage=vp_stage,
        pp_rank=pp_rank,
    )
    # megatron-core takes its local branch whenever TE is off, except for inference_optimized.
    local = not use_transformer_engine and config.transformer_impl != "inference_optimized"
    return TransformerBlockSubmodules(
        layer_specs=[
            _decoder_layer_spec(spec, local, enable_mhc_connections) for spec in block.layer_specs
        ],
        layer_norm=with_local_modules(block.layer_norm) if local else block.layer_norm,
    )
