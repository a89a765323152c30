"""Packing a stage payload's fields into the one tensor megatron-core exchanges, and back.

:func:`pack` lays the fields of a :class:`~megatron_ext.pipeline.payload.StagePayload` side
by side along the last axis, as raw bytes viewed in the wire's dtype (an fp32 field under a
bf16 pipeline takes two bf16 slots per value); :func:`unpack` cuts them out again. Both are
autograd functions whose backward does the same byte moves in the other direction: a field's
gradient crosses the edge bit for bit, in its own dtype, and no arithmetic ever touches the
bytes (an addition of zeros could canonicalise a NaN pattern or flush a subnormal half of an
fp32 value). A plain payload (one field in the wire's dtype) is returned as is.
"""

from __future__ import annotations

import torch

from megatron_ext.pipeline.payload import PayloadError, StagePayload

_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH_DTYPES[name]


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


class _Pack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, wire_dtype: torch.dtype, *fields: torch.Tensor) -> torch.Tensor:
        ctx.layout = [(f.dtype, f.shape[-1] * f.element_size()) for f in fields]
        return torch.cat([_as_bytes(f) for f in fields], dim=-1).view(wire_dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        pieces = _as_bytes(grad).split([size for _, size in ctx.layout], dim=-1)
        grads = [
            p.contiguous().view(dtype) for p, (dtype, _) in zip(pieces, ctx.layout, strict=True)
        ]
        return (None, *grads)


class _Unpack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, wire: torch.Tensor, layout: list[tuple[torch.dtype, int]]):
        ctx.wire_dtype = wire.dtype
        pieces = _as_bytes(wire).split([size for _, size in layout], dim=-1)
        return tuple(
            p.contiguous().view(dtype) for p, (dtype, _) in zip(pieces, layout, strict=True)
        )

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        return torch.cat([_as_bytes(g) for g in grads], dim=-1).view(ctx.wire_dtype), None


def _check_fields(payload: StagePayload, tensors: dict[str, torch.Tensor]) -> None:
    if set(tensors) != set(payload.names):
        raise PayloadError(
            f"a stage payload has the fields {', '.join(payload.names)}; got "
            f"{', '.join(sorted(tensors))}"
        )
    for field in payload.fields:
        tensor = tensors[field.name]
        if tensor.shape[-1] != field.width or tensor.dtype != torch_dtype(field.dtype):
            raise PayloadError(
                f"payload field {field.name}: expected [..., {field.width}] {field.dtype}, got "
                f"{list(tensor.shape)} {tensor.dtype}"
            )


def pack(payload: StagePayload, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """``{field: [s', b, width]}`` -> the wire tensor ``[s', b, payload.wire_width]``."""
    _check_fields(payload, tensors)
    if payload.is_plain:
        return tensors[payload.fields[0].name]
    ordered = [tensors[name] for name in payload.names]
    return _Pack.apply(torch_dtype(payload.wire_dtype), *ordered)


def unpack(payload: StagePayload, wire: torch.Tensor) -> dict[str, torch.Tensor]:
    """The wire tensor -> ``{field: [s', b, width]}`` (differentiable, bit for bit)."""
    if payload.is_plain:
        return {payload.fields[0].name: wire}
    if wire.shape[-1] != payload.wire_width:
        raise PayloadError(
            f"a stage payload of {', '.join(payload.names)} is {payload.wire_width} "
            f"{payload.wire_dtype} wide on the wire; received [..., {wire.shape[-1]}]"
        )
    layout = [(torch_dtype(f.dtype), f.token_bytes) for f in payload.fields]
    return dict(zip(payload.names, _Unpack.apply(wire, layout), strict=True))


__all__ = ["pack", "torch_dtype", "unpack"]
