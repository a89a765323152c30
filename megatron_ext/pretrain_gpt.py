"""Pretrain a GPT with ``megatron.training.pretrain``: megatron-ext's Megatron-LM ``pretrain_gpt.py``.

    torchrun --nproc_per_node N -m megatron_ext.pretrain_gpt <any Megatron flags>

This module owns the GPT-specific parts of a run:

- **the model**: :func:`model_provider` builds :class:`megatron_ext.models.gpt.GPTModel`. With
  ``--transformer-impl local`` (the default where Transformer Engine is not importable) it uses
  megatron-ext's sequence-parallel-safe local layer spec. With ``transformer_engine`` it uses
  megatron-core's TE spec. ``--spec``, MoE, MTP, experimental attention variants and
  heterogeneous layers use the builders that upstream uses. The config is
  :class:`megatron_ext.config.MHCTransformerConfig`; ``--enable-mhc-connections`` (and the other
  mHC flags, upstream's spellings) selects the mHC layer specs. :func:`main`'s ``config_class``
  can replace it.
- **the entry**: :func:`main` hands this model to :func:`megatron_ext.training_steps.train`.

What both pretraining entries share lives in :mod:`megatron_ext.training_steps` (and is
re-exported here, where recipes and patches look up an entry's hooks): the data (mock data or
indexed data, built by ``BlendedMegatronDatasetBuilder`` on the ranks that read batches), the
step (:func:`get_batch`, :func:`forward_step`, :func:`loss_func`: the per-token LM loss under the
loss mask, returned as ``(loss_sum, num_tokens, {'lm loss': ...})``), the flags and the hand-off
to ``pretrain``. The machinery that other entry points share is in
:mod:`megatron_ext.launch.training`.

It differs from upstream's ``pretrain_gpt.py`` in a few defaults and exclusions:

- Defaults that the machine needs replace Megatron's (see
  :func:`megatron_ext.launch.training.machine_defaults`). Examples are local layers without TE,
  gloo and no CUDA-only fusions on CPU, and ``--eval-interval`` 1000 when it is not given.
  Explicit flags still win.
- ``--tokenizer-type`` defaults to GPT2BPETokenizer, as upstream does.
- These are not wired, and they fail with a clear message: ``--sft``, ``--fim-data``,
  packed sequences (``--dataloader-inter-document-masking``), hybrid context parallelism, and
  ModelOpt / cached-logits distillation.
"""

from __future__ import annotations

import time

_PROGRAM_START_TIME = time.time()  # before the heavy imports, for megatron's start-up report

from megatron_ext.launch import silence_warnings_off_rank_zero, startup

silence_warnings_off_rank_zero()  # megatron's imports below warn identically on every rank
startup.begin_entry_imports()  # until the imports below are done: see launch/startup.py

import argparse
from collections.abc import Callable
from typing import Any

from megatron.core.models.gpt import gpt_layer_specs as core_specs
from megatron.core.transformer.spec_utils import import_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training import get_args, print_rank_0

from megatron_ext import training_steps
from megatron_ext.config import MHCTransformerConfig
from megatron_ext.models.gpt import (
    GPTModel,
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)

# The entry hooks recipes, tools and patches look up on an entry module.
from megatron_ext.training_steps import (  # noqa: F401  (re-exported entry hooks)
    ENTRY_DEFAULTS,
    UNSUPPORTED_FLAGS,
    add_megatron_ext_args,
    fall_back_to_local_layers,
    forward_step,
    get_batch,
    loss_func,
    reject_unsupported_flags,
    train_valid_test_datasets_provider,
    transformer_config,
)

startup.end_entry_imports()


# ---- model ---------------------------------------------------------------------------------------
def _kitchen_kwargs(config: TransformerConfig) -> dict[str, Any]:
    return {
        "use_kitchen": config.use_kitchen,
        "use_kitchen_attention": config.use_kitchen_attention,
        "kitchen_attention_backend": config.kitchen_attention_backend,
    }


def dense_layer_spec(args: argparse.Namespace, config: TransformerConfig):
    """One transformer layer's spec: megatron-core's TE spec, or megatron-ext's local one."""
    if args.transformer_impl == "transformer_engine":
        te_spec = (
            get_gpt_layer_with_transformer_engine_spec
            if args.enable_mhc_connections
            else core_specs.get_gpt_layer_with_transformer_engine_spec
        )
        mhc_kwargs = {"enable_mhc_connections": True} if args.enable_mhc_connections else {}
        return te_spec(
            **mhc_kwargs,
            num_experts=args.num_experts,
            moe_grouped_gemm=args.moe_grouped_gemm,
            qk_layernorm=args.qk_layernorm,
            multi_latent_attention=args.multi_latent_attention,
            qk_l2_norm=args.qk_l2_norm,
            use_te_op_fuser=args.use_transformer_engine_op_fuser,
            use_te_activation_func=args.use_te_activation_func,
            mla_down_proj_fusion=args.mla_down_proj_fusion,
            use_grouped_gemm_for_dense_mlp=args.use_grouped_gemm_for_dense_mlp,
            **_kitchen_kwargs(config),
        )
    if args.transformer_impl == "inference_optimized":
        return core_specs.get_gpt_layer_with_inference_spec(
            args.qk_layernorm, args.multi_latent_attention, qk_l2_norm=args.qk_l2_norm
        )
    return get_gpt_layer_local_spec(
        enable_mhc_connections=args.enable_mhc_connections,
        num_experts=args.num_experts,
        moe_grouped_gemm=args.moe_grouped_gemm,
        qk_layernorm=args.qk_layernorm,
        multi_latent_attention=args.multi_latent_attention,
        normalization=args.normalization,
        qk_l2_norm=args.qk_l2_norm,
        **_kitchen_kwargs(config),
    )


