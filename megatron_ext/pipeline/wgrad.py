"""Deferred weight gradients: the "W" of the zero-bubble schedules (ZB-H1).

A zero-bubble schedule splits a micro-batch's backward into B (input gradients, which the
previous stage waits for) and W (weight gradients, which nobody waits for and so can fill the
pipeline's bubble). This module owns W for megatron-ext's local layer specs:

* :class:`ColumnParallelLinear` and :class:`RowParallelLinear` are megatron-core's linears
  (same names, parameters, state dicts and sharded state dicts) whose matmul, when
  :func:`deferral_enabled` (``config.pipeline_schedule == "zb-h1"``), runs through
  :class:`_DeferrableLinearFunction`: its backward computes only the input gradient, with the
  tensor-parallel collectives megatron's ``LinearWithGradAccumulationAndAsyncCommunication``
  does (all-reduce of the input gradient for column-parallel layers without sequence
  parallelism, reduce-scatter with it). Inside :func:`capture` it stores what the weight
  gradient needs (the layer's input as the matmul saw it before any sequence-parallel gather,
  the output gradient, the weight and bias); outside it computes the weight gradient at once,
  with megatron's arithmetic (eager: plain ``loss.backward()``, or 1F1B with the field set).
  With deferral off the layers are megatron's, bit for bit (megatron's own autograd function).
* :func:`run` computes the stored work of one micro-batch and accumulates it through each
  parameter's own autograd accumulator (``param.expand_as(param)`` leads to the
  ``AccumulateGrad`` node megatron's DDP hooked), so DDP's grad hooks fire once per parameter
  per micro-batch, into ``main_grad``, as in an eager backward (a parameter several stored
  items share gets their sum, once).
* Each linear's ``backward_dw()`` (megatron-core's seam: attention, MLP, SequentialMLP and MLA
  call their linears' ``backward_dw``) computes that linear's stored work, micro-batch by
  micro-batch.
* A torch optimizer step (megatron's optimizers step their inner torch optimizer) with work
  still stored raises :class:`PendingWeightGradientError`, instead of applying a stale gradient;
  :func:`raise_if_pending` is the same check for a schedule to call before finalising grads.

Why the parameters enter the function detached: autograd runs a parameter's AccumulateGrad node
(and DDP's hook on it) even when the gradient reaching it is None, so a wired-in weight would
fire DDP's hook in B with no gradient and again in W. Detached, the node runs only when W (or
the eager path, from inside B) hands it the gradient. The price, in the eager path only: a
linear called twice in one forward accumulates twice (autograd would sum first), so DDP's hook
runs twice for it in that backward.

What stays in B (megatron's own path, weight gradient in the backward): linears our specs do
not swap (the output layer / LM head, tied to the embedding or not, which GPTModel builds
itself; the Hybrid MTP projections and Mamba's in/out projections), MLA's down projections (megatron's MLA accepts only its own classes
there, by identity), a call whose input needs no gradient (nothing would reach the detached
weight), the row-parallel bias added after the reduce and ``skip_bias_add`` biases (added by
the caller; their gradients are sums), frozen or non-leaf weights, megatron's embedding wgrad
deferral and GTP-sharded weights; and the mHC projection of :mod:`megatron_ext.mhc` (its output
is n^2 + 2n numbers per token, so its weight gradient is a small fraction of a layer's FLOPs;
deferring it is not worth keeping its n*h-wide input alive until W).
gradient_accumulation_fusion (wgrad GEMM straight into main_grad) is refused with zb-h1 by
:func:`megatron_ext.guards.check_pipeline_schedule`.

Transformer Engine specs are not deferred here: TE's own ``delay_wgrad_compute`` is switched on
through megatron-core 0.19.2's ``TransformerConfig.delay_wgrad_compute``, whose
``__post_init__`` requires ``overlap_moe_expert_parallel_comm`` (the MoE A2A overlap), so it
cannot be reached for a plain pipeline. With TE layers a zero-bubble schedule computes every
weight gradient in B (correct, no bubble filled). Not verifiable here: TE does not import on
this machine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron.core import tensor_parallel
from megatron.core.parallel_state import get_global_memory_buffer
from megatron.core.utils import prepare_input_tensors_for_wgrad_compute

from megatron_ext.errors import MegatronExtError

# The schedules that run backward as B and W steps (config.pipeline_schedule).
DEFERRING_SCHEDULES = ("zb-h1",)

# megatron's linears cast autocast inputs the same way (custom_fwd / custom_bwd for "cuda").
_custom_fwd = torch.amp.custom_fwd(device_type="cuda")
_custom_bwd = torch.amp.custom_bwd(device_type="cuda")


class PendingWeightGradientError(MegatronExtError, RuntimeError):
    """An optimizer step (or grad finalisation) while deferred weight gradients are stored."""


def deferral_enabled(config: Any) -> bool:
    """True when ``config`` asks for deferrable linears (``pipeline_schedule == "zb-h1"``)."""
    return getattr(config, "pipeline_schedule", "1f1b") in DEFERRING_SCHEDULES


# ----------------------------------------------------------------------------- stored work
@dataclass
class _Work:
    """What one linear's weight gradient for one micro-batch needs."""

    owner: torch.nn.Module
    input: torch.Tensor  # before the sequence-parallel all-gather (as megatron saves it)
    grad_output: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    sequence_parallel: bool
    tp_group: Any
    # The autocast state the backward ran under (custom_bwd re-enters the forward's): W runs
    # later, outside it, and must compute in the same dtype megatron's backward would.
    autocast: tuple[str, bool, torch.dtype] | None = None

    def gradients(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight and bias gradients, computed as megatron's linear backward does."""
        if self.autocast is None:
            return self._gradients()
        device_type, enabled, dtype = self.autocast
        with torch.autocast(device_type, dtype=dtype, enabled=enabled):
            return self._gradients()

    def _gradients(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        total_input = self.input
        if self.sequence_parallel:
            total_input = _gather_sequence(self.input, self.tp_group)
        grad_output, total_input = prepare_input_tensors_for_wgrad_compute(
            self.grad_output, total_input
        )
        grad_weight = grad_output.t().matmul(total_input)
        grad_bias = grad_output.sum(dim=0) if self.bias is not None else None
        return grad_weight, grad_bias

    def param_grads(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, gradient) for the weight and, when it is in the matmul, the bias."""
        grad_weight, grad_bias = self.gradients()
        pairs = [(self.weight, grad_weight)]
        if self.bias is not None and grad_bias is not None:
            pairs.append((self.bias, grad_bias))
        return pairs


def _autocast_state(device_type: str) -> tuple[str, bool, torch.dtype]:
    return (
        device_type,
        torch.is_autocast_enabled(device_type),
        torch.get_autocast_dtype(device_type),
    )


def _accumulate_micro_batch(works: list[_Work]) -> None:
    """Accumulate one micro-batch's work in order. A parameter that several items share (a
    linear called more than once in a forward) gets the sum, once, at its last item: an eager
    backward sums such contributions in the AccumulateGrad node's input buffer (first + next,
    in arrival order, which is the stored order) and runs the node, and DDP's hook, once."""
    remaining: dict[int, int] = {}
    for work in works:
        for param in (work.weight, work.bias):
            if param is not None:
                remaining[id(param)] = remaining.get(id(param), 0) + 1
    partial: dict[int, torch.Tensor] = {}
    for work in works:
        params, grads = [], []
        for param, grad in work.param_grads():
            key = id(param)
            remaining[key] -= 1
            if key in partial:
                grad = partial.pop(key) + grad
            if remaining[key]:
                partial[key] = grad
                continue
            params.append(param)
            grads.append(grad)
        if params:
            _accumulate(params, grads)


