"""mHC-lite's H_res (megatron_ext.mhc.birkhoff): the mapping's float64 gradcheck against its
analytic backward, exact double stochasticity in fp32, the lean StreamsIn with the n!-wide res
block, the config refusals and the refusal to load a checkpoint of the other method."""

import math

import pytest
import torch

from megatron_ext.config import MHCTransformerConfig
from megatron_ext.mhc.birkhoff import birkhoff_mix, birkhoff_reference, permutation_table
from megatron_ext.mhc.hyper_connection import HyperConnectionModule
from megatron_ext.mhc.lean import StreamsIn
from megatron_ext.testing.configs import small_config

pytestmark = pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC recompute")


def _float64(*shape, seed, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator, dtype=torch.float64) * scale).requires_grad_()


def test_permutation_table_holds_every_permutation_matrix_once():
    table = permutation_table(4, torch.float64, "cpu").view(24, 4, 4)
    assert torch.equal(table.sum(dim=1), torch.ones(24, 4))
    assert torch.equal(table.sum(dim=2), torch.ones(24, 4))
    assert len({tuple(m.flatten().tolist()) for m in table}) == 24


@pytest.mark.parametrize("n", [2, 3, 4])
def test_mapping_gradcheck_in_float64(n):
    logits = _float64(2, 3, math.factorial(n), seed=n, scale=2.0)
    assert torch.autograd.gradcheck(lambda z: birkhoff_mix(z, n), (logits,))
    torch.testing.assert_close(birkhoff_mix(logits, n), birkhoff_reference(logits, n))


def test_streams_in_with_birkhoff_gradcheck_in_float64():
    n, h, tokens = 3, 2, 4
    x3 = _float64(tokens, n, h, seed=0)
    width = 2 * n + math.factorial(n)
    weight, bias = _float64(width, n * h, seed=1, scale=0.7), _float64(width, seed=2, scale=0.5)
    assert torch.autograd.gradcheck(
        lambda *a: StreamsIn.apply(*a, n, 1, "birkhoff"), (x3, weight, bias)
    )


@pytest.mark.parametrize("scale", [1.0, 30.0])
def test_rows_and_columns_sum_to_one_in_fp32(scale):
    """Exact to rounding at any logit scale (Sinkhorn is off by 0.6 at scale 30)."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4096, 24, generator=generator) * scale
    h = birkhoff_mix(logits, 4)
    assert h.dtype == torch.float32
    assert (h.sum(dim=-1) - 1).abs().max() <= 1e-6
    assert (h.sum(dim=-2) - 1).abs().max() <= 1e-6
    assert h.min() >= 0


def _config(**overrides):
    base = dict(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=2,
        enable_mhc_connections=True,
        mhc_num_residual_streams=3,
        mhc_h_res_method="birkhoff",
    )
    return small_config(**{**base, **overrides})


def test_parameter_shapes_are_n_factorial_wide():
    module = HyperConnectionModule(_config(), layer_number=1)
    assert module.mapping_proj.weight.shape == (6 + 6, 3 * 8)
    assert module.bias.shape == (12,)
    h_pre, h_post, h_res = module.compute_mappings(torch.randn(5, 2, 24))
    assert h_res.shape == (5, 2, 3, 3)
    assert (h_res.sum(-1) - 1).abs().max() <= 1e-6 and (h_res.sum(-2) - 1).abs().max() <= 1e-6


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(mhc_h_res_method="greedy"), "mhc_h_res_method must be one of sinkhorn, birkhoff"),
        (dict(mhc_num_residual_streams=7), "n! = 5040 projection columns"),
        (dict(use_fused_mhc=True), "birkhoff' has no fused kernel yet"),
    ],
)
def test_config_refuses_what_birkhoff_cannot_do(overrides, message):
    with pytest.raises(ValueError, match=message):
        _config(**overrides)


def test_config_default_is_sinkhorn():
    assert MHCTransformerConfig.__dataclass_fields__["mhc_h_res_method"].default == "sinkhorn"


def test_loading_the_other_methods_weights_is_refused_with_the_fix():
    birkhoff = HyperConnectionModule(_config(mhc_num_residual_streams=4), layer_number=1)
    sinkhorn = HyperConnectionModule(
        _config(mhc_num_residual_streams=4, mhc_h_res_method="sinkhorn"), layer_number=1
    )
    with pytest.raises(RuntimeError, match="--mhc-h-res-method sinkhorn"):
        birkhoff.load_state_dict(sinkhorn.state_dict())
    with pytest.raises(RuntimeError, match="--mhc-h-res-method birkhoff"):
        sinkhorn.load_state_dict(birkhoff.state_dict())


def test_a_hybrid_with_mtp_refuses_the_other_methods_weights_in_every_hyper_connection():
    """The refusal holds in the Hybrid stack (learned contraction) and in its MTP depth's
    hyper connections, which a model-level load reaches only after the decoder's: the MTP
    block alone is refused too, naming its own key."""
    from megatron_ext.config import MHCTransformerConfig
    from megatron_ext.testing.distributed import model_parallel
    from megatron_ext.testing.equivalence import transformer_config
    from megatron_ext.testing.hybrid import hybrid_model_factory, hybrid_plan

    pattern = "*-/*-"
    models = {}
    with model_parallel(seed=1):
        for method in ("sinkhorn", "birkhoff"):
            plan = hybrid_plan(
                pattern,
                config_overrides=dict(
                    enable_mhc_connections=True, mhc_num_residual_streams=3, mhc_h_res_method=method
                ),
            )
            config = transformer_config(plan, parallel=False, config_class=MHCTransformerConfig)
            models[method] = hybrid_model_factory(plan, pattern)(config, True, True, None)
    sinkhorn, birkhoff = models["sinkhorn"], models["birkhoff"]
    with pytest.raises(RuntimeError, match="--mhc-h-res-method sinkhorn"):
        birkhoff.load_state_dict(sinkhorn.state_dict())
    with pytest.raises(RuntimeError, match=r"^mtp_model_layer\.layers\.0\..*birkhoff"):
        sinkhorn.mtp.layers[0].load_state_dict(birkhoff.mtp.layers[0].state_dict())
