"""Pretrain a HybridModel with ``megatron.training.pretrain``: megatron-ext's Megatron-LM
``pretrain_hybrid.py``.

    torchrun --nproc_per_node N -m megatron_ext.pretrain_hybrid \\
        --hybrid-layer-pattern "*-E*-|*-E*-" <any Megatron flags>

Only the model is Hybrid-specific; everything else is :mod:`megatron_ext.training_steps`, shared
with :mod:`megatron_ext.pretrain_gpt`: the mHC flags (upstream's spellings), data (mock or indexed
GPT datasets), batches, loss, forward step, the machine defaults and the hand-off to ``pretrain``.

:func:`model_provider` builds :class:`megatron_ext.models.hybrid.HybridModel` for this
pipeline stage (or virtual stage) from ``--hybrid-layer-pattern``, whose ``|`` segments
define the stages and whose ``/`` parts are MTP depths (megatron derives ``--num-layers``,
``--mtp-num-layers`` and the virtual stages from it). The stack spec is ``--spec`` when
given, megatron-core's inference spec with ``--transformer-impl inference_optimized``,
otherwise megatron-ext's Transformer Engine or local spec, with mHC layers when
``--enable-mhc-connections`` is set.
"""

from __future__ import annotations

import time

_PROGRAM_START_TIME = time.time()  # before the heavy imports, for megatron's start-up report

from megatron_ext.launch import silence_warnings_off_rank_zero, startup

silence_warnings_off_rank_zero()  # megatron's imports below warn identically on every rank
startup.begin_entry_imports()  # until the imports below are done: see launch/startup.py

import argparse

from megatron.core.transformer.spec_utils import import_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training import get_args, print_rank_0

from megatron_ext import training_steps
from megatron_ext.config import MHCTransformerConfig
from megatron_ext.launch.training import ArgsProvider
from megatron_ext.models.hybrid import (
    HybridModel,
    get_hybrid_stack_local_spec,
    get_hybrid_stack_with_transformer_engine_spec,
)

# The hooks megatron-ext validate looks up on an entry module (the shared training steps').
from megatron_ext.training_steps import ENTRY_DEFAULTS, add_megatron_ext_args, transformer_config  # noqa: F401

startup.end_entry_imports()


def check_args(args: argparse.Namespace) -> None:
    """What this entry needs beyond Megatron's own validation."""
    training_steps.reject_unsupported_flags(args, entry="megatron_ext.pretrain_hybrid")
    if args.hybrid_layer_pattern is None:
        raise SystemExit(
            "megatron_ext.pretrain_hybrid needs --hybrid-layer-pattern (e.g. \"*-*-|*-*-\": '*' "
            "attention, '-' MLP, 'E' MoE, 'M' Mamba, '|' pipeline stages, '/' MTP depths)"
        )


def hybrid_stack_spec(args: argparse.Namespace):
    """The stack spec: ``--spec``, the inference spec, or megatron-ext's TE / local spec."""
    if args.spec is not None:
        return import_module(args.spec)
    if args.transformer_impl == "inference_optimized":
        if args.enable_mhc_connections:
            raise SystemExit(
                "--transformer-impl inference_optimized has no mHC layers; drop "
                "--enable-mhc-connections or use --transformer-impl local/transformer_engine"
            )
        from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_inference_stack_spec

        return hybrid_inference_stack_spec
    if args.transformer_impl == "transformer_engine":
        return get_hybrid_stack_with_transformer_engine_spec(
            enable_mhc_connections=args.enable_mhc_connections
        )
    return get_hybrid_stack_local_spec(
        enable_mhc_connections=args.enable_mhc_connections,
        qk_layernorm=args.qk_layernorm,
        moe_grouped_gemm=args.moe_grouped_gemm,
    )


def model_provider(
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int | None = None,
    config: TransformerConfig | None = None,
    pg_collection=None,
    *,
    config_class: type[TransformerConfig] = TransformerConfig,
) -> HybridModel:
    """Build this pipeline stage's (or virtual stage's) HybridModel; ``pretrain`` calls it
    once per model chunk with ``pre_process`` / ``post_process`` / ``vp_stage`` set; its
    first call agrees the configuration with the other pipeline stages before anything is
    built (:func:`training_steps.stage_config`)."""
    args = get_args()
    print_rank_0("building Hybrid model ...")
    config = training_steps.stage_config(args, config, config_class, pg_collection)
    return HybridModel(
        config=config,
        hybrid_stack_spec=hybrid_stack_spec(args),
        hybrid_layer_pattern=args.hybrid_layer_pattern,
        **training_steps.language_model_kwargs(args, pre_process, post_process),
        pg_collection=pg_collection,
        vp_stage=vp_stage,
    )


def main(
    config_class: type[TransformerConfig] = MHCTransformerConfig,
    extra_args_provider: ArgsProvider | None = None,
) -> None:
    """Train a HybridModel from the command line's Megatron flags (see
    :func:`megatron_ext.pretrain_gpt.main` for ``config_class`` and ``extra_args_provider``)."""
    training_steps.train(
        model_provider,
        _PROGRAM_START_TIME,
        check_args=check_args,
        config_class=config_class,
        extra_args_provider=extra_args_provider,
    )


if __name__ == "__main__":
    main()
    startup.end_rank()
