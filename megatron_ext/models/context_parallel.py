"""Context parallelism (CP) for the local, torch-only layer specs.

megatron-core runs context parallelism only inside Transformer Engine's attention; its local
``DotProductAttention`` refuses ``context_parallel_size > 1``. This module is the core
attention of the local specs (GPT and Hybrid, with or without mHC) and makes CP work without
Transformer Engine, on CPU too.

How the sequence is shared (the same split as megatron's ``get_batch_on_this_cp_rank`` and
``get_pos_emb_on_this_cp_rank``): the sequence is cut into ``2 * cp`` equal chunks and CP rank
``r`` keeps chunks ``r`` and ``2 * cp - 1 - r``. Under a causal mask an early chunk has little
to attend to and a late one a lot, so pairing them gives every rank the same work.

Everything outside attention works per token and needs nothing else: embeddings read the
global position ids of the split batch, rotary embeddings are sliced by megatron itself, the
norms, MLP and mHC mixing act on each token. Attention is the only place that needs the other
ranks' tokens. Each rank projects its own tokens to Q/K/V, then
:func:`gather_sequence` all-gathers K and V (concatenated, so one collective per layer) over the
CP group; its backward reduce-scatters the K/V gradients, returning to each rank the sum of what
every rank's queries contributed to its keys and values. The local queries then attend to the
full keys with a causal mask built from global token indices (:func:`local_token_positions`).

Memory: each rank holds the full K/V of one layer at a time (``s * b * 2 * g * d`` values for
``g`` query groups of width ``d``) and a score matrix of ``s/cp * s`` per head. Ring attention
(Transformer Engine's ``cp_comm_type="p2p"``) streams K/V blocks between neighbours and keeps
only ``2 * s/cp`` of them; see ``bench/cp_memory.py`` and ``bench/README.md`` for when that
matters.

Supported: causal masks (``AttnMaskType.causal``), GQA, tensor and sequence parallelism,
pipeline parallelism, dropout. Not supported with CP > 1: other mask types, sliding windows,
packed sequences (THD) and attention bias; each raises a clear error when the module is built
or called.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import Tensor

from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_ext.parallel_plan import cp_token_positions, load_balanced_chunks


# ----------------------------------------------------------------------------- the split
def local_token_positions(local_seq_length: int, cp_size: int, cp_rank: int, device=None) -> Tensor:
    """Global sequence index of each of this rank's ``local_seq_length`` tokens, as a tensor
    (the split itself: :func:`megatron_ext.parallel_plan.cp_token_positions`)."""
    positions = cp_token_positions(local_seq_length, cp_size, cp_rank)
    return torch.tensor(positions, dtype=torch.long, device=device)


# ----------------------------------------------------------------------------- the collective
class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 over a group; backward reduce-scatters the gradient (each
    rank's slice of the gradient is the sum of every rank's contribution to it)."""

    @staticmethod
    def forward(ctx, local: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        local = local.contiguous()
        gathered = local.new_empty((group.size() * local.shape[0], *local.shape[1:]))
        dist.all_gather_into_tensor(gathered, local, group=group)
        return gathered

    @staticmethod
    def backward(ctx, grad_gathered: Tensor):
        group = ctx.group
        grad_gathered = grad_gathered.contiguous()
        grad_local = grad_gathered.new_empty(
            (grad_gathered.shape[0] // group.size(), *grad_gathered.shape[1:])
        )
        dist.reduce_scatter_tensor(grad_local, grad_gathered, group=group)
        return grad_local, None


def gather_sequence(local: Tensor, group: dist.ProcessGroup) -> Tensor:
    """``[s_local, ...]`` on each rank -> ``[size * s_local, ...]``, rank by rank (so in the
    ranks' local orders, not in sequence order). Differentiable."""
    return _GatherSequence.apply(local, group)


# ----------------------------------------------------------------------------- the attention
class ContextParallelDotProductAttention(DotProductAttention):
    """megatron-core's local ``DotProductAttention`` that also runs with
    ``context_parallel_size > 1`` (causal masks).

    With a CP group of one it *is* ``DotProductAttention``. With more, ``forward`` receives this
    rank's queries, keys and values (``[s/cp, b, heads, d]``, tokens in the load-balanced
    order), gathers the keys and values of every CP rank in one all-gather and lets the local
    queries attend to all of them under a causal mask on global token indices. The parameters
    (only a learnable softmax offset, if configured) and the output are those of the base class.

    ``k_channels``/``v_channels`` are the per-head query/key and value widths that multi-latent
    attention passes (megatron-core's local attention takes neither, so MLA needs Transformer
    Engine there): the output is ``v_channels`` per head and the default softmax scale is
    ``1/sqrt(k_channels)``.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
    ):
        cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        if cp_group is None and config.context_parallel_size > 1:
            cp_group = parallel_state.get_context_parallel_group()
        cp_size = cp_group.size() if cp_group is not None else 1
        if cp_size > 1:
            _check_supported(config, attn_mask_type, layer_number, cp_size)
        # The base class refuses CP; it only needs the config for sizes, scale and dropout.
        base_config = config
        if config.context_parallel_size > 1:
            base_config = copy.copy(config)
            base_config.context_parallel_size = 1
        if v_channels is not None and v_channels != config.kv_channels:
            # The base class sizes its output (heads x kv_channels) from the config.
            base_config = copy.copy(base_config)
            base_config.kv_channels = v_channels
        if softmax_scale is None and k_channels is not None:
            softmax_scale = k_channels**-0.5
        super().__init__(
            base_config,
            layer_number,
            # With CP the mask is ours (global indices, s/cp x s), so the softmax must apply
            # the given mask instead of building (or fusing) a square causal one.
            AttnMaskType.arbitrary if cp_size > 1 else attn_mask_type,
            attention_type,
            attention_dropout=attention_dropout,
            softmax_scale=softmax_scale,
            cp_comm_type=cp_comm_type,
            pg_collection=pg_collection,
        )
        self.config = config
        self.cp_group = cp_group
        self.cp_size = cp_size
        self.causal = attn_mask_type == AttnMaskType.causal

    def token_positions(self, local_seq_length: int, cp_rank: int, device) -> Tensor:
        """Global index of each token CP rank ``cp_rank`` holds (a method, so a test can
        break it on purpose and see the equivalence harness fail)."""
        return local_token_positions(local_seq_length, self.cp_size, cp_rank, device)

    def causal_mask(self, local_seq_length: int, device) -> Tensor:
        """``[1, 1, s/cp, s]`` boolean, True where a local query must not see a gathered key
        (keys in the gathered order: rank 0's tokens, then rank 1's, ...). Computed, not
        communicated: every rank knows every rank's positions."""
        assert self.cp_group is not None, "a causal mask across CP ranks needs the CP group"
        query_positions = self.token_positions(local_seq_length, self.cp_group.rank(), device)
        key_positions = torch.cat(
            [self.token_positions(local_seq_length, rank, device) for rank in range(self.cp_size)]
        )
        return (key_positions.unsqueeze(0) > query_positions.unsqueeze(1)).view(
            1, 1, local_seq_length, -1
        )

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> Tensor:
        if self.cp_size == 1:
            return super().forward(
                query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
            )
        if packed_seq_params is not None:
            raise NotImplementedError(
                "packed sequences (THD) are not supported by megatron-ext's local context-"
                "parallel attention; use context_parallel_size=1 or Transformer Engine"
            )
        # The given attention_mask is ignored, as Transformer Engine does for causal masks: it
        # is the square causal mask (or a CP slice of it), and ours follows global indices.
        assert self.cp_group is not None  # cp_size > 1 comes from a group (constructor)
        key_value = gather_sequence(torch.cat([key, value], dim=-1), self.cp_group)
        key, value = key_value.split([key.shape[-1], value.shape[-1]], dim=-1)
        mask = self.causal_mask(query.shape[0], query.device)
        return super().forward(query, key, value, mask, None, attention_bias, None)


def _check_supported(
    config: TransformerConfig, attn_mask_type: AttnMaskType, layer_number: int, cp_size: int
) -> None:
    from megatron.core.transformer.utils import is_layer_window_attention

    if attn_mask_type != AttnMaskType.causal:
        raise NotImplementedError(
            f"megatron-ext's local context-parallel attention supports causal masks only, got "
            f"attn_mask_type={attn_mask_type.name} with context_parallel_size={cp_size}; use a "
            f"causal mask, context_parallel_size=1, or Transformer Engine"
        )
    if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
        raise NotImplementedError(
            f"window_size={config.window_size} (sliding-window attention) is not supported by "
            f"megatron-ext's local context-parallel attention; unset window_size or use "
            f"context_parallel_size=1"
        )


__all__ = [
    "ContextParallelDotProductAttention",
    "gather_sequence",
    "load_balanced_chunks",
    "local_token_positions",
]
