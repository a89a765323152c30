"""Where each local parameter sits in the full (unsharded) model.

megatron-core already knows this: a module's ``sharded_state_dict()`` gives every
parameter a global key and its offset in the global tensor, across TP, PP, VPP and EP.
This module reads those entries so tests can place local tensors (weights, gradients)
into full shapes and compare them with a single-rank reference.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

Region = tuple[tuple[int, int], ...]
# (global key, global shape, region, values of that region): what crosses ranks in tests.
Piece = tuple[str, tuple[int, ...], Region, torch.Tensor]


@dataclass(frozen=True)
class ShardedParam:
    """A local parameter and the region of its global tensor it holds."""

    key: str
    name: str
    param: torch.nn.Parameter
    global_shape: tuple[int, ...]
    region: Region

    def region_slices(self) -> tuple[slice, ...]:
        return tuple(slice(start, stop) for start, stop in self.region)

    def region_shape(self) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.region)


def _region(entry: ShardedTensor) -> Region:
    if entry.flattened_range is not None:
        raise NotImplementedError(f"{entry.key}: flattened sharded tensors are not supported")
    local_shape = (1,) * entry.prepend_axis_num + tuple(entry.data.shape)
    return tuple(
        (off, off + size) for off, size in zip(entry.global_offset, local_shape, strict=True)
    )


def shard_index(
    modules: Iterable[torch.nn.Module],
    # Any: megatron's modules, whose sharded_state_dict torch's Module type does not declare
    sharded_state_dict: Callable[[Any], dict] = lambda module: module.sharded_state_dict(),
    first_entry_only: bool = False,
) -> list[ShardedParam]:
    """Every trainable parameter of ``modules`` (unwrapped model chunks) with its global
    key and region, read from ``sharded_state_dict(module)``. Raises if a parameter has no
    sharded-state-dict entry, so nothing is silently left out of a comparison.
    ``first_entry_only`` indexes a parameter once even when several entries name it."""
    index: list[ShardedParam] = []
    for module in modules:
        names = {p.data_ptr(): (n, p) for n, p in module.named_parameters() if p.requires_grad}
        seen: set[int] = set()
        for entry in nested_values(sharded_state_dict(module)):
            if isinstance(entry, ShardedTensorFactory):
                ptr = entry.data.data_ptr()
                if ptr in names:
                    raise NotImplementedError(
                        f"{names[ptr][0]} is saved through a ShardedTensorFactory ({entry.key}); "
                        "the harness cannot place it in the global tensor"
                    )
                continue
            if not isinstance(entry, ShardedTensor):
                continue
            ptr = entry.data.data_ptr()
            if ptr not in names or names[ptr][1].shape != entry.data.shape:
                continue
            if first_entry_only and ptr in seen:
                continue
            name, param = names[ptr]
            seen.add(ptr)
            index.append(
                ShardedParam(entry.key, name, param, tuple(entry.global_shape), _region(entry))
            )
        missing = [n for ptr, (n, _) in names.items() if ptr not in seen]
        if missing:
            raise RuntimeError(f"parameters without a sharded-state-dict entry: {missing}")
    return index


def local_pieces(
    index: list[ShardedParam], tensor_of: Callable[[torch.nn.Parameter], torch.Tensor | None]
) -> list[Piece]:
    """A :data:`Piece` for each indexed parameter, ``tensor_of`` choosing what to read
    (the weight, ``.grad`` or ``.main_grad``); a missing tensor counts as zeros."""
    pieces = []
    for entry in index:
        value = tensor_of(entry.param)
        value = torch.zeros_like(entry.param) if value is None else value
        values = value.detach().float().reshape(entry.region_shape()).clone()
        pieces.append((entry.key, entry.global_shape, entry.region, values))
    return pieces


def full_tensors(index: list[ShardedParam], tensor_of) -> dict[str, torch.Tensor]:
    """Full tensors of a single-rank model, whose regions each cover a whole tensor or, for
    stacked layers, one slice of it."""
    full: dict[str, torch.Tensor] = {}
    for key, shape, region, value in local_pieces(index, tensor_of):
        target = full.setdefault(key, torch.full(shape, float("nan")))
        target[tuple(slice(a, b) for a, b in region)] = value
    for key, value in full.items():
        if torch.isnan(value).any():
            raise RuntimeError(f"{key}: the single-rank model does not cover the whole tensor")
    return full


@torch.no_grad()
def load_full_weights(index: list[ShardedParam], weights: dict[str, torch.Tensor]) -> None:
    """Copy each parameter's region of the full ``weights`` into it."""
    for entry in index:
        source = weights[entry.key][entry.region_slices()]
        entry.param.data.copy_(source.reshape(entry.param.shape))
