"""The lean native mHC path against the kept reference formulas (megatron_ext.mhc.reference):
gradchecks of its two hand-written Functions, and a whole mHC layer's output and every
gradient equal to the reference's at 1e-6 in fp32 (dropout included), within a stated
tolerance in bf16."""

import pytest
import torch

from megatron.core.transformer.spec_utils import build_module

from megatron_ext.mhc.lean import MergeStreams, StreamsIn
from megatron_ext.models.gpt import get_gpt_layer_local_spec
from megatron_ext.testing.configs import small_config
from megatron_ext.testing.distributed import model_parallel

pytestmark = pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC recompute")

N, H, S, B = 4, 16, 6, 2


def _float64(*shape, seed, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator, dtype=torch.float64) * scale).requires_grad_()


def test_streams_in_gradcheck_in_float64():
    n, h, tokens, m = 2, 3, 4, 2 * 2 + 2 * 2
    x3 = _float64(tokens, n, h, seed=0)
    weight, bias = _float64(m, n * h, seed=1, scale=0.7), _float64(m, seed=2, scale=0.5)
    assert torch.autograd.gradcheck(lambda *a: StreamsIn.apply(*a, n, 3), (x3, weight, bias))


def test_merge_streams_gradcheck_in_float64():
    n, h, tokens = 3, 4, 2
    mix, x3 = _float64(tokens, n, n, seed=3), _float64(tokens, n, h, seed=4)
    post, written = _float64(tokens, n, 1, seed=5), _float64(tokens, 1, h, seed=6)
    assert torch.autograd.gradcheck(MergeStreams.apply, (mix, x3, post, written))


def _layers(dtype, hidden_dropout=0.0, h_res_method="sinkhorn", variant="megatron"):
    config = small_config(
        mhc_h_res_method=h_res_method,
        mhc_variant=variant,
        num_layers=1,
        hidden_size=H,
        num_attention_heads=4,
        enable_mhc_connections=True,
        mhc_num_residual_streams=N,
        hidden_dropout=hidden_dropout,
    )

    def build():
        torch.manual_seed(0)
        spec = get_gpt_layer_local_spec(enable_mhc_connections=True)
        return build_module(spec, config=config, layer_number=1)

    lean, reference = build(), build()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # away from init, so gates, bias and every map matter
        for name, param in lean.named_parameters():
            if "hyper_connection" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    reference.load_state_dict(lean.state_dict())
    for module in reference.modules():
        if hasattr(module, "use_reference_path"):
            module.use_reference_path = True
    return lean.to(dtype), reference


def _run(layer, x, weights, seed=7):
    torch.manual_seed(seed)  # the same dropout masks for every layer
    x = x.detach().clone().requires_grad_(True)
    mask = torch.triu(torch.ones(1, 1, S, S, dtype=torch.bool), diagonal=1)
    output, _ = layer(x, attention_mask=mask)
    (output * weights.to(output.dtype)).sum().backward()
    grads = {name: p.grad.double() for name, p in layer.named_parameters()}
    return output.double(), x.grad.double(), grads


def _assert_close(ours, reference, tolerance, what):
    scale = reference.abs().max().clamp_min(1.0)
    error = (ours - reference).abs().max()
    assert error <= tolerance * scale, f"{what}: max error {error:.3g} (scale {scale:.3g})"


@pytest.mark.parametrize(
    "hidden_dropout, h_res_method, variant",
    [
        (0.0, "sinkhorn", "megatron"),
        (0.2, "sinkhorn", "megatron"),
        (0.0, "birkhoff", "megatron"),
        (0.2, "sinkhorn", "deepseek-v4"),
        (0.0, "birkhoff", "glm5"),
    ],
)
def test_layer_matches_the_reference_in_fp32(hidden_dropout, h_res_method, variant):
    """Output and input gradient equal the fp32 reference at 1e-6 of scale. Parameter
    gradients are long fp32 reductions (alpha_res sums ~10⁴ products), where the reduction
    order alone moves the last digits, so both the lean path and the fp32 reference are held
    to 2e-6 of the float64 reference's value."""
    with model_parallel(seed=3):
        lean, reference = _layers(torch.float32, hidden_dropout, h_res_method, variant)
        exact = _layers(torch.float32, hidden_dropout, h_res_method, variant)[1].double()
        generator = torch.Generator().manual_seed(2)
        x = torch.randn(S, B, N * H, generator=generator)
        weights = torch.randn(S, B, N * H, generator=generator)
        (out, grad_x, grads), (ref_out, ref_grad_x, ref_grads) = (
            _run(layer, x, weights) for layer in (lean, reference)
        )
        exact_out, exact_grad_x, exact_grads = _run(exact, x.double(), weights.double())
    _assert_close(out, ref_out, 1e-6, "output")
    _assert_close(grad_x, ref_grad_x, 1e-6, "input gradient")
    assert grads.keys() == ref_grads.keys() == exact_grads.keys()
    for name in grads:
        _assert_close(grads[name], exact_grads[name], 2e-6, f"lean {name}")
        _assert_close(ref_grads[name], exact_grads[name], 2e-6, f"reference {name}")
    _assert_close(out, exact_out, 1e-6, "output vs float64")
    _assert_close(grad_x, exact_grad_x, 1e-6, "input gradient vs float64")


def test_layer_in_bf16_stays_within_two_percent_of_the_fp32_reference():
    """bf16 streams: the maps are cast to bf16 for the batched matmuls (as upstream's fused
    path does), so the lean bf16 layer is compared to the fp32 reference at 2e-2 of scale."""
    with model_parallel(seed=3):
        lean, reference = _layers(torch.bfloat16)
        generator = torch.Generator().manual_seed(2)
        x = torch.randn(S, B, N * H, generator=generator)
        weights = torch.randn(S, B, N * H, generator=generator)
        out, grad_x, grads = _run(lean, x.bfloat16(), weights)
        ref_out, ref_grad_x, ref_grads = _run(reference, x.bfloat16().float(), weights)
        # weights are rounded to bf16 in the lean run; the difference is within tolerance
    _assert_close(out, ref_out, 2e-2, "output")
    _assert_close(grad_x, ref_grad_x, 2e-2, "input gradient")
    for name in grads:
        _assert_close(grads[name], ref_grads[name], 5e-2, name)
    # The tolerance can fail: bf16 rounding is visible at this size.
    assert (out - ref_out).abs().max() > 1e-6


def test_lean_sublayer_has_no_graph_breaks_for_torch_compile():
    """Maps + aggregate + merge of the lean path trace as ONE graph (torch._dynamo.explain):
    no .item(), no autograd.grad, nothing else that would split what torch.compile can fuse."""
    import torch._dynamo

    from megatron_ext.mhc.hyper_connection import HyperConnectionModule, merge_rows

    with model_parallel():
        config = small_config(
            num_layers=1,
            hidden_size=H,
            num_attention_heads=4,
            enable_mhc_connections=True,
            mhc_num_residual_streams=N,
            mhc_sinkhorn_iterations=3,
        )
        connection = HyperConnectionModule(config, layer_number=1)

        def sublayer(x, y, bias):
            aggregated, post, mix = connection.streams_in(x)
            return merge_rows(mix, x, post, aggregated + y, bias)

        x = torch.randn(S, B, N * H, requires_grad=True)
        explanation = torch._dynamo.explain(sublayer)(x, torch.randn(S, B, H), torch.randn(H))
    torch._dynamo.reset()
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
