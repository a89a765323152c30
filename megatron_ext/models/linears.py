"""The local specs' row-parallel linear: megatron_ext.pipeline.wgrad's (deferrable weight
gradient) with experts' output reduce skipped where it would do nothing, and a returned bias
that is a view of the parameter, not the parameter.

Why: megatron-core 0.19.2's expert MLP (``MLP.forward`` with a ``per_token_scale``, as
``SequentialMLP`` calls it) adds the bias of ``linear_fc2`` to that linear's output in place.
``RowParallelLinear`` hands its matmul output through ``reduce_from_tensor_model_parallel_region``
(or the sequence-parallel reduce-scatter) unless ``explicit_expert_comm`` is set, which megatron
sets only for expert tensor- or expert-parallel sizes above 1. With one rank in the expert's
group that reduce is an autograd Function returning its input as-is, so autograd marks the
output a view and the in-place bias add raises ("Output 0 of _ReduceFromModelParallelRegion is a
view and is being modified inplace"): every MoE model with ``add_bias_linear=True`` at
EP=1 and expert TP=1 (megatron's config allows bias only with expert TP 1) fails in its first
forward, with or without mHC.

Here such an expert linear sets ``explicit_expert_comm``, as megatron itself does on the legacy
linears of its overlapped shared experts: the output is the matmul's own tensor. Over a one-rank
group the skipped reduce is the identity forward and backward, so values and gradients are
unchanged, nothing is copied, and one autograd node fewer runs. ``explicit_expert_comm`` also
requires ``skip_bias_add`` (the caller adds the bias), which the MLP's ``linear_fc2`` always has;
a linear without it keeps megatron's path.

The returned bias: with ``skip_bias_add`` megatron's linear returns its bias parameter itself.
Under megatron's "mlp" selective recompute the MLP runs inside a ``CheckpointFunction`` whose
outputs include ``linear_fc2``'s bias; an autograd Function that returns a leaf parameter gives
it the Function as ``grad_fn``, so every later use of the bias chains into the previous
checkpoint's backward, and megatron-core 0.19.2 with ``add_bias_linear=True`` hangs (or
overflows the stack) in its first backward, with or without mHC. A view of the parameter is the
same values and the same gradient, and leaves the parameter a leaf.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron.core.utils import get_pg_size

from megatron_ext.pipeline import wgrad


class RowParallelLinear(wgrad.RowParallelLinear):
    """megatron-core's RowParallelLinear with a deferrable weight gradient
    (:class:`megatron_ext.pipeline.wgrad.RowParallelLinear`) whose output is never a view when
    it is an expert's over a one-rank group (module doc)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.is_expert and self.skip_bias_add and get_pg_size(self.tp_group) == 1:
            self.explicit_expert_comm = True

    def forward(self, input_: Any, *args: Any, **kwargs: Any) -> Any:
        output, bias = super().forward(input_, *args, **kwargs)
        if isinstance(bias, torch.nn.Parameter):
            # A view, not the parameter: an MLP under megatron's "mlp" recompute returns it from
            # a CheckpointFunction, which would become the parameter's grad_fn (module doc).
            bias = bias.view_as(bias)
        return output, bias


__all__ = ["RowParallelLinear"]
