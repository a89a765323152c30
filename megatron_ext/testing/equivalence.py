"""Train a sharded model for a few steps and compare it with a single-rank reference.

:func:`check_equivalence` runs, on every rank of the current world:

1. the reference: the same model with every parallel size 1, built from the plan's seed,
   trained on the whole global batch with megatron's no-pipelining schedule and a plain
   torch AdamW + grad-norm clipping;
2. the sharded run: the plan's TP/PP/VPP/CP/EP/DP with megatron's own DDP, schedules,
   finalize_model_grads and optimizer (distributed or not), starting from the reference's
   initial weights (placed by global key and offset); with CP each rank keeps its share of
   every micro-batch as megatron's ``get_batch_on_this_cp_rank`` splits it, and the loss
   reports are summed over CP as megatron's training loop sums them;
3. the comparison: the loss of every step, every gradient of every step and every weight
   after the last step, each rank's pieces gathered onto every rank, checked region by
   region and for full coverage. Every rank reaches the same verdict and raises the same
   :class:`EquivalenceError`, so no rank is left waiting in a collective.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from megatron_ext.errors import MegatronExtError
from megatron_ext.models.lm_loss import masked_token_loss
from megatron_ext.parallel_plan import ParallelPlan, ParallelPlanError
from megatron_ext.testing.configs import CPU_SAFE_FIELDS
from megatron_ext.testing.distributed import model_parallel, world_size
from megatron_ext.testing.shards import (
    Piece,
    full_tensors,
    load_full_weights,
    local_pieces,
    shard_index,
)

ModelFactory = Callable[..., torch.nn.Module]  # (config, pre_process, post_process, vp_stage)


class EquivalenceError(MegatronExtError, AssertionError):
    """The sharded run differs from the single-rank reference."""


@dataclass
class TrainPlan:
    """A tiny training run: model sizes, parallel sizes, batch and optimiser settings."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    # The sharded run's pipeline schedule: "1f1b" (megatron's, by get_forward_backward_func)
    # or "zb-h1" (megatron_ext.pipeline.zero_bubble; the config's pipeline_schedule too).
    schedule: str = "1f1b"
    num_layers: int = 4
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_moe_experts: int | None = None
    vocab_size: int = 64
    seq_length: int = 16
    micro_batch_size: int = 2
    global_batch_size: int = 8
    steps: int = 3
    lr: float = 1e-3
    clip_grad: float = 1.0
    seed: int = 1234
    # Loss-mask every position that is a multiple of this (None: a random 10 % only). With CP
    # and MTP, s // (2 * cp) zeroes every chunk's first token: megatron scales MTP losses by
    # each CP rank's own token counts before and after its roll, which then equal the whole
    # sequence's.
    loss_mask_zero_every: int | None = None
    config_overrides: dict[str, Any] = field(default_factory=dict)
    # Only for the sharded run's config (e.g. pipeline_model_parallel_layout).
    parallel_overrides: dict[str, Any] = field(default_factory=dict)
    loss_rtol: float = 1e-5
    grad_atol: float = 1e-5
    param_atol: float = 1e-5

    @property
    def parallel(self) -> ParallelPlan:
        """The plan in the current world (checked: every problem at once)."""
        return ParallelPlan(
            tp=self.tp,
            pp=self.pp,
            vpp=self.vpp,
            cp=self.cp,
            ep=self.ep,
            sp=self.sequence_parallel,
            world=world_size(),
        ).check()

    @property
    def data_parallel_size(self) -> int:
        return self.parallel.dp

    @property
    def microbatches_per_step(self) -> int:
        """Micro-batches of the whole global batch (what the reference runs per step)."""
        return self.global_batch_size // self.micro_batch_size

    def local_microbatches(self) -> int:
        plan = self.parallel
        problem = plan.batch_problem(self.global_batch_size, self.micro_batch_size)
        if problem:
            raise ParallelPlanError(f"global_batch_size {problem}")
        return self.microbatches_per_step // plan.dp


@dataclass
class StepRecord:
    losses: list[float]
    grads: list[Piece]


