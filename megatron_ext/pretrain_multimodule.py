"""Train a multi-module recipe: ``python -m megatron_ext.pretrain_multimodule RECIPE [KEY=VALUE ...]``.

Launch it under torchrun with the recipe's number of ranks (``launch.nproc``). The recipe is
megatron-ext's recipe YAML with ``model.type: multimodule``, read by the one recipe loader
(:func:`megatron_ext.recipes.load`) into the typed :class:`~megatron_ext.recipes.schema.Recipe`;
its module section becomes the plan through :mod:`megatron_ext.recipes.multimodule`, which also
lists what it reads and what ``megatron-ext validate`` checks without starting anything. This
entry reads besides ``model.seq_length`` (text tokens per sample), ``model.hidden_dropout``,
``model.attention_dropout``, ``data.tokenizer.vocab_size`` and ``training``: ``iterations``,
``micro_batch_size`` (of the language model), ``global_batch_size``, ``lr`` (constant),
``weight_decay``, ``clip_grad`` (global norm over every module), ``seed``, every default the
schema's, as for the single-model entries.

``KEY=VALUE`` overrides use dotted paths (``training.iterations=20``,
``model.modules.llm.pp=1``; values are YAML). The Megatron flags the recipe runner appends
(``--recipe PATH``, ``--train-iters``, ``--micro-batch-size``, ``--global-batch-size``,
``--lr``, ``--weight-decay``, ``--clip-grad``, ``--seed``, ``--lr-decay-style``,
``--tensorboard-dir``) are honoured; other Megatron flags are ignored. Data is the
deterministic synthetic VLM data of :class:`~megatron_ext.multimodule.vlm.VLMData`.

Metrics go where Megatron's go: the last rank writes TensorBoard scalars under Megatron's tags
("lm loss", "grad-norm", "iteration-time" in seconds, "learning-rate", "batch-size") into
``--tensorboard-dir``, which the runner reads. Progress is logged as a plain line per
iteration (``multimodule: iteration N/M | lm loss X | grad norm G | T ms``).

``model.modules.<language model>.mhc.log_stats: true`` adds the mHC statistics of
:mod:`megatron_ext.mhc.stats` at every iteration (the runner's log interval is 1): the language
model's hyper connections record their sample with the language model's own TP/CP/DP groups,
every rank takes part in the gather (the encoders' ranks contribute nothing), the last rank
writes the ``mhc/...`` scalars and prints the gains.
"""

from __future__ import annotations

from megatron_ext.launch import startup
from megatron_ext.recipes.schema import RecipeFieldError

startup.begin_entry_imports()  # until the imports below are done: see launch/startup.py

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from megatron_ext.multimodule.plan import MultiModulePlan
from megatron_ext.recipes import multimodule as recipe_plan
from megatron_ext.recipes.loader import load
from megatron_ext.recipes.schema import Recipe, RecipeError

startup.end_entry_imports()

logger = logging.getLogger(__name__)

# The Megatron flags this entry honours: flag -> (type, the recipe's training field).
HONOURED_FLAGS = recipe_plan.HONOURED_FLAGS


def load_recipe(path: str, overrides: Sequence[str] = ()) -> Recipe:
    """The typed recipe through the one recipe loader (schema, overrides); RecipeFieldError lists
    every problem. A pipeline schedule other than megatron's 1F1B is refused here too: started
    without ``megatron-ext run`` (which validates), this entry would otherwise ignore it."""
    from megatron_ext.recipes.checks import schedule_problems

    try:
        recipe = load(path, overrides=list(overrides)).recipe
    except RecipeError as error:
        raise RecipeFieldError("; ".join(str(p) for p in error.problems)) from None
    problems = schedule_problems(recipe)
    if problems:
        raise RecipeFieldError("; ".join(str(p) for p in problems))
    return recipe


def _module_impls(recipe: Recipe, plan: MultiModulePlan) -> dict:
    from megatron_ext.multimodule import vlm

    model = recipe.model
    impls = {}
    for name, m in (model.modules or {}).items():
        overrides: dict[str, Any] = dict(
            hidden_dropout=model.hidden_dropout, attention_dropout=model.attention_dropout
        )
        if m.mhc.enabled:
            overrides.update(
                enable_mhc_connections=True,
                mhc_num_residual_streams=m.mhc.num_residual_streams,
                mhc_sinkhorn_iterations=m.mhc.sinkhorn_iterations,
                mhc_h_res_method=m.mhc.h_res_method,
                mhc_variant=m.mhc.variant,
                mhc_init_gating_factor=m.mhc.init_gating_factor,
            )
        config = vlm.transformer_config(
            m.num_layers, m.hidden_size, m.num_attention_heads, **overrides
        )
        if m.kind == "vision_encoder":
            impls[name] = vlm.encoder_impl(config, m.patch_dim, bool(m.flatten_output))
        elif m.kind == "projector":
            impls[name] = vlm.projector_impl(config)
        else:
            max_seq = model.seq_length + _max_image_tokens(recipe, plan)
            impls[name] = vlm.language_model_impl(config, _vocab_size(recipe), max_seq)
    return impls


