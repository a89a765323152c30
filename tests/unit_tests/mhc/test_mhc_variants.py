"""``mhc_variant`` deepseek-v4 / glm5 against the installed transformers modules (a reference
nobody here wrote): ``DeepseekV4HyperConnection`` / ``DeepseekV4HyperHead`` and GLM-5-Next's
``Glm5NextTextHyperConnection`` / ``Glm5NextTextHyperHead``, built from their configs (no
download) and given our weights by the parameter mapping fn = ``mapping_proj.weight``,
base = ``bias``, scale = ``[alpha_pre, alpha_post, alpha_res]``.

One sub-layer: maps, aggregation, a stand-in sub-layer F (the same fixed function on both
sides) and the merge ``post ⊗ F + combᵀ x``, as transformers' decoder layers compose them.
Forward and every gradient (streams, fn, base, scale, F's weight) are compared in float64 (to
round-off) and fp32, for n = 4 and 3 and several hidden sizes, on both our lean path and our
reference path."""

import contextlib

import pytest
import torch

from megatron_ext.mhc.hyper_connection import HyperConnectionModule, learned_contract
from megatron_ext.mhc.lean import StreamsIn
from megatron_ext.mhc.variants import (
    HC_EPS,
    SoftmaxSinkhornTokenLast,
    head_weight_eps,
    maps_form,
    softmax_sinkhorn_reference,
)
from megatron_ext.testing.configs import small_config
from megatron_ext.testing.distributed import model_parallel

pytestmark = pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC recompute")

S, B = 5, 2
RMS_EPS = 1e-6


def _transformers_connection(variant, n, hidden):
    if variant == "deepseek-v4":
        from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
            DeepseekV4HyperConnection,
        )

        config = DeepseekV4Config(hidden_size=hidden, hc_mult=n, rms_norm_eps=RMS_EPS)
        return DeepseekV4HyperConnection(config)
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextHyperConnection

    config = Glm5NextTextConfig(hidden_size=hidden, hc_mult=n, rms_norm_eps=RMS_EPS)
    return Glm5NextTextHyperConnection(config)


@contextlib.contextmanager
def _float64_kept():
    """transformers upcasts with ``.float()`` (fp32 maths under bf16); for the float64
    comparison that upcast keeps float64, so both sides compute in float64."""
    original = torch.Tensor.float
    torch.Tensor.float = lambda self, *a, **k: (
        self if self.dtype == torch.float64 else original(self, *a, **k)
    )
    try:
        yield
    finally:
        torch.Tensor.float = original


def _ours(variant, n, hidden, dtype, seed=0):
    config = small_config(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=1,
        enable_mhc_connections=True,
        mhc_num_residual_streams=n,
        mhc_variant=variant,
        layernorm_epsilon=RMS_EPS,
    )
    connection = HyperConnectionModule(config, layer_number=1)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # away from init: every map and both eps matter
        connection.mapping_proj.weight.copy_(
            torch.randn(connection.mapping_proj.weight.shape, generator=generator)
        )
        connection.bias.copy_(torch.randn(connection.bias.shape, generator=generator))
        for alpha in (connection.alpha_pre, connection.alpha_post, connection.alpha_res):
            alpha.copy_(torch.rand(1, generator=generator) + 0.5)
    return connection.to(dtype)


def _theirs_from(connection, variant):
    theirs = _transformers_connection(variant, connection.n, connection.hidden_size)
    scale = torch.cat([connection.alpha_pre, connection.alpha_post, connection.alpha_res])
    with torch.no_grad():
        theirs.fn.copy_(connection.mapping_proj.weight)
        theirs.base.copy_(connection.bias)
        theirs.scale.copy_(scale)
    return theirs.to(connection.bias.dtype)


def _sublayer(u, weight):
    return torch.tanh(u @ weight)


def _run_ours(connection, x, weight, reference):
    connection.use_reference_path = reference
    x = x.detach().clone().requires_grad_()
    weight = weight.detach().clone().requires_grad_()
    if reference:
        from megatron_ext.mhc.reference import reference_bias_dropout_add_streams

        aggregated, h_res, h_post = connection(x)
        y = _sublayer(aggregated, weight)
        out = reference_bias_dropout_add_streams(h_res, x, h_post, (y, None), 0.0, False)
    else:
        aggregated, post, mix = connection.streams_in(x)
        out = connection.merge_fn(mix, x, post, _sublayer(aggregated, weight), None)
    grads = _backward(out, connection.named_parameters(), x, weight)
    connection.zero_grad()
    return out, grads


