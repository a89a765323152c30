"""Sharded training steps on 2 ranks match the single-rank reference (loss, every gradient
of every step, weights after 3 steps). Run: torchrun --nproc_per_node 2 -m pytest ..."""

import pytest

from megatron_ext import registry
from megatron_ext.testing.equivalence import EquivalenceError, TrainPlan, check_equivalence

pytestmark = pytest.mark.world_size(2)

BATCHED_P2P = "megatron.core.pipeline_parallel.p2p_communication:_batched_p2p_ops"


def test_pp2_1f1b_matches_reference():
    check_equivalence(TrainPlan(pp=2))


@pytest.mark.parametrize("batch_p2p_comm", [True, False])
def test_pp2_vpp2_interleaved_matches_reference(batch_p2p_comm):
    check_equivalence(TrainPlan(pp=2, vpp=2, config_overrides=dict(batch_p2p_comm=batch_p2p_comm)))


def test_dp2_distributed_optimizer_matches_reference():
    check_equivalence(TrainPlan(use_distributed_optimizer=True))


def test_ep2_moe_alltoall_matches_reference():
    # Biased experts trip an in-place-on-view autograd error in megatron-core's
    # SequentialMLP at TP=1; MoE models are trained without linear biases anyway.
    check_equivalence(
        TrainPlan(num_moe_experts=4, ep=2, config_overrides=dict(add_bias_linear=False))
    )


def test_a_perturbed_gradient_is_caught():
    """The harness must be able to fail: one gradient element off by 1e-3 on one rank."""

    def perturb(step, chunks):
        import torch.distributed as dist

        if step == 0 and dist.get_rank() == 0:
            param = next(
                p for n, p in chunks[0].module.named_parameters() if "linear_fc1.weight" in n
            )
            param.main_grad.view(-1)[0] += 1e-3

    with pytest.raises(
        EquivalenceError, match=r"step 0 gradient: decoder\.layers\.mlp\.linear_fc1\.weight"
    ):
        check_equivalence(TrainPlan(pp=2, steps=1), on_gradients=perturb)


def test_upstream_batched_p2p_order_corrupts_vpp_gradients():
    """Why the registry replaces _batched_p2p_ops: with megatron-core's own posting order a
    PP=2 x VPP=2 step with batch_p2p_comm=True differs from the reference."""
    import megatron_ext

    megatron_ext.install()
    with registry.suspended(BATCHED_P2P):
        with pytest.raises(EquivalenceError, match="loss"):
            check_equivalence(
                TrainPlan(pp=2, vpp=2, steps=1, config_overrides=dict(batch_p2p_comm=True))
            )
