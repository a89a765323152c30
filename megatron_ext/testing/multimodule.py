"""A multi-module pipeline against a single-process reference of the same modules.

:func:`check_pipeline_equivalence` runs, on every rank of the current world:

1. the reference, on rank 0: every module built whole (TP = PP = DP = 1), fed sample by
   sample-range exactly the samples the language model's DP replicas see, the loss defined
   as megatron defines it for one model (mean over replicas and micro-batches of each
   micro-batch's token mean, or the global token mean with ``calculate_per_token_loss``),
   then plain SGD; its initial weights, losses, gradients and final weights are broadcast;
2. the pipeline: :func:`~megatron_ext.multimodule.build` with megatron-core's DDP on every
   module and megatron-core's schedule, starting from the reference's weights (placed by
   sharded-state-dict key and offset, per module), the same SGD on the finalised ``main_grad``
   divided by the loss scale;
3. the comparison, on every rank: every micro-batch loss, every gradient of every step
   (times the loss scale) and every weight after the last step, for full coverage of every
   module. Every rank raises the same :class:`PipelineEquivalenceError`.
"""

from __future__ import annotations

import dataclasses
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megatron_ext.errors import MegatronExtError
from megatron_ext.multimodule.builder import ModuleImpl, build, ensure_global_memory_buffer
from megatron_ext.multimodule.model import StageContext
from megatron_ext.multimodule.plan import MultiModulePipelineConfig, MultiModulePlan
from megatron_ext.multimodule.vlm import (
    VLMData,
    lm_input_count,
    local_batches,
    make_forward_step,
    masked_lm_loss,
)
from megatron_ext.testing import shards
from megatron_ext.testing.equivalence import compare_pieces, raise_differences
from megatron_ext.testing.shards import ShardedParam, full_tensors, load_full_weights, local_pieces


class PipelineEquivalenceError(MegatronExtError, AssertionError):
    """The multi-module pipeline differs from the single-process reference."""


@dataclass
class PipelineRun:
    """What to run: a plan, its modules, data and the training settings."""

    plan: MultiModulePlan
    impls: dict[str, ModuleImpl]
    data: VLMData
    micro_batch_size: int = 2  # of the language model, per DP replica
    num_microbatches: int = 4
    steps: int = 2
    lr: float = 0.05
    grad_scale: float = 1.0
    calculate_per_token_loss: bool = False
    deallocate_pipeline_outputs: bool = False
    ddp_overrides: dict = field(default_factory=dict)
    loss_rtol: float = 1e-5
    grad_atol: float = 2e-5
    param_atol: float = 2e-5


@dataclass
class Reference:
    initial: dict[str, torch.Tensor]
    losses: list[list[dict]]  # per step, per (micro-batch, replica): the loss report
    grads: list[dict[str, torch.Tensor]]
    final: dict[str, torch.Tensor]


# ---------------------------------------------------------------------------------------------
def shard_index(module: torch.nn.Module, dp_cp_group: Any) -> list[ShardedParam]:
    """:func:`megatron_ext.testing.shards.shard_index` for a module built on its own groups:
    megatron's sharded_state_dict falls back to parallel_state's DP group unless the metadata
    names one, and multi-module pipelines never initialise parallel_state."""
    return shards.shard_index(
        [module],
        lambda m: _sharded_state_dict(m, {"dp_cp_group": dp_cp_group}),
        first_entry_only=True,
    )


def _sharded_state_dict(module: Any, metadata: dict) -> dict:
    """The module's sharded state dict. A language model whose last stage holds the tied
    output weight names it after the embedding; megatron does that with a replica id read from
    parallel_state, so here the children are asked one by one and the key is renamed."""
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.utils import sharded_state_dict_default

    tp_group = getattr(module, "tp_group", None)
    if tp_group is not None:
        # A MegatronModule without a tp_group attribute falls back to parallel_state's group
        # in sharded_state_dict (megatron-ext's HyperConnectionModule is one): lend it the
        # module's own.
        for child in module.modules():
            if isinstance(child, MegatronModule) and not hasattr(child, "tp_group"):
                child.tp_group = tp_group
    tied = getattr(module, "share_embeddings_and_output_weights", False)
    if not (
        tied and getattr(module, "post_process", False) and not getattr(module, "pre_process", True)
    ):
        return module.sharded_state_dict(metadata=metadata)
    entries = {}
    for name, child in module.named_children():
        entries.update(
            sharded_state_dict_default(child, f"{name}.", (), metadata, tp_group=module.tp_group)
        )
    entry = entries.pop("output_layer.weight", None)
    if entry is not None:
        entry.key = "embedding.word_embeddings.weight"
        entries["embedding.word_embeddings.weight"] = entry
    return entries


_single_rank_groups: dict = {}


