"""The mHC hyper connection: upstream's parameters, the maps' formulas and init values, the
H_resᵀ mixing orientation, expand/contract, and the n-stream bias-dropout-add."""

import math
import warnings

import pytest
import torch

from megatron_ext.config import MHCTransformerConfig
from megatron_ext.mhc import hyper_connection
from megatron_ext.mhc.hyper_connection import (
    HyperConnectionModule,
    aggregate,
    bias_dropout_add_streams,
    contract_mean,
    expand_output,
    expand_streams,
    learned_contract,
    mix_residual,
)

N, H = 4, 8  # streams, hidden size
S, B = 3, 2  # sequence, batch


def _config(**overrides):
    fields = dict(
        num_layers=2,
        hidden_size=H,
        num_attention_heads=2,
        enable_mhc_connections=True,
        mhc_num_residual_streams=N,
    )
    fields.update(overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the "consider 'mhc' recompute" hint
        return MHCTransformerConfig(**fields)


def _module(seed=0, **overrides):
    torch.manual_seed(seed)
    return HyperConnectionModule(_config(**overrides), layer_number=1)


def _streams(dtype=torch.float32, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(S, B, N * H, generator=generator).to(dtype)


def _randomise(module, seed=2):
    """Move the parameters away from init so every term of the formula matters."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return module


# ----------------------------------------------------------------------------- parameters


def test_parameter_names_and_shapes_match_upstream():
    shapes = {name: tuple(p.shape) for name, p in _module().named_parameters()}
    assert shapes == {
        "mapping_proj.weight": (N * N + 2 * N, N * H),
        "alpha_pre": (1,),
        "alpha_post": (1,),
        "alpha_res": (1,),
        "bias": (N * N + 2 * N,),
    }


def test_initial_values():
    module = _module(mhc_init_gating_factor=0.03)
    for name in ("alpha_pre", "alpha_post", "alpha_res"):
        assert torch.equal(getattr(module, name).detach(), torch.tensor([0.03])), name
    assert torch.equal(module.bias.detach(), torch.zeros(N * N + 2 * N))
    assert module.layer_number == 1


def test_mapping_proj_uses_xavier_uniform_only_when_initialization_is_on():
    fan_out, fan_in = N * N + 2 * N, N * H
    xavier_bound = math.sqrt(6.0 / (fan_in + fan_out))
    torch_default_bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform(a=√5) of nn.Linear
    xavier = _module(perform_initialization=True).mapping_proj.weight.abs().max().item()
    default = _module(perform_initialization=False).mapping_proj.weight.abs().max().item()
    assert torch_default_bound < xavier <= xavier_bound
    assert default <= torch_default_bound


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_sequence_parallel_attribute_on_all_five_parameters(sequence_parallel):
    tp = 2 if sequence_parallel else 1
    module = _module(sequence_parallel=sequence_parallel, tensor_model_parallel_size=tp)
    params = dict(module.named_parameters())
    assert len(params) == 5
    for name, param in params.items():
        assert getattr(param, "sequence_parallel", False) is sequence_parallel, name


# ----------------------------------------------------------------------------- the maps


def _reference_mappings(module, x):
    """compute_mappings written out per token in float64."""
    x = x.double()
    weight = module.mapping_proj.weight.detach().double()
    bias = module.bias.detach().double()
    alphas = [module.alpha_pre.item()] * N + [module.alpha_post.item()] * N
    alphas += [module.alpha_res.item()] * (N * N)
    alphas = torch.tensor(alphas, dtype=torch.float64)
    r = 1.0 / (x.norm(dim=-1, keepdim=True) / math.sqrt(N * H) + 1e-6)
    z = r * (x @ weight.T) * alphas + bias
    h_pre = torch.sigmoid(z[..., :N])
    h_post = 2 * torch.sigmoid(z[..., N : 2 * N])
    m = torch.exp(z[..., 2 * N :].reshape(S, B, N, N))
    for _ in range(module.sinkhorn_iterations):
        m = m / m.sum(-1, keepdim=True)
        m = m / m.sum(-2, keepdim=True)
    return h_pre, h_post, m


def test_compute_mappings_follows_the_formula():
    module = _randomise(_module())
    x = _streams()
    for ours, reference in zip(
        module.compute_mappings(x), _reference_mappings(module, x), strict=True
    ):
        assert ours.dtype == torch.float32
        torch.testing.assert_close(ours.double(), reference, rtol=1e-5, atol=1e-6)


def test_maps_at_init_are_half_one_and_uniform():
    h_pre, h_post, h_res = _module().compute_mappings(_streams())
    assert h_pre.shape == (S, B, N) and h_post.shape == (S, B, N) and h_res.shape == (S, B, N, N)
    torch.testing.assert_close(h_pre, torch.full_like(h_pre, 0.5), atol=0.02, rtol=0)
    torch.testing.assert_close(h_post, torch.ones_like(h_post), atol=0.04, rtol=0)
    torch.testing.assert_close(h_res, torch.full_like(h_res, 1 / N), atol=0.01, rtol=0)


def test_h_res_is_doubly_stochastic():
    _, _, h_res = _randomise(_module()).compute_mappings(_streams())
    torch.testing.assert_close(h_res.sum(-1), torch.ones(S, B, N), atol=1e-4, rtol=0)
    torch.testing.assert_close(h_res.sum(-2), torch.ones(S, B, N), atol=1e-4, rtol=0)


def test_bf16_activations_keep_fp32_maps_and_bf16_outputs():
    module = _randomise(_module())
    x = _streams(torch.bfloat16)
    for from_bf16, from_fp32 in zip(
        module.compute_mappings(x), module.compute_mappings(x.float()), strict=True
    ):
        assert from_bf16.dtype == torch.float32
        assert torch.equal(from_bf16, from_fp32)
    aggregated, h_res, h_post = module(x)
    assert aggregated.dtype == torch.bfloat16
    assert mix_residual(x, h_res).dtype == torch.bfloat16
    assert h_res.dtype == h_post.dtype == torch.float32


def test_forward_returns_aggregate_h_res_and_h_post():
    module = _randomise(_module())
    x = _streams()
    aggregated, h_res, h_post = module(x)
    h_pre, expected_post, expected_res = module.compute_mappings(x)
    assert aggregated.shape == (S, B, H)
    torch.testing.assert_close(aggregated, aggregate(x, h_pre))
    torch.testing.assert_close(h_res, expected_res)
    torch.testing.assert_close(h_post, expected_post)


# ----------------------------------------------------------------------------- applying the maps


def _two_streams():
    """One token, n=2, h=2: stream 0 = [1, 2], stream 1 = [10, 20] (stream-major)."""
    return torch.tensor([[[1.0, 2.0, 10.0, 20.0]]])


def test_mix_residual_uses_the_transpose_of_h_res():
    h_res = torch.tensor([[[[0.9, 0.1], [0.2, 0.8]]]])
    # mixed_i = Σ_j H_res[j, i] x_j:
    #   mixed_0 = 0.9·[1, 2] + 0.2·[10, 20] = [2.9, 5.8]
    #   mixed_1 = 0.1·[1, 2] + 0.8·[10, 20] = [8.1, 16.2]
    # (H_res·x would give [1.9, 3.8] and [8.2, 16.4].)
    expected = torch.tensor([[[2.9, 5.8, 8.1, 16.2]]])
    torch.testing.assert_close(mix_residual(_two_streams(), h_res), expected)


def test_aggregate_weights_each_stream():
    h_pre = torch.tensor([[[0.5, 2.0]]])
    expected = torch.tensor([[[0.5 * 1 + 2 * 10, 0.5 * 2 + 2 * 20]]])
    torch.testing.assert_close(aggregate(_two_streams(), h_pre), expected)


def test_expand_output_scales_each_stream():
    h_post = torch.tensor([[[0.5, 2.0]]])
    y = torch.tensor([[[1.0, 2.0]]])
    torch.testing.assert_close(expand_output(y, h_post), torch.tensor([[[0.5, 1.0, 2.0, 4.0]]]))
    bias = torch.tensor([3.0, 4.0])
    torch.testing.assert_close(expand_output(bias, h_post), torch.tensor([[[1.5, 2.0, 6.0, 8.0]]]))


def test_class_exposes_the_map_helpers_and_upstream_spellings():
    assert HyperConnectionModule.aggregate is aggregate
    assert HyperConnectionModule.mix_residual is mix_residual
    assert HyperConnectionModule.expand_output is expand_output
    assert HyperConnectionModule.input_expand is expand_streams
    assert HyperConnectionModule.output_contract is contract_mean


# ----------------------------------------------------------------------------- expand / contract


def test_expand_is_stream_major_and_contract_mean_undoes_it():
    x = torch.randn(S, B, H)
    expanded = expand_streams(x, N)
    assert expanded.shape == (S, B, N * H) and expanded.is_contiguous()
    for i in range(N):
        assert torch.equal(expanded[..., i * H : (i + 1) * H], x)
    torch.testing.assert_close(contract_mean(expanded, N), x)


def test_contract_mean_averages_streams():
    torch.testing.assert_close(contract_mean(_two_streams(), 2), torch.tensor([[[5.5, 11.0]]]))


def test_stream_count_must_divide_the_width():
    with pytest.raises(ValueError, match="mhc_num_residual_streams=3"):
        contract_mean(_two_streams(), 3)


def _reference_learned_contract(x, head_fn, head_base, head_scale, n, eps):
    x, head_fn = x.double(), head_fn.double()
    out = torch.zeros(*x.shape[:-1], x.shape[-1] // n, dtype=torch.float64)
    for s in range(x.shape[0]):
        for b in range(x.shape[1]):
            token = x[s, b]
            rho = 1.0 / math.sqrt(token.pow(2).mean().item() + eps)
            for i in range(n):
                m_i = (head_fn[i] @ token).item() * rho
                w_i = 1 / (1 + math.exp(-(m_i * head_scale.item() + head_base[i].item()))) + eps
                out[s, b] += w_i * token.view(n, -1)[i]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_learned_contract_matches_a_hand_written_reference(dtype):
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(S, B, N * H, generator=generator).to(dtype)
    head_fn = torch.randn(N, N * H, generator=generator) * 0.3
    head_base = torch.randn(N, generator=generator)
    head_scale = torch.tensor([1.7])
    eps = 1e-5
    ours = learned_contract(x, head_fn, head_base, head_scale, N, eps)
    assert ours.shape == (S, B, H) and ours.dtype == dtype
    reference = _reference_learned_contract(x.float(), head_fn, head_base, head_scale, N, eps)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(ours.double(), reference, **tolerance)


# ----------------------------------------------------------------------------- bias-dropout-add


def test_bias_dropout_add_without_dropout_is_mix_plus_scaled_output():
    generator = torch.Generator().manual_seed(3)
    residual = _streams()
    h_res = torch.softmax(torch.randn(S, B, N, N, generator=generator), dim=-1)
    h_post = torch.rand(S, B, N, generator=generator) * 2
    y, bias = torch.randn(S, B, H, generator=generator), torch.randn(H, generator=generator)
    out = bias_dropout_add_streams(h_res, residual, h_post, (y, bias), 0.5, training=False)
    expected = mix_residual(residual, h_res) + expand_output(y + bias, h_post)
    torch.testing.assert_close(out, expected)
    no_bias = bias_dropout_add_streams(h_res, residual, h_post, (y, None), 0.0, training=True)
    torch.testing.assert_close(no_bias, mix_residual(residual, h_res) + expand_output(y, h_post))


def test_bias_dropout_add_drops_per_stream_element_through_megatron(monkeypatch):
    calls = []
    megatron_bda = hyper_connection.get_bias_dropout_add

    def spy(training, fused):
        calls.append((training, fused))
        return megatron_bda(training, fused)

    monkeypatch.setattr(hyper_connection, "get_bias_dropout_add", spy)
    residual = torch.zeros(S, B, N * H)  # so the output is exactly the dropped-out term
    h_res = torch.eye(N).expand(S, B, N, N)
    h_post = torch.ones(S, B, N)
    y = torch.ones(S, B, H)
    torch.manual_seed(0)
    out = bias_dropout_add_streams(h_res, residual, h_post, (y, None), 0.5, training=True)
    assert calls == [(True, False)]
    added = out.view(S, B, N, H)
    assert set(added.unique().tolist()) == {0.0, 2.0}  # kept elements are scaled by 1/(1-p)
    # Each stream gets its own mask: the copies of y are not dropped together.
    assert not all(torch.equal(added[:, :, 0], added[:, :, i]) for i in range(1, N))


def test_gradients_reach_all_five_parameters():
    module = _module()
    x = _streams().requires_grad_(True)
    aggregated, h_res, h_post = module(x)
    sublayer_out = torch.tanh(aggregated)
    out = bias_dropout_add_streams(h_res, x, h_post, (sublayer_out, None), 0.0, training=True)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    (out * weights).sum().backward()
    for name, param in module.named_parameters():
        assert param.grad is not None, name
        assert param.grad.abs().sum() > 0, name
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_gradcheck_of_the_whole_module_in_float64():
    """Maps, aggregation, mixing and write-back, differentiated w.r.t. the streams and all
    five parameters, against finite differences."""
    from megatron_ext.mhc.hyper_connection import bias_dropout_add_streams

    torch.manual_seed(0)
    module = HyperConnectionModule(
        _config(hidden_size=3, mhc_num_residual_streams=2, mhc_sinkhorn_iterations=4),
        layer_number=1,
    ).double()
    with torch.no_grad():
        module.bias.normal_(0, 0.5)  # away from the symmetric initial point
        for alpha in (module.alpha_pre, module.alpha_post, module.alpha_res):
            alpha.fill_(0.7)
    x = torch.randn(2, 1, 6, dtype=torch.float64, requires_grad=True)
    y = torch.randn(2, 1, 3, dtype=torch.float64, requires_grad=True)
    names = [name for name, _ in module.named_parameters()]

    def layer(x, y, *weights):
        aggregated, h_res, h_post = torch.func.functional_call(
            module, dict(zip(names, weights, strict=True)), (x,)
        )
        return aggregated, bias_dropout_add_streams(
            h_res, x, h_post, (y * aggregated, None), 0.0, False
        )

    weights = [p.detach().clone().requires_grad_(True) for p in module.parameters()]
    assert torch.autograd.gradcheck(layer, (x, y, *weights))
