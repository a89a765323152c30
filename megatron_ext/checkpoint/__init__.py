"""Moving mHC checkpoints between upstream Megatron-LM and megatron-ext: key conversion
(:mod:`megatron_ext.checkpoint.convert`, ``megatron-ext convert-checkpoint``)."""

from megatron_ext.checkpoint.convert import (
    H_RES_NOTE,
    SOURCES,
    ConversionError,
    hybrid_from_upstream,
    hybrid_to_upstream,
    notes_for,
)

__all__ = [
    "ConversionError",
    "H_RES_NOTE",
    "SOURCES",
    "hybrid_from_upstream",
    "hybrid_to_upstream",
    "notes_for",
]
