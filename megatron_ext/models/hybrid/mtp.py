"""Hybrid multi-token prediction (MTP) over mHC residual streams.

With ``enable_mhc_connections`` a Hybrid MTP depth keeps the n streams, as upstream's
HybridModel does (Megatron-LM PR #6401, DeepSeek-V4):

* input: depth 1 takes the decoder's n-stream state (before its learned contraction), depth
  k+1 takes depth k's n-stream output. ``hnorm`` and ``h_proj`` (``[h] -> [h]``, column
  parallel) act on every stream separately; ``e_proj`` (``[h] -> [h]``) on the normalised
  embedding of the next tokens; stream i of the depth's input is ``h_proj(hnorm(x_i)) +
  e_proj(enorm(e))``. These two projections replace the single-stream ``eh_proj``.
* layers: the depth's pattern (after ``/``), built from the stack's mHC layer specs; they
  map ``[s, b, n*h]`` to ``[s, b, n*h]``.
* loss: each depth owns its ``hc_head_fn / hc_head_base / hc_head_scale`` and contracts its
  output with them (learned contraction) before its final layernorm; the MTP losses are
  computed from these contracted states, the next depth continues from the streams.

Single-pass mHC (``mhc_single_pass=True``, :mod:`megatron_ext.mhc.single_pass`): the MTP
depths' layers are further sites of the same chain. A depth's first site aggregates its input
streams with the coefficients the preceding sub-layer produced, i.e. depth 1 with the
decoder's last pre (the coefficients the decoder's own contraction for the main loss uses),
depth k+1 with depth k's last pre; each depth contracts its output for its loss with its own
last pre (no ``hc_head_*`` on a depth) and hands that pre on. Choice stated: the public
sources (Megatron-LM PR #7500 and the #7224 tracker, NeMo Automodel's DeepSeek-V4.1 PR #3855)
do not say how an MTP depth's first site is seeded (#7500 ships single pass for the decoder
only, with TP = CP = PP = 1); continuing the chain rather than restarting at stream 0 (e_0)
keeps "every site reads the previous sub-layer's pre" true across the decoder/MTP boundary,
and the depth's input streams differ from each other (``h_proj`` of each decoder stream), so
stream 0 alone would not stand for them as the replicated embedding does for the decoder.
Under ``mtp_detach_heads`` the coefficients are detached with the streams.

The MTP block must sit on the model's final post_process chunk, where the decoder has both
its n-stream state and its own contraction: the decoder returns ``(normalised contraction,
n-stream state)`` and :class:`HyperConnectionMTPBlock` returns ``[main; depth 1; ...]``
contracted states concatenated along the sequence, which is what megatron-core's
``process_mtp_loss`` splits. Inference (speculative decoding) with mHC MTP is not supported.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from megatron.core.tensor_parallel import (
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlock,
    MultiTokenPredictionLayer,
    MultiTokenPredictionLayerSubmodules,
    get_mtp_layer_offset,
)
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.typed_torch import apply_module
from megatron.core.utils import make_viewless_tensor

from megatron_ext import registry
from megatron_ext.errors import SpecError
from megatron_ext.mhc.hyper_connection import HyperConnectionModule
from megatron_ext.mhc.learned_contraction import LearnedContraction
from megatron_ext.mhc.single_pass import SinglePassState, contract_with_pre_mix


def _mhc_enabled(config) -> bool:
    return bool(getattr(config, "enable_mhc_connections", False))


@dataclass
class HyperConnectionMTPLayerSubmodules(MultiTokenPredictionLayerSubmodules):
    """MTP layer submodules plus the two per-stream projections used with mHC (``eh_proj`` is
    used only without mHC)."""

    e_proj: ModuleSpec | type = None
    h_proj: ModuleSpec | type = None


class HyperConnectionMTPLayer(LearnedContraction, MultiTokenPredictionLayer):
    """megatron-core's Hybrid MTP layer; with mHC it carries n streams (see the module doc).

    Same constructor as ``MultiTokenPredictionLayer``. Without mHC it is that class.
    """

    def __init__(
        self,
        config,
        submodules: MultiTokenPredictionLayerSubmodules,
        layer_number: int = 1,
        vp_stage: int | None = None,
        pg_collection=None,
        mtp_layer_pattern: str | None = None,
        hybrid_submodules=None,
        mamba_submodules=None,
        name: str | None = None,
    ):
        carries_streams = _mhc_enabled(config)
        base_submodules = submodules
        if carries_streams:
            if mtp_layer_pattern is None or (hybrid_submodules or mamba_submodules) is None:
                raise SpecError(
                    "with enable_mhc_connections=True, MTP layers carry the n residual streams "
                    "and exist only in a HybridModel (its MTP block passes mtp_layer_pattern and "
                    "hybrid_submodules); GPT MTP layers cannot use HyperConnectionMTPLayer"
                )
            missing = [f for f in ("e_proj", "h_proj") if getattr(submodules, f, None) is None]
            if missing:
                raise SpecError(
                    f"with enable_mhc_connections=True the MTP layer spec needs {missing}: use "
                    "HyperConnectionMTPLayerSubmodules with e_proj and h_proj (column-parallel "
                    "linears), e.g. from get_hybrid_stack_local_spec(enable_mhc_connections=True)"
                )
            # The single-stream eh_proj is not built with mHC.
            base_submodules = dataclasses.replace(submodules, eh_proj=IdentityOp)
        super().__init__(
            config,
            base_submodules,
            layer_number=layer_number,
            vp_stage=vp_stage,
            pg_collection=pg_collection,
            mtp_layer_pattern=mtp_layer_pattern,
            hybrid_submodules=hybrid_submodules,
            mamba_submodules=mamba_submodules,
            name=name,
        )
        self.carries_streams = carries_streams
        if not carries_streams:
            return
        self.submodules = submodules
        self.eh_proj = None
        self.num_residual_streams = config.mhc_num_residual_streams
        self.e_proj = self._build_projection(submodules.e_proj, "mtp_e_proj", pg_collection)
        self.h_proj = self._build_projection(submodules.h_proj, "mtp_h_proj", pg_collection)

        self.single_pass = bool(getattr(config, "mhc_single_pass", False))
        if not self.single_pass:  # single pass contracts with the depth's last pre
            self._build_learned_contraction()
        # mhc.stats reports this depth's hyper connections apart from the decoder's (their
        # layer numbers restart at 1 inside the depth).
        for module in self.modules():
            if isinstance(module, HyperConnectionModule):
                module.stats_mtp_depth = self.layer_number

    def _build_projection(self, spec, buffer_name: str, pg_collection):
        h = self.config.hidden_size
        return build_module(
            spec,
            h,
            h,
            config=self.config,
            init_method=self.config.init_method,
            gather_output=False,
            bias=False,
            skip_bias_add=False,
            is_expert=False,
            tp_comm_buffer_name=buffer_name,
            tp_group=pg_collection.tp if pg_collection is not None else None,
        )

    # ------------------------------------------------------------------ streams in

    def _concat_embeddings(self, hidden_states: Tensor, decoder_input: Tensor) -> Tensor:
        """Depth input: stream i = ``h_proj(hnorm(x_i)) + e_proj(enorm(e))`` ``[s, b, n*h]``."""
        if not self.carries_streams:
            return super()._concat_embeddings(hidden_states, decoder_input)
        n, h = self.num_residual_streams, self.config.hidden_size
        seq, batch, _ = hidden_states.shape
        embedded = apply_module(self.enorm)(decoder_input)
        embedded = make_viewless_tensor(inp=embedded, requires_grad=True, keep_graph=True)
        # Streams as extra batch entries: [s, b*n, h] keeps the sequence axis first, which is
        # what sequence parallelism gathers and megatron's linears expect (3-D).
        streams = apply_module(self.hnorm)(hidden_states.reshape(seq, batch * n, h))
        streams = make_viewless_tensor(inp=streams, requires_grad=True, keep_graph=True)

        embedded, _ = self.e_proj(embedded)
        embedded = gather_from_tensor_model_parallel_region(embedded, group=self.tp_group)
        projected, _ = self.h_proj(streams)
        projected = gather_from_tensor_model_parallel_region(projected, group=self.tp_group)
        full_seq = projected.shape[0]
        combined = projected.view(full_seq, batch, n, h) + embedded.unsqueeze(2)
        combined = combined.reshape(full_seq, batch, n * h)
        if self.sequence_parallel:
            combined = scatter_to_sequence_parallel_region(combined, group=self.tp_group)
        return combined

    # ------------------------------------------------------------------ streams out

    def _postprocess(self, hidden_states: Tensor) -> Tensor:
        """Without mHC: final layernorm. With mHC the depth's output stays n-stream (the next
        depth continues from it); :meth:`contract_for_loss` gives the loss input."""
        if not self.carries_streams:
            return super()._postprocess(hidden_states)
        return hidden_states

    def single_pass_layers(self) -> list:
        """The depth's mHC sites (its inner stack's layers), in order."""
        layers = self.mtp_model_layer.layers
        return [layer for layer in layers if hasattr(layer, "single_pass_state")]

    def contract_for_loss(self, streams: Tensor, state: SinglePassState | None = None) -> Tensor:
        """``[s, b, n*h] -> [s, b, h]``: this depth's learned contraction (single pass: by the
        depth's last pre, ``state``), then its final layernorm (eps = layernorm eps)."""
        if state is not None:
            contracted = contract_with_pre_mix(streams, state)
        else:
            contracted = self.contract_streams(streams)
        normalised = apply_module(self.final_layernorm)(contracted)
        return make_viewless_tensor(inp=normalised, requires_grad=True, keep_graph=True)

    def forward_single_position(self, *args: Any, **kwargs: Any) -> Tensor:
        if self.carries_streams:
            raise NotImplementedError(
                "speculative decoding with mHC MTP layers is not supported: the decoder's "
                "n-stream state is not kept for it; set enable_mhc_connections=False or "
                "decode without MTP"
            )
        return super().forward_single_position(*args, **kwargs)


