"""The local specs' row-parallel linear: megatron_ext.pipeline.wgrad's (deferrable weight
gradient) with experts' output reduce skipped where it would do nothing.

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
"""

from __future__ import annotations

from typing import Any

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


__all__ = ["RowParallelLinear"]