def _vocab_size(recipe: Recipe) -> int:
    return recipe.data.tokenizer.vocab_size or 128  # (None only for a tokenizer with a file)


def _image_lengths(recipe: Recipe) -> tuple[int, ...]:
    lengths = {
        tuple(m.image_lengths)
        for m in (recipe.model.modules or {}).values()
        if m.kind == "vision_encoder"
    }
    if len(lengths) > 1:
        raise RecipeFieldError(
            f"every vision_encoder must use the same image_lengths, got {sorted(lengths)}"
        )
    return lengths.pop() if lengths else (8,)


def _max_image_tokens(recipe: Recipe, plan: MultiModulePlan) -> int:
    return max(_image_lengths(recipe)) * len(plan.predecessors(plan.language_model))


# ------------------------------------------------------------------------------ training
def _init_distributed() -> None:
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        from megatron_ext import runtime

        runtime.use_cpu()
    else:
        import megatron_ext

        megatron_ext.install()
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")


def _parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str], list[str]]:
    """``RECIPE [KEY=VALUE ...]`` first, then flags: ``--recipe`` and the Megatron flags this
    entry honours; other flags (and their values) are ignored and reported."""
    parser = argparse.ArgumentParser(
        prog="python -m megatron_ext.pretrain_multimodule", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--recipe", help="the recipe (the recipe runner passes it this way)")
    parser.add_argument("--tensorboard-dir", help="where the last rank writes TensorBoard scalars")
    for flag, (kind, _) in HONOURED_FLAGS.items():
        parser.add_argument(flag, type=kind)
    split = next((i for i, token in enumerate(argv) if token.startswith("-")), len(argv))
    positional, flags = argv[:split], argv[split:]
    args, ignored = parser.parse_known_args(flags)
    recipe = args.recipe
    overrides = []
    for item in positional:
        if "=" in item:
            overrides.append(item)
        elif recipe is None:
            recipe = item
        else:
            parser.error(f"more than one recipe: {recipe} and {item}")
    if recipe is None:
        parser.error("give the recipe file (RECIPE.yaml or --recipe RECIPE.yaml)")
    args.recipe = recipe
    for flag, (_, field) in HONOURED_FLAGS.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            overrides.append(f"training.{field}={value}")
    return args, overrides, [token for token in ignored if token.startswith("--")]


def _tensorboard_writer(directory: str | None):
    """Megatron's choice: a SummaryWriter on the last rank only (None without a directory)."""
    if not directory:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        logger.warning(
            "tensorboard is not installed: no TensorBoard scalars (pip install tensorboard)"
        )
        return None
    return SummaryWriter(log_dir=directory, max_queue=1000)


def train(
    recipe: Recipe, plan: MultiModulePlan, log=print, tensorboard_dir: str | None = None
) -> list[float]:
    """Train; returns the lm loss of every iteration (on every rank). The last rank writes
    TensorBoard scalars into ``tensorboard_dir`` (Megatron's tags) and logs one progress line
    per iteration through ``log``."""
    import torch
    import torch.distributed as dist

    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_ext.launch import faults
    from megatron_ext.multimodule import MultiModulePipelineConfig, build, vlm
    from megatron_ext.multimodule.grads import global_grad_norm

    t = recipe.training
    if t.lr_schedule != "constant":
        raise RecipeFieldError(
            f"training.lr_schedule={t.lr_schedule!r}: this entry trains with a constant lr"
        )
    num_microbatches = recipe_plan.num_microbatches(recipe, plan)
    config = MultiModulePipelineConfig(pipeline_dtype=torch.float32)
    pipeline = build(
        plan, _module_impls(recipe, plan), config, DistributedDataParallelConfig(), seed=t.seed
    )
    params = [
        p for m in pipeline.model.core_modules().values() for p in m.parameters() if p.requires_grad
    ]
    optimizer = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)
    modules = recipe.model.modules or {}
    readers = {name: m.patch_dim for name, m in modules.items() if m.kind == "vision_encoder"}
    data = vlm.VLMData(
        plan.language_model,
        readers,
        vocab_size=_vocab_size(recipe),
        text_length=recipe.model.seq_length,
        image_lengths=_image_lengths(recipe),
        seed=t.seed,
        text_pattern=modules[plan.language_model].text_pattern,
    )
    forward_step = vlm.make_forward_step(plan.language_model)
    last_rank = dist.get_rank() == dist.get_world_size() - 1
    writer = _tensorboard_writer(tensorboard_dir) if last_rank else None
    recorder = _mhc_stats_recorder(recipe, plan)
    losses = []
    # No try/finally around destroy(): it starts with a barrier, which a failing rank would
    # block in while its peers wait on it. A failure ends the rank (main's fail-fast) instead.
    for iteration in range(1, t.iterations + 1):
        faults.at_step(iteration)
        start = time.perf_counter()
        pipeline.zero_grad_buffer()
        optimizer.zero_grad(set_to_none=True)
        batches = vlm.local_batches(
            pipeline, data, iteration - 1, num_microbatches, t.micro_batch_size
        )
        reports = pipeline.forward_backward(forward_step, iter(batches), num_microbatches)
        # Megatron's lm loss: the mean over micro-batches and language-model replicas.
        total = torch.tensor(
            [sum(r["lm loss"] for r in reports), len(reports)]
            if pipeline.reports_loss
            else [0.0, 0.0],
            dtype=torch.float64,
        )
        dist.all_reduce(total)
        loss = float(total[0] / total[1])
        grad_norm = global_grad_norm(pipeline)
        scale = min(1.0, t.clip_grad / (grad_norm + 1e-6)) if t.clip_grad > 0 else 1.0
        for p in params:
            # main_grad: megatron DDP's attribute, which torch's Parameter type does not declare
            p.grad = p.main_grad * scale  # type: ignore[attr-defined]
        optimizer.step()
        elapsed_ms = (time.perf_counter() - start) * 1e3
        losses.append(loss)
        if writer is not None:
            for tag, value in (
                ("lm loss", loss),
                ("grad-norm", grad_norm),
                ("learning-rate", t.lr),
                ("batch-size", t.global_batch_size),
                ("iteration-time", elapsed_ms / 1e3),
            ):
                writer.add_scalar(tag, value, iteration)
            writer.flush()
        if last_rank:
            log(
                f"multimodule: iteration {iteration}/{t.iterations} | lm loss {loss:.6f} "
                f"| grad norm {grad_norm:.3f} | {elapsed_ms:.0f} ms"
            )
            sys.stdout.flush()
        if recorder is not None:
            _log_mhc_stats(recorder, iteration, writer, log if last_rank else None)
    if recorder is not None:
        from megatron_ext.mhc import stats

        stats.disable()
    if writer is not None:
        writer.close()
    pipeline.destroy()
    return losses


