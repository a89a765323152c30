"""megatron_ext.parallel_plan: derived sizes and every problem at once, with values and the fix."""

import pytest

from megatron_ext.parallel_plan import ParallelPlan


def test_derived_sizes():
    plan = ParallelPlan(tp=2, pp=2, vpp=2, cp=2, world=16)
    assert (plan.model_parallel_size, plan.dp, plan.world_size, plan.model_chunks) == (8, 2, 16, 4)
    assert ParallelPlan(tp=2, dp_size=3).world_size == 6
    assert ParallelPlan().dp == 1 and ParallelPlan().world_size == 1


@pytest.mark.parametrize(
    "plan, divisor",
    [
        (ParallelPlan(), 1),
        (ParallelPlan(tp=4, sp=True), 4),  # SP splits the sequence over tp
        (ParallelPlan(tp=4, cp=2), 4),  # load-balanced CP: 2 * cp chunks
        (ParallelPlan(tp=4, cp=2, sp=True), 16),  # each CP chunk split again over tp
    ],
)
def test_seq_len_divisor(plan, divisor):
    assert plan.seq_len_divisor == divisor
    assert plan.seq_length_problem(divisor * 3) is None
    if divisor > 1:
        assert plan.seq_length_problem(divisor * 3 + 1)


def test_every_problem_at_once():
    problems = ParallelPlan(tp=1, sp=True, ep=3, dp_size=2, world=4).problems()
    assert [(p.where, p.what) for p in problems] == [
        (
            "world_size",
            "4 ranks, but tp(1) * pp(1) * cp(1) * dp(2) = 2; leave nproc null or change dp",
        ),
        ("sp", "sequence parallelism needs tp > 1 (megatron silently turns it off at tp=1)"),
        (
            "ep",
            "world size 4 is not divisible by the expert grid etp=tp(1) * ep(3) * pp(1) = 3 "
            "(megatron's expert tensor parallelism defaults to tp); set parallelism.dp to a "
            "multiple of 3 (world size 3), or change ep",
        ),
    ]
    assert [p.where for p in ParallelPlan(tp=0, vpp=0, dp_size=-1).problems()] == [
        "tp",
        "dp",
        "vpp",
    ]


def test_world_not_divisible_and_check_raises():
    with pytest.raises(
        ValueError, match=r"world size 6 is not divisible by tp\(4\)\*pp\(1\)\*cp\(1\)=4"
    ):
        ParallelPlan(tp=4, world=6).check()


def test_layers_and_batch():
    plan = ParallelPlan(pp=2, vpp=2, world=4)
    assert plan.layers_problem(8) is None
    assert plan.layers_problem(6) == "6 layers do not split over pp(2) * vpp(2) = 4 model chunks"
    assert plan.batch_problem(8, 2) is None
    assert plan.batch_problem(6, 2) == "6 is not a multiple of micro_batch_size(2) * dp(2)"