# ---------------------------------------------------------------------------------------------
# Model, config and data
# ---------------------------------------------------------------------------------------------
def transformer_config(plan: TrainPlan, parallel: bool, config_class=None):
    """The plan's TransformerConfig; ``parallel=False`` gives the single-rank reference's."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs: dict[str, Any] = dict(
        num_layers=plan.num_layers,
        hidden_size=plan.hidden_size,
        num_attention_heads=plan.num_attention_heads,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        **CPU_SAFE_FIELDS,
    )
    if plan.num_moe_experts:
        kwargs.update(
            num_moe_experts=plan.num_moe_experts,
            moe_router_topk=2,
            moe_token_dispatcher_type="alltoall",
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=False,
        )
    if parallel:
        kwargs.update(
            tensor_model_parallel_size=plan.tp,
            pipeline_model_parallel_size=plan.pp,
            virtual_pipeline_model_parallel_size=plan.vpp,
            context_parallel_size=plan.cp,
            expert_model_parallel_size=plan.ep,
            sequence_parallel=plan.sequence_parallel,
        )
    cls = config_class or TransformerConfig
    if parallel and plan.schedule != "1f1b":
        # What switches the weight-gradient deferral on (a config class without the field
        # cannot defer: its W steps stay empty).
        if "pipeline_schedule" in {f.name for f in dataclasses.fields(cls)}:
            kwargs["pipeline_schedule"] = plan.schedule
    kwargs.update(plan.config_overrides)
    if parallel:
        kwargs.update(plan.parallel_overrides)
    return cls(**kwargs)


def gpt_model_factory(
    plan: TrainPlan, share_embeddings_and_output_weights: bool = True
) -> ModelFactory:
    """megatron-ext's GPTModel with the local layer spec (tied embeddings unless
    ``share_embeddings_and_output_weights`` is False, learned positions);
    the mHC layer spec when the config enables mHC. MoE and MLA models are built from the
    decoder block spec ``pretrain_gpt`` uses (dense and MoE layers by ``moe_layer_freq``)."""
    from megatron_ext.models.gpt import (
        GPTModel,
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )

    def build(config, pre_process: bool, post_process: bool, vp_stage: int | None):
        mhc = bool(getattr(config, "enable_mhc_connections", False))
        if plan.num_moe_experts or config.multi_latent_attention:
            spec = get_gpt_decoder_block_spec(
                config,
                use_transformer_engine=False,
                normalization=config.normalization,
                vp_stage=vp_stage,
                enable_mhc_connections=mhc,
            )
        else:
            spec = get_gpt_layer_local_spec(enable_mhc_connections=mhc)
        return GPTModel(
            config,
            spec,
            vocab_size=plan.vocab_size,
            max_sequence_length=plan.seq_length,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=share_embeddings_and_output_weights,
            position_embedding_type="rope" if config.multi_latent_attention else "learned_absolute",
            vp_stage=vp_stage,
        )

    return build


def make_microbatches(plan: TrainPlan, step: int) -> list[dict[str, torch.Tensor]]:
    """The step's whole global batch, identical on every rank (seeded by plan and step)."""
    generator = torch.Generator().manual_seed(plan.seed * 1000 + step)
    s, b = plan.seq_length, plan.micro_batch_size
    causal = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    batches = []
    for _ in range(plan.microbatches_per_step):
        tokens = torch.randint(0, plan.vocab_size, (b, s + 1), generator=generator)
        # Some masked-out tokens make the per-token normalisation matter.
        loss_mask = (torch.rand(b, s, generator=generator) > 0.1).float()
        if plan.loss_mask_zero_every:
            loss_mask[:, :: plan.loss_mask_zero_every] = 0.0
        batches.append(
            dict(
                tokens=tokens[:, :-1].contiguous(),
                labels=tokens[:, 1:].contiguous(),
                loss_mask=loss_mask,
                position_ids=torch.arange(s).unsqueeze(0).expand(b, s).contiguous(),
                attention_mask=causal,
            )
        )
    return batches


def split_for_context_parallel(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This CP rank's share of a micro-batch (megatron's ``get_batch_on_this_cp_rank``: the
    load-balanced chunks r and 2*cp-1-r); the batch itself when CP is off."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    cp_group = _context_parallel_group()
    if cp_group is None:
        return batch
    return get_batch_on_this_cp_rank(dict(batch), is_hybrid_cp=False, cp_group=cp_group)


