"""What the installed megatron-core's own (native) mHC does, found by looking, not by version.

megatron-core 0.19.2 has no mHC. The 0.20 line carries upstream's native mHC, in more than one
shape (Megatron-LM main: PP 1 only; pull request #4946: also under pipeline parallelism).
Where megatron-ext and upstream meet, megatron-ext adapts to what the code declares:

* :func:`config_declares_mhc` -- ``TransformerConfig`` owns ``enable_mhc_connections`` and the
  ``mhc_*`` fields (same names and defaults as ours) and validates them in ``__post_init__``,
  refusing what megatron-ext supports (PP > 1, MTP, full recompute). megatron-ext's config then
  runs that validation with the flag hidden and judges mHC with its own guards.
* :func:`layer_submodules_declare_hyper_connections` -- ``TransformerLayerSubmodules`` has the
  ``*_hyper_connection`` fields; the specs must not pass them a second time.
* :func:`block_expands_streams` -- ``TransformerBlock.forward`` expands the residual at
  ``pre_process`` and mean-contracts it before the final norm when the config enables mHC;
  megatron-ext's block does both itself (and learned / single-pass contraction), so it shows
  upstream's forward a config with the flag off.
* :func:`schedules_size_streams` -- the schedules size their receive buffers
  ``n * hidden_size`` themselves (#4946); megatron-ext's pipeline width then starts from that
  width instead of widening it a second time.

Each answer is cached: the installed code does not change during a process.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

# The config fields upstream's native mHC owns (megatron-ext's have the same names/defaults).
NATIVE_MHC_FIELDS = (
    "enable_mhc_connections",
    "mhc_num_residual_streams",
    "mhc_sinkhorn_iterations",
    "mhc_init_gating_factor",
    "mhc_recompute_layer_num",
)
HYPER_CONNECTION_SUBMODULES = (
    "self_attention_hyper_connection",
    "cross_attention_hyper_connection",
    "mlp_hyper_connection",
)


def _source_mentions(obj: object, name: str) -> bool:
    """Whether ``obj``'s source reads ``name`` (False when the source cannot be read)."""
    try:
        return name in inspect.getsource(obj)  # type: ignore[arg-type]
    except (OSError, TypeError):
        return False


@functools.cache
def config_declares_mhc() -> bool:
    """megatron-core's ``TransformerConfig`` declares ``enable_mhc_connections`` itself."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    declared = {f.name for f in dataclasses.fields(TransformerConfig)}
    return "enable_mhc_connections" in declared


@functools.cache
def layer_submodules_declare_hyper_connections() -> bool:
    """megatron-core's ``TransformerLayerSubmodules`` declares the ``*_hyper_connection`` fields."""
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

    declared = {f.name for f in dataclasses.fields(TransformerLayerSubmodules)}
    return set(HYPER_CONNECTION_SUBMODULES) <= declared


@functools.cache
def block_expands_streams() -> bool:
    """megatron-core's ``TransformerBlock.forward`` expands/contracts the mHC streams itself."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    return _source_mentions(TransformerBlock.forward, "enable_mhc_connections")


@functools.cache
def schedules_size_streams() -> bool:
    """megatron-core's pipeline schedules size their buffers for the n mHC streams (#4946)."""
    from megatron.core.pipeline_parallel import schedules

    return _source_mentions(schedules, "mhc_num_residual_streams")


__all__ = [
    "HYPER_CONNECTION_SUBMODULES",
    "NATIVE_MHC_FIELDS",
    "block_expands_streams",
    "config_declares_mhc",
    "layer_submodules_declare_hyper_connections",
    "schedules_size_streams",
]
