"""Which Megatron flags a recipe's fields (or the runner) own.

:func:`megatron_ext.recipes.command.megatron_args` writes these flags from the schema's fields,
so the same flag in ``extra_args`` would silently win or lose (Megatron's parser takes the
last one): ``extra_args={--pipeline-model-parallel-size: 1}`` would validate as pp2 and run
PP=1. :func:`conflicts` names the field to use instead, and the Megatron-LM test-case importer
(:mod:`megatron_ext.recipes.upstream`) uses the same table to place each ``MODEL_ARGS`` flag.

Nothing here imports torch or megatron.
"""

from __future__ import annotations

from typing import Any

from megatron_ext.recipes.schema import Problem

FIELD_FLAGS: dict[str, str] = {
    "--num-layers": "model.num_layers",
    "--hidden-size": "model.hidden_size",
    "--ffn-hidden-size": "model.ffn_hidden_size",
    "--num-attention-heads": "model.num_attention_heads",
    "--num-query-groups": "model.num_query_groups",
    "--group-query-attention": "model.num_query_groups",
    "--seq-length": "model.seq_length",
    "--max-position-embeddings": "model.max_position_embeddings",
    "--position-embedding-type": "model.position_embedding",
    "--normalization": "model.normalization",
    "--hidden-dropout": "model.hidden_dropout",
    "--attention-dropout": "model.attention_dropout",
    "--untie-embeddings-and-output-weights": "model.untie_embeddings",
    "--transformer-impl": "model.transformer_impl",
    "--pipeline-model-parallel-layout": "model.pipeline_layout",
    "--hybrid-layer-pattern": "model.hybrid_layer_pattern",
    "--mtp-num-layers": "model.mtp_num_layers",
    "--num-experts": "model.num_experts",
    "--moe-router-topk": "model.moe_router_topk",
    "--mhc-sinkhorn-iterations": "model.mhc.sinkhorn_iterations",
    "--mhc-h-res-method": "model.mhc.h_res_method",
    "--mhc-variant": "model.mhc.variant",
    "--mhc-single-pass": "model.mhc.single_pass",
    "--log-mhc-stats": "model.mhc.log_stats",
    "--mhc-init-gating-factor": "model.mhc.init_gating_factor",
    "--mhc-recompute-layer-num": "model.mhc.recompute_layer_num",
    "--recompute-hyper-connections": "model.mhc.recompute",
    "--tensor-model-parallel-size": "parallelism.tp",
    "--pipeline-model-parallel-size": "parallelism.pp",
    "--num-virtual-stages-per-pipeline-rank": "parallelism.vpp",
    "--num-layers-per-virtual-pipeline-stage": "parallelism.vpp",
    "--context-parallel-size": "parallelism.cp",
    "--expert-model-parallel-size": "parallelism.ep",
    "--sequence-parallel": "parallelism.sp",
    "--pipeline-schedule": "parallelism.schedule",
    "--train-iters": "training.iterations",
    "--micro-batch-size": "training.micro_batch_size",
    "--global-batch-size": "training.global_batch_size",
    "--lr": "training.lr",
    "--min-lr": "training.min_lr",
    "--lr-decay-style": "training.lr_schedule",
    "--lr-warmup-iters": "training.lr_warmup_iters",
    "--lr-warmup-fraction": "training.lr_warmup_fraction",
    "--lr-decay-iters": "training.lr_decay_iters",
    "--weight-decay": "training.weight_decay",
    "--clip-grad": "training.clip_grad",
    "--seed": "training.seed",
    "--bf16": "training.dtype",
    "--fp16": "training.dtype",
    "--deterministic-mode": "training.deterministic",
    "--eval-interval": "training.eval_interval",
    "--eval-iters": "training.eval_iters",
    "--mock-data": "data.type",
    "--data-path": "data.paths",
    "--split": "data.split",
    "--train-data-path": "data.paths (with data.valid_paths / data.test_paths)",
    "--valid-data-path": "data.valid_paths",
    "--test-data-path": "data.test_paths",
    "--tokenizer-type": "data.tokenizer.type",
    "--vocab-size": "data.tokenizer.vocab_size",
    "--tokenizer-model": "data.tokenizer.model",
    "--vocab-file": "data.tokenizer.vocab_file",
    "--merge-file": "data.tokenizer.merge_file",
    "--ckpt-format": "test.ckpt_format",
}
"""Flag -> the schema field that writes it."""

RUNNER_FLAGS: dict[str, str] = {
    "--log-interval": "the runner logs every iteration (--log-interval 1)",
    "--log-num-zeros-in-grad": "set by 'num-zeros' in test.metrics",
    "--distributed-backend": "set by launch.device (cpu: gloo, gpu: nccl)",
    "--tensorboard-dir": "the runner writes TensorBoard files into RUN_DIR/tensorboard",
    "--save": "test.type ckpt-resume saves into RUN_DIR/checkpoints",
    "--load": "test.type ckpt-resume loads from RUN_DIR/checkpoints",
    "--save-interval": "test.type ckpt-resume saves at iterations/2",
    "--exit-interval": "test.type ckpt-resume sets it",
}
"""Flag -> why the runner, not the recipe, sets it."""


def conflicts(extra_args: dict[str, Any]) -> list[Problem]:
    """One problem per ``extra_args`` flag that a schema field or the runner owns."""
    problems = []
    for flag in extra_args:
        if flag in FIELD_FLAGS:
            problems.append(
                Problem(
                    f"extra_args.{flag}",
                    f"is set by {FIELD_FLAGS[flag]}; set that "
                    "field instead (the flag would override it)",
                )
            )
        elif flag in RUNNER_FLAGS:
            problems.append(
                Problem(
                    f"extra_args.{flag}",
                    f"is managed by megatron-ext: {RUNNER_FLAGS[flag]}; remove it",
                )
            )
    return problems