def _run_theirs(theirs, x, weight, n):
    xt = x.detach().clone().transpose(0, 1).reshape(B, S, n, -1).requires_grad_()
    weight = weight.detach().clone().requires_grad_()
    post, comb, collapsed = theirs(xt)
    y = _sublayer(collapsed, weight)
    out = post.unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), xt)
    out = out.reshape(B, S, -1).transpose(0, 1)
    named = {"fn": theirs.fn, "base": theirs.base, "scale": theirs.scale}
    grads = _backward(out, named.items(), xt, weight)
    grads["x"] = grads["x"].reshape(B, S, -1).transpose(0, 1)
    return out, grads


def _backward(out, named_parameters, x, weight):
    generator = torch.Generator().manual_seed(5)
    probe = torch.randn(out.shape, generator=generator, dtype=torch.float64).to(out.dtype)
    (out * probe).sum().backward()
    grads = {name: p.grad.detach().clone() for name, p in named_parameters}
    grads.update(x=x.grad, weight=weight.grad)
    return grads


def _as_theirs(grads):
    """Our parameter gradients under transformers' names."""
    scale = torch.cat([grads["alpha_pre"], grads["alpha_post"], grads["alpha_res"]])
    return {
        "fn": grads["mapping_proj.weight"],
        "base": grads["bias"],
        "scale": scale,
        "x": grads["x"],
        "weight": grads["weight"],
    }


def _assert_close(ours, theirs, tolerance, what):
    scale = theirs.abs().max().clamp_min(1.0)
    error = (ours.double() - theirs.double()).abs().max()
    assert error <= tolerance * scale, f"{what}: max error {error:.3g} (scale {scale:.3g})"


CASES = [
    ("deepseek-v4", 4, 16),
    ("deepseek-v4", 3, 8),
    ("deepseek-v4", 4, 48),
    ("glm5", 4, 16),
    ("glm5", 3, 24),
]


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("variant, n, hidden", CASES)
def test_sublayer_matches_transformers_forward_and_every_gradient(
    variant, n, hidden, dtype, tolerance
):
    with model_parallel():
        connection = _ours(variant, n, hidden, dtype)
        theirs = _theirs_from(connection, variant)
        generator = torch.Generator().manual_seed(1)
        x = torch.randn(S, B, n * hidden, generator=generator, dtype=torch.float64).to(dtype)
        weight = (torch.randn(hidden, hidden, generator=generator, dtype=torch.float64) * 0.3).to(
            dtype
        )
        guard = _float64_kept() if dtype == torch.float64 else contextlib.nullcontext()
        with guard:
            out_theirs, grads_theirs = _run_theirs(theirs, x, weight, n)
        for reference in (False, True):
            path = "reference" if reference else "lean"
            out, grads = _run_ours(connection, x, weight, reference)
            _assert_close(out, out_theirs, tolerance, f"{path} output")
            ours = _as_theirs(grads)
            assert ours.keys() == grads_theirs.keys()
            for name, grad in grads_theirs.items():
                _assert_close(ours[name], grad, tolerance, f"{path} d{name}")


def test_the_megatron_variant_differs_from_transformers():
    """The comparison can fail: the default variant's maps are not DeepSeek-V4's."""
    with model_parallel():
        connection = _ours("deepseek-v4", 4, 16, torch.float64)
        theirs = _theirs_from(connection, "deepseek-v4")
        connection.maps_form = maps_form("megatron", RMS_EPS)
        x = torch.randn(S, B, 64, dtype=torch.float64)
        weight = torch.randn(16, 16, dtype=torch.float64) * 0.3
        with _float64_kept():
            out_theirs, _ = _run_theirs(theirs, x, weight, 4)
        out, _ = _run_ours(connection, x, weight, reference=False)
    assert (out - out_theirs).abs().max() > 1e-6


