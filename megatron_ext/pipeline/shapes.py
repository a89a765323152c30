"""How wide the tensors exchanged between pipeline stages are.

What crosses a stage boundary is the edge's typed payload (:mod:`megatron_ext.pipeline.payload`),
packed into one tensor ``[s, b, wire_width]``: with mHC the flattened n-stream residual
``[s, b, n*h]``, with single-pass mHC that and the next sub-layer's fp32 coefficients.
megatron-core 0.19.2 sizes its fixed P2P receive buffers from ``config.hidden_size`` (0.20 with
native mHC under PP, Megatron-LM #4946, from ``n * hidden_size`` where it sees mHC). Every schedule (1F1B's ``get_tensor_shapes`` and the interleaved
schedule's inline shape) ends up in ``P2PCommunicator._communicate``, so that is where the
width is corrected, once, for every communicating edge, the interleaved wrap-around from the
last physical rank to the first rank's next virtual chunk included. Sends and receives that
megatron suppresses at the model's true ends allocate nothing, so no single-stream buffer is
needed there. The sequence axis is left as megatron computed it (divided by CP, and by TP
under sequence parallelism); with ``variable_seq_lengths`` megatron exchanges the actual
shapes and ignores the fixed ones.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from megatron_ext.pipeline.payload import stage_payload


def pipeline_hidden_size(config: Any, pipeline_parallel_size: int) -> int:
    """The last dimension of every tensor exchanged between pipeline stages: the wire width of
    the stage payload (``hidden_size``, ``n * hidden_size`` with mHC, plus the packed fp32
    coefficients with single-pass mHC)."""
    return stage_payload(config, pipeline_parallel_size).wire_width


def pipeline_tensor_shape(
    config: Any, tensor_shape: Sequence[int] | None, pipeline_parallel_size: int
) -> Sequence[int] | None:
    """``tensor_shape`` as megatron sized it ([s', b, hidden_size]) with the pipeline width."""
    if tensor_shape is None or len(tensor_shape) == 0:
        return tensor_shape
    width = pipeline_hidden_size(config, pipeline_parallel_size)
    if width == tensor_shape[-1] or tensor_shape[-1] not in megatron_widths(config):
        return tensor_shape
    return [*tensor_shape[:-1], width]


def megatron_widths(config: Any) -> tuple[int, ...]:
    """The last dimensions megatron-core itself gives a pipeline buffer: ``hidden_size``, and,
    where its schedules size buffers for native mHC's n streams (Megatron-LM #4946), also
    ``n * hidden_size``. Either is replaced by the payload's wire width, never widened twice."""
    from megatron_ext import native_mhc as native

    if getattr(config, "enable_mhc_connections", False) and native.schedules_size_streams():
        return (config.hidden_size, config.hidden_size * config.mhc_num_residual_streams)
    return (config.hidden_size,)


def communicate_with_pipeline_width(communicate):
    """Wraps ``P2PCommunicator._communicate`` so its receive buffers have the pipeline width,
    and the stages' agreement on what they exchange is checked (pipeline.consistency): on
    the communicator's first exchange over the pipeline group, then on every send locally."""
    from megatron_ext.pipeline import consistency

    @functools.wraps(communicate)
    def _communicate(self, *, tensor_shape, **kwargs):
        shape = pipeline_tensor_shape(self.config, tensor_shape, self.pp_group.size())
        sends = (kwargs.get("tensor_send_next"), kwargs.get("tensor_send_prev"))
        consistency.check_once(self, shape, sends)
        consistency.check_sends(self, *sends)
        return communicate(self, tensor_shape=shape, **kwargs)

    return _communicate
