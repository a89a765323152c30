"""Pipeline stages agree on what crosses their edges, or the run stops naming who differs.

Each rank builds its own stage from its own configuration. When two stages disagree on a
field that shapes the inter-stage tensors, megatron-core either deadlocks, aborts inside gloo
with a size error naming neither stage, or - when the byte counts happen to match (mHC n=4
h=32 next to a plain h=128 stage) - trains on a silently reshaped tensor. So the first
exchange of every P2P communicator (once per schedule call; once for a multi-module
communicator) all-gathers, over the pipeline group, the fields that define those tensors
(:func:`stage_fields`) plus the shape this rank is about to exchange, and every rank raises
:class:`PipelineConsistencyError` naming the first differing field, the stages, their ranks
and values. Later exchanges are held, locally, to the agreed shape: a stage that sends
another shape is named with both stages and both shapes (:func:`check_sends`).
The caller is megatron-ext's wrapper of ``P2PCommunicator._communicate`` (pipeline.shapes).

That first exchange comes too late for what megatron-core does collectively while it builds
the stages: with tied embeddings and PP > 1 the first and last stages all-reduce their word
embeddings inside the model constructor, so stages of different widths abort inside gloo with
a size error naming neither stage (or, one stage tied and the other not, wait forever). So
megatron-ext's training entries agree, in their model provider's first call, before any model
is built (:func:`agree_before_build`), on :func:`stage_fields` plus the run's fields that shape
the embeddings and the exchanged tensors (:func:`build_fields`). A pipeline group agreed this
way is not asked again per communicator: its first exchange gathers only the shape (what
only shows at run time), and later communicators exchanging that shape gather nothing.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from megatron_ext.errors import MegatronExtError

# What each communicator's stages agreed on (the exchanged shape, None when nothing is held to
# one), kept beside megatron's communicators rather than as attributes on them.
_agreed_shapes: weakref.WeakKeyDictionary[Any, list[int] | None] = weakref.WeakKeyDictionary()

# Pipeline groups whose stages agreed on every field before the model was built
# (agree_before_build) -> the exchanged shape they agreed on since (_NO_SHAPE_YET until their
# first exchange). One entry per process and group, however many schedules run.
_NO_SHAPE_YET = object()
_agreed_groups: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


class PipelineConsistencyError(MegatronExtError, RuntimeError):
    """Two pipeline stages were built to exchange different tensors."""


def _dtype_name(dtype: Any) -> str | None:
    return None if dtype is None else str(dtype).replace("torch.", "")


def _variable_shapes(config: Any) -> bool:
    # megatron then exchanges the real shapes first; fixed shapes are not comparable
    return bool(
        getattr(config, "variable_seq_lengths", False) or getattr(config, "mtp_standalone", False)
    )


def stage_fields(config: Any, exchanged_shape: Sequence[int] | None) -> dict[str, Any]:
    """What defines this stage's inter-stage tensors, in the order mismatches are reported
    (the configuration fields first: they say what to fix; the shape then says what it does)."""
    mhc = bool(getattr(config, "enable_mhc_connections", False))
    return {
        "hidden_size": getattr(config, "hidden_size", None),
        "enable_mhc_connections": mhc,
        "mhc_num_residual_streams": getattr(config, "mhc_num_residual_streams", None)
        if mhc
        else None,
        # adds the payload's pre_mix field (pipeline.payload)
        "mhc_single_pass": bool(getattr(config, "mhc_single_pass", False)) if mhc else None,
        "pipeline_dtype": _dtype_name(getattr(config, "pipeline_dtype", None)),
        "sequence_parallel": bool(getattr(config, "sequence_parallel", False)),
        "tensor_model_parallel_size": getattr(config, "tensor_model_parallel_size", None),
        "context_parallel_size": getattr(config, "context_parallel_size", None),
        "variable_seq_lengths": _variable_shapes(config),
        "batch_p2p_comm": bool(getattr(config, "batch_p2p_comm", False)),
        # [sequence (/CP, /TP under SP), micro batch, pipeline width]; None where not known yet
        "exchanged tensor shape": None
        if exchanged_shape is None or _variable_shapes(config)
        else [int(d) for d in exchanged_shape],
    }


def build_fields(config: Any, **run_fields: Any) -> dict[str, Any]:
    """What the stages must agree on before any of them is built: :func:`stage_fields` (the
    shape is not known yet), the MTP depth (it adds the MTP stage to the tied embedding's
    all-reduce), the layer and virtual-stage counts, then ``run_fields``
    (the caller's: e.g. share_embeddings_and_output_weights, padded_vocab_size, seq_length,
    micro_batch_size, in the order they are to be reported)."""
    fields = stage_fields(config, None)
    del fields["exchanged tensor shape"]
    fields["mtp_num_layers"] = getattr(config, "mtp_num_layers", None) or 0
    # every stage derives its layers and its schedule's chunks from these global counts
    fields["num_layers"] = getattr(config, "num_layers", None)
    fields["virtual_pipeline_model_parallel_size"] = getattr(
        config, "virtual_pipeline_model_parallel_size", None
    )
    return {**fields, **run_fields}


def first_difference(records: list[dict[str, Any]]) -> str | None:
    """The message for the first field on which the stages differ (None if they agree).
    ``records[i]`` is pipeline stage i's :func:`stage_fields` plus its global ``rank``."""
    for name in records[0]:
        if name == "rank":
            continue
        known = [
            (i, r[name])
            for i, r in enumerate(records)
            if not (name == "exchanged tensor shape" and r[name] is None)
        ]
        if len({repr(v) for _, v in known}) > 1:
            values = ", ".join(f"stage {i} (rank {records[i]['rank']}) {v}" for i, v in known)
            return (
                f"pipeline stages disagree on {name}: {values}. Every pipeline stage must be "
                "built with the same hidden_size, mHC settings, dtypes, vocabulary and "
                "sequence/micro-batch sizes, or the tensors they exchange (and the tied "
                "embedding they all-reduce) are misread, or the exchange hangs"
            )
    return None


