"""Sinkhorn-Knopp: doubly-stochastic output, exact gradients, a backward that keeps only M0,
and fp32 maths for bf16 inputs."""

import pytest
import torch

from megatron_ext.mhc.sinkhorn import (
    SinkhornKnopp,
    sinkhorn_forward_token_last,
    sinkhorn_knopp,
    sinkhorn_reference,
    sinkhorn_token_last,
)


def _logits(*shape, dtype=torch.float32, seed=0, scale=3.0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator, dtype=torch.float64) * scale).to(dtype)


def test_rows_and_columns_sum_to_one():
    # Unit-scale logits, as the mapping produces; much larger spreads need more iterations.
    projected = sinkhorn_knopp(_logits(5, 3, 4, 4, scale=1.0), iterations=20)
    assert projected.shape == (5, 3, 4, 4)
    assert (projected >= 0).all()
    torch.testing.assert_close(projected.sum(-1), torch.ones(5, 3, 4), atol=1e-4, rtol=0)
    torch.testing.assert_close(projected.sum(-2), torch.ones(5, 3, 4), atol=1e-4, rtol=0)


def test_equal_logits_give_the_uniform_matrix():
    projected = sinkhorn_knopp(torch.zeros(2, 3, 3), iterations=1)
    torch.testing.assert_close(projected, torch.full((2, 3, 3), 1 / 3))


def test_forward_matches_the_unrolled_loop():
    logits = _logits(7, 4, 4, seed=1)
    torch.testing.assert_close(sinkhorn_knopp(logits, 20), sinkhorn_reference(logits, 20))


def test_gradcheck_in_float64():
    logits = _logits(2, 3, 3, dtype=torch.float64, seed=2, scale=1.0).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: sinkhorn_knopp(x, 5), (logits,))


@pytest.mark.parametrize("iterations", [1, 3, 20])
def test_backward_matches_autograd_through_the_unrolled_loop(iterations):
    logits = _logits(6, 4, 4, dtype=torch.float64, seed=3)
    upstream = _logits(6, 4, 4, dtype=torch.float64, seed=4, scale=1.0)

    ours = logits.clone().requires_grad_(True)
    (sinkhorn_knopp(ours, iterations) * upstream).sum().backward()
    reference = logits.clone().requires_grad_(True)
    (sinkhorn_reference(reference, iterations) * upstream).sum().backward()

    torch.testing.assert_close(ours.grad, reference.grad, rtol=1e-9, atol=1e-12)


def _count_saved_tensors(fn, logits):
    saved = []

    def pack(tensor):
        saved.append(tensor.shape)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn(logits.clone().requires_grad_(True), 20)
    return len(saved)


def test_backward_keeps_only_m0_not_every_iteration():
    logits = _logits(4, 4, 4)
    assert _count_saved_tensors(sinkhorn_knopp, logits) <= 2
    # The same maths through plain autograd saves tensors per iteration; this is what the
    # autograd.Function avoids (and shows the counter can tell them apart).
    assert _count_saved_tensors(sinkhorn_reference, logits) >= 40


def test_bf16_input_is_computed_in_fp32_and_returned_in_bf16():
    logits = _logits(8, 4, 4, dtype=torch.bfloat16, seed=5).requires_grad_(True)
    projected = sinkhorn_knopp(logits, 20)
    assert projected.dtype == torch.bfloat16
    in_fp32 = sinkhorn_knopp(logits.detach().float(), 20)
    assert torch.equal(projected, in_fp32.to(torch.bfloat16))

    upstream = torch.randn(8, 4, 4)
    (projected.float() * upstream).sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    reference = logits.detach().float().requires_grad_(True)
    (sinkhorn_reference(reference, 20) * upstream.bfloat16().float()).sum().backward()
    torch.testing.assert_close(logits.grad.float(), reference.grad, rtol=2e-2, atol=1e-3)


def test_bf16_arithmetic_would_differ():
    """Guards the bf16 test above: the same loop run in bf16 does not give the fp32 answer."""
    logits = _logits(8, 4, 4, dtype=torch.bfloat16, seed=5)
    m = torch.exp(logits - logits.amax(-1, keepdim=True))
    for _ in range(20):
        m = m / m.sum(-1, keepdim=True)
        m = m / m.sum(-2, keepdim=True)
    assert not torch.equal(m, sinkhorn_knopp(logits, 20))


@pytest.mark.parametrize("iterations", [0, -1])
def test_iterations_below_one_are_rejected(iterations):
    with pytest.raises(ValueError, match="iterations"):
        sinkhorn_knopp(torch.zeros(2, 2), iterations)
    with pytest.raises(ValueError, match="iterations"):
        SinkhornKnopp.apply(torch.zeros(2, 2, requires_grad=True), iterations)


def test_token_last_sinkhorn_runs_on_contiguous_token_rows_whatever_the_input_layout():
    """The maps hand the Sinkhorn a transposed view of [T, n²+2n] logits (token dim strided).
    Every op would inherit that layout and run ~3× slower in a layer, so the view is copied
    once: the projection, M0 (what backward keeps) and the result are contiguous token rows."""
    n, tokens = 4, 64
    logits = _logits(tokens, n * n + 2 * n, seed=5)
    view = logits[:, 2 * n :].t().reshape(n, n, -1)
    assert not view.is_contiguous()

    projected, m0 = sinkhorn_forward_token_last(view, 20)
    assert projected.is_contiguous() and m0.is_contiguous()
    torch.testing.assert_close(projected, sinkhorn_forward_token_last(view.contiguous(), 20)[0])

    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        sinkhorn_token_last(view.clone().requires_grad_(True), 20)
    assert saved and all(tensor.is_contiguous() for tensor in saved)
