"""Recorded pipeline orders of real runs against megatron-core's rules, on 4 ranks.

Each case trains one iteration of a tiny model with megatron-core's own schedule under
``tracing()`` and checks that every rank's recorded steps (passes, P2P calls and the
micro-batch/chunk of every message, received tensors labelled by the pass that consumed them)
equal :func:`build_schedule`'s, action for action. Batched P2P is on (megatron's default).
Run: torchrun --nproc_per_node 4 -m pytest tests/unit_tests/schedules/test_trace_4ranks.py"""

import pytest
import torch
import torch.distributed as dist

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
    gpt_forward_step,
    gpt_model_factory,
    run_sharded,
    transformer_config,
)
from megatron_ext.testing.shards import full_tensors, shard_index

pytestmark = [
    pytest.mark.world_size(4),
    pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC recompute"),
]


def initial_weights(plan, factory, config_class=None):
    with model_parallel(seed=plan.seed):
        model = factory(
            transformer_config(plan, parallel=False, config_class=config_class), True, True, None
        )
        return full_tensors(shard_index([model]), lambda p: p)


def pipeline_rank_and_dp(plan):
    """This rank's pipeline rank, and whether it is the first (tp, dp) replica of its stage."""
    from megatron.core import parallel_state as ps

    with model_parallel(plan.tp, plan.pp, plan.vpp):
        return ps.get_pipeline_model_parallel_rank()


def traced_run(plan, factory=None, forward_step=gpt_forward_step, config_class=None, tracer=None):
    init_distributed()
    factory = factory or gpt_model_factory(plan)
    weights = initial_weights(plan, factory, config_class)
    tracer = tracer or Tracer()
    with tracing(tracer):
        records, _ = run_sharded(plan, factory, forward_step, weights, config_class)
    return tracer, records, weights


def all_steps(tracer, plan):
    """Every pipeline rank's recorded steps (from the first data-parallel replica), as
    gathered on every rank."""
    rank = pipeline_rank_and_dp(plan)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (rank, tracer.steps(0)))
    by_pipeline_rank = {}
    for pp_rank, steps in gathered:
        by_pipeline_rank.setdefault(pp_rank, steps)
    return [by_pipeline_rank[r] for r in sorted(by_pipeline_rank)]


def check_against_theory(plan, tracer):
    local = plan.local_microbatches()
    schedule = build_schedule(
        SchedulePlan(pp=plan.pp, vpp=plan.vpp, microbatches=local, schedule=plan.schedule)
    )
    assert_same_order(schedule, all_steps(tracer, plan))
    return schedule


def tiny(**kwargs):
    kwargs.setdefault("hidden_size", 16)
    kwargs.setdefault("num_attention_heads", 2)
    kwargs.setdefault("seq_length", 8)
    kwargs.setdefault("steps", 1)
    return TrainPlan(**kwargs)


@pytest.mark.parametrize(
    "layout",
    [
        dict(pp=2, num_layers=2, global_batch_size=16),
        dict(pp=4, num_layers=4, global_batch_size=12),
        dict(pp=4, vpp=2, num_layers=8, global_batch_size=8),
    ],
    ids=["pp2_1f1b_dp2", "pp4_1f1b", "pp4_vpp2"],
)
def test_recorded_order_equals_megatrons_rules(layout):
    plan = tiny(**layout)
    tracer, _, _ = traced_run(plan)
    schedule = check_against_theory(plan, tracer)
    # Every pass was timed.
    assert all(e.end_ns >= e.start_ns > 0 for e in tracer.events)
    passes = [s for s in tracer.steps(0) if isinstance(s, Compute)]
    assert (
        len(passes) == 2 * plan.local_microbatches() * (plan.vpp or 1) == len(schedule.computes(0))
    )


def test_pp2_vpp2_order_and_tracing_changes_no_number():
    """Interleaved PP=2 x VPP=2 (DP=2): the order matches, and the traced run's losses and
    every gradient are bit-identical to an untraced run of the same plan."""
    plan = tiny(pp=2, vpp=2, num_layers=4, global_batch_size=16)
    factory = gpt_model_factory(plan)
    tracer, traced, weights = traced_run(plan, factory)
    plain, _ = run_sharded(plan, factory, gpt_forward_step, weights)
    check_against_theory(plan, tracer)
    assert traced[0].losses == plain[0].losses
    assert len(traced[0].grads) == len(plain[0].grads) > 0
    for (key, _, _region, a), (key_b, _, _, b) in zip(traced[0].grads, plain[0].grads, strict=True):
        assert key == key_b and torch.equal(a, b), key


def test_a_wrong_theoretical_order_is_caught():
    """Give rank 0 no warm-up (one forward fewer before its first backward than megatron
    runs): the recorded order of the real run no longer matches, and the error names the
    rank and the step."""
    plan = tiny(pp=2, num_layers=2, global_batch_size=16)
    tracer, _, _ = traced_run(plan)
    recorded = all_steps(tracer, plan)
    from megatron_ext.schedules.schedule import Schedule, one_f_one_b

    right = build_schedule(SchedulePlan(pp=2, microbatches=4))
    wrong = Schedule(
        right.plan,
        [one_f_one_b(4, 0, True, False), right.ranks[1]],
        right.prev_ranks,
        right.next_ranks,
    )
    assert_same_order(right, recorded)
    with pytest.raises(
        ScheduleMismatch,
        match=r"rank 0, step 2: expected send_forward_recv_backward\(sF0\+rB0\), got send_forward\(sF0\)",
    ):
        assert_same_order(wrong, recorded)


