"""The learned contraction's parameters on the module that owns the n streams.

Upstream dev (DeepSeek-V4) contracts the n residual streams back to ``[s, b, h]`` with a
learned map whose parameters live on the block, not on a child module: ``hc_head_fn [n, n*h]``
(xavier), ``hc_head_base [n]`` (zeros), ``hc_head_scale [1]`` (ones); checkpoint keys are
``decoder.hc_head_*``. :class:`LearnedContraction` gives a block those three pieces (build,
contract, and its own parameters in megatron's sharded state dict) so the Hybrid stack and the
GPT mHC block share one implementation. The maths itself is
:func:`megatron_ext.mhc.hyper_connection.learned_contract`.

``mhc_variant`` picks the head: "megatron" upstream dev's (ε = layernorm eps in the norm and on
the weights), "deepseek-v4" DeepSeek-V4's ``DeepseekV4HyperHead`` (ε = hc_eps on the weights),
"glm5" GLM-5-Next's ``Glm5NextTextHyperHead``: the plain mean, no parameters.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
)

from megatron_ext.mhc.hyper_connection import KeepsHCHeadFP32, contract_mean, learned_contract
from megatron_ext.mhc.variants import DEFAULT_VARIANT, contracts_by_mean, head_weight_eps


class LearnedContraction(KeepsHCHeadFP32):
    """Mixin for a block with ``config`` and ``num_residual_streams`` that contracts its streams
    with learned ``hc_head_*`` parameters (kept fp32 under a bf16/fp16 cast). Put it before the
    megatron base class."""

    # Provided by the block this is mixed into (megatron's TransformerBlock, HybridStack, MTP
    # layer); annotations only, for the type checker.
    config: Any
    num_residual_streams: int
    tp_group: Any

    def _build_learned_contraction(self) -> None:
        if contracts_by_mean(self._mhc_variant):
            return  # GLM-5-Next: the mean, nothing to learn
        n, h = self.num_residual_streams, self.config.hidden_size
        self.hc_head_fn = torch.nn.Parameter(torch.empty(n, n * h))
        self.hc_head_base = torch.nn.Parameter(torch.zeros(n))
        self.hc_head_scale = torch.nn.Parameter(torch.ones(1))
        torch.nn.init.xavier_uniform_(self.hc_head_fn)
        for param in (self.hc_head_fn, self.hc_head_base, self.hc_head_scale):
            # Read by finalize_model_grads: sum this parameter's grad over TP under SP (an
            # attribute megatron attaches to parameters, unknown to torch's type stubs).
            param.sequence_parallel = self.config.sequence_parallel  # type: ignore[attr-defined]

    @property
    def _mhc_variant(self) -> str:
        return getattr(self.config, "mhc_variant", DEFAULT_VARIANT)

    def contract_streams(self, hidden_states: Tensor) -> Tensor:
        """``[s, b, n*h] -> [s, b, h]`` with the variant's head (RMS eps = layernorm eps)."""
        if contracts_by_mean(self._mhc_variant):
            return contract_mean(hidden_states, self.num_residual_streams)
        eps = self.config.layernorm_epsilon
        return learned_contract(
            hidden_states,
            self.hc_head_fn,
            self.hc_head_base,
            self.hc_head_scale,
            self.num_residual_streams,
            eps,
            head_weight_eps(self._mhc_variant, eps),
        )

    def _with_own_parameters(
        self, sharded_state_dict: dict, prefix: str, sharded_offsets, metadata
    ) -> dict:
        """Add this module's own parameters (not its children's: the ``hc_head_*``) to
        megatron's sharded state dict, as replicated tensors of ``prefix``; megatron's base
        classes iterate child modules only and would leave them out of checkpoints."""
        own = dict(self.named_parameters(recurse=False))
        if own:
            metadata = ensure_metadata_has_dp_cp_group(metadata)
            sharded_state_dict.update(
                make_sharded_tensors_for_checkpoint(
                    own,
                    prefix,
                    sharded_offsets=sharded_offsets or (),
                    tp_group=self.tp_group,
                    dp_cp_group=metadata["dp_cp_group"],
                )
            )
        return sharded_state_dict


__all__ = ["LearnedContraction"]
