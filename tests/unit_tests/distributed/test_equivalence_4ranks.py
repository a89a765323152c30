"""Sharded training steps on 4 ranks match the single-rank reference."""

import pytest

from megatron_ext.testing.equivalence import TrainPlan, check_equivalence

pytestmark = pytest.mark.world_size(4)


def test_tp2_pp2_sequence_parallel_matches_reference():
    check_equivalence(TrainPlan(tp=2, pp=2, sequence_parallel=True))


def test_tp2_pp2_vpp2_sequence_parallel_matches_reference():
    check_equivalence(TrainPlan(tp=2, pp=2, vpp=2, sequence_parallel=True))


def test_pp2_dp2_distributed_optimizer_matches_reference():
    check_equivalence(TrainPlan(pp=2, use_distributed_optimizer=True))
