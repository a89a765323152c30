"""Single-pass mHC on DeepSeek's maps against an independent transcription of upstream
Megatron-LM's single pass (``HyperConnectionModule._compute_single_pass_mappings``, PR #7500).

The transcription below is written from the published order of operations and epsilons, not
from megatron-ext's code: per site, the flattened streams are normalised by
``rsqrt(mean(x²) + eps)``, projected by fn, scaled and shifted (``scale``, ``base``); pre is
``σ(·) + hc_eps``, post ``2σ(·)``, comb ``softmax(·, -1) + hc_eps`` followed by a column
normalisation and ``iterations − 1`` × [row, column] (each denominator ``+ hc_eps``); the
site's input is the *previous* site's pre applied to its streams, in fp32; the streams become
``combᵀ x + post ⊗ F(input)``; the first site reads stream 0 (pre = e_0) and the output is the
last pre applied to the last streams. A chain of sites with stand-in sub-layers F is run
through megatron-ext's :func:`~megatron_ext.mhc.single_pass.single_pass_site` (lean and
reference paths) and compared, forward and every gradient, in float64 and fp32.
"""

import pytest
import torch

from megatron_ext.mhc.hyper_connection import HyperConnectionModule
from megatron_ext.mhc.single_pass import (
    SinglePassState,
    contract_with_pre_mix,
    initial_pre_mix,
    single_pass_site,
)
from megatron_ext.testing.configs import small_config
from megatron_ext.testing.distributed import model_parallel

pytestmark = pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC recompute")

S, B = 5, 2
RMS_EPS = 1e-6  # the model's RMSNorm eps (layernorm_epsilon)
UPSTREAM_HC_EPS = 1e-6  # upstream's mhc_epsilon default (DeepSeek-V4's hc_eps)
ITERATIONS = 20


# ----------------------------------------------------------------------------- transcription


def _upstream_comb(logits: torch.Tensor, iterations: int) -> torch.Tensor:
    """softmax over the last axis + eps, a column normalisation, then (iterations − 1) ×
    [row, column], every denominator + eps."""
    comb = torch.softmax(logits, dim=-1) + UPSTREAM_HC_EPS
    comb = comb / (comb.sum(dim=-2, keepdim=True) + UPSTREAM_HC_EPS)
    for _ in range(iterations - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + UPSTREAM_HC_EPS)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + UPSTREAM_HC_EPS)
    return comb


def _upstream_maps(streams: torch.Tensor, fn, base, scale, n: int):
    """(pre, post, comb) of one site from ``streams [T, n, D]``, in fp32 (float64 kept)."""
    compute = torch.promote_types(streams.dtype, torch.float32)
    flat = streams.reshape(streams.shape[0], -1).to(compute)
    mixes = (flat @ fn.to(compute).t()) * torch.rsqrt(
        flat.square().mean(-1, keepdim=True) + RMS_EPS
    )
    base, scale = base.to(compute), scale.to(compute)
    pre = torch.sigmoid(mixes[:, :n] * scale[0] + base[:n]) + UPSTREAM_HC_EPS
    post = 2.0 * torch.sigmoid(mixes[:, n : 2 * n] * scale[1] + base[n : 2 * n])
    comb_logits = (mixes[:, 2 * n :] * scale[2] + base[2 * n :]).view(-1, n, n)
    return pre, post, _upstream_comb(comb_logits, ITERATIONS)


def _upstream_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Σ_j pre[j]·x[j] in fp32, cast back to the activations' dtype."""
    compute = pre.dtype
    return (pre.unsqueeze(-1) * streams.to(compute)).sum(dim=-2).to(streams.dtype)


