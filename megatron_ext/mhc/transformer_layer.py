"""A transformer layer whose residual is n mHC streams.

:class:`HyperConnectionTransformerLayer` is megatron-core's ``TransformerLayer`` with each
residual connection replaced by a hyper connection. Its input and output are the flattened
n-stream residual ``[s, b, n*h]``; attention and the MLP still see and return ``[s, b, h]``.
For each sub-layer (F = attention or MLP, with its norm):

    h_pre, h_post, h_res = connection.compute_mappings(x)     # per token, from the streams
    y = F(norm(Σ_i h_pre_i · x_i))
    x_next = H_resᵀ · x + dropout(H_post ⊗ (y + bias))        # megatron's bias-dropout-add

megatron-core 0.19.2 has no hooks for this in ``TransformerLayer`` (upstream main refactored
its forward into overridable steps later), so this class overrides the two monolithic steps
``_forward_attention`` and ``_forward_mlp``. Each mHC computation is one small method
(:meth:`_maps_and_aggregate`, :meth:`_normalise`, :meth:`_merge`) and the three
whose outputs are large go through :func:`~megatron_ext.mhc.recompute.run_maybe_checkpointed`,
so the "mhc" selective recompute can discard and rebuild them.

Sub-layers that are ``IdentityOp`` (attention-only or MLP-only layers, as a HybridModel
builds them) get no hyper connection and pass the n streams through unchanged.

MoE MLPs (megatron's ``MoELayer``, any router, dispatcher, shared experts, expert parallelism)
are wrapped like a dense MLP: the router sees the aggregated sub-layer input ``[s, b, h]``,
so its aux loss and expert-bias updates are those of a plain layer fed that input. (Upstream
main refuses MoE here; upstream dev and DeepSeek-V4 wrap it as this layer does.)
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from megatron.core import tensor_parallel
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
)
from megatron.core.utils import deprecate_inference_params, make_viewless_tensor

from megatron_ext import native_mhc as native
from megatron_ext.errors import ConfigError, SpecError, UnsupportedCombinationError
from megatron_ext.mhc.recompute import LayerRecompute, MHCRecomputeGroup, run_maybe_checkpointed
from megatron_ext.mhc.reference import reference_aggregate
from megatron_ext.mhc.single_pass import SinglePassState, single_pass_site

# Where the error messages send people who built a non-mHC layer spec.
MHC_SPEC_HINT = (
    "build the layer spec with megatron_ext.models.gpt.get_gpt_layer_local_spec("
    "enable_mhc_connections=True) (or get_gpt_layer_with_transformer_engine_spec("
    "enable_mhc_connections=True))"
)


@dataclass
class HyperConnectionTransformerLayerSubmodules(TransformerLayerSubmodules):
    """``TransformerLayerSubmodules`` plus one hyper connection per sub-layer.

    Each ``*_hyper_connection`` is built as ``build_module(spec, config=..., layer_number=...)``
    (normally :class:`~megatron_ext.mhc.HyperConnectionModule`). A sub-layer that is present
    needs one; a sub-layer that is ``IdentityOp`` gets none, whatever is given here.
    Cross-attention hyper connections are not supported.
    """

    self_attention_hyper_connection: ModuleSpec | type = IdentityOp
    cross_attention_hyper_connection: ModuleSpec | type = IdentityOp
    mlp_hyper_connection: ModuleSpec | type = IdentityOp


def layer_fields_without_hyper_connections(
    submodules: TransformerLayerSubmodules, fields_of: type | None = None
) -> dict[str, Any]:
    """The dataclass fields of ``submodules`` (of ``fields_of`` when given) by name, without
    the ``*_hyper_connection`` ones: megatron-core's own ``TransformerLayerSubmodules`` declares
    those where it has native mHC, and a spec sets them once, as
    :class:`HyperConnectionTransformerLayerSubmodules` arguments."""
    names = [f.name for f in dataclasses.fields(fields_of or submodules)]
    return {
        name: getattr(submodules, name)
        for name in names
        if name not in native.HYPER_CONNECTION_SUBMODULES
    }


def _is_identity(spec: Any) -> bool:
    module = spec.module if isinstance(spec, ModuleSpec) else spec
    return module is IdentityOp


def check_mhc_layer_features(config: Any) -> None:
    """What the mHC layers do not implement, at any pipeline size (a guard of
    :data:`megatron_ext.guards.GUARDS`; also run by the layers, for configs that are not
    MHCTransformerConfig)."""
    if not getattr(config, "enable_mhc_connections", False):
        return
    if config.cuda_graph_impl != "none" or config.enable_cuda_graph or config.external_cuda_graph:
        raise UnsupportedCombinationError(
            f"mHC layers are not qualified with CUDA graphs (cuda_graph_impl="
            f"{config.cuda_graph_impl!r}): their static inputs would be single-stream; set "
            "cuda_graph_impl='none' (and enable_cuda_graph/external_cuda_graph=False)"
        )
    offloaded_norms = {"attn_norm", "mlp_norm"} & set(config.offload_modules or [])
    if config.fine_grained_activation_offloading and offloaded_norms:
        raise UnsupportedCombinationError(
            f"mHC layers do not offload their norms: remove {sorted(offloaded_norms)} from "
            "offload_modules (or set fine_grained_activation_offloading=False)"
        )
    if config.mlp_chunks_for_training > 1:
        raise UnsupportedCombinationError(
            f"mHC layers do not chunk the MLP (mlp_chunks_for_training="
            f"{config.mlp_chunks_for_training}); set mlp_chunks_for_training=1"
        )


def _check_config(config) -> None:
    """Refuse configurations this layer does not implement, before anything is built."""
    if not getattr(config, "enable_mhc_connections", False):
        raise ConfigError(
            "HyperConnectionTransformerLayer needs enable_mhc_connections=True in its config "
            "(megatron_ext.config.MHCTransformerConfig); set enable_mhc_connections=True, or "
            "build the spec with enable_mhc_connections=False for plain residual connections"
        )
    check_mhc_layer_features(config)


def _check_submodules(submodules: TransformerLayerSubmodules) -> None:
    cross_connection = getattr(submodules, "cross_attention_hyper_connection", IdentityOp)
    if not _is_identity(cross_connection):
        raise SpecError(
            "HyperConnectionTransformerLayer does not support cross-attention hyper "
            "connections; set cross_attention_hyper_connection=IdentityOp"
        )
    if not _is_identity(submodules.cross_attention):
        raise NotImplementedError(
            "HyperConnectionTransformerLayer does not support cross-attention; set "
            "cross_attention=IdentityOp (and pre_cross_attn_layernorm=IdentityOp)"
        )


def run_attention_then_mlp(layer: TransformerLayer, *args: Any, **kwargs: Any):
    """What megatron-core's ``TransformerLayer.forward`` does -- ``_forward_attention``, then
    ``_forward_mlp`` with the keyword arguments it takes -- called directly: upstream's native
    mHC (Megatron-LM #4946) makes that forward refuse any config with
    ``enable_mhc_connections``, which every layer of an mHC model has."""
    hidden_states, context = layer._forward_attention(*args, **kwargs)
    output = layer._forward_mlp(
        hidden_states,
        kwargs.get("inference_context", None),
        padding_mask=kwargs.get("padding_mask", None),
        packed_seq_params=kwargs.get("packed_seq_params", None),
    )
    return output, context


class HyperConnectionTransformerLayer(TransformerLayer):
    """megatron-core's TransformerLayer with n mHC residual streams (see the module doc).

    Same constructor as ``TransformerLayer``. ``allow_moe_mlp`` is accepted for specs written
    when MoE MLPs had to be allowed explicitly (Hybrid 'E' layers); MoE is always accepted now.
    """

    supports_mhc_connections: bool = True

    def __init__(
        self,
        config,
        submodules: TransformerLayerSubmodules,
        layer_number: int = 1,
        hidden_dropout: float | None = None,
        pg_collection=None,
        vp_stage: int | None = None,
        is_mtp_layer: bool = False,
        add_layer_offset: bool = True,
        pp_layer_offset: int | None = None,
        name: str | None = None,
        allow_moe_mlp: bool = False,
    ):
        _check_config(config)
        _check_submodules(submodules)
        if is_mtp_layer:
            raise NotImplementedError(
                "mHC layers cannot be multi-token-prediction layers in a GPTModel (the decoder "
                "contracts its streams before MTP); set mtp_num_layers=None or build the MTP "
                "block from a spec with enable_mhc_connections=False"
            )
        super().__init__(
            config=config,
            submodules=submodules,
            layer_number=layer_number,
            hidden_dropout=hidden_dropout,
            pg_collection=pg_collection,
            vp_stage=vp_stage,
            is_mtp_layer=is_mtp_layer,
            add_layer_offset=add_layer_offset,
            pp_layer_offset=pp_layer_offset,
            name=name,
        )
        self.self_attention_hyper_connection = self._build_connection(
            self.self_attention, submodules, "self_attention"
        )
        self.mlp_hyper_connection = self._build_connection(self.mlp, submodules, "mlp")
        if self.self_attention_hyper_connection is None and self.mlp_hyper_connection is None:
            raise SpecError(
                "HyperConnectionTransformerLayer has neither self_attention nor mlp (both are "
                "IdentityOp); give the layer spec at least one of them"
            )
        # Set by HyperConnectionTransformerBlock before each training forward when the "mhc"
        # selective recompute is on; taken (and cleared) by this layer's forward.
        self.mhc_recompute: LayerRecompute | None = None
        # Set by HyperConnectionTransformerBlock for each forward with mhc_single_pass=True:
        # the coefficients running from site to site (megatron_ext.mhc.single_pass).
        self.single_pass_state: SinglePassState | None = None
        self._active_recompute: tuple[MHCRecomputeGroup | None, bool] = (None, False)

    def _build_connection(self, sublayer, submodules, name: str):
        """The hyper connection of one sub-layer, or None when the sub-layer is absent."""
        if isinstance(sublayer, IdentityOp):
            return None
        field = f"{name}_hyper_connection"
        spec = getattr(submodules, field, IdentityOp)
        if _is_identity(spec):
            raise SpecError(
                f"HyperConnectionTransformerLayer has a {name} but no {field}; set {field}="
                f"HyperConnectionModule in its submodules ({MHC_SPEC_HINT})"
            )
        connection = build_module(spec, config=self.config, layer_number=self.layer_number)
        connection.stats_sublayer = name  # "self_attention" or "mlp" in mhc/layerNN.<name>/...
        connection.stats_groups = self.pg_collection  # whose TP/CP/DP ranks hold its sample
        return connection

    # ---------------------------------------------------------- mHC steps (small on purpose)

    @staticmethod
    def _normalise(norm, norm_name: str, layer_input: Tensor, recompute) -> Tensor:
        """``norm(layer_input)``; discardable unless the norm is the identity (TE specs fuse it
        into the next linear), whose output is its input."""

        def apply_norm(x):
            output = norm(x)
            if isinstance(output, tuple):
                raise SpecError(
                    f"HyperConnectionTransformerLayer does not support a {norm_name} that "
                    "returns an (output, residual) tuple: the mHC residual is the n-stream "
                    f"input, not the norm's; use a {norm_name} that returns only its output"
                )
            return output

        if isinstance(norm, IdentityOp):
            return layer_input
        return run_maybe_checkpointed(recompute, apply_norm, (layer_input,))

    def _merge(self, connection, h_res, residual, h_post, output_with_bias, recompute) -> Tensor:
        """``H_resᵀ · residual + dropout(H_post ⊗ (y + bias))`` ``[s, b, n*h]`` (discardable
        unless it is the output that ends a recompute group: pass ``recompute=None`` then)."""
        output, bias = output_with_bias
        merge = functools.partial(
            connection.merge_fn, dropout_p=self.hidden_dropout, training=self.training
        )
        with self.bias_dropout_add_exec_handler():
            return run_maybe_checkpointed(recompute, merge, (h_res, residual, h_post, output, bias))

    @staticmethod
    def _maps_and_aggregate(connection, hidden_states: Tensor, recompute):
        """``(sub-layer input [s, b, h], h_post, h_res)`` (all discardable).

        Lean path: one Function computes the maps and ``Σ_i h_pre_i · x_i`` (under recompute
        the maps are rebuilt with the aggregate, as they are one computation). Reference
        path: fp32 maps (kept), then the aggregate (discardable).
        """
        if connection.use_reference_path:
            h_pre, h_post, h_res = connection.compute_mappings(hidden_states)
            layer_input = run_maybe_checkpointed(
                recompute, reference_aggregate, (hidden_states, h_pre)
            )
            return layer_input, h_post, h_res
        return run_maybe_checkpointed(recompute, connection.streams_in, (hidden_states,))

    def _connection_in(self, connection, norm, norm_name, hidden_states, recompute, norm_recompute):
        """Maps, aggregate and norm: everything before the sub-layer itself (single-pass mHC:
        aggregated with the previous site's coefficients, :mod:`megatron_ext.mhc.single_pass`)."""
        if self.single_pass_state is not None:
            layer_input, h_post, h_res = single_pass_site(
                connection, hidden_states, self.single_pass_state
            )
        else:
            layer_input, h_post, h_res = self._maps_and_aggregate(
                connection, hidden_states, recompute
            )
        normed = self._normalise(norm, norm_name, layer_input, norm_recompute)
        return normed, h_res, h_post

    # ------------------------------------------------------------------ recompute bookkeeping

    def _take_recompute_plan(self):
        """``(group, ends_group)`` for this forward; ``(None, False)`` when "mhc" recompute is
        off (or there is no backward to recompute for)."""
        plan, self.mhc_recompute = self.mhc_recompute, None
        if plan is None or not (self.training and torch.is_grad_enabled()):
            return None, False
        return plan.group, plan.ends_group

    def _norm_recompute_group(self, mhc_group, layernorm_recompute: bool):
        """Where a norm's output is checkpointed: the mHC group if there is one, else a
        one-norm group for megatron-core's own "layernorm" selective recompute."""
        if mhc_group is not None:
            return mhc_group
        if layernorm_recompute and torch.is_grad_enabled():
            return MHCRecomputeGroup()
        return None

    # ------------------------------------------------------------------ forward

    def forward(self, *args, **kwargs):
        """TransformerLayer.forward (attention, then MLP) with this forward's recompute plan
        available to both halves."""
        self._active_recompute = self._take_recompute_plan()
        try:
            return run_attention_then_mlp(self, *args, **kwargs)
        finally:
            self._active_recompute = (None, False)

    def _forward_attention(
        self,
        hidden_states: Tensor,
        attention_mask: Tensor | None = None,
        context: Tensor | None = None,
        context_mask: Tensor | None = None,
        rotary_pos_emb: Tensor | None = None,
        rotary_pos_cos: Tensor | None = None,
        rotary_pos_sin: Tensor | None = None,
        rotary_pos_cos_sin: Tensor | None = None,
        attention_bias: Tensor | None = None,
        inference_context=None,
        packed_seq_params=None,
        sequence_len_offset: Tensor | None = None,
        padding_mask: Tensor | None = None,
        *,
        inference_params=None,
    ):
        """Attention sub-layer on the n streams: ``[s, b, n*h] -> ([s, b, n*h], context)``."""
        inference_context = deprecate_inference_params(inference_context, inference_params)
        connection = self.self_attention_hyper_connection
        if connection is None:
            return hidden_states, context
        group, ends_group = getattr(self, "_active_recompute", (None, False))
        norm_group = self._norm_recompute_group(group, self.recompute_input_layernorm)

        residual = hidden_states
        attention_input, h_res, h_post = self._connection_in(
            connection, self.input_layernorm, "input_layernorm", hidden_states, group, norm_group
        )
        attention_output_with_bias = self.self_attention(
            attention_input,
            attention_mask=attention_mask,
            inference_context=inference_context,
            rotary_pos_emb=rotary_pos_emb,
            rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin,
            rotary_pos_cos_sin=rotary_pos_cos_sin,
            attention_bias=attention_bias,
            packed_seq_params=packed_seq_params,
            sequence_len_offset=sequence_len_offset,
        )
        if norm_group is not None and norm_group is not group:
            norm_group.discard_and_recompute_on_backward(attention_output_with_bias[0])

        # In an attention-only layer the attention output ends the group: keep it.
        keep_output = ends_group and self.mlp_hyper_connection is None
        output = self._merge(
            connection,
            h_res,
            residual,
            h_post,
            attention_output_with_bias,
            None if keep_output else group,
        )
        return output, context

    def _forward_mlp(
        self,
        hidden_states: Tensor,
        inference_context=None,
        padding_mask: Tensor | None = None,
        packed_seq_params=None,
    ) -> Tensor:
        """MLP sub-layer on the n streams: ``[s, b, n*h] -> [s, b, n*h]`` (viewless)."""
        group, ends_group = getattr(self, "_active_recompute", (None, False))
        connection = self.mlp_hyper_connection
        if connection is None:
            output = hidden_states
        else:
            norm_group = self._norm_recompute_group(group, self.recompute_pre_mlp_layernorm)
            residual = hidden_states
            mlp_input, h_res, h_post = self._connection_in(
                connection,
                self.pre_mlp_layernorm,
                "pre_mlp_layernorm",
                hidden_states,
                group,
                norm_group,
            )
            mlp_output_with_bias = self._mlp_on_aggregate(
                mlp_input, padding_mask, packed_seq_params
            )
            if norm_group is not None and norm_group is not group:
                norm_group.discard_and_recompute_on_backward(mlp_output_with_bias[0])
            output = self._merge(
                connection,
                h_res,
                residual,
                h_post,
                mlp_output_with_bias,
                None if ends_group else group,
            )
        output = make_viewless_tensor(
            inp=output, requires_grad=output.requires_grad, keep_graph=True
        )
        if ends_group:
            assert group is not None  # only a layer in a recompute group ends one
            group.discard_and_recompute_on_backward(output)
        return output

    # Not named _run_mlp: megatron-core 0.20's TransformerLayer has a private _run_mlp with
    # another signature, which a method of that name here would silently override.
    def _mlp_on_aggregate(self, mlp_input: Tensor, padding_mask, packed_seq_params):
        """The MLP (or MoE) on ``[s, b, h]``, with megatron's "mlp" recompute if configured."""
        mlp_input, padding_mask, unflattened_mbs = self._maybe_unflatten_for_moe(
            mlp_input, padding_mask, packed_seq_params
        )
        mlp = functools.partial(self.mlp, padding_mask=padding_mask)
        if self.recompute_mlp:
            output, bias = tensor_parallel.checkpoint(mlp, False, mlp_input)
        else:
            output, bias = mlp(mlp_input)
        output = self._maybe_reflatten_from_moe(output, packed_seq_params, unflattened_mbs)
        return output, bias


def layer_supports_mhc(module: Any) -> bool:
    """Whether a layer class (or ModuleSpec of one) implements mHC residual streams."""
    layer_class = module.module if isinstance(module, ModuleSpec) else module
    return bool(getattr(layer_class, "supports_mhc_connections", False))


__all__ = [
    "HyperConnectionTransformerLayer",
    "HyperConnectionTransformerLayerSubmodules",
    "MHC_SPEC_HINT",
    "layer_fields_without_hyper_connections",
    "layer_supports_mhc",
    "run_attention_then_mlp",
]
