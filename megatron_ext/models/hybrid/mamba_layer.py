"""A Mamba layer (pattern symbol ``M``) whose residual is n mHC residual streams.

:class:`HyperConnectionMambaLayer` is megatron-core's ``MambaLayer`` with its residual
connection replaced by a hyper connection, exactly as
:class:`~megatron_ext.mhc.HyperConnectionTransformerLayer` does for attention and MLP:

    h_pre, h_post, h_res = mixer_hyper_connection.compute_mappings(x)
    y = mixer(norm(Σ_i h_pre_i · x_i))
    x_next = H_resᵀ · x + dropout(H_post ⊗ (y + bias))

Input and output are the flattened ``[s, b, n*h]`` residual; the mixer sees ``[s, b, h]``.
The connection's parameters are named after the sub-layer they wrap, like the transformer
layers' ``self_attention_hyper_connection`` / ``mlp_hyper_connection``:
``mixer_hyper_connection.*``. (Upstream's DeepSeek-V4 code instead wraps every Hybrid layer
in one module with ``hyper_connection`` and ``inner_layer.*``; no megatron-core release
ships either, so there are no checkpoints to stay compatible with.)

The "mhc" selective recompute does not checkpoint inside this layer: it keeps its
activations, and recompute groups are formed from the stack's other mHC layers.

With ``mhc_single_pass=True`` the stack hands the layer its ``single_pass_state``: the mixer
input is aggregated with the previous site's coefficients and this site's pre travels on
(:func:`megatron_ext.mhc.single_pass.single_pass_site`, as in the transformer layers).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.typed_torch import apply_module
from megatron.core.utils import deprecate_inference_params, make_viewless_tensor

from megatron_ext.errors import ConfigError
from megatron_ext.mhc.hyper_connection import (
    HyperConnectionModule,
    aggregate,
    bias_dropout_add_streams,
)
from megatron_ext.mhc.single_pass import SinglePassState, single_pass_site


@dataclass
class HyperConnectionMambaLayerSubmodules(MambaLayerSubmodules):
    """``MambaLayerSubmodules`` plus the mixer's hyper connection."""

    mixer_hyper_connection: ModuleSpec | type = HyperConnectionModule


class HyperConnectionMambaLayer(MambaLayer):
    """megatron-core's MambaLayer with n mHC residual streams (see the module doc).

    Same constructor as ``MambaLayer``; ``config.enable_mhc_connections`` must be True.
    """

    supports_mhc_connections: bool = True

    def __init__(
        self,
        config,
        submodules: MambaLayerSubmodules,
        layer_number: int = 1,
        pg_collection=None,
        pp_layer_offset: int = 0,
        name: str | None = None,
    ):
        if not getattr(config, "enable_mhc_connections", False):
            raise ConfigError(
                "HyperConnectionMambaLayer needs enable_mhc_connections=True in its config "
                "(megatron_ext.config.MHCTransformerConfig); use megatron-core's MambaLayer "
                "for plain residual connections"
            )
        super().__init__(
            config,
            submodules,
            layer_number=layer_number,
            pg_collection=pg_collection,
            pp_layer_offset=pp_layer_offset,
            name=name,
        )
        spec = getattr(submodules, "mixer_hyper_connection", HyperConnectionModule)
        self.mixer_hyper_connection = build_module(spec, config=config, layer_number=layer_number)
        self.mixer_hyper_connection.stats_sublayer = "mixer"
        self.mixer_hyper_connection.stats_groups = pg_collection  # for mhc.stats' sample
        # Set by the stack (or an MTP depth) for each single-pass forward.
        self.single_pass_state: SinglePassState | None = None

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Tensor | None = None,
        inference_context=None,
        rotary_pos_emb: Tensor | None = None,
        *,
        inference_params=None,
        packed_seq_params=None,
    ) -> Tensor:
        """``[s, b, n*h] -> [s, b, n*h]`` (the mixer runs on the aggregated ``[s, b, h]``)."""
        inference_context = deprecate_inference_params(inference_context, inference_params)
        residual = hidden_states
        connection = self.mixer_hyper_connection
        if self.single_pass_state is not None:
            mixer_input, post, res = single_pass_site(
                connection, hidden_states, self.single_pass_state
            )
        else:
            h_pre, h_post, h_res = connection.compute_mappings(hidden_states)
            mixer_input = aggregate(hidden_states, h_pre)
        mixer_input = apply_module(self.norm)(mixer_input.to(dtype=self.config.params_dtype))
        mixer_out_with_bias = self.mixer(
            mixer_input, inference_context=inference_context, packed_seq_params=packed_seq_params
        )
        with self.bias_dropout_add_exec_handler():
            if self.single_pass_state is not None:
                output = connection.merge_fn(
                    res,
                    residual,
                    post,
                    *mixer_out_with_bias,
                    dropout_p=self.hidden_dropout,
                    training=self.training,
                )
            else:
                output = bias_dropout_add_streams(
                    h_res, residual, h_post, mixer_out_with_bias, self.hidden_dropout, self.training
                )
        return make_viewless_tensor(inp=output, requires_grad=output.requires_grad, keep_graph=True)


__all__ = ["HyperConnectionMambaLayer", "HyperConnectionMambaLayerSubmodules"]