def transformer_layer_spec(
    args: argparse.Namespace, config: TransformerConfig, vp_stage: int | None
):
    """The decoder's spec, chosen the way upstream's GPT builder chooses it."""
    use_te = args.transformer_impl == "transformer_engine"
    if args.spec is not None:
        return import_module(args.spec)
    if args.experimental_attention_variant is not None:
        from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
            get_transformer_block_with_experimental_attention_variant_spec,
        )

        return get_transformer_block_with_experimental_attention_variant_spec(
            config=config, vp_stage=vp_stage
        )
    if args.num_experts:
        # A block spec: dense and MoE layers interleave per --moe-layer-freq; megatron-core's,
        # with our local modules and, under --enable-mhc-connections, mHC in every layer.
        return get_gpt_decoder_block_spec(
            config,
            use_transformer_engine=use_te,
            normalization=args.normalization,
            qk_l2_norm=args.qk_l2_norm,
            vp_stage=vp_stage,
            enable_mhc_connections=bool(args.enable_mhc_connections),
        )
    if args.heterogeneous_layers_config_path is not None:
        from megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs import (
            get_gpt_heterogeneous_layer_spec,
        )

        return get_gpt_heterogeneous_layer_spec(config, use_te)
    return dense_layer_spec(args, config)


def mtp_block_spec(
    args: argparse.Namespace, config: TransformerConfig, decoder_spec, vp_stage: int | None
):
    """Multi-token-prediction layers reuse the spec of the decoder's last layer."""
    if args.mtp_num_layers is None:
        return None
    use_te = args.transformer_impl == "transformer_engine"
    if hasattr(decoder_spec, "layer_specs") and len(decoder_spec.layer_specs) == 0:
        # A MoE block spec holds no decoder layer on a stage that only hosts MTP.
        last_layer_spec = dense_layer_spec(args, config)
    else:
        last_layer_spec = core_specs.get_gpt_decoder_layer_specs(
            config,
            use_transformer_engine=use_te,
            normalization=args.normalization,
            qk_l2_norm=args.qk_l2_norm,
            vp_stage=vp_stage,
        )[-1]
    return core_specs.get_gpt_mtp_block_spec(
        config, last_layer_spec, use_transformer_engine=use_te, vp_stage=vp_stage
    )


def model_provider(
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int | None = None,
    config: TransformerConfig | None = None,
    pg_collection=None,
    *,
    config_class: type[TransformerConfig] = TransformerConfig,
) -> GPTModel:
    """Build this pipeline stage's (or virtual stage's) GPT.

    ``pretrain`` calls it once per model chunk with ``pre_process`` (embedding here) and
    ``post_process`` (output layer and loss here) already set from the stage and the virtual
    stage, and with ``vp_stage`` under interleaving. Its first call agrees the configuration
    with the other pipeline stages before anything is built (:func:`training_steps.stage_config`).
    """
    args = get_args()
    print_rank_0("building GPT model ...")
    config = training_steps.stage_config(args, config, config_class, pg_collection)
    decoder_spec = transformer_layer_spec(args, config, vp_stage)
    return GPTModel(
        config=config,
        transformer_layer_spec=decoder_spec,
        **training_steps.language_model_kwargs(args, pre_process, post_process),
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
        mtp_block_spec=mtp_block_spec(args, config, decoder_spec, vp_stage),
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )


# ---- entry ---------------------------------------------------------------------------------------
def main(
    config_class: type[TransformerConfig] = MHCTransformerConfig,
    extra_args_provider: Callable[[argparse.ArgumentParser], argparse.ArgumentParser] | None = None,
) -> None:
    """Train a GPT from the command line's Megatron flags.

    ``config_class`` is the TransformerConfig (sub)class that the model is built from.
    ``extra_args_provider`` adds flags that such a class reads. Together they let a feature
    such as mHC reuse this entry unchanged.
    """
    training_steps.train(
        model_provider,
        _PROGRAM_START_TIME,
        check_args=reject_unsupported_flags,
        config_class=config_class,
        extra_args_provider=extra_args_provider,
    )


if __name__ == "__main__":
    main()
    startup.end_rank()