def _gather_sequence(local: torch.Tensor, group: Any) -> torch.Tensor:
    """The sequence-parallel all-gather of ``local`` along dim 0, into megatron's buffer."""
    shape = list(local.size())
    shape[0] *= group.size()
    gathered = get_global_memory_buffer().get_tensor(shape, local.dtype, "mpu")
    dist.all_gather_into_tensor(gathered, local.contiguous(), group=group)
    return gathered


def _accumulate(params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """Add ``grads`` to ``params`` through their AccumulateGrad nodes: ``expand_as`` to the
    same shape is an identity whose backward reaches the node (and the hooks megatron's DDP
    registered on it, which move the gradient into main_grad), as an eager backward would."""
    with torch.enable_grad():
        torch.autograd.backward([p.expand_as(p) for p in params], grads)


class _Store:
    """The stored work, by micro-batch key (oldest first), and the key being captured.

    Module-level on purpose, not thread-local: autograd runs CUDA backward functions on its
    own device threads, which must see the key the calling thread set."""

    def __init__(self) -> None:
        self.work: dict[Hashable, list[_Work]] = {}
        self.capturing: Hashable | None = None
        self.active = False

    def add(self, work: _Work) -> None:
        self.work.setdefault(self.capturing, []).append(work)

    def take(self, key: Hashable) -> list[_Work]:
        return self.work.pop(key, [])

    def take_owned(self, owner: torch.nn.Module) -> list[list[_Work]]:
        """``owner``'s work, one list per micro-batch (oldest first)."""
        taken = []
        for key in list(self.work):
            mine = [w for w in self.work[key] if w.owner is owner]
            if mine:
                self.work[key] = [w for w in self.work[key] if w.owner is not owner]
                taken.append(mine)
                if not self.work[key]:
                    del self.work[key]
        return taken


_STORE = _Store()


@contextlib.contextmanager
def capture(microbatch: Hashable) -> Iterator[None]:
    """Backward passes run inside store each deferrable linear's weight-gradient work under
    ``microbatch`` instead of computing it (:func:`run` computes it)."""
    if _STORE.active:
        raise RuntimeError(
            f"wgrad.capture({microbatch!r}) inside capture({_STORE.capturing!r}): captures do "
            "not nest; run each micro-batch's backward in its own capture"
        )
    _STORE.active, _STORE.capturing = True, microbatch
    try:
        yield
    finally:
        _STORE.active, _STORE.capturing = False, None


def run(microbatch: Hashable) -> None:
    """Compute and accumulate all work stored under ``microbatch``, in the order stored
    (nothing stored: nothing to do, e.g. a stage without deferrable linears).

    Under megatron's DDP the accumulation fires its grad hooks, which start the bucket reduce
    when the DDP is at its last micro-batch: run every W but the one that comes last inside
    DDP's ``no_sync()`` (config.no_sync_func), as megatron does for every B but the last."""
    _accumulate_micro_batch(_STORE.take(microbatch))


def pending() -> list:
    """The keys with work still stored, oldest first."""
    return [key for key, work in _STORE.work.items() if work]


def deferrable_linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The linears of ``model`` whose weight gradient can be deferred (empty for a Transformer
    Engine spec: a zero-bubble schedule's W steps then have nothing to do)."""
    return [m for m in model.modules() if isinstance(m, _Deferrable)]


def raise_if_pending(when: str) -> None:
    """Raise :class:`PendingWeightGradientError` if any work is stored (``when``: what was
    about to happen, for the message)."""
    keys = pending()
    if keys:
        shown = ", ".join(repr(k) for k in keys[:8]) + (", ..." if len(keys) > 8 else "")
        raise PendingWeightGradientError(
            f"{when} with the weight gradients of {len(keys)} micro-batch(es) still deferred "
            f"({shown}): call megatron_ext.pipeline.wgrad.run(key) for each (the zero-bubble "
            "schedule runs every W step before it returns), or backward outside wgrad.capture()"
        )


def discard_pending() -> None:
    """Drop every stored work item (after a failed step, so the next one starts clean)."""
    _STORE.work.clear()


_optimizer_hook: Any = None


def _check_before_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    raise_if_pending(f"{type(optimizer).__name__}.step()")


def _guard_optimizer_steps() -> None:
    """Register, once per process, the global torch optimizer-step pre-hook."""
    global _optimizer_hook
    if _optimizer_hook is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _optimizer_hook = register_optimizer_step_pre_hook(_check_before_optimizer_step)


# ----------------------------------------------------------------------------- autograd
class _DeferrableLinearFunction(torch.autograd.Function):
    """megatron's linear (optional sequence-parallel all-gather, matmul, bias) whose backward
    computes the input gradient (and its TP collective) and stores or accumulates the
    weight's.

    The weight and bias enter detached (``params`` holds the parameters themselves): autograd
    runs a parameter's AccumulateGrad node, and the grad hooks megatron's DDP put on it, even
    for a gradient of None, so a parameter wired into this function's inputs would have DDP's
    hook fire in B without a gradient (an assertion under overlap_grad_reduce) and again in W.
    Without the edge the hook fires only when :func:`_accumulate` hands the gradient over."""

    @staticmethod
    @_custom_fwd
    def forward(
        ctx, input, weight, bias, params, allreduce_dgrad, sequence_parallel, tp_group, owner
    ):
        ctx.save_for_backward(input, weight)
        ctx.params = params
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.sequence_parallel = sequence_parallel
        ctx.tp_group = tp_group
        ctx.owner = owner
        total_input = _gather_sequence(input, tp_group) if sequence_parallel else input
        output = torch.matmul(total_input, weight.t())
        if bias is not None:
            output = output + bias
        return output

    @staticmethod
    @_custom_bwd
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight)
        if ctx.allreduce_dgrad:
            dist.all_reduce(grad_input, group=ctx.tp_group)
        elif ctx.sequence_parallel:
            local = torch.empty(input.size(), dtype=input.dtype, device=grad_input.device)
            dist.reduce_scatter_tensor(local, grad_input, group=ctx.tp_group)
            grad_input = local
        param_weight, param_bias = ctx.params
        work = _Work(
            ctx.owner,
            input,
            grad_output,
            param_weight,
            param_bias,
            ctx.sequence_parallel,
            ctx.tp_group,
            _autocast_state(input.device.type),
        )
        if _STORE.active:
            _STORE.add(work)
        else:  # eager (no capture): W right away, inside B
            _accumulate_micro_batch([work])
        return grad_input, None, None, None, None, None, None, None


# ----------------------------------------------------------------------------- the linears
def _is_trainable_leaf(tensor: torch.Tensor | None) -> bool:
    return tensor is None or (tensor.requires_grad and tensor.grad_fn is None)


class _Deferrable:
    """The part both linears share: choose megatron's path or the deferrable one per call."""

    config: Any
    tp_group: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # megatron's linear (the next class in the MRO)
        if deferral_enabled(self.config):
            _guard_optimizer_steps()

    def _forward_impl(self, input, weight, *args, **kwargs):
        if args or not self._defers(input, weight, kwargs):
            return super()._forward_impl(input, weight, *args, **kwargs)  # type: ignore[misc]
        return self._deferrable_forward(input, weight, kwargs)

    def _defers(self, input: torch.Tensor, weight: torch.Tensor, kwargs: dict) -> bool:
        # Weights handed in by a caller (tied output layers) may be non-leaf: their graph is
        # gone by W, so they, frozen weights, megatron's embedding wgrad deferral and GTP
        # sharded weights keep megatron's own path; so does an input that needs no gradient
        # (no backward would reach the detached weight).
        return (
            deferral_enabled(self.config)
            and torch.is_grad_enabled()
            and input.requires_grad
            and weight.requires_grad
            and _is_trainable_leaf(weight)
            and _is_trainable_leaf(kwargs.get("bias"))
            and not kwargs.get("gradient_accumulation_fusion", False)
            and kwargs.get("grad_output_buffer") is None
            and kwargs.get("gtp_remat_size", 1) == 1
        )

    def _deferrable_forward(self, input: torch.Tensor, weight: torch.Tensor, kwargs: dict):
        group = kwargs.get("tp_group")
        if group is None:  # RowParallelLinear passes None (its matmul needs no group)
            group = self.tp_group
        bias = kwargs.get("bias")
        return _DeferrableLinearFunction.apply(
            input,
            weight.detach(),
            None if bias is None else bias.detach(),
            (weight, bias),
            kwargs["allreduce_dgrad"],
            kwargs["sequence_parallel"],
            group,
            self,
        )

    def backward_dw(self) -> None:
        """Compute and accumulate this linear's stored weight-gradient work (every
        micro-batch's, oldest first); nothing stored: nothing to do."""
        for micro_batch in _STORE.take_owned(self):  # type: ignore[arg-type]
            _accumulate_micro_batch(micro_batch)


class ColumnParallelLinear(_Deferrable, tensor_parallel.ColumnParallelLinear):
    """megatron-core's ColumnParallelLinear with a deferrable weight gradient (module doc)."""


class RowParallelLinear(_Deferrable, tensor_parallel.RowParallelLinear):
    """megatron-core's RowParallelLinear with a deferrable weight gradient (module doc); the
    output reduce and the bias add after it stay megatron's, outside the matmul."""


# megatron-core's linear -> ours, for the local specs.
DEFERRABLE_LINEARS = {
    tensor_parallel.ColumnParallelLinear: ColumnParallelLinear,
    tensor_parallel.RowParallelLinear: RowParallelLinear,
}

__all__ = [
    "ColumnParallelLinear",
    "DEFERRABLE_LINEARS",
    "DEFERRING_SCHEDULES",
    "PendingWeightGradientError",
    "RowParallelLinear",
    "capture",
    "deferrable_linears",
    "deferral_enabled",
    "discard_pending",
    "pending",
    "raise_if_pending",
    "run",
]