def test_zb_h1_pp4_order_with_w_steps_and_a_wrong_theory_caught():
    """megatron-ext's ZB-H1 at PP=4 with mHC, 6 micro-batches: every rank's recorded order,
    its W steps included, is build_schedule's; 1F1B's order, or ZB-H1 with rank 2 keeping
    up to 3 W pending, is caught at the first step that differs."""
    from megatron_ext.config import MHCTransformerConfig
    from megatron_ext.schedules.schedule import Schedule, zero_bubble_h1

    plan = tiny(
        pp=4,
        num_layers=4,
        global_batch_size=12,
        schedule="zb-h1",
        config_overrides=dict(enable_mhc_connections=True, mhc_num_residual_streams=2),
    )
    tracer, _, _ = traced_run(plan, config_class=MHCTransformerConfig)
    right = check_against_theory(plan, tracer)
    recorded = all_steps(tracer, plan)
    weights = [[s for s in steps if isinstance(s, Compute) and s.kind == "W"] for steps in recorded]
    assert [sorted(w.microbatch for w in ws) for ws in weights] == [list(range(6))] * 4
    assert all(e.end_ns >= e.start_ns > 0 for e in tracer.events if e.kind == "W")
    with pytest.raises(
        ScheduleMismatch,
        match=r"rank 0, step 13: expected send_backward_recv_forward\(-\), got send_backward\(-\)",
    ):
        assert_same_order(build_schedule(SchedulePlan(pp=4, microbatches=6)), recorded)
    greedy = Schedule(
        right.plan,
        right.ranks[:2] + [zero_bubble_h1(6, 1, False, False, pending_limit=3)] + right.ranks[3:],
        right.prev_ranks,
        right.next_ranks,
    )
    with pytest.raises(
        ScheduleMismatch,
        match=r"^rank 2, step 15: expected send_backward_recv_forward\(rF4\+sB2\), got send_backward\(sB2\)",
    ):
        assert_same_order(greedy, recorded)


def test_mhc_hybrid_with_an_empty_chunk():
    """mHC Hybrid over PP=2 x VPP=2 with an empty intermediate chunk (DP=2)."""
    from megatron_ext.config import MHCTransformerConfig
    from megatron_ext.testing.hybrid import hybrid_forward_step, hybrid_model_factory, hybrid_plan

    pattern = "*-||*-|*-"
    plan = hybrid_plan(
        pattern,
        pp=2,
        vpp=2,
        hidden_size=16,
        num_attention_heads=2,
        seq_length=8,
        steps=1,
        global_batch_size=16,
        config_overrides=dict(
            enable_mhc_connections=True,
            mhc_num_residual_streams=2,
            deallocate_pipeline_outputs=True,
        ),
    )
    tracer, _, _ = traced_run(
        plan, hybrid_model_factory(plan, pattern), hybrid_forward_step, MHCTransformerConfig
    )
    check_against_theory(plan, tracer)


def test_multimodule_encoders_of_different_depths():
    """Encoder a (PP1, rank 0) and encoder b (PP2, ranks 1-2) feed a language model (rank 3):
    every rank runs 1F1B with the builder's own warm-up (1, 2, 1, 0; megatron's global rule
    would give rank 0 two and deadlock), and the recorded order
    equals the theory's for every world rank."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "multimodule"))
    from multimodule_cases import encoder, language_model, make_plan  # noqa: E402

    from megatron_ext.multimodule import ModulePlan as M, vlm
    from megatron_ext.testing.multimodule import PipelineRun, run_pipeline

    modules = {"a": M(), "b": M(pp=2, first_rank=1), "llm": M(first_rank=3)}
    topology = {"a": ["llm"], "b": ["llm"]}
    plan = make_plan(modules, topology)
    impls = {"a": encoder(layers=1), "b": encoder(), "llm": language_model()}
    data = vlm.VLMData("llm", {"a": 12, "b": 12}, image_lengths=(4,))
    run = PipelineRun(plan, impls, data, steps=1, num_microbatches=3)
    tracer = Tracer()
    with tracing(tracer):
        run_pipeline(run)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, tracer.steps(0))
    schedule = build_schedule(SchedulePlan(microbatches=3, multimodule=plan))
    assert [plan.warmup_on(r) for r in range(4)] == [1, 2, 1, 0]
    assert_same_order(schedule, gathered)


def test_a_failing_shape_check_names_the_step_on_every_rank():
    """The encoder's first stage hands a [s, b, 1] tensor to its second stage (multi-module
    ambiguous-shape guard). Under tracing every rank's error keeps its type and names where
    it stood: rank 0 in its first send, the others in the receive that got the abort marker."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "multimodule"))
    from multimodule_cases import encoder, language_model, last_dim_one, pipeline_only  # noqa: E402

    from megatron_ext.multimodule import AmbiguousShapeError, ModulePlan as M

    modules = {"enc": M(pp=2), "llm": M(pp=2, first_rank=2)}
    impls = {"enc": encoder(forward=last_dim_one), "llm": language_model()}
    outcome = None
    with tracing(Tracer()):
        try:
            pipeline_only(modules, {"enc": ["llm"]}, impls)
        except AmbiguousShapeError as error:
            outcome = "\n".join(getattr(error, "__notes__", []))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, outcome)
    assert all(note is not None for note in everyone), everyone
    assert (
        "pipeline step: rank 0, module enc, step 2: send_forward(sF0) (iteration 0)" in everyone[0]
    )
    for rank, module in ((1, "enc"), (2, "llm"), (3, "llm")):
        assert (
            f"pipeline step: rank {rank}, module {module}, step 0: recv_forward(rF?)"
            in everyone[rank]
        ), everyone
