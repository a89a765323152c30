"""HybridStack specs: local (torch-only, runs on CPU, sequence-parallel safe) and Transformer
Engine, each with or without mHC residual streams.

A Hybrid stack builds one layer per symbol of ``hybrid_layer_pattern``. What each symbol
becomes here (local spec; the Transformer Engine spec is megatron-core's):

* ``*`` attention-only TransformerLayer (norm + SelfAttention; its MLP is ``IdentityOp``);
* ``-`` MLP-only layer (megatron's ``MLPLayer``);
* ``E`` MoE-only layer (local experts, with or without ``add_bias_linear``; see
  :mod:`megatron_ext.models.linears`);
* ``M`` MambaLayer (norm + MambaMixer), only where ``mamba_ssm`` is installed.

Symbols without a spec here (``G``, ``D``, ``+`` locally, ``M`` without ``mamba_ssm``) build a
placeholder that raises a clear error naming the symbol, instead of megatron's silent
``IdentityOp`` layer.

With ``enable_mhc_connections=True`` every layer carries the n residual streams: the
TransformerLayer-based ones (``*``, ``-``, ``E``, and ``G``/``D``/``+`` in the TE spec) become
:class:`HybridHyperConnectionLayer` (:class:`~megatron_ext.mhc.HyperConnectionTransformerLayer`
as a Hybrid stack uses it; MoE allowed) with ``self_attention_hyper_connection.*`` /
``mlp_hyper_connection.*`` as upstream names them, and Mamba becomes
:class:`~megatron_ext.models.hybrid.mamba_layer.HyperConnectionMambaLayer`
(``mixer_hyper_connection.*``).

Both builders also fill ``mtp_block_spec`` (the per-depth norms and projections; the depth's
own layers come from the pattern after ``/``). With mHC the MTP layer is
:class:`~megatron_ext.models.hybrid.mtp.HyperConnectionMTPLayer`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlock,
    MultiTokenPredictionBlockSubmodules,
    MultiTokenPredictionLayer,
    MultiTokenPredictionLayerSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import (
    MoETransformerLayer,
    TransformerLayer,
    TransformerLayerSubmodules,
)

from megatron_ext.mhc.hyper_connection import HyperConnectionModule
from megatron_ext.mhc.transformer_layer import (
    HyperConnectionTransformerLayer,
    HyperConnectionTransformerLayerSubmodules,
    layer_fields_without_hyper_connections,
)
from megatron_ext.models.gpt.layer_specs import get_gpt_layer_local_spec, with_local_modules
from megatron_ext.models.hybrid.hybrid_stack import HybridStack, HybridStackSubmodules
from megatron_ext.models.hybrid.mamba_layer import (
    HyperConnectionMambaLayer,
    HyperConnectionMambaLayerSubmodules,
)
from megatron_ext.models.hybrid.mtp import (
    HyperConnectionMTPLayer,
    HyperConnectionMTPLayerSubmodules,
)
from megatron_ext.models.norms import LocalNorm

# megatron-core's MoE spec builder needs some positive expert count; the real one is
# config.num_moe_experts, read when the layer is built (megatron's own Hybrid spec does this too).
_ANY_EXPERT_COUNT = 8

# Pattern symbol -> (HybridStackSubmodules field, what it is), for error messages.
LAYER_FIELDS = {
    "M": ("mamba_layer", "Mamba"),
    "G": ("gdn_layer", "gated delta net"),
    "*": ("attention_layer", "attention"),
    "D": ("dsa_layer", "DeepSeek sparse attention"),
    "+": ("mla_layer", "multi-latent attention"),
    "-": ("mlp_layer", "MLP"),
    "E": ("moe_layer", "MoE"),
}


class HybridHyperConnectionLayer(HyperConnectionTransformerLayer):
    """:class:`~megatron_ext.mhc.HyperConnectionTransformerLayer` as a Hybrid stack builds it.

    Identical to its base, except that it may be a layer of a Hybrid MTP depth: Hybrid MTP
    keeps the n streams through its depths (the base refuses ``is_mtp_layer`` because GPT's
    decoder contracts the streams before MTP). A HybridStack passes ``is_mtp_layer`` only to
    attention-type layers (``*``, ``D``, ``+``), whose MLP is ``IdentityOp`` and whose layer
    number is given exactly (``add_layer_offset=False``), so building the base with
    ``is_mtp_layer=False`` and recording the flag afterwards gives the same modules.
    """

    def __init__(self, *args: Any, is_mtp_layer: bool = False, **kwargs: Any) -> None:
        kwargs["is_mtp_layer"] = False  # the base's own check; the flag is recorded below
        super().__init__(*args, **kwargs)
        self.is_mtp_layer = is_mtp_layer


class UnavailableHybridLayer:
    """Placeholder for a pattern symbol this spec cannot build: raises when built."""

    def __new__(cls, *args: Any, symbol: str, reason: str, **kwargs: Any):
        field, what = LAYER_FIELDS[symbol]
        raise NotImplementedError(
            f"hybrid_layer_pattern uses {symbol!r} ({what}), but {reason}. Remove {symbol!r} "
            f"from hybrid_layer_pattern, or give the stack spec a {field}"
        )


def _unavailable(symbol: str, reason: str) -> ModuleSpec:
    return ModuleSpec(module=UnavailableHybridLayer, params={"symbol": symbol, "reason": reason})


def mamba_ssm_available() -> bool:
    """Whether ``mamba_ssm`` (needed by megatron's MambaMixer) can be imported."""
    return importlib.util.find_spec("mamba_ssm") is not None


def transformer_engine_available() -> bool:
    from megatron.core.extensions.transformer_engine import HAVE_TE

    return bool(HAVE_TE)


# ----------------------------------------------------------------------------- mHC conversion


def with_hyper_connections(layer_spec: ModuleSpec, *, allow_moe_mlp: bool = False) -> ModuleSpec:
    """A Hybrid TransformerLayer spec (attention-only, MLP-only or MoE-only) turned into the
    same layer with mHC residual streams: :class:`HybridHyperConnectionLayer` with a
    :class:`~megatron_ext.mhc.HyperConnectionModule` for the sub-layer that is present."""
    if not (isinstance(layer_spec, ModuleSpec) and issubclass(layer_spec.module, TransformerLayer)):
        raise TypeError(
            f"with_hyper_connections expects a ModuleSpec of a TransformerLayer, got {layer_spec!r}"
        )
    submodules = layer_spec.submodules
    fields = layer_fields_without_hyper_connections(submodules, TransformerLayerSubmodules)
    # Sub-layers that are IdentityOp get no hyper connection (the layer skips them).
    mhc_submodules = HyperConnectionTransformerLayerSubmodules(
        **fields,
        self_attention_hyper_connection=HyperConnectionModule,
        mlp_hyper_connection=HyperConnectionModule,
    )
    params = dict(layer_spec.params)
    if allow_moe_mlp:
        params["allow_moe_mlp"] = True
    return ModuleSpec(module=HybridHyperConnectionLayer, params=params, submodules=mhc_submodules)


def with_mamba_hyper_connection(layer_spec: ModuleSpec) -> ModuleSpec:
    """A MambaLayer spec turned into :class:`HyperConnectionMambaLayer` (same submodules plus
    the mixer's hyper connection)."""
    fields = {
        f.name: getattr(layer_spec.submodules, f.name)
        for f in dataclasses.fields(MambaLayerSubmodules)
    }
    return ModuleSpec(
        module=HyperConnectionMambaLayer,
        params=dict(layer_spec.params),
        submodules=HyperConnectionMambaLayerSubmodules(**fields),
    )


def _with_mhc(layer_spec: Any, symbol: str) -> Any:
    """One pattern symbol's layer spec with mHC residual streams."""
    if not isinstance(layer_spec, ModuleSpec) or not isinstance(layer_spec.module, type):
        return _unavailable(symbol, "its layer spec has no mHC version")
    if layer_spec.module is UnavailableHybridLayer:
        return layer_spec  # already explains why the symbol cannot be built
    if issubclass(layer_spec.module, MambaLayer):
        return with_mamba_hyper_connection(layer_spec)
    if issubclass(layer_spec.module, TransformerLayer):
        return with_hyper_connections(layer_spec, allow_moe_mlp=symbol == "E")
    return _unavailable(symbol, f"{layer_spec.module.__name__} has no mHC version")


def _mhc_stack_submodules(submodules: HybridStackSubmodules) -> HybridStackSubmodules:
    """The same stack submodules with every layer carrying the n streams."""
    changes = {
        field: _with_mhc(getattr(submodules, field), symbol)
        for symbol, (field, _) in LAYER_FIELDS.items()
    }
    return dataclasses.replace(submodules, **changes)


def _mtp_block_spec(*, norm: Any, linear: type, enable_mhc_connections: bool) -> ModuleSpec:
    """Per-depth MTP norms and projections (the depth's layers come from the pattern)."""
    if enable_mhc_connections:
        layer = ModuleSpec(
            module=HyperConnectionMTPLayer,
            submodules=HyperConnectionMTPLayerSubmodules(
                enorm=norm,
                hnorm=norm,
                layer_norm=norm,
                eh_proj=linear,
                e_proj=linear,
                h_proj=linear,
            ),
        )
    else:
        layer = ModuleSpec(
            module=MultiTokenPredictionLayer,
            submodules=MultiTokenPredictionLayerSubmodules(
                enorm=norm, hnorm=norm, layer_norm=norm, eh_proj=linear, mtp_model_layer=None
            ),
        )
    return ModuleSpec(
        module=MultiTokenPredictionBlock,
        submodules=MultiTokenPredictionBlockSubmodules(layer_specs=[layer]),
    )


# ----------------------------------------------------------------------------- local


def _local_mamba_layer() -> ModuleSpec:
    if not mamba_ssm_available():
        return _unavailable("M", "mamba_ssm is not installed (pip install mamba-ssm)")
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules

    return ModuleSpec(
        module=MambaLayer,
        submodules=MambaLayerSubmodules(
            norm=LocalNorm,
            mixer=ModuleSpec(
                module=MambaMixer,
                submodules=MambaMixerSubmodules(
                    in_proj=ColumnParallelLinear, out_proj=RowParallelLinear
                ),
            ),
            mamba_bda=get_bias_dropout_add,
        ),
    )


def get_hybrid_stack_local_spec(
    *,
    enable_mhc_connections: bool = False,
    qk_layernorm: bool = False,
    moe_grouped_gemm: bool = False,
) -> ModuleSpec:
    """A HybridStack spec from megatron-core's local (non-Transformer-Engine) modules.

    Attention (``*``) is an attention-only TransformerLayer: ``LocalNorm`` input norm and
    SelfAttention (ColumnParallelLinear / ContextParallelDotProductAttention /
    RowParallelLinear), the GPT local spec's attention; MLP (``-``) and MoE (``E``, local
    experts, bias or not) are MLP-only layers with a ``LocalNorm``
    pre-MLP norm; the final norm is ``LocalNorm``. Mamba (``M``) is built only where
    ``mamba_ssm`` is installed. ``LocalNorm`` works under sequence parallelism and the core
    attention under context parallelism (causal masks), so the spec runs under every
    parallelism, on CPU too.

    ``enable_mhc_connections=True`` gives the mHC layers (the config must enable mHC too).
    """
    gpt = get_gpt_layer_local_spec(qk_layernorm=qk_layernorm).submodules
    attention_layer = ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=LocalNorm,
            self_attention=gpt.self_attention,
            self_attn_bda=get_bias_dropout_add,
            # Checkpoints line up with the Transformer Engine spec, whose norm is fused.
            sharded_state_dict_keys_map={
                "input_layernorm.": "self_attention.linear_qkv.layer_norm_"
            },
        ),
    )
    mlp_layer = ModuleSpec(
        module=MLPLayer,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=LocalNorm,
            mlp=gpt.mlp,
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"},
        ),
    )
    moe_layer = ModuleSpec(
        module=MoETransformerLayer,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=LocalNorm,
            # Experts' linears deferrable as the dense layers' (SequentialMLP).
            mlp=with_local_modules(
                get_moe_module_spec(
                    use_te=False, num_experts=_ANY_EXPERT_COUNT, moe_grouped_gemm=moe_grouped_gemm
                )
            ),
            mlp_bda=get_bias_dropout_add,
        ),
    )
    no_local = "the local spec has no local implementation of it"
    submodules = HybridStackSubmodules(
        mamba_layer=_local_mamba_layer(),
        gdn_layer=_unavailable("G", no_local),
        attention_layer=attention_layer,
        dsa_layer=_unavailable("D", no_local),
        mla_layer=_unavailable("+", no_local),
        mlp_layer=mlp_layer,
        moe_layer=moe_layer,
        final_norm=LocalNorm,
        mtp_block_spec=_mtp_block_spec(
            norm=LocalNorm,
            linear=ColumnParallelLinear,
            enable_mhc_connections=enable_mhc_connections,
        ),
    )
    if enable_mhc_connections:
        submodules = _mhc_stack_submodules(submodules)
    return ModuleSpec(module=HybridStack, submodules=submodules)


