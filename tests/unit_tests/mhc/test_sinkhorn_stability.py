"""Why H_res is projected: the product of many doubly-stochastic mixings stays doubly
stochastic (signal neither explodes nor vanishes across depth), while the product of the
raw exp(logits) blows up. Also: extreme logits stay finite, forward and backward."""

import itertools

import pytest
import torch

from megatron_ext.mhc.sinkhorn import sinkhorn_knopp

N = 4
DEPTH = 64


def _uniform_logits(*shape, bound, seed):
    generator = torch.Generator().manual_seed(seed)
    return (torch.rand(*shape, generator=generator) * 2 - 1) * bound


@pytest.mark.parametrize("bound", [10.0, 50.0])
def test_extreme_logits_stay_finite_with_finite_gradients(bound):
    logits = _uniform_logits(64, N, N, bound=bound, seed=0)
    logits[0] = bound  # a constant matrix at the edge
    logits[1, :, 0] = -bound  # a column at the bottom of the range
    logits.requires_grad_(True)
    projected = sinkhorn_knopp(logits, iterations=20)
    assert torch.isfinite(projected).all()
    assert ((projected >= 0) & (projected <= 1 + 1e-6)).all()
    weights = torch.randn(projected.shape, generator=torch.Generator().manual_seed(1))
    (projected * weights).sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_bf16_extreme_logits_stay_finite():
    logits = _uniform_logits(16, N, N, bound=50.0, seed=2).bfloat16().requires_grad_(True)
    projected = sinkhorn_knopp(logits, iterations=20)
    projected.float().sum().backward()
    assert torch.isfinite(projected.float()).all() and torch.isfinite(logits.grad.float()).all()


def test_product_of_64_projected_matrices_stays_doubly_stochastic():
    logits = _uniform_logits(DEPTH, N, N, bound=1.0, seed=3)
    product = torch.eye(N, dtype=torch.float64)
    for h_res in sinkhorn_knopp(logits, iterations=20).double():
        product = product @ h_res
        for sums in (product.sum(dim=0), product.sum(dim=1)):
            assert ((sums >= 0.99) & (sums <= 1.01)).all(), sums


def test_product_of_64_unprojected_matrices_grows_without_bound():
    logits = _uniform_logits(DEPTH, N, N, bound=1.0, seed=3).double()
    product = torch.eye(N, dtype=torch.float64)
    growth = []
    for raw in torch.exp(logits):
        product = product @ raw
        growth.append(product.sum(dim=1).max().item())
    # Every factor's row sums exceed 1 (|z| <= 1 gives entries near e^0 = 1, n = 4 of them),
    # so the largest row sum grows geometrically: past 1e30 after 64 layers, never shrinking.
    assert all(later > earlier for earlier, later in itertools.pairwise(growth))
    assert growth[-1] > 1e30
    assert growth[-1] / growth[DEPTH // 2] > 1e15


def test_gradient_where_the_clamp_engages_matches_autograd_through_the_loop():
    """A column at the bottom of the range sums to ~1e-44 < 1e-6: the clamp engages and must
    pass no gradient through that sum, exactly as autograd through clamp_min does."""
    from megatron_ext.mhc.sinkhorn import sinkhorn_reference

    logits = _uniform_logits(8, N, N, bound=50.0, seed=4).double()
    logits[:, :, 0] = -50.0
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(5)).double()
    ours = logits.clone().requires_grad_(True)
    (sinkhorn_knopp(ours, 20) * weights).sum().backward()
    reference = logits.clone().requires_grad_(True)
    (sinkhorn_reference(reference, 20) * weights).sum().backward()
    torch.testing.assert_close(ours.grad, reference.grad, rtol=1e-9, atol=1e-12)
