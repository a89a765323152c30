"""The typed stage payload: what one pipeline edge carries, field by field.

A pipeline edge carries a :class:`StagePayload`: named fields, each a per-token tensor
``[s', b, width]`` with its own dtype and whether a gradient travels back with it. ``s'`` is
the sequence as megatron-core sizes it (divided by CP, and by TP under sequence parallelism),
so every field is split along the sequence axis exactly as the residual is. The payload is
derived from the model's config for each edge (:func:`edge_payload`):

- ``hidden_states``: the residual, ``hidden_size`` wide, or ``n * hidden_size`` with mHC
  (the flattened n streams), in ``pipeline_dtype``, with its gradient;
- ``pre_mix`` (``mhc_single_pass`` only): the next sub-layer's mHC aggregation coefficients,
  ``[s', b, n]`` in fp32, with its gradient (:mod:`megatron_ext.mhc.single_pass`).

On the wire megatron-core still exchanges one tensor per message: the fields packed side by
side along the last axis, as bytes, viewed in ``pipeline_dtype``
(:mod:`megatron_ext.pipeline.payload_wire`), so its fixed P2P buffers, its 1F1B and
interleaved schedules (wrap-around edge included), megatron-ext's ZB-H1 and the trace all move
it unchanged. A payload of one field in ``pipeline_dtype`` -- every model but single-pass
mHC -- *is* that tensor: packing and unpacking are the identity, so the bytes and the results
of today's models do not change. The receive buffers get the payload's width in
``P2PCommunicator._communicate`` (:mod:`megatron_ext.pipeline.shapes`).

Nothing here imports torch: recipes and ``megatron-ext schedule`` size messages from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_ext.errors import MegatronExtError

# Bytes per element of the dtypes a field may have (names as recipes spell precisions).
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
_TORCH_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}

HIDDEN_STATES = "hidden_states"
PRE_MIX = "pre_mix"


class PayloadError(MegatronExtError, ValueError):
    """A payload cannot be laid out on the wire (a field is not a whole number of elements)."""


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` / ``"bfloat16"`` / ``"bf16"`` -> ``"bf16"`` (fp32 when None)."""
    if dtype is None:
        return "fp32"
    text = str(dtype).replace("torch.", "")
    return _TORCH_NAMES.get(text, text)


@dataclass(frozen=True)
class PayloadField:
    """One tensor of a payload: ``[s', b, width]`` of ``dtype``."""

    name: str
    width: int
    dtype: str  # a DTYPE_BYTES key
    requires_grad: bool = True

    @property
    def token_bytes(self) -> int:
        return self.width * DTYPE_BYTES[self.dtype]

    def nbytes(self, seq: int, micro_batch_size: int) -> int:
        return seq * micro_batch_size * self.token_bytes

    def describe(self, seq: int, micro_batch_size: int, width_text: str | None = None) -> str:
        grad = "" if self.requires_grad else ", no grad"
        return (
            f"{self.name} [{seq}, {micro_batch_size}, {width_text or self.width}] {self.dtype}"
            f"{grad} = {self.nbytes(seq, micro_batch_size)} B"
        )


@dataclass(frozen=True)
class StagePayload:
    """The fields one pipeline edge carries, in wire order, and the wire's dtype."""

    fields: tuple[PayloadField, ...]
    wire_dtype: str

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    def field(self, name: str) -> PayloadField:
        return next(f for f in self.fields if f.name == name)

    @property
    def is_plain(self) -> bool:
        """One field in the wire's dtype: the wire tensor is the field itself."""
        return len(self.fields) == 1 and self.fields[0].dtype == self.wire_dtype

    @property
    def token_bytes(self) -> int:
        return sum(f.token_bytes for f in self.fields)

    @property
    def wire_width(self) -> int:
        """The last dimension of the one tensor megatron-core exchanges."""
        element = DTYPE_BYTES[self.wire_dtype]
        if self.token_bytes % element:
            raise PayloadError(
                f"the payload fields {', '.join(self.names)} take {self.token_bytes} bytes a "
                f"token, not a whole number of {self.wire_dtype} elements"
            )
        return self.token_bytes // element

    def nbytes(self, seq: int, micro_batch_size: int) -> int:
        return seq * micro_batch_size * self.token_bytes

    def field_bytes(self, seq: int, micro_batch_size: int) -> dict[str, int]:
        return {f.name: f.nbytes(seq, micro_batch_size) for f in self.fields}


def stage_payload(config: Any, pipeline_parallel_size: int | None = None) -> StagePayload:
    """The payload of every communicating edge of a model built from ``config`` (a
    TransformerConfig, megatron's arguments or anything with the same field names)."""
    pp = pipeline_parallel_size or getattr(config, "pipeline_model_parallel_size", 1) or 1
    wire = dtype_name(
        getattr(config, "pipeline_dtype", None) or getattr(config, "params_dtype", None)
    )
    hidden = config.hidden_size
    mhc = bool(getattr(config, "enable_mhc_connections", False)) and pp > 1
    streams = getattr(config, "mhc_num_residual_streams", 1) if mhc else 1
    fields = [PayloadField(HIDDEN_STATES, hidden * streams, wire)]
    if mhc and getattr(config, "mhc_single_pass", False):
        fields.append(PayloadField(PRE_MIX, streams, "fp32"))
    return StagePayload(tuple(fields), wire)


def edge_payload(
    config: Any, sender_stage: int, receiver_stage: int, pipeline_parallel_size: int
) -> StagePayload:
    """What the edge from virtual stage ``sender_stage`` to ``receiver_stage`` carries
    (the interleaved wrap-around, last rank to the first rank's next chunk, included).

    Every edge of megatron-ext's models carries the same fields: each stage boundary falls
    between transformer layers (a standalone embedding stage expands the streams and a
    single-pass one sends the initial coefficients; a standalone loss stage receives them),
    and the two model ends, where the width differs, never communicate.
    """
    del sender_stage, receiver_stage  # the same on every edge of these models (docstring)
    return stage_payload(config, pipeline_parallel_size)


__all__ = [
    "DTYPE_BYTES",
    "HIDDEN_STATES",
    "PRE_MIX",
    "PayloadError",
    "PayloadField",
    "StagePayload",
    "dtype_name",
    "edge_payload",
    "stage_payload",
]
