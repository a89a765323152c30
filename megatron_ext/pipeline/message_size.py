"""The message on a pipeline edge from sizes alone (no model): the stage payload
(:mod:`megatron_ext.pipeline.payload`) of a hidden size, sequence, micro-batch, mHC streams and
dtype, and its bytes. ``megatron-ext schedule`` prints it (``--hidden ...`` or ``--recipe``) and a
traced run checks the measured messages against it. Nothing here imports torch or megatron."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from megatron_ext.pipeline.payload import HIDDEN_STATES, StagePayload, stage_payload
from megatron_ext.schedules.schedule import format_bytes

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# The wire's dtype for a width in bytes (fp16's messages are bf16's size).
WIRE_DTYPES = {4: "fp32", 2: "bf16"}


@dataclass
class MessageSize:
    """The message on a pipeline edge: the edge's stage payload
    (:mod:`megatron_ext.pipeline.payload`), every field [seq / cp (/ tp with SP),
    micro_batch_size, width], packed into one tensor: n * hidden wide (the residual), plus the
    fp32 coefficients with single-pass mHC."""

    hidden: int
    seq: int
    micro_batch_size: int
    mhc_streams: int = 1
    dtype_bytes: int = 4
    tp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    single_pass: bool = False

    @property
    def local_seq(self) -> int:
        return self.seq // self.cp // (self.tp if self.sequence_parallel else 1)

    @property
    def payload(self) -> StagePayload:
        settings = SimpleNamespace(
            hidden_size=self.hidden,
            enable_mhc_connections=self.mhc_streams > 1,
            mhc_num_residual_streams=self.mhc_streams,
            mhc_single_pass=self.single_pass,
            pipeline_dtype=WIRE_DTYPES[self.dtype_bytes],
        )
        return stage_payload(settings, pipeline_parallel_size=2)

    @property
    def bytes(self) -> int:
        return self.payload.nbytes(self.local_seq, self.micro_batch_size)

    def describe(self) -> str:
        s, b, payload = self.local_seq, self.micro_batch_size, self.payload
        width = f"{self.mhc_streams}*{self.hidden}" if self.mhc_streams > 1 else str(self.hidden)
        if not payload.is_plain:
            width = str(payload.wire_width)
        return f"[{s}, {b}, {width}] x {self.dtype_bytes} B = {format_bytes(self.bytes)}"

    def describe_fields(self) -> list[str]:
        """One line per payload field: name, shape, dtype, gradient, bytes."""
        s, b = self.local_seq, self.micro_batch_size
        lines = []
        for field in self.payload.fields:
            width = str(field.width)
            if field.name == HIDDEN_STATES and self.mhc_streams > 1:
                width = f"{self.mhc_streams}*{self.hidden}"
            grad = "with its gradient" if field.requires_grad else "no gradient"
            lines.append(
                f"    {field.name} [{s}, {b}, {width}] {field.dtype} ({grad}) = "
                f"{format_bytes(field.nbytes(s, b))}"
            )
        return lines