class HyperConnectionMTPBlock(MultiTokenPredictionBlock):
    """megatron-core's MTP block fed with ``(main output, n-stream state)`` by an mHC Hybrid
    decoder (see the module doc). Given a plain tensor it is megatron-core's block.

    megatron-core's HybridModel constructs ``MultiTokenPredictionBlock`` itself;
    :meth:`adopt` turns that freshly built block into this class in place.
    """

    @classmethod
    def adopt(cls, block: MultiTokenPredictionBlock) -> HyperConnectionMTPBlock:
        if type(block) is not MultiTokenPredictionBlock:
            registry.adopt(block, cls)  # raises: only a plain MultiTokenPredictionBlock
        plain = [
            type(layer).__name__
            for layer in block.layers
            if not getattr(layer, "carries_streams", False)
        ]
        if plain:
            raise SpecError(
                f"with enable_mhc_connections=True the MTP block's layers must carry the n "
                f"streams, but it has {', '.join(plain)}; build mtp_block_spec with "
                "HyperConnectionMTPLayer (get_hybrid_stack_local_spec(enable_mhc_connections=True))"
            )
        registry.adopt(block, cls)
        return block

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        hidden_states,
        attention_mask: Tensor,
        padding_mask: Tensor | None = None,
        context: Tensor | None = None,
        context_mask: Tensor | None = None,
        rotary_pos_emb: Tensor | None = None,
        rotary_pos_cos: Tensor | None = None,
        rotary_pos_sin: Tensor | None = None,
        attention_bias: Tensor | None = None,
        inference_params=None,
        packed_seq_params=None,
        sequence_len_offset: Tensor | None = None,
        extra_block_kwargs: dict | None = None,
        embedding=None,
    ) -> Tensor:
        """``hidden_states = (main [s, b, h], streams [s, b, n*h])`` -> ``[(1+D)*s, b, h]``:
        the main output followed by every depth's contracted output."""
        if not isinstance(hidden_states, tuple):
            return super().forward(
                input_ids,
                position_ids,
                hidden_states,
                attention_mask,
                padding_mask=padding_mask,
                context=context,
                context_mask=context_mask,
                rotary_pos_emb=rotary_pos_emb,
                rotary_pos_cos=rotary_pos_cos,
                rotary_pos_sin=rotary_pos_sin,
                attention_bias=attention_bias,
                inference_params=inference_params,
                packed_seq_params=packed_seq_params,
                sequence_len_offset=sequence_len_offset,
                extra_block_kwargs=extra_block_kwargs,
                embedding=embedding,
            )
        main, streams, *single_pass = hidden_states
        if get_mtp_layer_offset(self.config, self.vp_stage) != 0:
            raise NotImplementedError(
                "mHC MTP layers must all be on the final post_process chunk (got MTP layers "
                "split across pipeline stages by pipeline_model_parallel_layout)"
            )
        # Single pass: the decoder's last pre, which the first depth's first site reads.
        state = SinglePassState(single_pass[0]) if single_pass else None
        if self.config.mtp_detach_heads:
            streams = streams.detach()
            if state is not None:
                state.pre_mix = state.pre_mix.detach()
        outputs = [main]
        for depth in range(self.config.mtp_num_layers):
            layer = self.layers[0 if self.mtp_use_repeated_layer else depth]
            streams, input_ids, position_ids, padding_mask = self._run_depth(
                layer,
                state,
                input_ids=input_ids,
                position_ids=position_ids,
                hidden_states=streams,
                attention_mask=attention_mask,
                padding_mask=padding_mask,
                inference_params=inference_params,
                rotary_pos_emb=rotary_pos_emb,
                rotary_pos_cos=rotary_pos_cos,
                rotary_pos_sin=rotary_pos_sin,
                packed_seq_params=packed_seq_params,
                sequence_len_offset=sequence_len_offset,
                embedding=embedding,
                **(extra_block_kwargs or {}),
            )
            outputs.append(layer.contract_for_loss(streams, state))
        return torch.cat(outputs, dim=0)

    @staticmethod
    def _run_depth(layer, state: SinglePassState | None, **kwargs: Any):
        """One depth's forward; single pass: its sites share ``state`` for this call only."""
        if state is None:
            return layer(**kwargs)
        sites = layer.single_pass_layers()
        for site in sites:
            site.single_pass_state = state
        try:
            return layer(**kwargs)
        finally:
            for site in sites:
                site.single_pass_state = None


__all__ = [
    "HyperConnectionMTPBlock",
    "HyperConnectionMTPLayer",
    "HyperConnectionMTPLayerSubmodules",
]
