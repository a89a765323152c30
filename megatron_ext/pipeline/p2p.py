"""Batched point-to-point exchange with forward messages ordered before backward ones.

megatron-core 0.19.2's ``_batched_p2p_ops`` posts send_prev, recv_prev, send_next,
recv_next. Messages between one pair of ranks are matched in posting order, so when the
previous and the next rank are the same process (PP=2) a rank's gradient (send_prev) is
matched with its peer's activation receive (recv_prev). The interleaved schedule
exchanges both in one call, and because activations and gradients have the same shape the
swap goes unnoticed: every gradient is silently wrong. Posting the forward pair (send_next,
recv_prev) before the backward pair (send_prev, recv_next) keeps each message in its own
buffer on both sides; for distinct neighbours the order changes nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def batched_p2p_ops_forward_first(
    *,
    tensor_send_prev: torch.Tensor | None,
    tensor_recv_prev: torch.Tensor | None,
    tensor_send_next: torch.Tensor | None,
    tensor_recv_next: torch.Tensor | None,
    group: dist.ProcessGroup,
    prev_pipeline_rank: int,
    next_pipeline_rank: int,
):
    """Same contract as megatron-core's ``_batched_p2p_ops``: post all four in one batch."""
    planned = [
        (dist.isend, tensor_send_next, next_pipeline_rank),  # forward: activation out
        (dist.irecv, tensor_recv_prev, prev_pipeline_rank),  # forward: activation in
        (dist.isend, tensor_send_prev, prev_pipeline_rank),  # backward: gradient out
        (dist.irecv, tensor_recv_next, next_pipeline_rank),  # backward: gradient in
    ]
    ops = [
        dist.P2POp(op, tensor, peer, group) for op, tensor, peer in planned if tensor is not None
    ]
    return dist.batch_isend_irecv(ops) if ops else []
