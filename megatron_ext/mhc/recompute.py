"""Selective recompute "mhc": drop the mHC intermediate outputs in forward, rebuild them in
backward.

Each mHC sub-layer produces three activations that are cheap to recompute but large to keep:
the aggregated sub-layer input ``Σ h_pre_i x_i`` ``[s, b, h]``, its layernorm ``[s, b, h]``,
and the merged n-stream output ``H_resᵀ x + H_post ⊗ (y + bias)`` ``[s, b, n*h]``. With
recompute on, a layer computes them inside :meth:`MHCRecomputeGroup.checkpoint`; when the
group's last layer has produced its output,
:meth:`MHCRecomputeGroup.discard_and_recompute_on_backward` frees their storage (tensor
metadata stays, so the autograd graph is intact) and hangs one gradient hook on that output.
Backward reaches that output before anything inside the group, so the hook refills every
discarded tensor, in forward order, before any of them is read.

Peak memory: backward refills a whole group at once, so the peak is (everything kept) + (one
group's discarded activations). With ``mhc_recompute_layer_num=None`` the block is one group
and the peak barely moves; small groups (upstream's suggested size is about
sqrt(n·L/(n+2))) lower it.

Groups are consecutive layers of one block (one pipeline stage or virtual chunk), at most
``mhc_recompute_layer_num`` long (:func:`plan_recompute_groups`); the output that ends a group
is kept, so no group reaches into another block. The maps ``h_pre, h_post, h_res`` are not
recomputed: they are tiny and both halves of the sub-layer need them.

megatron-core 0.19.2's ``CheckpointWithoutOutput`` has no notion of a group (upstream main
later added a manager for that), so this module carries its own. Refilling a discarded
tensor copies the recomputed bytes into the tensor's original storage (so every view and
every tensor autograd saved sees them) and then frees the recomputed copy, so at most one
extra activation exists at a time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_ext import registry
from megatron_ext.errors import ConfigError

_RANDOM = "megatron.core.tensor_parallel.random"


def plan_recompute_groups(num_layers: int, layers_per_group: int | None) -> list[bool]:
    """For each local layer, whether it ends a recompute group.

    A group ends every ``layers_per_group`` layers and always at the block's last layer;
    ``None`` makes the whole block one group.
    """
    if layers_per_group is not None and layers_per_group < 1:
        raise ConfigError(
            f"mhc_recompute_layer_num must be a positive integer or None, got {layers_per_group}"
        )
    ends = []
    for index in range(num_layers):
        is_last = index == num_layers - 1
        full = layers_per_group is not None and (index + 1) % layers_per_group == 0
        ends.append(is_last or full)
    return ends


@dataclass
class LayerRecompute:
    """What one layer needs for one forward: its group, and whether its output ends it."""

    group: MHCRecomputeGroup
    ends_group: bool


def _rng_states():
    # megatron-core's own helpers: CPU, device and model-parallel tracker states together
    # (the CPU runtime redirects the device part to the CPU generator).
    return registry.private(f"{_RANDOM}:_get_all_rng_states")()


@contextlib.contextmanager
def _replayed_rng(states):
    with registry.private(f"{_RANDOM}:_fork_rng")():
        registry.private(f"{_RANDOM}:_set_all_rng_states")(*states)
        yield


def _detached_leaf(value):
    if not isinstance(value, torch.Tensor):
        return value
    leaf = value.detach()
    leaf.requires_grad_(value.requires_grad)
    return leaf


class _OutputDiscardingFunction(torch.autograd.Function):
    """Runs ``checkpoint.function`` without recording a graph; backward replays the graph
    that :meth:`_Checkpoint.recompute` rebuilt."""

    @staticmethod
    def forward(ctx, checkpoint: _Checkpoint, *args):
        with torch.no_grad():
            outputs = checkpoint.function(*args)
        ctx.checkpoint = checkpoint
        ctx.save_for_backward(*args)
        checkpoint.ctx = ctx
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        checkpoint: _Checkpoint = ctx.checkpoint
        if checkpoint.replay is None:
            raise RuntimeError(
                "an mHC recompute checkpoint reached backward without being recomputed: the "
                "gradient hook of its group's last output did not run before it"
            )
        outputs, inputs = checkpoint.replay
        checkpoint.replay = None
        roots, grads = [], []
        for output, grad in zip(outputs, grad_outputs, strict=True):
            if grad is not None and output.requires_grad:
                roots.append(output)
                grads.append(grad)
        if roots:
            torch.autograd.backward(roots, grads)
        input_grads = tuple(
            inp.grad if isinstance(inp, torch.Tensor) and inp.requires_grad else None
            for inp in inputs
        )
        return (None,) + input_grads


class _Checkpoint:
    """One function whose outputs are discarded after forward and rebuilt on demand."""

    def __init__(self, function: Callable):
        # function and rng_states are dropped (None) once recompute() has used them.
        self.function: Any = function
        self.rng_states: Any = _rng_states()
        self.ctx: Any = None  # the autograd context, set by _OutputDiscardingFunction.forward
        self._input_storages: set[int] = set()
        self.outputs: tuple[torch.Tensor, ...] = ()
        self.replay: tuple[tuple, tuple] | None = None

    def run(self, *args):
        self._input_storages = {
            t.untyped_storage().data_ptr() for t in args if isinstance(t, torch.Tensor)
        }
        result = _OutputDiscardingFunction.apply(self, *args)
        self.outputs = (result,) if isinstance(result, torch.Tensor) else tuple(result)
        return result

    def discard(self) -> None:
        for output in self.outputs:
            if output.untyped_storage().data_ptr() in self._input_storages:
                raise RuntimeError(
                    "an mHC recompute checkpoint returned a tensor that shares storage with its "
                    "input; discarding it would also discard the input"
                )
        with torch.no_grad():
            for output in self.outputs:
                output.untyped_storage().resize_(0)

    def recompute(self) -> None:
        """Rebuild the outputs (same RNG as in forward) into their original storage."""
        inputs = tuple(_detached_leaf(t) for t in self.ctx.saved_tensors)
        saved_by_graph: set[int] = set()

        def remember(tensor):
            # Returning the tensor itself keeps autograd's usual behaviour; the rebuilt graph
            # is consumed (and freed) by this checkpoint's backward.
            saved_by_graph.add(tensor.untyped_storage().data_ptr())
            return tensor

        with _replayed_rng(self.rng_states), torch.enable_grad():
            with torch.autograd.graph.saved_tensors_hooks(remember, lambda tensor: tensor):
                outputs = self.function(*inputs)
        outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
        with torch.no_grad():
            for original, rebuilt in zip(self.outputs, outputs, strict=True):
                self._refill(original, rebuilt)
                if rebuilt.untyped_storage().data_ptr() not in saved_by_graph:
                    # Backward needs only the rebuilt tensor's graph, not its values.
                    rebuilt.untyped_storage().resize_(0)
        self.replay = (outputs, inputs)
        self.function = None
        self.rng_states = None
        self.outputs = ()

    @staticmethod
    def _refill(original: torch.Tensor, rebuilt: torch.Tensor) -> None:
        def layout(t):
            return tuple(t.shape), t.stride(), t.storage_offset(), t.dtype

        original_layout, rebuilt_layout = layout(original), layout(rebuilt)
        if original_layout != rebuilt_layout:
            raise RuntimeError(
                f"mHC recompute rebuilt a tensor with layout {rebuilt_layout}, but forward "
                f"produced {original_layout}; the recomputed function changed its output layout"
            )
        storage = original.untyped_storage()
        storage.resize_(rebuilt.untyped_storage().nbytes())
        storage.copy_(rebuilt.untyped_storage())


class MHCRecomputeGroup:
    """The checkpoints of consecutive layers, discarded together and recomputed together.

    Usage, per forward: every discardable computation goes through :meth:`checkpoint`; the
    group's last layer computes its output normally and hands it to
    :meth:`discard_and_recompute_on_backward`.
    """

    def __init__(self) -> None:
        self._checkpoints: list[_Checkpoint] = []
        self._closed = False

    def __len__(self) -> int:
        return len(self._checkpoints)

    def checkpoint(self, function: Callable, *args: torch.Tensor | None):
        """``function(*args)`` whose outputs will be discarded at the end of the group.

        ``args`` are tensors (or None); anything else ``function`` needs must be bound into
        it. Outputs must be fresh tensors (not views of an input).
        """
        if self._closed:
            raise RuntimeError("this mHC recompute group has already been closed")
        checkpoint = _Checkpoint(function)
        self._checkpoints.append(checkpoint)
        return checkpoint.run(*args)

    def discard_and_recompute_on_backward(self, hook_tensor: torch.Tensor) -> None:
        """Free every checkpointed output and recompute them all when ``hook_tensor``'s
        gradient arrives. ``hook_tensor`` (the group's last output) must not be one of them."""
        self._closed = True
        checkpoints, self._checkpoints = self._checkpoints, []
        if not checkpoints or not hook_tensor.requires_grad:
            return  # nothing to free, or no backward will come to rebuild it
        for checkpoint in checkpoints:
            if any(output is hook_tensor for output in checkpoint.outputs):
                raise RuntimeError(
                    "the tensor that ends an mHC recompute group must not be discarded"
                )
        for checkpoint in checkpoints:
            checkpoint.discard()

        def recompute_group(grad):
            if not registry.private("torch.autograd:_is_checkpoint_valid")():
                raise RuntimeError(
                    "mHC recompute needs torch.autograd.backward(); torch.autograd.grad() "
                    "cannot replay the discarded activations"
                )
            for checkpoint in checkpoints:
                checkpoint.recompute()
            checkpoints.clear()
            return grad

        hook_tensor.register_hook(recompute_group)


def run_maybe_checkpointed(
    group: MHCRecomputeGroup | None, function: Callable, args: Sequence[torch.Tensor | None]
):
    """``function(*args)``, through ``group`` when recompute is on for this call."""
    if group is None:
        return function(*args)
    return group.checkpoint(function, *args)


__all__ = [
    "LayerRecompute",
    "MHCRecomputeGroup",
    "plan_recompute_groups",
    "run_maybe_checkpointed",
]