def _single_rank_group() -> Any:
    """This rank alone as a process group (made once, collectively, on every rank)."""
    if "group" not in _single_rank_groups:
        group, _ = dist.new_subgroups_by_enumeration([[r] for r in range(dist.get_world_size())])
        _single_rank_groups["group"] = group
    return _single_rank_groups["group"]


def _single_rank_pg_collection() -> Any:
    from megatron.core.process_groups_config import ProcessGroupCollection

    alone = _single_rank_group()
    pgc = ProcessGroupCollection()
    for name in ("tp", "cp", "pp", "dp", "ep", "tp_cp", "dp_cp", "mp", "expt_dp", "expt_tp"):
        setattr(pgc, name, alone)
    pgc.embd = None
    pgc.pos_embd = None
    return pgc


def _reference_modules(
    run: PipelineRun, seed: int
) -> dict[str, tuple[torch.nn.Module, StageContext]]:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    pgc = _single_rank_pg_collection()
    modules = {}
    for name in run.plan.topological_order:
        impl = run.impls[name]
        config = None
        if impl.config is not None:
            config = dataclasses.replace(
                impl.config,
                tensor_model_parallel_size=1,
                pipeline_model_parallel_size=1,
                context_parallel_size=1,
                calculate_per_token_loss=run.calculate_per_token_loss,
            )
        stage = StageContext(
            name=name,
            config=config,
            pg_collection=pgc,
            pp_rank=0,
            pp_size=1,
            tp_rank=0,
            dp_rank=0,
            dp_size=1,
            predecessors=run.plan.predecessors(name),
            successors=run.plan.successors(name),
            is_language_model=name == run.plan.language_model,
        )
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed, tp_rank=0, ep_rank=0, etp_rank=0)
        modules[name] = (impl.factory(stage), stage)
    return modules


def _prefixed(name: str, tensors: dict) -> dict:
    return {f"{name}/{key}": value for key, value in tensors.items()}


def run_reference(run: PipelineRun, seed: int = 1234) -> Reference:
    """The single-process reference (see the module docstring)."""
    from megatron.core import parallel_state

    created = ensure_global_memory_buffer()
    try:
        return _run_reference(run, seed)
    finally:
        if created:
            parallel_state.destroy_global_memory_buffer()


def _run_reference(run: PipelineRun, seed: int) -> Reference:
    from megatron_ext.multimodule.model import default_forward

    plan = run.plan
    built = _reference_modules(run, seed)
    indexes = {
        name: shard_index(module, stage.pg_collection.dp_cp)
        for name, (module, stage) in built.items()
    }
    initial = {}
    for name, index in indexes.items():
        initial.update(_prefixed(name, full_tensors(index, lambda p: p)))
    params = [p for module, _ in built.values() for p in module.parameters() if p.requires_grad]
    lm = plan.language_model
    replicas = plan.modules[lm].dp
    mbs = run.micro_batch_size
    losses, grads = [], []
    for step in range(run.steps):
        for p in params:
            p.grad = None
        reports, pieces = [], []
        for m in range(run.num_microbatches):
            full = run.data.global_microbatch(step, m, mbs * replicas, lm_input_count(plan))
            for replica in range(replicas):
                samples = range(replica * mbs, (replica + 1) * mbs)
                batch = {name: run.data.take(full[name], samples) for name in full}
                outputs: dict[str, Any] = {}
                for name, (module, stage) in built.items():
                    inputs = {p: outputs[p] for p in stage.predecessors} or None
                    forward = run.impls[name].forward or default_forward
                    outputs[name] = forward(module, batch, inputs, stage)
                loss_sum, tokens, report = masked_lm_loss(batch[lm]["loss_mask"], outputs[lm])
                reports.append(report)
                pieces.append((loss_sum, tokens))
        total_tokens = sum(int(t) for _, t in pieces)
        for loss_sum, tokens in pieces:
            if run.calculate_per_token_loss:
                loss = loss_sum / max(total_tokens, 1)
            else:
                loss = loss_sum / tokens.clamp(min=1) / (run.num_microbatches * replicas)
            loss.backward()
        step_grads = {}
        for name, index in indexes.items():
            step_grads.update(_prefixed(name, full_tensors(index, lambda p: p.grad)))
        losses.append(reports)
        grads.append(step_grads)
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-run.lr)
    final = {}
    for name, index in indexes.items():
        final.update(_prefixed(name, full_tensors(index, lambda p: p)))
    return Reference(initial, losses, grads, final)


