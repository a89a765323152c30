"""megatron's "mlp" selective recompute with a linear bias (megatron's default) on the local
specs: megatron-core 0.19.2 hangs in the first backward (the checkpointed MLP returns the fc2
bias parameter itself, and autograd gives the parameter the CheckpointFunction as grad_fn);
megatron_ext.models.linears hands the bias back as a view. The recomputed run must train
exactly like the one without recompute."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.config import MHCTransformerConfig
from megatron_ext.testing.equivalence import (
    TrainPlan,
    gpt_forward_step,
    gpt_model_factory,
    run_reference,
)

pytestmark = pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC")


def _train(mhc: bool, **recompute):
    overrides = dict(add_bias_linear=True, **recompute)
    if mhc:
        overrides.update(enable_mhc_connections=True, mhc_num_residual_streams=3)
    plan = TrainPlan(
        hidden_size=16,
        num_attention_heads=2,
        seq_length=8,
        steps=2,
        num_layers=2,
        config_overrides=overrides,
    )
    return run_reference(
        plan, gpt_model_factory(plan), gpt_forward_step, config_class=MHCTransformerConfig
    )


@pytest.mark.parametrize("mhc", [False, True], ids=["plain", "mhc"])
def test_mlp_recompute_with_a_linear_bias_trains_like_no_recompute(mhc):
    plain = _train(mhc)
    recomputed = _train(mhc, recompute_granularity="selective", recompute_modules=["mlp"])
    assert recomputed.losses == plain.losses
    for step, (ours, theirs) in enumerate(zip(recomputed.grads, plain.grads, strict=True)):
        assert ours.keys() == theirs.keys()
        for name in ours:
            assert torch.equal(ours[name], theirs[name]), (step, name)
    assert any("linear_fc2.bias" in name for name in plain.grads[0])
