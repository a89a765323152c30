"""Shared pieces of the ZB-H1 tests: plans, the 1F1B-vs-ZB-H1 comparison, the check that W
steps really computed deferred weight gradients, and the traced order against the theory."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch.distributed as dist

from megatron_ext.config import MHCTransformerConfig
from megatron_ext.pipeline import wgrad, zero_bubble
from megatron_ext.schedules.schedule import (
    Compute,
    ScheduleMismatch,
    SchedulePlan,
    assert_same_order,
    build_schedule,
)
from megatron_ext.schedules.trace import Tracer, tracing
from megatron_ext.testing.distributed import init_distributed, model_parallel
from megatron_ext.testing.equivalence import (
    TrainPlan,
    check_equivalence,
    gpt_forward_step,
    gpt_model_factory,
    run_reference,
    run_sharded,
)

STREAMS = 4
MHC_LR = 1e-4  # as mhc_pipeline_cases: Adam on rounding-noise gradients needs a small lr


def zb_plan(mhc: bool = True, **kwargs) -> TrainPlan:
    """A tiny ZB-H1 plan (hidden 16, sequence 8, 2 steps); ``mhc``: 4 residual streams."""
    overrides = dict(enable_mhc_connections=True, mhc_num_residual_streams=STREAMS) if mhc else {}
    overrides.update(kwargs.pop("config_overrides", {}))
    kwargs.setdefault("hidden_size", 16)
    kwargs.setdefault("num_attention_heads", 2)
    kwargs.setdefault("seq_length", 8)
    kwargs.setdefault("steps", 2)
    kwargs.setdefault("num_layers", 2 * kwargs.get("pp", 1))
    if mhc:
        kwargs.setdefault("lr", MHC_LR)
    return TrainPlan(schedule="zb-h1", config_overrides=overrides, **kwargs)


@dataclasses.dataclass
class WeightSteps:
    """What every W step found: (micro-batch, deferred before, still deferred after)."""

    seen: list[tuple[int, bool, bool]] = dataclasses.field(default_factory=list)

    def assert_every_w_computed_deferred_work(self, microbatches: int, steps: int) -> None:
        assert len(self.seen) == microbatches * steps, self.seen
        lazy = [mb for mb, before, _ in self.seen if not before]
        assert not lazy, f"W steps of micro-batches {lazy} found no deferred weight gradient"
        left = [mb for mb, _, after in self.seen if after]
        assert not left, f"W steps of micro-batches {left} left their weight gradients pending"


@contextlib.contextmanager
def watched_weight_steps(monkeypatch):
    """Record, for every W step, whether the micro-batch had deferred weight gradients before
    it and none after it (wgrad.pending())."""
    original = zero_bubble.weight_gradient_step
    record = WeightSteps()

    def watched(model_chunk, microbatch, config):
        before = microbatch in wgrad.pending()
        original(model_chunk, microbatch, config)
        record.seen.append((microbatch, before, microbatch in wgrad.pending()))

    monkeypatch.setattr(zero_bubble, "weight_gradient_step", watched)
    yield record


def check_zb(plan: TrainPlan, monkeypatch, **kwargs):
    """The ZB-H1 run matches the single-rank reference (loss, every gradient of every step,
    weights after the last), and its W steps ran real deferred weight gradients."""
    kwargs.setdefault("config_class", MHCTransformerConfig)
    with watched_weight_steps(monkeypatch) as steps:
        reference = check_equivalence(plan, **kwargs)
    steps.assert_every_w_computed_deferred_work(plan.local_microbatches(), plan.steps)
    return reference


def assert_same_as_1f1b(plan: TrainPlan, grad_atol: float = 0.0) -> None:
    """The ZB-H1 run and megatron's 1F1B run of the same plan from the same weights report the
    same losses and gradients at every step (within ``grad_atol``; 0: bit for bit)."""
    assert_runs_identical(
        dataclasses.replace(plan, schedule="1f1b"),
        dataclasses.replace(plan, schedule="zb-h1"),
        grad_atol,
    )


def assert_runs_identical(first: TrainPlan, second: TrainPlan, grad_atol: float = 0.0) -> None:
    """Two sharded runs of the same model from the same weights (``first``'s reference)
    report the same losses and gradients at every step (within ``grad_atol``; 0: bit for
    bit)."""
    factory = gpt_model_factory(first)
    reference = run_reference(first, factory, gpt_forward_step, MHCTransformerConfig)
    runs = []
    for plan in (first, second):
        records, _ = run_sharded(
            plan, factory, gpt_forward_step, reference.initial_weights, MHCTransformerConfig
        )
        runs.append(records)
    for step, (a, b) in enumerate(zip(*runs, strict=True)):
        assert a.losses == b.losses, (step, a.losses, b.losses)
        assert len(a.grads) == len(b.grads) > 0
        for (key, _, region, x), (key_b, _, region_b, y) in zip(a.grads, b.grads, strict=True):
            assert (key, region) == (key_b, region_b)
            error = (x - y).abs().max().item() if x.numel() else 0.0
            assert error <= grad_atol, f"step {step}: {key}{region} differs by {error:.3e}"


def traced_zb_run(plan: TrainPlan) -> Tracer:
    """One traced ZB-H1 iteration of ``plan`` (steps=1 recommended)."""
    init_distributed()
    factory = gpt_model_factory(plan)
    with model_parallel(seed=plan.seed):
        from megatron_ext.testing.equivalence import transformer_config
        from megatron_ext.testing.shards import full_tensors, shard_index

        config = transformer_config(plan, parallel=False, config_class=MHCTransformerConfig)
        weights = full_tensors(shard_index([factory(config, True, True, None)]), lambda p: p)
    tracer = Tracer()
    with tracing(tracer):
        run_sharded(plan, factory, gpt_forward_step, weights, MHCTransformerConfig)
    return tracer


def recorded_orders(plan: TrainPlan, tracer: Tracer) -> list:
    """Every pipeline rank's recorded steps of the first iteration (first DP/TP replica)."""
    from megatron.core import parallel_state as ps

    with model_parallel(plan.tp, plan.pp):
        pp_rank = ps.get_pipeline_model_parallel_rank()
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (pp_rank, tracer.steps(0)))
    by_rank: dict = {}
    for rank, steps in gathered:
        by_rank.setdefault(rank, steps)
    return [by_rank[r] for r in sorted(by_rank)]


def zb_schedule(plan: TrainPlan):
    return build_schedule(
        SchedulePlan(pp=plan.pp, microbatches=plan.local_microbatches(), schedule="zb-h1")
    )


def assert_traced_order_is_the_schedule(plan: TrainPlan) -> None:
    """The recorded order equals ZB-H1's derived steps, and is told apart from 1F1B's."""
    tracer = traced_zb_run(plan)
    recorded = recorded_orders(plan, tracer)
    assert_same_order(zb_schedule(plan), recorded)
    one_f_one_b = build_schedule(SchedulePlan(pp=plan.pp, microbatches=plan.local_microbatches()))
    with pytest.raises(ScheduleMismatch):
        assert_same_order(one_f_one_b, recorded)
    kinds = {step.kind for steps in recorded for step in steps if isinstance(step, Compute)}
    assert kinds == {"F", "B", "W"}, kinds
