"""A transformer block that carries n mHC residual streams between its layers.

:class:`HyperConnectionTransformerBlock` is megatron-core's ``TransformerBlock`` plus the two
block-level mHC steps, placed so that pipeline stages compose:

* expand: where ``pre_process`` (the embedding is in this stage), the ``[s, b, h]`` input is
  replicated into ``[s, b, n*h]`` (a viewless tensor, like every block input). Other stages
  receive the n-stream tensor from the previous stage (``set_input_tensor``).
* contract: where the final layernorm is in this stage, the streams are averaged back to
  ``[s, b, h]`` just before it (upstream GPT's mean contraction), or, with
  ``mhc_learned_output_contract=True``, contracted by upstream dev's learned contraction with
  ``decoder.hc_head_fn/base/scale`` (the
  :class:`~megatron_ext.mhc.learned_contraction.LearnedContraction` mixin, shared with the
  HybridStack). Other stages return the n-stream tensor, which travels to the next stage.

With ``mhc_single_pass=True`` (:mod:`megatron_ext.mhc.single_pass`) the block runs the
coefficients from site to site (its layers' ``single_pass_state``), starts them at e_0 where it
expands, contracts with the last site's, and exchanges them with the neighbouring stages as the
payload's ``pre_mix`` field (:mod:`megatron_ext.pipeline.payload`): a stage that receives
unpacks ``[hidden_states | pre_mix]``, a stage that sends packs them.

It also plans the "mhc" selective recompute (:mod:`megatron_ext.mhc.recompute`): before each
training forward, consecutive local layers are put into groups of ``mhc_recompute_layer_num``
(the block's last layer always ends a group, so no group crosses a stage or virtual chunk).

megatron-core's GPTModel constructs a plain ``TransformerBlock`` itself, with no seam to pick
the class; :meth:`HyperConnectionTransformerBlock.adopt` turns that freshly built block into
this class in place (same modules, same parameters, nothing rebuilt). Building this class
directly works as well.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.utils import WrappedTensor, make_viewless_tensor

from megatron_ext import native_mhc as native, registry
from megatron_ext.errors import ConfigError, SpecError
from megatron_ext.mhc.hyper_connection import contract_mean, expand_streams
from megatron_ext.mhc.learned_contraction import LearnedContraction
from megatron_ext.mhc.recompute import LayerRecompute, MHCRecomputeGroup, plan_recompute_groups
from megatron_ext.mhc.single_pass import SinglePassState, contract_with_pre_mix, start_single_pass
from megatron_ext.mhc.transformer_layer import MHC_SPEC_HINT, layer_supports_mhc
from megatron_ext.pipeline.payload import HIDDEN_STATES, PRE_MIX, stage_payload
from megatron_ext.pipeline.payload_wire import pack

# TransformerBlock.forward reads a receiving stage's input from input_tensor (declared seam).
INPUT_TENSOR_SEAM = "megatron.core.transformer.transformer_block:TransformerBlock.set_input_tensor"


def _layer_class(layer: Any) -> type:
    """The class behind a built layer, a ModuleSpec or a class."""
    if isinstance(layer, torch.nn.Module):
        return type(layer)
    if isinstance(layer, ModuleSpec):
        return layer.module
    return layer


def check_layers_support_mhc(config, layers: Iterable[Any], where: str) -> None:
    """Refuse layers (built, or as specs/classes) without mHC residual streams when mHC is on."""
    if not getattr(config, "enable_mhc_connections", False):
        return
    classes = {_layer_class(layer) for layer in layers}
    plain = sorted(cls.__name__ for cls in classes if not layer_supports_mhc(cls))
    if plain:
        raise SpecError(
            f"enable_mhc_connections=True, but {where} uses {', '.join(plain)}, which does not "
            f"implement mHC residual streams (no supports_mhc_connections); {MHC_SPEC_HINT}, "
            "or set enable_mhc_connections=False"
        )


def _contract_before_norm(num_streams: int, _norm: torch.nn.Module, args: tuple) -> tuple:
    """Forward pre-hook of the final layernorm: ``[s, b, n*h] -> [s, b, h]`` by the mean."""
    hidden_states, *rest = args
    return (contract_mean(hidden_states, num_streams), *rest)


class HyperConnectionTransformerBlock(LearnedContraction, TransformerBlock):
    """megatron-core's TransformerBlock with mHC expansion, contraction and recompute groups.

    Same constructor as ``TransformerBlock``; ``config.enable_mhc_connections`` must be True and
    every layer must support mHC (:class:`~megatron_ext.mhc.HyperConnectionTransformerLayer`).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._setup_streams()

    @classmethod
    def adopt(cls, block: TransformerBlock) -> HyperConnectionTransformerBlock:
        """Make a just-built megatron-core ``TransformerBlock`` this class, in place."""
        registry.adopt(block, cls)  # (refuses anything but a plain TransformerBlock)
        block._setup_streams()
        return block

    def _setup_streams(self) -> None:
        config = self.config
        if not getattr(config, "enable_mhc_connections", False):
            raise ConfigError(
                "HyperConnectionTransformerBlock needs enable_mhc_connections=True in its config "
                "(megatron_ext.config.MHCTransformerConfig)"
            )
        check_layers_support_mhc(config, self.layers, "the transformer block")
        self.num_residual_streams = config.mhc_num_residual_streams
        self.contracts_streams = self.final_layernorm is not None
        if self.post_process and not self.contracts_streams and config.mtp_num_layers is None:
            raise SpecError(
                "with enable_mhc_connections=True the last stage must have the final layernorm "
                "(the n streams are contracted right before it); build the block with "
                "post_layer_norm=True and a layer_norm in its spec"
            )
        # A DeepSeek variant brings its own head (deepseek-v4 learned, glm5 the mean).
        variant_head = getattr(config, "mhc_variant", "megatron") != "megatron"
        learned = getattr(config, "mhc_learned_output_contract", False)
        self.single_pass = bool(getattr(config, "mhc_single_pass", False))
        self._single_pass_state: SinglePassState | None = None
        self.payload = stage_payload(config)
        if self.contracts_streams and self.single_pass:
            self.final_layernorm.register_forward_pre_hook(self._contract_single_pass_before_norm)
        elif self.contracts_streams and (learned or variant_head):
            self._use_learned_contraction()
        elif self.contracts_streams:
            self.final_layernorm.register_forward_pre_hook(
                functools.partial(_contract_before_norm, self.num_residual_streams)
            )
        # Not megatron-core's attribute name: its 0.20 block builds its own mHC recompute
        # managers when its mhc_recompute_enabled is set (ours plans groups, _assign_...).
        self.ext_mhc_recompute_enabled = bool(getattr(config, "mhc_recompute_enabled", False))
        self._hide_mhc_from_upstream_forward()

    def _hide_mhc_from_upstream_forward(self) -> None:
        """Where megatron-core's own block expands and contracts the streams (its native mHC,
        :func:`megatron_ext.native_mhc.block_expands_streams`), it must not do so a second
        time: its forward reads a config view with mHC off, and its recompute managers stay
        off. The layers keep the shared config (they are megatron-ext's mHC layers)."""
        if not native.block_expands_streams():
            return
        if getattr(self.config, "enable_mhc_connections", False):
            block_view = copy.copy(self.config)
            block_view.enable_mhc_connections = False
            self.config = block_view
        self.mhc_recompute_enabled = False

    # ------------------------------------------------------------------ learned contraction
    # Upstream dev's GPT contracts with DeepSeek-V4's learned contraction (decoder.hc_head_*),
    # as our HybridStack does: both take it from the LearnedContraction mixin.

    def _use_learned_contraction(self) -> None:
        self._build_learned_contraction()
        self.final_layernorm.register_forward_pre_hook(self._contract_learned_before_norm)

    def _contract_learned_before_norm(self, _norm: torch.nn.Module, args: tuple) -> tuple:
        hidden_states, *rest = args
        return (self.contract_streams(hidden_states), *rest)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """megatron-core's entries plus the block's own ``hc_head_*`` parameters."""
        sharded_state_dict = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        return self._with_own_parameters(sharded_state_dict, prefix, sharded_offsets, metadata)

    # ------------------------------------------------------------------ single pass

    def _contract_single_pass_before_norm(self, _norm: torch.nn.Module, args: tuple) -> tuple:
        hidden_states, *rest = args
        assert self._single_pass_state is not None, "contracting outside the block's forward"
        return (contract_with_pre_mix(hidden_states, self._single_pass_state), *rest)

    def _start_single_pass(self, hidden_states: Tensor | None) -> None:
        self._single_pass_state = start_single_pass(
            self, hidden_states, self.layers, INPUT_TENSOR_SEAM
        )

    def _finish_single_pass(self, output: Any) -> Any:
        """A stage whose output travels on sends ``[hidden_states | pre_mix]``."""
        state, self._single_pass_state = self._single_pass_state, None
        for layer in self.layers:
            layer.single_pass_state = None
        if self.contracts_streams or not isinstance(output, Tensor) or state is None:
            return output
        if self.payload.is_plain:  # one stage (the reference): nothing travels
            return output
        return pack(self.payload, {HIDDEN_STATES: output, PRE_MIX: state.pre_mix})

    # ------------------------------------------------------------------ expand

    def expand_streams(self, hidden_states: Tensor) -> Tensor:
        """``[s, b, h] -> [s, b, n*h]``, every stream a copy of the input (viewless)."""
        if isinstance(hidden_states, WrappedTensor):
            hidden_states = hidden_states.unwrap()
        expanded = expand_streams(hidden_states, self.num_residual_streams)
        return make_viewless_tensor(
            inp=expanded, requires_grad=expanded.requires_grad, keep_graph=True
        )

    # ------------------------------------------------------------------ recompute groups

    def _assign_recompute_groups(self, extract_layer_indices) -> None:
        """Give every local layer its group for this forward (training with grad only)."""
        if not (self.ext_mhc_recompute_enabled and self.training and torch.is_grad_enabled()):
            return
        if extract_layer_indices:
            raise NotImplementedError(
                "'mhc' in recompute_modules cannot be combined with extract_layer_indices during "
                "training (intermediate outputs are discarded); remove 'mhc' from "
                "recompute_modules or stop extracting layers"
            )
        group = MHCRecomputeGroup()
        ends = plan_recompute_groups(len(self.layers), self.config.mhc_recompute_layer_num)
        for layer, ends_group in zip(self.layers, ends, strict=True):
            layer.mhc_recompute = LayerRecompute(group, ends_group)
            if ends_group:
                group = MHCRecomputeGroup()

    # ------------------------------------------------------------------ forward

    def forward(self, hidden_states, attention_mask=None, *args: Any, **kwargs: Any):
        """TransformerBlock.forward on n streams: expands first where ``pre_process``; the
        final layernorm (where present) contracts before normalising."""
        if self.pre_process:
            hidden_states = self.expand_streams(hidden_states)
        if self.single_pass:
            self._start_single_pass(hidden_states)
        self._assign_recompute_groups(kwargs.get("extract_layer_indices"))
        try:
            output = super().forward(hidden_states, attention_mask, *args, **kwargs)
        except BaseException:
            if self.single_pass:
                self._finish_single_pass(None)  # no coefficients left behind on the layers
            raise
        finally:
            for layer in self.layers:
                layer.mhc_recompute = None
        return self._finish_single_pass(output) if self.single_pass else output


__all__ = ["HyperConnectionTransformerBlock", "check_layers_support_mhc"]
