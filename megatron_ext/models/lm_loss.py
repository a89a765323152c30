"""The language-model loss every megatron-ext training step computes: the sum of the per-token
losses under the loss mask and the number of tokens counted. megatron-core 0.19.2's schedules
sum both over micro-batches (and data-parallel ranks) and divide at the end, so the loss is a
true per-token mean however the masks vary. The entries, the multi-module VLM step and the
test harnesses build their reports on it."""

from __future__ import annotations

import torch


def masked_token_loss(
    loss_mask: torch.Tensor, output_tensor: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the per-token losses where ``loss_mask`` is set, the mask as fp32 [N])."""
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.reshape(-1).float()
    return torch.sum(losses * mask), mask
