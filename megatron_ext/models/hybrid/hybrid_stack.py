"""megatron-core's HybridStack with a final norm chosen by the spec and, with
``config.enable_mhc_connections``, n mHC residual streams between its layers.

Differences from megatron-core's ``HybridStack`` (everything else is inherited):

* The final norm is built from ``submodules.final_norm`` (megatron-core hard-codes TENorm,
  which cannot be built without Transformer Engine). Parameter names are unchanged
  (``final_norm.*``).
* An empty stage or virtual chunk that neither embeds nor normalises returns a clone of its
  input, not the input tensor itself: the pipeline schedule frees ("pseudo-deallocates") the
  data of every output it has sent, which must not resize the received input that backward
  still needs. The clone is in the autograd graph, so gradients flow through it unchanged.

With mHC (``enable_mhc_connections=True``, and mHC layers from the spec):

* expand: where ``pre_process``, the embedding ``[s, b, h]`` is replicated into the
  flattened n-stream residual ``[s, b, n*h]``; later stages receive that from the previous
  stage, so every stage boundary carries ``n*h``.
* contract: where ``post_process``, DeepSeek-V4's learned contraction
  (:class:`megatron_ext.mhc.learned_contraction.LearnedContraction`) maps the streams back to
  ``[s, b, h]`` right before the final norm. Its parameters live on the stack:
  ``hc_head_fn [n, n*h]`` (xavier), ``hc_head_base [n]`` (zeros), ``hc_head_scale [1]``
  (ones), so checkpoint keys are ``decoder.hc_head_*`` as upstream. They are replicated across tensor parallelism and carry
  ``sequence_parallel`` so their gradients are summed over TP under sequence parallelism.
* MTP: when the model's MTP block runs on this chunk, the stack returns
  ``(normalised contraction, n-stream state)``; the MTP block consumes the streams (see
  :mod:`megatron_ext.models.hybrid.mtp`).
* single pass (``mhc_single_pass=True``, :mod:`megatron_ext.mhc.single_pass`): as GPT's
  :class:`~megatron_ext.mhc.transformer_block.HyperConnectionTransformerBlock`, the stack runs
  the coefficients from site to site over every mHC layer (attention, MLP, MoE and Mamba alike),
  starts them at e_0 where it expands, unpacks/packs the payload's ``pre_mix`` field at stage
  edges, and contracts with the last site's coefficients (no ``hc_head_*``). With MTP it also
  hands that last pre to the MTP block (:mod:`megatron_ext.models.hybrid.mtp`).
* "mhc" selective recompute: before each training forward the local mHC transformer layers
  are put into recompute groups (:mod:`megatron_ext.mhc.recompute`; Mamba layers in between
  keep their activations); the stack's last such layer always ends a group, so no group
  crosses a stage or virtual chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron.core.extensions.transformer_engine import TENorm
from megatron.core.inference.utils import InferenceMode
from megatron.core.models.hybrid.hybrid_block import (
    HybridStack as _CoreHybridStack,
    HybridStackSubmodules as _CoreHybridStackSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.utils import WrappedTensor, make_viewless_tensor

from megatron_ext.errors import SpecError
from megatron_ext.mhc.hyper_connection import expand_streams
from megatron_ext.mhc.learned_contraction import LearnedContraction
from megatron_ext.mhc.recompute import LayerRecompute, MHCRecomputeGroup, plan_recompute_groups
from megatron_ext.mhc.single_pass import SinglePassState, contract_with_pre_mix, start_single_pass
from megatron_ext.pipeline.payload import HIDDEN_STATES, PRE_MIX, stage_payload
from megatron_ext.pipeline.payload_wire import pack

# HybridStack.forward reads a receiving stage's input from input_tensor (declared seam).
INPUT_TENSOR_SEAM = "megatron.core.models.hybrid.hybrid_block:HybridStack.set_input_tensor"


@dataclass
class HybridStackSubmodules(_CoreHybridStackSubmodules):
    """megatron-core's ``HybridStackSubmodules`` plus the final norm (megatron-core's choice,
    TENorm, by default; local specs use :class:`~megatron_ext.models.norms.LocalNorm`)."""

    final_norm: ModuleSpec | type = TENorm


def _mhc_enabled(config) -> bool:
    return bool(getattr(config, "enable_mhc_connections", False))


class HybridStack(LearnedContraction, _CoreHybridStack):
    """megatron-core's HybridStack; same constructor (see the module doc for the additions)."""

    def __init__(
        self,
        config,
        submodules: _CoreHybridStackSubmodules,
        pre_process: bool = True,
        layer_type_list: list[str] | None = None,
        pp_layer_offset: int = 0,
        post_layer_norm: bool = True,
        post_process: bool = True,
        device=None,
        dtype=None,
        pg_collection=None,
        is_mtp_layer: bool = False,
        name: str | None = None,
    ) -> None:
        # The base class would build a TENorm; build ours from the spec instead.
        super().__init__(
            config,
            submodules,
            pre_process=pre_process,
            layer_type_list=layer_type_list,
            pp_layer_offset=pp_layer_offset,
            post_layer_norm=False,
            post_process=post_process,
            device=device,
            dtype=dtype,
            pg_collection=pg_collection,
            is_mtp_layer=is_mtp_layer,
            name=name,
        )
        self.post_layer_norm = post_layer_norm
        if self.post_process and self.post_layer_norm:
            self.final_norm = build_module(
                getattr(submodules, "final_norm", TENorm),
                config=self.config,
                hidden_size=self.config.hidden_size,
                eps=self.config.layernorm_epsilon,
            )

        # mHC: this stack owns the streams unless it is an MTP depth's inner stack, whose
        # input and output are already n-stream (the MTP layer owns those ends).
        self.carries_streams = _mhc_enabled(config) and not is_mtp_layer
        self.num_residual_streams = config.mhc_num_residual_streams if self.carries_streams else 1
        self.contracts_streams = self.carries_streams and self.post_process
        # Set by HybridModel when its MTP block on this chunk consumes the n-stream state.
        self.returns_streams_for_mtp = False
        # During one forward that hands its streams to MTP: where the final norm's pre-hook
        # leaves the n-stream state it contracted.
        self._streams_for_mtp: list | None = None
        self.mhc_recompute_enabled = self.carries_streams and bool(
            getattr(config, "mhc_recompute_enabled", False)
        )
        self.single_pass = self.carries_streams and bool(getattr(config, "mhc_single_pass", False))
        self._single_pass_state: SinglePassState | None = None
        self.payload = stage_payload(config)
        if self.contracts_streams:
            if not self.post_layer_norm:
                raise SpecError(
                    "with enable_mhc_connections=True the post_process HybridStack must have its "
                    "final norm (the n streams are contracted right before it); build it with "
                    "post_layer_norm=True"
                )
            if not self.single_pass:  # single pass contracts with the last pre: no hc_head
                self._build_learned_contraction()
            self.final_norm.register_forward_pre_hook(self._contract_before_final_norm)

    # ------------------------------------------------------------------ learned contraction

    def _contract_before_final_norm(self, _norm: torch.nn.Module, args: tuple) -> tuple:
        """Forward pre-hook of the final norm: the norm sees the contracted residual."""
        streams, *rest = args
        if self._streams_for_mtp is not None:
            self._streams_for_mtp.append(streams)
        if self.single_pass:
            assert self._single_pass_state is not None, "contracting outside the stack's forward"
            return (contract_with_pre_mix(streams, self._single_pass_state), *rest)
        return (self.contract_streams(streams), *rest)

    # ------------------------------------------------------------------ single pass

    def _single_pass_layers(self) -> list:
        return [layer for layer in self.layers if hasattr(layer, "single_pass_state")]

    def _start_single_pass(self, hidden_states) -> None:
        self._single_pass_state = start_single_pass(
            self, hidden_states, self._single_pass_layers(), INPUT_TENSOR_SEAM
        )

    def _finish_single_pass(self) -> SinglePassState | None:
        state, self._single_pass_state = self._single_pass_state, None
        for layer in self._single_pass_layers():
            layer.single_pass_state = None
        return state

    def _send_single_pass(self, output, state: SinglePassState | None):
        """A stage whose output travels on sends ``[hidden_states | pre_mix]``."""
        if self.contracts_streams or state is None or self.payload.is_plain:
            return output
        return pack(self.payload, {HIDDEN_STATES: output, PRE_MIX: state.pre_mix})

    # ------------------------------------------------------------------ recompute groups

    def _assign_recompute_groups(self) -> None:
        """Give every local layer that takes part in "mhc" recompute its group for this
        forward. Groups are consecutive such layers (layers in between, e.g. Mamba, keep
        their activations); the last such layer always ends a group."""
        if not (self.mhc_recompute_enabled and self.training and torch.is_grad_enabled()):
            return
        layers = [layer for layer in self.layers if hasattr(layer, "mhc_recompute")]
        group = MHCRecomputeGroup()
        ends = plan_recompute_groups(len(layers), self.config.mhc_recompute_layer_num)
        for layer, ends_group in zip(layers, ends, strict=True):
            layer.mhc_recompute = LayerRecompute(group, ends_group)
            if ends_group:
                group = MHCRecomputeGroup()

    def _clear_recompute_groups(self) -> None:
        for layer in self.layers:
            if hasattr(layer, "mhc_recompute"):
                layer.mhc_recompute = None

    # ------------------------------------------------------------------ forward

    def _hands_streams_to_mtp(self) -> bool:
        # Exactly when HybridModel.forward runs its MTP block (never in inference).
        return (
            self.contracts_streams
            and self.returns_streams_for_mtp
            and (not InferenceMode.is_active())
        )

    def forward(self, hidden_states, attention_mask, *args: Any, **kwargs: Any):
        """HybridStack.forward; with mHC, expands first where ``pre_process`` and contracts
        before the final norm where ``post_process``. Returns ``(output, n-stream state)``
        when the model's MTP block consumes the streams."""
        if self.carries_streams and self.pre_process:
            if isinstance(hidden_states, WrappedTensor):
                hidden_states = hidden_states.unwrap()
            expanded = expand_streams(hidden_states, self.num_residual_streams)
            hidden_states = make_viewless_tensor(
                inp=expanded, requires_grad=expanded.requires_grad, keep_graph=True
            )
        if self.single_pass:
            self._start_single_pass(hidden_states)
        self._streams_for_mtp = [] if self._hands_streams_to_mtp() else None
        self._assign_recompute_groups()
        state = None
        try:
            output = super().forward(hidden_states, attention_mask, *args, **kwargs)
            streams = self._streams_for_mtp
        finally:
            self._clear_recompute_groups()
            self._streams_for_mtp = None
            if self.single_pass:
                state = self._finish_single_pass()
        if len(self.layers) == 0 and not (self.pre_process or self.post_process):
            # Otherwise the output would be the received input tensor itself (see module doc).
            output = output.clone()
        if streams:
            if state is not None:  # single pass: the MTP depth reads the decoder's last pre
                return output, streams[0], state.pre_mix
            return output, streams[0]
        return self._send_single_pass(output, state)

    # ------------------------------------------------------------------ checkpoints

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=None, metadata=None):
        """megatron-core's entries plus this stack's own parameters (``hc_head_*``), which the
        base class (iterating child modules only) would leave out."""
        sharded_state_dict = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        return self._with_own_parameters(sharded_state_dict, prefix, sharded_offsets, metadata)


__all__ = ["HybridStack", "HybridStackSubmodules"]