def _exchanged_shape(tensor_shape: Sequence[int] | None, sends: Sequence[Any]) -> list[int] | None:
    if tensor_shape is not None and len(tensor_shape):
        return list(tensor_shape)
    for tensor in sends:
        if tensor is not None and hasattr(tensor, "shape"):
            return list(tensor.shape)
    return None


def _agree(group: Any, fields: dict[str, Any]) -> list[dict[str, Any]]:
    """Every stage's ``fields`` (with its global rank), in pipeline-stage order; raises
    :class:`PipelineConsistencyError` on every rank when they differ."""
    import torch.distributed as dist

    records: list[Any] = [None] * group.size()
    dist.all_gather_object(records, {"rank": dist.get_rank(), **fields}, group=group)
    problem = first_difference(records)
    if problem is not None:
        raise PipelineConsistencyError(problem)
    return records


def agree_before_build(config: Any, pp_group: Any, run_fields: dict[str, Any]) -> None:
    """Before this rank builds its first model chunk: agree :func:`build_fields` over the
    pipeline group, once per process and group (every rank of a group calls it on its first
    chunk, so later calls, e.g. for virtual stages, need no collective)."""
    import torch.distributed as dist

    if pp_group is None or not dist.is_initialized() or pp_group.size() == 1:
        return
    if pp_group in _agreed_groups:
        return
    _agree(pp_group, build_fields(config, **run_fields))
    _agreed_groups[pp_group] = _NO_SHAPE_YET


def _check_shape_of_agreed_group(communicator: Any, shape: list[int] | None) -> None:
    """A communicator of a group agreed before build: its stages agree on the exchanged shape
    once (the fields are agreed already); a shape agreed before is held without a collective."""
    group = communicator.pp_group
    _agreed_shapes[communicator] = None
    if _variable_shapes(communicator.config):
        return
    agreed = _agreed_groups[group]
    if agreed is _NO_SHAPE_YET or (shape is not None and shape != agreed):
        records = _agree(group, {"exchanged tensor shape": shape})
        shapes = [r["exchanged tensor shape"] for r in records if r["exchanged tensor shape"]]
        agreed = _agreed_groups[group] = shapes[0] if shapes else _NO_SHAPE_YET
    _agreed_shapes[communicator] = None if agreed is _NO_SHAPE_YET else agreed


def check_once(communicator: Any, tensor_shape: Sequence[int] | None, sends: Sequence[Any]) -> None:
    """On the communicator's first exchange: all-gather :func:`stage_fields` over its
    pipeline group and raise on every rank if the stages differ (only the shape, and only
    when it is new, where :func:`agree_before_build` agreed on the fields already)."""
    if communicator in _agreed_shapes:
        return
    group = communicator.pp_group
    if group is None or group.size() == 1:
        _agreed_shapes[communicator] = None
        return
    shape = _exchanged_shape(tensor_shape, sends)
    if group in _agreed_groups:
        _check_shape_of_agreed_group(communicator, shape)
        return
    _agreed_shapes[communicator] = None
    records = _agree(group, stage_fields(communicator.config, shape))
    shapes = [
        r["exchanged tensor shape"] for r in records if r["exchanged tensor shape"] is not None
    ]
    _agreed_shapes[communicator] = shapes[0] if shapes else None


def check_sends(communicator: Any, tensor_send_next: Any, tensor_send_prev: Any) -> None:
    """A tensor this stage sends must have the shape the stages agreed on (what its peer's
    buffer has): otherwise name both stages and both shapes, before anything is posted."""
    agreed = _agreed_shapes.get(communicator)
    if agreed is None or _variable_shapes(communicator.config):
        return
    group = communicator.pp_group
    for tensor, direction, peer in (
        (tensor_send_next, "next", getattr(communicator, "next_rank", None)),
        (tensor_send_prev, "previous", getattr(communicator, "prev_rank", None)),
    ):
        if tensor is not None and list(tensor.shape) != agreed:
            stage = group.rank()
            other = (stage + (1 if direction == "next" else -1)) % group.size()
            raise PipelineConsistencyError(
                f"pipeline edge stage {stage} -> stage {other}: stage {stage} (rank {_global(group, stage)}) "
                f"sends a tensor of shape {list(tensor.shape)} to the {direction} stage {other} "
                f"(rank {peer}), which receives {agreed}"
            )


def _global(group: Any, group_rank: int) -> Any:
    try:
        import torch.distributed as dist

        return dist.get_global_rank(group, group_rank)
    except Exception:  # noqa: BLE001 - only for the message
        return "?"
