"""``convert-checkpoint --source main``: upstream main mixes the streams with H_res, megatron-ext
with H_resᵀ, so the res rows ``2n + i*n + j`` and ``2n + j*n + i`` of every hyper connection's
``mapping_proj.weight`` and ``bias`` swap. Checked here on megatron-ext's own module (any
megatron-core): the converted module's res logits are the source's transposed, exactly, and
its H_res the transpose of the source's up to Sinkhorn convergence. The end-to-end move of a
checkpoint saved by upstream's own mHC model is tests/unit_tests/mcore_020/ (it needs
upstream's classes)."""

import pytest
import torch

from megatron_ext.checkpoint import convert
from megatron_ext.mhc.hyper_connection import HyperConnectionModule
from megatron_ext.testing.configs import small_config
from megatron_ext.testing.distributed import model_parallel

HIDDEN = 8


def _connection(n: int, seed: int, iterations: int = 20) -> HyperConnectionModule:
    torch.manual_seed(seed)
    config = small_config(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=2,
        enable_mhc_connections=True,
        mhc_num_residual_streams=n,
        mhc_sinkhorn_iterations=iterations,
    )
    module = HyperConnectionModule(config, layer_number=1)
    with torch.no_grad():  # non-trivial maps: the res logits far from their symmetric start
        module.bias.normal_()
        for name in ("alpha_pre", "alpha_post", "alpha_res"):
            getattr(module, name).fill_(0.5)
    return module


def _prefixed(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    head = "decoder.layers.0.self_attention_hyper_connection."
    return {head + k: v for k, v in module.state_dict().items()}


def _unprefixed(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.rsplit("hyper_connection.", 1)[1]: v for k, v in state.items()}


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_the_permutation_transposes_the_res_block_and_is_an_involution(n):
    order = convert.res_transposition(n * n + 2 * n)
    assert order[: 2 * n] == list(range(2 * n))
    res = torch.arange(n * n).reshape(n, n)
    assert torch.equal(torch.tensor(order[2 * n :]) - 2 * n, res.t().reshape(-1))
    assert [order[i] for i in order] == list(range(n * n + 2 * n))


@pytest.mark.parametrize("n", [3, 4])
def test_converted_logits_are_the_transpose_to_rounding_and_h_res_to_convergence(n):
    # The rows are moved exactly (tests above); a matrix product may still round a moved row
    # differently (CPU GEMM kernels block the output columns), so the logits agree to rounding.
    with model_parallel():
        source = _connection(n, seed=1)
        target = _connection(n, seed=2)
        converted = convert.transpose_main_res(_prefixed(source))
        target.load_state_dict(_unprefixed(converted))
        x = torch.randn(5, 2, n * HIDDEN)
        tokens = x.reshape(-1, n * HIDDEN)
        with torch.no_grad():
            z_source, z_target = source._mapping_logits(tokens), target._mapping_logits(tokens)
            pre_post = slice(0, 2 * n)
            exact_to_rounding = dict(atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(
                z_target[:, pre_post], z_source[:, pre_post], **exact_to_rounding
            )
            res_source = z_source[:, 2 * n :].reshape(-1, n, n)
            res_target = z_target[:, 2 * n :].reshape(-1, n, n)
            torch.testing.assert_close(res_target, res_source.transpose(1, 2), **exact_to_rounding)
            # Sinkhorn of the transpose = transpose of Sinkhorn, once it has converged.
            for module in (source, target):
                module.sinkhorn_iterations = 200
            h_res_source = source.compute_mappings(x)[2]
            h_res_target = target.compute_mappings(x)[2]
        torch.testing.assert_close(h_res_target, h_res_source.transpose(-1, -2), atol=1e-5, rtol=0)


def test_stacked_layers_and_optimizer_state_are_transposed_too():
    n, width = 2, 8
    weight = torch.arange(2 * width * HIDDEN, dtype=torch.float32).reshape(2, width, HIDDEN)
    bias = torch.arange(2 * width, dtype=torch.float32).reshape(2, width)
    state = {
        "decoder.layers.mlp_hyper_connection.mapping_proj.weight": weight,
        "optimizer.state.exp_avg.decoder.layers.mlp_hyper_connection.bias": bias,
        "decoder.layers.mlp_hyper_connection.alpha_res": torch.ones(2, 1),
    }
    from megatron_ext.checkpoint import torch_dist

    out = convert.transpose_main_res(state, torch_dist.parameter_name)
    order = convert.res_transposition(width)
    assert order == [0, 1, 2, 3, 4, 6, 5, 7] and n == 2
    assert torch.equal(
        out["decoder.layers.mlp_hyper_connection.mapping_proj.weight"], weight[:, order]
    )
    key = "optimizer.state.exp_avg.decoder.layers.mlp_hyper_connection.bias"
    assert torch.equal(out[key], bias[:, order])
    assert (
        out["decoder.layers.mlp_hyper_connection.alpha_res"]
        is state["decoder.layers.mlp_hyper_connection.alpha_res"]
    )


def test_a_width_that_is_not_sinkhorns_is_refused_naming_the_key():
    state = {"decoder.layers.0.mlp_hyper_connection.bias": torch.zeros(7)}
    with pytest.raises(convert.ConversionError, match="mlp_hyper_connection.bias: 7 logits"):
        convert.transpose_main_res(state)