def _mhc_stats_recorder(recipe: Recipe, plan: MultiModulePlan):
    """The mHC statistics' recorder when the language model logs them (else None)."""
    lm = (recipe.model.modules or {}).get(plan.language_model)
    if lm is None or not (lm.mhc.enabled and lm.mhc.log_stats):
        return None
    from megatron_ext.mhc import stats

    return stats.enable()


def _log_mhc_stats(recorder, iteration: int, writer, log) -> None:
    """Every rank: gather the step's figures; the last rank writes and prints them. Then the
    next step records afresh."""
    from megatron_ext.mhc import stats, stats_logging

    figures = stats.collect(recorder)
    recorder.samples.clear()
    if writer is not None and figures:
        stats_logging.add_scalars(writer, figures, iteration)
        writer.flush()
    line = stats_logging.console_line(figures, iteration)
    if log is not None and line:
        log(line)
        sys.stdout.flush()


def _report_placement(plan: MultiModulePlan, rank: int) -> None:
    """This rank's module and coordinates in its grid (launch.nodes: under Slurm only)."""
    from megatron_ext.launch import nodes

    for name, module in plan.modules.items():
        if rank in module.ranks:
            nodes.report_placement(module.coordinates(rank), module=name)


def main(argv: list[str] | None = None) -> int:
    args, overrides, ignored = _parse_args(list(sys.argv[1:] if argv is None else argv))
    _init_distributed()
    import torch.distributed as dist

    recipe = load_recipe(args.recipe, overrides)
    plan = recipe_plan.plan_of(recipe, dist.get_world_size())
    _report_placement(plan, dist.get_rank())
    if dist.get_rank() == 0:
        modules = ", ".join(
            f"{n} (tp{m.tp} pp{m.pp} dp{m.dp}, ranks {m.ranks.start}-{m.ranks.stop - 1})"
            for n, m in plan.modules.items()
        )
        print(
            f"multimodule: {modules}; topology {plan.topology}; "
            f"{recipe_plan.num_microbatches(recipe, plan)} micro-batches per iteration",
            flush=True,
        )
        if ignored:
            print(
                f"multimodule: ignoring Megatron flags this entry does not use: {' '.join(ignored)}",
                flush=True,
            )
    train(recipe, plan, tensorboard_dir=args.tensorboard_dir)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from megatron_ext.launch.faults import run_failing_fast
    from megatron_ext.launch.startup import end_rank

    end_rank(run_failing_fast(main))