# ----------------------------------------------------------------------------- Transformer Engine


def get_hybrid_stack_with_transformer_engine_spec(
    *, enable_mhc_connections: bool = False
) -> ModuleSpec:
    """megatron-core's Transformer Engine ``hybrid_stack_spec`` built by megatron-ext's
    HybridStack; ``enable_mhc_connections=True`` gives the mHC layers (attention, MLP and
    MoE; Mamba and the other symbols are refused with mHC). Needs Transformer Engine."""
    if not transformer_engine_available():
        raise ImportError(
            "get_hybrid_stack_with_transformer_engine_spec needs transformer_engine, which does "
            "not import here; install Transformer Engine, or use "
            "get_hybrid_stack_local_spec(enable_mhc_connections=...) instead"
        )
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TENorm
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

    core = hybrid_stack_spec.submodules
    fields = {f.name: getattr(core, f.name) for f in dataclasses.fields(core)}
    fields["mtp_block_spec"] = _mtp_block_spec(
        norm=TENorm, linear=TEColumnParallelLinear, enable_mhc_connections=enable_mhc_connections
    )
    submodules = HybridStackSubmodules(**fields, final_norm=TENorm)
    if enable_mhc_connections:
        submodules = _mhc_stack_submodules(submodules)
    return ModuleSpec(module=HybridStack, submodules=submodules)


def stack_layer_specs(submodules: Any, pattern: str | None) -> dict[str, Any]:
    """The layer spec each symbol of ``pattern`` (main and MTP parts) is built from."""
    used = {symbol for symbol in (pattern or "") if symbol in LAYER_FIELDS}
    return {symbol: getattr(submodules, LAYER_FIELDS[symbol][0]) for symbol in sorted(used)}


__all__ = [
    "HybridHyperConnectionLayer",
    "LAYER_FIELDS",
    "UnavailableHybridLayer",
    "get_hybrid_stack_local_spec",
    "get_hybrid_stack_with_transformer_engine_spec",
    "mamba_ssm_available",
    "stack_layer_specs",
    "with_hyper_connections",
]