def _context_parallel_group():
    """megatron's CP group when CP is on, else None (also where parallel_state is not set
    up, e.g. multi-module grids, which have no CP)."""
    from megatron.core import parallel_state as ps

    group = ps.get_context_parallel_group(check_initialized=False)
    return group if group is not None and group.size() > 1 else None


def masked_lm_loss(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron's pretrain_gpt loss: (sum of masked token losses, token count, report).

    The reported loss is the whole micro-batch's: under CP, loss sum and token count are
    summed over the CP group first (megatron's training loop sums the report over DP x CP).
    The returned loss stays this rank's; megatron's schedules and grad reduction combine it."""
    loss_sum, mask = masked_token_loss(loss_mask, output_tensor)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach(), mask.sum()])
    cp_group = _context_parallel_group()
    if cp_group is not None:
        dist.all_reduce(report, group=cp_group)
    return loss_sum, num_tokens, {"lm loss": (report[0] / report[1]).item()}


def gpt_forward_step(data_iterator, model):
    batch = split_for_context_parallel(next(data_iterator))
    output = model(
        batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
    )
    return output, partial(masked_lm_loss, batch["loss_mask"])


# ---------------------------------------------------------------------------------------------
# The reference
# ---------------------------------------------------------------------------------------------
@dataclass
class Reference:
    initial_weights: dict[str, torch.Tensor]
    losses: list[float]
    grads: list[dict[str, torch.Tensor]]
    final_weights: dict[str, torch.Tensor]


def schedule_function(plan: TrainPlan) -> Callable:
    """The forward-backward function for the current parallel state: megatron's choice, or
    megatron-ext's ZB-H1 when the plan asks for it and there is a pipeline (looked up on its
    module at call time, where the tracer wraps it)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if plan.schedule == "zb-h1" and ps.get_pipeline_model_parallel_world_size() > 1:
        from megatron_ext.pipeline import zero_bubble

        return zero_bubble.forward_backward_pipelining_zero_bubble_h1
    return get_forward_backward_func()


def forward_backward(plan: TrainPlan, forward_step, model: list, data, num_microbatches: int):
    """One step's forward and backward passes through the plan's schedule for ``model``
    (its chunks), at the plan's sequence length and micro-batch size; the schedule's reports."""
    return schedule_function(plan)(
        forward_step_func=forward_step,
        data_iterator=data,
        model=model,
        num_microbatches=num_microbatches,
        seq_length=plan.seq_length,
        micro_batch_size=plan.micro_batch_size,
        forward_only=False,
    )


def raise_differences(problems: list[str], error: type[Exception], reference: str) -> None:
    """Raise ``error`` listing the first 20 differences from ``reference`` (none: return)."""
    if not problems:
        return
    shown = "\n  ".join(problems[:20])
    more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
    raise error(f"{len(problems)} differences from {reference}:\n  {shown}{more}")


def run_reference(
    plan: TrainPlan, factory: ModelFactory, forward_step, config_class=None
) -> Reference:
    with model_parallel(seed=plan.seed):
        config = transformer_config(plan, parallel=False, config_class=config_class)
        model = factory(config, True, True, None)
        index = shard_index([model])
        initial = full_tensors(index, lambda p: p)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(
            params, lr=plan.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0
        )
        losses, grads = [], []
        for step in range(plan.steps):
            optimizer.zero_grad(set_to_none=False)
            microbatches = make_microbatches(plan, step)
            reports = forward_backward(
                plan, forward_step, [model], iter(microbatches), len(microbatches)
            )
            losses.append(sum(r["lm loss"] for r in reports) / len(reports))
            if config.calculate_per_token_loss:
                # What finalize_model_grads does in the sharded run: divide by all the tokens.
                tokens = torch.stack([batch["loss_mask"].sum() for batch in microbatches]).sum()
                for param in params:
                    assert param.grad is not None  # every parameter takes part in the loss
                    param.grad /= torch.clamp(tokens, min=1)
            grads.append(full_tensors(index, lambda p: p.grad))
            if plan.clip_grad > 0:
                torch.nn.utils.clip_grad_norm_(params, plan.clip_grad)
            optimizer.step()
        return Reference(initial, losses, grads, full_tensors(index, lambda p: p))


# ---------------------------------------------------------------------------------------------
# The sharded run
# ---------------------------------------------------------------------------------------------
def build_model_chunks(plan: TrainPlan, config, factory: ModelFactory) -> list[torch.nn.Module]:
    """One chunk per virtual stage, with megatron's pre/post-process rules."""
    from megatron.core import parallel_state as ps

    chunks = []
    for vp_stage in range(plan.vpp or 1):
        stage = vp_stage if plan.vpp else None
        chunks.append(
            factory(
                config,
                ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                stage,
            )
        )
    return chunks


def _gather_full_grad_buffers(ddp_chunks) -> None:
    """With the distributed optimizer each DP rank holds only its reduced shard of the
    grad buffer; all-gather the shards so every main_grad is the full reduced gradient."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    for chunk in ddp_chunks:
        for group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
            size = group.intra_distributed_optimizer_instance_size
            rank = group.intra_distributed_optimizer_instance_rank
            for bucket in group.buckets:
                shard = shard_buffer(bucket.grad_data, size)[rank].clone()
                dist.all_gather_into_tensor(
                    bucket.grad_data, shard, group=group.intra_distributed_optimizer_instance_group
                )


def build_sharded_training(
    plan: TrainPlan,
    factory: ModelFactory,
    config_class=None,
    initialise: Callable[[list], None] | None = None,
) -> tuple[Any, list, Any]:
    """The plan's model chunks wrapped in megatron's DDP and megatron's own optimizer (Adam,
    distributed or not, grad-norm clipping), wired as megatron's training loop wires them:
    (config, DDP chunks, optimizer). ``initialise(unwrapped chunks)`` sets the weights first.
    Call inside the plan's :func:`model_parallel`."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = transformer_config(plan, parallel=True, config_class=config_class)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=plan.use_distributed_optimizer,
        overlap_grad_reduce=plan.overlap_grad_reduce,
    )
    chunks = [
        DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=i > 0)
        for i, chunk in enumerate(build_model_chunks(plan, config, factory))
    ]
    if initialise is not None:
        initialise([chunk.module for chunk in chunks])
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=plan.lr,
            weight_decay=0.0,
            adam_beta1=0.9,
            adam_beta2=0.999,
            adam_eps=1e-8,
            clip_grad=plan.clip_grad,
            use_distributed_optimizer=plan.use_distributed_optimizer,
            params_dtype=torch.float32,
        ),
        chunks,
        # The default group already is gloo here; megatron's extra gloo groups are not made.
        use_gloo_process_groups=False,
    )
    config.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    return config, chunks, optimizer


