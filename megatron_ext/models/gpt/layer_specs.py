"""Layer specs for GPT: megatron-core's, with the local norm swapped in where needed."""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron.core.models.gpt import gpt_layer_specs as upstream
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from megatron_ext.models.norms import LocalNorm


def _with_local_norm(value: Any) -> Any:
    """megatron-core's torch-norm builder refuses SP; ours does not. Replace it, recursively."""
    if value is WrappedTorchNorm:
        return LocalNorm
    if isinstance(value, ModuleSpec):
        return dataclasses.replace(
            value,
            module=_with_local_norm(value.module),
            submodules=_with_local_norm(value.submodules),
        )
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: _with_local_norm(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return dataclasses.replace(value, **changes)
    return value


def get_gpt_layer_local_spec(**kwargs: Any) -> ModuleSpec:
    """megatron-core's ``get_gpt_layer_local_spec`` (same arguments), sequence-parallel safe."""
    return _with_local_norm(upstream.get_gpt_layer_local_spec(**kwargs))
