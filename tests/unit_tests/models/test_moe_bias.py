"""MoE layers with a linear bias (megatron's default ``add_bias_linear=True``), single rank.

megatron-core 0.19.2's expert MLP adds its ``linear_fc2`` bias in place to an output that its
RowParallelLinear returns as a view at EP=1 and expert TP=1, which autograd refuses;
megatron_ext.models.linears makes the local specs' expert linear return the matmul's own tensor
there. Here: megatron's linear still has the problem (so the fix is still needed), ours gives
bit-identical values and gradients without it, GPT (with and without mHC) and Hybrid MoE
models with biases train, and shared experts with a bias are refused before any model is built.
The 2-rank comparisons with the single-rank reference are in
tests/unit_tests/pipeline/test_mhc_moe_mla_2ranks.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron.core import tensor_parallel

from megatron_ext.config import MHCTransformerConfig
from megatron_ext.guards import UnsupportedCombinationError
from megatron_ext.models import linears
from megatron_ext.testing.configs import small_config
from megatron_ext.testing.distributed import model_parallel
from megatron_ext.testing.equivalence import (
    TrainPlan,
    forget_moe_metrics,
    gpt_forward_step,
    gpt_model_factory,
    run_reference,
)
from megatron_ext.testing.hybrid import hybrid_forward_step, hybrid_model_factory, hybrid_plan

pytestmark = pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC")

IN, OUT, TOKENS = 12, 8, 5
IN_PLACE_ON_A_VIEW = "is a view and is being modified inplace"


def _expert_fc2(module, seed: int = 5):
    """An expert MLP's linear_fc2 (row-parallel, bias added by the caller) of ``module``."""
    config = small_config(num_layers=1, hidden_size=OUT, num_attention_heads=2)
    torch.manual_seed(seed)
    layer = module.RowParallelLinear(
        IN,
        OUT,
        config=config,
        init_method=lambda w: torch.nn.init.normal_(w, std=0.5),
        bias=True,
        input_is_parallel=True,
        skip_bias_add=True,
        is_expert=True,
    )
    with torch.no_grad():  # megatron zeroes biases; a zero bias would hide a wrong add
        layer.bias.normal_()
    return layer


def _expert_output(layer, tokens: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What megatron's MLP.forward does with an expert's fc2 output and per-token scale."""
    output, bias = layer(tokens)
    output += bias.unsqueeze(0) * scale.unsqueeze(-1)
    return output


def test_expert_linear_gives_megatrons_values_without_its_view():
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randn(TOKENS, IN, generator=generator)
    scale = torch.rand(TOKENS, generator=generator)
    grad = torch.randn(TOKENS, OUT, generator=generator)
    with model_parallel():
        core, ours = _expert_fc2(tensor_parallel), _expert_fc2(linears)
        assert not core.explicit_expert_comm  # megatron: a reduce over a one-rank group
        # megatron-core 0.19.2 fails here; when this stops raising, linears can go.
        with pytest.raises(RuntimeError, match=IN_PLACE_ON_A_VIEW):
            _expert_output(core, tokens, scale)

        results = []
        for layer, expert_scale in ((core, None), (ours, scale)):
            x = tokens.clone().requires_grad_()
            if expert_scale is None:  # megatron's own layer: the bias added out of place
                output, bias = layer(x)
                output = output + bias.unsqueeze(0) * scale.unsqueeze(-1)
            else:
                output = _expert_output(layer, x, expert_scale)
            output.backward(grad)
            results.append((output, x.grad, layer.weight.grad, layer.bias.grad))
    for name, core_value, our_value in zip(("output", "dx", "dw", "db"), *results, strict=True):
        assert torch.equal(core_value, our_value), name


def _assert_trains_with_expert_biases(reference) -> None:
    assert all(math.isfinite(loss) for loss in reference.losses), reference.losses
    for step, grads in enumerate(reference.grads):
        for key, grad in grads.items():
            assert torch.isfinite(grad).all(), f"step {step}: {key}"
        expert_biases = [k for k in grads if "experts" in k and k.endswith("linear_fc2.bias")]
        assert expert_biases, sorted(grads)
        assert all(grads[k].abs().sum() > 0 for k in expert_biases), expert_biases


@pytest.mark.parametrize(
    "mhc", [dict(enable_mhc_connections=True, mhc_num_residual_streams=4), {}], ids=["mhc4", "off"]
)
def test_gpt_moe_with_linear_bias_trains(mhc):
    overrides = dict(moe_layer_freq=[0, 1], moe_ffn_hidden_size=32, add_bias_linear=True, **mhc)
    plan = TrainPlan(
        num_layers=2, num_moe_experts=4, steps=2, global_batch_size=4, config_overrides=overrides
    )
    forget_moe_metrics()
    reference = run_reference(
        plan, gpt_model_factory(plan), gpt_forward_step, config_class=MHCTransformerConfig
    )
    _assert_trains_with_expert_biases(reference)


def test_hybrid_moe_with_linear_bias_and_mhc_trains():
    pattern = "*E"
    overrides = dict(add_bias_linear=True, enable_mhc_connections=True, mhc_num_residual_streams=4)
    plan = hybrid_plan(pattern, steps=2, global_batch_size=4, config_overrides=overrides)
    forget_moe_metrics()
    reference = run_reference(
        plan,
        hybrid_model_factory(plan, pattern),
        hybrid_forward_step,
        config_class=MHCTransformerConfig,
    )
    _assert_trains_with_expert_biases(reference)


def test_shared_experts_with_a_bias_are_refused_before_the_model_is_built():
    with pytest.raises(UnsupportedCombinationError, match="add_bias_linear=False") as caught:
        small_config(
            num_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            num_moe_experts=4,
            moe_shared_expert_intermediate_size=32,
            add_bias_linear=True,
        )
    assert "\n" not in str(caught.value)