def reports_are_mine() -> bool:
    """Whether this rank's schedule reports are the ones to count (last stage, first TP and
    CP rank: one report per micro-batch per DP rank)."""
    from megatron.core import parallel_state as ps

    return (
        ps.is_pipeline_last_stage()
        and ps.get_tensor_model_parallel_rank() == 0
        and ps.get_context_parallel_rank() == 0
    )


def sharded_forward_backward(plan: TrainPlan, forward_step, chunks: list, step: int) -> list:
    """Step ``step``'s forward and backward on this DP rank's share of the global batch, the
    grad buffers zeroed first (the optimizer step is the caller's); the schedule's reports."""
    from megatron.core import parallel_state as ps

    for chunk in chunks:
        chunk.zero_grad_buffer()
    n_local = plan.local_microbatches()
    dp_rank = ps.get_data_parallel_rank()
    mine = make_microbatches(plan, step)[dp_rank * n_local : (dp_rank + 1) * n_local]
    data = [iter(mine) for _ in chunks] if plan.vpp else iter(mine)
    return forward_backward(plan, forward_step, chunks, data, n_local)


def run_sharded(
    plan: TrainPlan,
    factory: ModelFactory,
    forward_step,
    initial_weights: dict[str, torch.Tensor],
    config_class=None,
    on_gradients: Callable[[int, list], None] | None = None,
) -> tuple[list[StepRecord], list[Piece]]:
    with model_parallel(plan.tp, plan.pp, plan.vpp, plan.cp, plan.ep, seed=plan.seed):
        index: list = []

        def place_initial_weights(modules: list) -> None:
            index.extend(shard_index(modules))
            load_full_weights(index, initial_weights)

        _, chunks, optimizer = build_sharded_training(
            plan, factory, config_class, place_initial_weights
        )
        counted = reports_are_mine()
        records = []
        for step in range(plan.steps):
            optimizer.zero_grad()
            reports = sharded_forward_backward(plan, forward_step, chunks, step)
            if plan.use_distributed_optimizer:
                _gather_full_grad_buffers(chunks)
            if on_gradients is not None:
                on_gradients(step, chunks)
            losses = [r["lm loss"] for r in reports] if counted else []
            # main_grad: megatron DDP's attribute (torch's Parameter type lacks it)
            pieces = local_pieces(index, lambda p: p.main_grad)  # type: ignore[attr-defined]
            records.append(StepRecord(losses, pieces))
            optimizer.step()
        return records, local_pieces(index, lambda p: p)


