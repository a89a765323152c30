"""megatron-core's HybridModel, with mHC residual streams when the config enables them."""

from __future__ import annotations

import inspect
from typing import Any

from megatron.core.models.hybrid.hybrid_layer_allocation import parse_hybrid_pattern
from megatron.core.models.hybrid.hybrid_model import HybridModel as _CoreHybridModel
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_ext import guards
from megatron_ext.errors import SpecError
from megatron_ext.mhc.transformer_layer import layer_supports_mhc
from megatron_ext.models.hybrid.hybrid_stack import HybridStack
from megatron_ext.models.hybrid.layer_specs import UnavailableHybridLayer, stack_layer_specs
from megatron_ext.models.hybrid.mtp import HyperConnectionMTPBlock, HyperConnectionMTPLayer

_CORE_SIGNATURE = inspect.signature(_CoreHybridModel.__init__)

# Where the error messages send people whose spec cannot carry mHC streams.
HYBRID_MHC_SPEC_HINT = (
    "build the stack spec with megatron_ext.models.hybrid.get_hybrid_stack_local_spec("
    "enable_mhc_connections=True) (or get_hybrid_stack_with_transformer_engine_spec("
    "enable_mhc_connections=True))"
)


def _check_mhc_spec(spec: Any, pattern: str | None) -> None:
    """Refuse, before anything is built, a stack spec that cannot carry n streams."""
    stack_class = spec.module if isinstance(spec, ModuleSpec) else spec
    if not (isinstance(stack_class, type) and issubclass(stack_class, HybridStack)):
        raise SpecError(
            "enable_mhc_connections=True needs megatron_ext's HybridStack (it expands and "
            f"contracts the streams), but hybrid_stack_spec builds {stack_class!r}; "
            f"{HYBRID_MHC_SPEC_HINT}"
        )
    parsed = parse_hybrid_pattern(pattern)
    symbols = (parsed.main_pattern or "") + (parsed.mtp_pattern or "")
    layer_specs = stack_layer_specs(spec.submodules, symbols)
    for layer in layer_specs.values():
        if isinstance(layer, ModuleSpec) and layer.module is UnavailableHybridLayer:
            UnavailableHybridLayer(**layer.params)  # raises, naming the pattern symbol
    plain = {
        symbol: getattr(layer, "module", layer).__name__
        for symbol, layer in layer_specs.items()
        if not layer_supports_mhc(layer)
    }
    if plain:
        described = ", ".join(f"{symbol!r} ({name})" for symbol, name in plain.items())
        raise SpecError(
            f"enable_mhc_connections=True, but hybrid_stack_spec builds layers without mHC "
            f"residual streams for pattern symbols {described}; {HYBRID_MHC_SPEC_HINT}, or set "
            "enable_mhc_connections=False"
        )
    if parsed.mtp_pattern and parsed.mtp_num_depths:
        mtp_submodules = getattr(spec.submodules.mtp_block_spec, "submodules", None)
        layer_classes = [s.module for s in getattr(mtp_submodules, "layer_specs", None) or []]
        plain_mtp = [
            c.__name__ for c in layer_classes if not issubclass(c, HyperConnectionMTPLayer)
        ]
        if plain_mtp:
            raise SpecError(
                "enable_mhc_connections=True with MTP needs mtp_block_spec layers that carry the "
                f"n streams (HyperConnectionMTPLayer), got {', '.join(plain_mtp)}; "
                f"{HYBRID_MHC_SPEC_HINT}"
            )


class HybridModel(_CoreHybridModel):
    """megatron-core's HybridModel; same constructor, same parameters and outputs.

    With ``config.enable_mhc_connections=True`` the stack spec must build mHC layers
    (:func:`~megatron_ext.models.hybrid.get_hybrid_stack_local_spec` with
    ``enable_mhc_connections=True``; checked before anything is built). The stack then
    expands the embedding output into n streams where ``pre_process``, carries ``[s, b, n*h]``
    across every pipeline stage and virtual chunk, and contracts the streams with its learned
    contraction before the final norm where ``post_process``. MTP (the pattern after ``/``)
    runs on the final post_process chunk and continues from the n-stream decoder state; a
    standalone mHC MTP stage is refused.
    """

    def __init__(self, config, hybrid_stack_spec, *args: Any, **kwargs: Any) -> None:
        mhc = bool(getattr(config, "enable_mhc_connections", False))
        if mhc:
            guards.check_hybrid_mhc_mtp(config)
            arguments = _CORE_SIGNATURE.bind(self, config, hybrid_stack_spec, *args, **kwargs)
            arguments.apply_defaults()
            named = arguments.arguments
            _check_mhc_spec(
                hybrid_stack_spec, named["hybrid_layer_pattern"] or named["hybrid_override_pattern"]
            )
        super().__init__(config, hybrid_stack_spec, *args, **kwargs)
        if not mhc:
            return
        if self.mtp_process:
            if not self.post_process:
                raise guards.UnsupportedCombinationError(
                    "a standalone MTP stage is not supported with enable_mhc_connections: this "
                    "chunk has the MTP layers but not the final norm and loss (post_process), "
                    "so it lacks the decoder's learned contraction; keep the MTP layers on the "
                    "final post_process chunk (no pipeline_model_parallel_layout placing them "
                    "elsewhere)"
                )
            self.decoder.returns_streams_for_mtp = True
            HyperConnectionMTPBlock.adopt(self.mtp)


__all__ = ["HybridModel", "HYBRID_MHC_SPEC_HINT"]