# ---------------------------------------------------------------------------------------------
def run_pipeline(
    run: PipelineRun,
    initial: dict[str, torch.Tensor] | None = None,
    on_gradients: Callable[[int, Any], None] | None = None,
) -> tuple[list[list[dict]], list[list], list]:
    """The multi-module pipeline from ``initial``: (loss reports, gradient pieces per step,
    final weight pieces) of this rank."""
    from megatron.core.distributed import DistributedDataParallelConfig

    config = MultiModulePipelineConfig(
        pipeline_dtype=torch.float32,
        calculate_per_token_loss=run.calculate_per_token_loss,
        deallocate_pipeline_outputs=run.deallocate_pipeline_outputs,
    )
    if run.grad_scale != 1.0:
        config.grad_scale_func = lambda loss: loss * run.grad_scale
    ddp_config = DistributedDataParallelConfig(**run.ddp_overrides)
    pipeline = build(run.plan, run.impls, config, ddp_config=ddp_config)
    try:
        cores = pipeline.model.core_modules()
        indexes = {
            name: shard_index(module, pipeline.module_pg_collections[name].dp_cp)
            for name, module in cores.items()
        }
        for name, index in indexes.items() if initial is not None else ():
            assert initial is not None
            load_full_weights(
                index,
                {k.split("/", 1)[1]: v for k, v in initial.items() if k.startswith(f"{name}/")},
            )
        forward_step = make_forward_step(run.plan.language_model)
        reports, grads = [], []
        for step in range(run.steps):
            pipeline.zero_grad_buffer()
            batches = local_batches(
                pipeline, run.data, step, run.num_microbatches, run.micro_batch_size
            )
            step_reports = pipeline.forward_backward(
                forward_step, iter(batches), run.num_microbatches
            )
            if on_gradients is not None:
                on_gradients(step, pipeline)
            reports.append(list(step_reports) if pipeline.reports_loss else [])
            step_grads = []
            for name, index in indexes.items():
                step_grads += [
                    (f"{name}/{k}", *rest)
                    # main_grad: megatron DDP's attribute (torch's Parameter type lacks it)
                    for k, *rest in local_pieces(index, lambda p: p.main_grad)  # type: ignore[attr-defined]
                ]
            grads.append(step_grads)
            with torch.no_grad():
                for module in cores.values():
                    for p in module.parameters():
                        if p.requires_grad:
                            # megatron DDP's main_grad (torch's Parameter type lacks it)
                            p.add_(p.main_grad, alpha=-run.lr / run.grad_scale)  # type: ignore[attr-defined]
        final = []
        for name, index in indexes.items():
            final += [(f"{name}/{k}", *rest) for k, *rest in local_pieces(index, lambda p: p)]
        return reports, grads, final
    finally:
        pipeline.destroy()


def _broadcast(obj: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def check_pipeline_equivalence(
    run: PipelineRun, on_gradients: Callable[[int, Any], None] | None = None
) -> Reference:
    """Raise :class:`PipelineEquivalenceError` on every rank if the pipeline's losses,
    gradients (every step) or final weights differ from the reference."""
    problem = None
    reference = None
    _single_rank_group()  # collective: every rank, before the reference runs on rank 0
    if dist.get_rank() == 0:
        try:
            reference = run_reference(run)
        except Exception as error:  # shared below so every rank raises
            tail = "".join(traceback.format_tb(error.__traceback__)[-4:])
            problem = f"the reference failed: {type(error).__name__}: {error}\n{tail}"
    reference, problem = _broadcast((reference, problem))
    if problem:
        raise PipelineEquivalenceError(problem)
    mine = run_pipeline(run, reference.initial, on_gradients)
    everything: list = [None] * dist.get_world_size()
    dist.all_gather_object(everything, mine)

    problems = []
    replicas = run.plan.modules[run.plan.language_model].dp
    for step in range(run.steps):
        got = [r for reports, _, _ in everything for r in reports[step]]
        expected = reference.losses[step]
        if len(got) != run.num_microbatches * replicas:
            problems.append(f"step {step}: {len(got)} loss reports, expected {len(expected)}")
        else:
            g = sum(r["loss sum"] for r in got) / max(sum(r["tokens"] for r in got), 1)
            e = sum(r["loss sum"] for r in expected) / max(sum(r["tokens"] for r in expected), 1)
            gm = sum(r["lm loss"] for r in got) / len(got)
            em = sum(r["lm loss"] for r in expected) / len(expected)
            for what, a, b in (("token-mean loss", g, e), ("mean micro-batch loss", gm, em)):
                if abs(a - b) > run.loss_rtol * abs(b):
                    problems.append(f"step {step}: {what} {a:.8f} vs reference {b:.8f}")
        scaled = {k: v * run.grad_scale for k, v in reference.grads[step].items()}
        problems += compare_pieces(
            f"step {step} gradient",
            [grads[step] for _, grads, _ in everything],
            scaled,
            run.grad_atol * max(1.0, run.grad_scale),
        )
    problems += compare_pieces(
        f"weights after {run.steps} steps",
        [final for _, _, final in everything],
        reference.final,
        run.param_atol,
    )
    raise_differences(problems, PipelineEquivalenceError, "the single-process reference")
    return reference