def upstream_single_pass(x: torch.Tensor, sites, sublayers, n: int) -> torch.Tensor:
    """``x [s, b, n*D]`` through the chain; returns the contracted ``[s, b, D]``."""
    lead = x.shape[:-1]
    streams = x.reshape(-1, n, x.shape[-1] // n)
    previous_pre = torch.zeros(
        streams.shape[0], n, dtype=torch.promote_types(x.dtype, torch.float32)
    )
    previous_pre[:, 0] = 1.0
    for (fn, base, scale), sublayer in zip(sites, sublayers, strict=True):
        pre, post, comb = _upstream_maps(streams, fn, base, scale, n)
        y = sublayer(_upstream_collapse(streams, previous_pre))
        mixed = torch.matmul(comb.transpose(-1, -2).to(x.dtype), streams)
        streams = mixed + post.to(x.dtype).unsqueeze(-1) * y.unsqueeze(-2)
        previous_pre = pre
    return _upstream_collapse(streams, previous_pre).view(*lead, -1)


# ----------------------------------------------------------------------------- megatron-ext


def _connections(variant: str, n: int, hidden: int, count: int, dtype):
    config = small_config(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=1,
        enable_mhc_connections=True,
        mhc_num_residual_streams=n,
        mhc_variant=variant,
        mhc_sinkhorn_iterations=ITERATIONS,
        layernorm_epsilon=RMS_EPS,
    )
    generator = torch.Generator().manual_seed(0)
    connections = []
    for site in range(count):
        connection = HyperConnectionModule(config, layer_number=site + 1)
        with torch.no_grad():  # away from init: every map and every eps matters
            weight = connection.mapping_proj.weight
            weight.copy_(torch.randn(weight.shape, generator=generator) * 0.5)
            connection.bias.copy_(torch.randn(connection.bias.shape, generator=generator))
            for alpha in (connection.alpha_pre, connection.alpha_post, connection.alpha_res):
                alpha.copy_(torch.rand(1, generator=generator) + 0.5)
        connections.append(connection.to(dtype))
    return connections


def _sublayer_weights(hidden: int, count: int, dtype):
    generator = torch.Generator().manual_seed(3)
    return [
        (torch.randn(hidden, hidden, generator=generator, dtype=torch.float64) * 0.3).to(dtype)
        for _ in range(count)
    ]


def _ours(connections, x, sublayers, reference: bool) -> torch.Tensor:
    state = SinglePassState(initial_pre_mix(x, connections[0].n))
    for connection, sublayer in zip(connections, sublayers, strict=True):
        connection.use_reference_path = reference
        layer_input, post, res = single_pass_site(connection, x, state)
        x = connection.merge_fn(res, x, post, sublayer(layer_input), None)
    return contract_with_pre_mix(x, state)


def _forward_and_grads(run, connections, x, weights):
    x = x.detach().clone().requires_grad_()
    weights = [w.detach().clone().requires_grad_() for w in weights]
    sublayers = [lambda u, w=w: torch.tanh(u @ w) for w in weights]
    out = run(x, sublayers)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    (out * probe.to(out.dtype)).sum().backward()
    grads = {"x": x.grad}
    grads.update({f"F{k}": w.grad for k, w in enumerate(weights)})
    for k, connection in enumerate(connections):
        for name, parameter in connection.named_parameters():
            grads[f"site{k}.{name}"] = parameter.grad.detach().clone()
        connection.zero_grad()
    return out.detach(), grads


def _upstream_params(connection):
    scale = torch.cat([connection.alpha_pre, connection.alpha_post, connection.alpha_res])
    return connection.mapping_proj.weight, connection.bias, scale


def _relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    scale = theirs.double().abs().max().clamp_min(1e-30)
    return float((ours.double() - theirs.double()).abs().max() / scale)


def _compare(variant, n, hidden, sites, dtype, reference):
    with model_parallel():
        connections = _connections(variant, n, hidden, sites, dtype)
        weights = _sublayer_weights(hidden, sites, dtype)
        x = torch.randn(S, B, n * hidden, generator=torch.Generator().manual_seed(1))
        x = x.to(torch.float64).to(dtype)

        def theirs(x, sublayers):
            params = [_upstream_params(c) for c in connections]
            return upstream_single_pass(x, params, sublayers, n)

        def ours(x, sublayers):
            return _ours(connections, x, sublayers, reference)

        out_theirs, grads_theirs = _forward_and_grads(theirs, connections, x, weights)
        out_ours, grads_ours = _forward_and_grads(ours, connections, x, weights)
    errors = {"output": _relative_error(out_ours, out_theirs)}
    assert grads_ours.keys() == grads_theirs.keys()
    errors.update(
        {name: _relative_error(grads_ours[name], grad) for name, grad in grads_theirs.items()}
    )
    return errors


CASES = [("deepseek-v4", 4, 16, 4), ("deepseek-v4", 3, 8, 5), ("glm5", 4, 24, 3)]


@pytest.mark.parametrize("reference", [False, True], ids=["lean", "reference"])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("variant, n, hidden, sites", CASES)
def test_single_pass_upstream_maps(variant, n, hidden, sites, dtype, tolerance, reference):
    """Forward and every gradient (streams, every site's fn/base/scale, every F) equal the
    transcription of upstream's single pass: float64 to 1e-12 relative, fp32 to 2e-5."""
    errors = _compare(variant, n, hidden, sites, dtype, reference)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= tolerance, f"{worst}: relative error {errors[worst]:.3g}"


def test_the_megatron_maps_are_not_upstreams_single_pass():
    """The comparison can fail: the default maps under the same order differ well above the
    float64 tolerance."""
    errors = _compare("megatron", 4, 16, 4, torch.float64, reference=False)
    assert errors["output"] > 1e-6, errors["output"]


def test_single_pass_aggregates_in_fp32_under_bf16():
    """A site's input is Σ pre·x computed in fp32 and rounded once to bf16 (upstream's
    order), not the bf16-rounded coefficients applied to the streams."""
    with model_parallel():
        (connection,) = _connections("deepseek-v4", 4, 16, 1, torch.float32)
        x = torch.randn(S, B, 4 * 16, generator=torch.Generator().manual_seed(2))
        x = x.to(torch.bfloat16)
        pre = torch.rand(S, B, 4, generator=torch.Generator().manual_seed(4)) + 0.3
        layer_input, _, _ = single_pass_site(connection, x, SinglePassState(pre.clone()))
        streams = x.float().view(S, B, 4, 16)
        expected = (pre.unsqueeze(-1) * streams).sum(-2).to(torch.bfloat16)
        assert torch.equal(layer_input, expected)
