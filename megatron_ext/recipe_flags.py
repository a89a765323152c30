"""Which Megatron flags a recipe's fields (or the runner) own.

:func:`megatron_ext.recipes.command.megatron_args` writes these flags from the schema's fields,
so the same flag in ``extra_args`` would silently win or lose (Megatron's parser takes the
last one): ``extra_args={--pipeline-model-parallel-size: 1}`` would validate as pp2 and run
PP=1. :func:`conflicts` names the field to use instead, and the Megatron-LM test-case importer
(:mod:`megatron_ext.upstream_cases`) uses the same table to place each ``MODEL_ARGS`` flag.

It sits below both :mod:`megatron_ext.recipes` and :mod:`megatron_ext.upstream_cases`, which
share it (with :data:`DEFAULT_PLATFORM`); it imports nothing of either. Nothing here imports
torch or megatron.
"""

from __future__ import annotations

import ast
from typing import Any

from megatron_ext.errors import Problem

DEFAULT_PLATFORM = "cpu"
"""The platform whose sizes are the recipe's top-level sections (``platforms`` overlay them);
an imported test case's cpu overlay is this platform."""

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
    "--pipeline-schedule-file": "parallelism.schedule_file",
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

# Flags that count the embedding / the loss as one more layer when the layers are split over
# the pipeline stages (megatron-core 0.19.2, TransformerConfig.__post_init__ and
# transformer_block.get_num_layers_to_build).
PIPELINE_SPLIT_FLAGS = {
    "--account-for-embedding-in-pipeline-split": "the embedding",
    "--account-for-loss-in-pipeline-split": "the loss",
}

# Flags whose value is a per-layer list expression ("([0]+[1]*3)"; megatron-core 0.19.2's
# training/arguments.py moe_freq_type / la_freq_type): one value, one entry per layer.
PATTERN_LIST_FLAGS = ("--moe-layer-freq", "--linear-attention-freq")


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


def layer_list(text: Any) -> list[int] | None:
    """The per-layer list a ``--moe-layer-freq`` expression stands for ("([0]*1+[1]*3)*2",
    "[0,1,1]"), None for a plain number or anything else. Read from its syntax tree: only
    list displays of integers, ``+`` and ``*`` are understood; nothing is evaluated."""
    if not isinstance(text, str) or "[" not in text:
        return None
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        return None

    def value(node: ast.AST) -> list[int] | int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.List):
            items = [value(item) for item in node.elts]
            if all(isinstance(item, int) for item in items):
                return items  # type: ignore[return-value]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Add) and isinstance(left, list) and isinstance(right, list):
                return left + right
            if isinstance(node.op, ast.Mult) and isinstance(left, list) != isinstance(right, list):
                count = right if isinstance(left, list) else left
                if isinstance(count, int) and 0 <= count <= 100_000:
                    return (left if isinstance(left, list) else right) * count
        raise ValueError(ast.dump(node)[:40])

    try:
        result = value(tree)
    except (ValueError, RecursionError):
        return None
    return result if isinstance(result, list) else None


def layer_list_text(layers: list[int]) -> str:
    """A per-layer list in upstream's run-length spelling: [0, 1, 1] -> "([0]*1+[1]*2)"."""
    runs: list[list[int]] = []
    for entry in layers:
        if runs and runs[-1][0] == entry:
            runs[-1][1] += 1
        else:
            runs.append([entry, 1])
    return "(" + "+".join(f"[{entry}]*{count}" for entry, count in runs) + ")"
