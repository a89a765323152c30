"""Pretrain a HybridModel with ``megatron.training.pretrain``: megatron-ext's Megatron-LM
``pretrain_hybrid.py``.

    torchrun --nproc_per_node N -m megatron_ext.pretrain_hybrid \\
        --hybrid-layer-pattern "*-E*-|*-E*-" <any Megatron flags>

Only the model is Hybrid-specific; everything else is :mod:`megatron_ext.pretrain_gpt`'s (by
import): the mHC flags (upstream's spellings), data (mock or indexed GPT datasets), batches,
loss, forward step, the machine defaults and the hand-off to ``pretrain``.

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
startup.defer_torch_compile()  # until the imports below are done: see launch/startup.py

import argparse
from functools import partial
from typing import Optional

from megatron.core.enums import ModelType
from megatron.core.transformer.spec_utils import import_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training import get_args, print_rank_0
from megatron.training.training import set_startup_timestamps

from megatron_ext import pretrain_gpt as gpt
from megatron_ext.config import MHCTransformerConfig

# The entry hooks recipes and tools look up on an entry module are pretrain_gpt's own.
from megatron_ext.pretrain_gpt import (  # noqa: F401  (re-exported entry hooks)
    ENTRY_DEFAULTS,
    add_megatron_ext_args,
    forward_step,
    train_valid_test_datasets_provider,
    transformer_config,
)
from megatron_ext.launch import training as launch
from megatron_ext.launch.training import ArgsProvider
from megatron_ext.models.hybrid import (
    HybridModel,
    get_hybrid_stack_local_spec,
    get_hybrid_stack_with_transformer_engine_spec,
)

startup.restore_torch_compile()


def check_args(args: argparse.Namespace) -> None:
    """What this entry needs beyond Megatron's own validation."""
    used = [flag for dest, flag in gpt.UNSUPPORTED_FLAGS.items() if getattr(args, dest, None)]
    if used:
        raise SystemExit(
            "megatron_ext.pretrain_hybrid does not support " + ", ".join(used) + ". "
            "Use Megatron-LM's own pretrain_hybrid.py for these."
        )
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
    vp_stage: Optional[int] = None,
    config: Optional[TransformerConfig] = None,
    pg_collection=None,
    *,
    config_class: type[TransformerConfig] = TransformerConfig,
) -> HybridModel:
    """Build this pipeline stage's (or virtual stage's) HybridModel; ``pretrain`` calls it
    once per model chunk with ``pre_process`` / ``post_process`` / ``vp_stage`` set."""
    args = get_args()
    print_rank_0("building Hybrid model ...")
    if config is None:
        config = transformer_config(args, config_class)
    return HybridModel(
        config=config,
        hybrid_stack_spec=hybrid_stack_spec(args),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        hybrid_layer_pattern=args.hybrid_layer_pattern,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        pg_collection=pg_collection,
        vp_stage=vp_stage,
    )


def main(
    config_class: type[TransformerConfig] = MHCTransformerConfig,
    extra_args_provider: Optional[ArgsProvider] = None,
) -> None:
    """Train a HybridModel from the command line's Megatron flags (see
    :func:`megatron_ext.pretrain_gpt.main` for ``config_class`` and ``extra_args_provider``)."""
    set_startup_timestamps(program_start=_PROGRAM_START_TIME, main_entry=time.time())
    runtime = launch.select_runtime()
    args = launch.parse_megatron_args(
        extra_args_providers=(add_megatron_ext_args, extra_args_provider),
        parser_defaults={**ENTRY_DEFAULTS, **launch.machine_defaults(on_cpu=runtime == "cpu")},
    )
    check_args(args)
    gpt.fall_back_to_local_layers(args)
    launch.run_pretrain(
        args,
        train_valid_test_datasets_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        model_provider=partial(model_provider, config_class=config_class),
    )


if __name__ == "__main__":
    main()
