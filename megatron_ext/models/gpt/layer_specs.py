"""Layer specs for GPT: megatron-core's, with, in the local spec, the local norm (which works
under sequence parallelism) and the context-parallel core attention
(:class:`~megatron_ext.models.context_parallel.ContextParallelDotProductAttention`, which is
megatron's ``DotProductAttention`` at CP=1) swapped in and, with
``enable_mhc_connections=True``, the mHC layer and its two hyper connections."""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron.core.models.gpt import gpt_layer_specs as upstream
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_ext.mhc.hyper_connection import HyperConnectionModule
from megatron_ext.mhc.transformer_layer import (
    HyperConnectionTransformerLayer,
    HyperConnectionTransformerLayerSubmodules,
)
from megatron_ext.models.context_parallel import ContextParallelDotProductAttention
from megatron_ext.models.norms import LocalNorm

# megatron-core's local modules that refuse a parallelism, and ours that do not:
# its torch-norm builder refuses SP, its DotProductAttention refuses CP.
LOCAL_MODULE_SWAPS = {
    WrappedTorchNorm: LocalNorm,
    DotProductAttention: ContextParallelDotProductAttention,
}


def _with_local_modules(value: Any) -> Any:
    """``value`` (a spec, submodules dataclass or module) with LOCAL_MODULE_SWAPS applied,
    recursively."""
    if isinstance(value, type) and value in LOCAL_MODULE_SWAPS:
        return LOCAL_MODULE_SWAPS[value]
    if isinstance(value, ModuleSpec):
        return dataclasses.replace(
            value,
            module=_with_local_modules(value.module),
            submodules=_with_local_modules(value.submodules),
        )
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {
            f.name: _with_local_modules(getattr(value, f.name)) for f in dataclasses.fields(value)
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
    fields = {f.name: getattr(spec.submodules, f.name) for f in dataclasses.fields(spec.submodules)}
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
    spec = _with_local_modules(upstream.get_gpt_layer_local_spec(**kwargs))
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