@pytest.mark.parametrize("n, hidden", [(4, 16), (3, 8)])
def test_deepseek_head_matches_transformers_hyper_head(n, hidden):
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperHead

    head = DeepseekV4HyperHead(
        DeepseekV4Config(hidden_size=hidden, hc_mult=n, rms_norm_eps=RMS_EPS)
    ).double()
    generator = torch.Generator().manual_seed(3)
    params = [
        torch.randn(n, n * hidden, generator=generator, dtype=torch.float64).requires_grad_(),
        torch.randn(n, generator=generator, dtype=torch.float64).requires_grad_(),
        (torch.rand(1, generator=generator, dtype=torch.float64) + 0.5).requires_grad_(),
    ]
    with torch.no_grad():
        for target, value in zip((head.hc_fn, head.hc_base, head.hc_scale), params, strict=True):
            target.copy_(value)
    x = torch.randn(S, B, n * hidden, generator=generator, dtype=torch.float64)
    x.requires_grad_()
    ours = learned_contract(x, *params, n, RMS_EPS, head_weight_eps("deepseek-v4", RMS_EPS))
    xt = x.detach().transpose(0, 1).reshape(B, S, n, hidden).requires_grad_()
    with _float64_kept():
        theirs = head(xt)
    probe = torch.randn(theirs.shape, generator=generator, dtype=torch.float64)
    (ours.transpose(0, 1) * probe).sum().backward()
    (theirs * probe).sum().backward()
    _assert_close(ours.transpose(0, 1), theirs, 1e-12, "head output")
    _assert_close(x.grad.transpose(0, 1).reshape(xt.shape), xt.grad, 1e-12, "head dx")
    for mine, name in zip(params, ("hc_fn", "hc_base", "hc_scale"), strict=True):
        _assert_close(mine.grad, getattr(head, name).grad, 1e-12, f"head d{name}")


def test_glm5_head_is_the_mean_of_transformers():
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextHyperHead

    from megatron_ext.mhc.hyper_connection import contract_mean

    x = torch.randn(S, B, 4 * 8, dtype=torch.float64)
    theirs = Glm5NextTextHyperHead()(x.view(S, B, 4, 8))
    torch.testing.assert_close(contract_mean(x, 4), theirs, rtol=0, atol=1e-15)


def test_softmax_sinkhorn_analytic_backward_equals_autograd():
    generator = torch.Generator().manual_seed(4)
    leaf = (torch.randn(3, 3, 7, generator=generator, dtype=torch.float64) * 2).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda z: SoftmaxSinkhornTokenLast.apply(z, 5), (leaf,), fast_mode=True
    )
    ours = SoftmaxSinkhornTokenLast.apply(leaf, 4)
    reference = softmax_sinkhorn_reference(leaf.permute(2, 0, 1), 4).permute(1, 2, 0)
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-15)


@pytest.mark.parametrize("method", ["sinkhorn", "birkhoff"])
def test_streams_in_with_the_deepseek_form_passes_gradcheck(method):
    n, h, tokens = 3, 2, 3
    width = 2 * n + (6 if method == "birkhoff" else n * n)
    generator = torch.Generator().manual_seed(6)

    def tensor(*shape, scale=1.0):
        value = torch.randn(*shape, generator=generator, dtype=torch.float64) * scale
        return value.requires_grad_()

    x3, weight, bias = tensor(tokens, n, h), tensor(width, n * h, scale=0.7), tensor(width)
    form = maps_form("deepseek-v4", 1e-5)

    def run(*args):
        return StreamsIn.apply(*args, n, 3, method, form)

    assert torch.autograd.gradcheck(run, (x3, weight, bias), fast_mode=True)


def test_h_pre_carries_hc_eps():
    with model_parallel():
        connection = _ours("deepseek-v4", 4, 8, torch.float64)
        with torch.no_grad():
            connection.bias[:4] = -1e3  # sigmoid underflows to 0: H_pre is eps
        h_pre, _, h_res = connection.compute_mappings(torch.randn(2, 1, 32, dtype=torch.float64))
    torch.testing.assert_close(h_pre, torch.full_like(h_pre, HC_EPS), rtol=1e-9, atol=0)
    # eps in every Sinkhorn denominator leaves the column sums a few eps short of 1
    torch.testing.assert_close(
        h_res.sum(-2), torch.ones(2, 1, 4, dtype=torch.float64), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(mhc_variant="deepseek-v3"), "mhc_variant must be one of megatron, deepseek-v4, glm5"),
        (dict(mhc_variant="glm5", use_fused_mhc=True), "'glm5' has no fused kernel"),
        (dict(mhc_variant="glm5", mhc_learned_output_contract=True), "GLM-5-Next has no hc_head"),
    ],
)
def test_guard_refuses_what_the_variant_cannot_do(fields, message):
    with pytest.raises(ValueError, match=message):
        small_config(
            num_layers=1,
            hidden_size=8,
            num_attention_heads=1,
            enable_mhc_connections=True,
            **fields,
        )
