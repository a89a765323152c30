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


def test_norms_not_summed_over_tensor_parallel_are_caught(monkeypatch):
    """Why the local norm marks its parameters: without the mark, finalize_model_grads does
    not sum their partial SP gradients over TP, and the harness sees it."""
    from megatron_ext.models import norms
    from megatron_ext.testing.equivalence import EquivalenceError

    build = norms.LocalNorm.__new__

    def unmarked(cls, config, hidden_size, eps=1e-5, **kwargs):
        norm = build(cls, config, hidden_size, eps, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = False
        return norm

    monkeypatch.setattr(norms.LocalNorm, "__new__", unmarked)
    with pytest.raises(EquivalenceError, match=r"layer_norm_weight.*differs"):
        check_equivalence(TrainPlan(tp=2, pp=2, sequence_parallel=True, steps=1))