# ---------------------------------------------------------------------------------------------
# The comparison
# ---------------------------------------------------------------------------------------------
def _region_text(region) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in region) + "]"


def compare_pieces(
    what: str, gathered: list[list[Piece]], reference: dict[str, torch.Tensor], atol: float
) -> list[str]:
    """Check every rank's pieces against the reference and that together they cover it."""
    problems = []
    covered = {key: torch.zeros(value.shape, dtype=torch.bool) for key, value in reference.items()}
    for rank, pieces in enumerate(gathered):
        for key, shape, region, values in pieces:
            if key not in reference or tuple(reference[key].shape) != tuple(shape):
                problems.append(f"{what}: rank {rank} has {key} {shape}, unknown to the reference")
                continue
            slices = tuple(slice(a, b) for a, b in region)
            expected = reference[key][slices]
            error = (values - expected).abs().max().item() if values.numel() else 0.0
            if not error <= atol:
                problems.append(
                    f"{what}: {key}{_region_text(region)} on rank {rank} differs from the "
                    f"single-rank reference by {error:.3e} (atol {atol:.0e})"
                )
            covered[key][slices] = True
    for key, mask in covered.items():
        if not mask.all():
            problems.append(f"{what}: {key} is only partly covered by the sharded run")
    return problems


def forget_moe_metrics() -> None:
    """Empty megatron's process-wide MoE metrics tracker: it sizes each metric (the aux loss)
    by the first model's layer count and keeps the process groups it was given, so a later
    model with more layers in the same process would index past its end."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    get_moe_metrics_tracker().metrics.clear()


def check_equivalence(
    plan: TrainPlan,
    factory: ModelFactory | None = None,
    forward_step=gpt_forward_step,
    config_class=None,
    on_gradients: Callable[[int, list], None] | None = None,
) -> Reference:
    """Run the plan sharded and on one rank; raise :class:`EquivalenceError` on any
    difference in loss, gradients (every step) or final weights. Returns the reference."""
    factory = factory or gpt_model_factory(plan)
    forget_moe_metrics()
    reference = run_reference(plan, factory, forward_step, config_class)
    records, final_pieces = run_sharded(
        plan, factory, forward_step, reference.initial_weights, config_class, on_gradients
    )
    everything: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everything, (records, final_pieces))

    problems = []
    for step in range(plan.steps):
        losses = [loss for rank_records, _ in everything for loss in rank_records[step].losses]
        if len(losses) != plan.microbatches_per_step:
            problems.append(
                f"step {step}: {len(losses)} micro-batch losses reported, "
                f"expected {plan.microbatches_per_step}"
            )
        else:
            loss, expected = sum(losses) / len(losses), reference.losses[step]
            if abs(loss - expected) > plan.loss_rtol * abs(expected):
                problems.append(
                    f"step {step}: loss {loss:.8f} vs reference {expected:.8f} "
                    f"(rtol {plan.loss_rtol:.0e})"
                )
        problems += compare_pieces(
            f"step {step} gradient",
            [r[step].grads for r, _ in everything],
            reference.grads[step],
            plan.grad_atol,
        )
    problems += compare_pieces(
        f"weights after {plan.steps} steps",
        [final for _, final in everything],
        reference.final_weights,
        plan.param_atol,
    )
    raise_differences(problems, EquivalenceError, "the single-rank reference")
    return reference
