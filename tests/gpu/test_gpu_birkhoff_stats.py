"""mHC-lite's Birkhoff H_res (megatron_ext.mhc.birkhoff) and the mHC stability statistics
(megatron_ext.mhc.stats) on one CUDA device (marked ``gpu``, skipped without CUDA), each against
a CPU float64 computation. tests/unit_tests/mhc/test_birkhoff.py and test_mhc_stats.py check
the same on CPU; here the softmax, the GEMM against the permutation table and the analytic
backward run on CUDA kernels, in fp32 and from bf16 logits.

Tolerances are derived from the arithmetic (eps32 = 2^-23 relative, bf16 results rounded to
2^-8 relative); see each bound's comment."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC recompute"),
]

DEVICE = torch.device("cuda", 0)
TOKENS = 4096
STREAMS = [2, 4, 6]  # 6 is MAX_BIRKHOFF_STREAMS (720 permutations)
EPS32 = torch.finfo(torch.float32).eps


def _logits(n: int, dtype: torch.dtype, scale: float = 5.0) -> torch.Tensor:
    """[TOKENS, n!] logits at scale 5 (where Sinkhorn's row sums are visibly off), made on
    the CPU so every device draws the same numbers."""
    generator = torch.Generator().manual_seed(n)
    logits = torch.randn(TOKENS, math.factorial(n), generator=generator) * scale
    return logits.to(DEVICE, dtype)


@pytest.mark.parametrize("n", STREAMS)
def test_birkhoff_rows_and_columns_sum_to_one(n):
    from megatron_ext.mhc.birkhoff import birkhoff_mix

    h = birkhoff_mix(_logits(n, torch.float32), n)
    assert h.device.type == DEVICE.type and h.dtype == torch.float32
    assert h.shape == (TOKENS, n, n) and (h >= 0).all()
    # Each row/column sum is Σ_k w_k (every permutation matrix has one 1 per row and column),
    # exact in real arithmetic. In fp32: the softmax's weights sum to 1 within ~n! eps32, the
    # GEMM's sums of (n-1)! weights and the n-term row/column sum add at most ~(n! + n) eps32
    # more; 2 (n! + n) eps32 bounds both (n=4: 6.7e-6; Sinkhorn leaves up to 6e-2).
    bound = 2 * (math.factorial(n) + n) * EPS32
    row_err = (h.sum(-1) - 1).abs().max().item()
    col_err = (h.sum(-2) - 1).abs().max().item()
    assert row_err <= bound and col_err <= bound, (row_err, col_err, bound)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n", STREAMS)
def test_birkhoff_forward_and_backward_match_cpu_float64(n, dtype):
    from megatron_ext.mhc.birkhoff import birkhoff_mix, birkhoff_reference

    logits = _logits(n, dtype).requires_grad_()
    generator = torch.Generator().manual_seed(100 + n)
    grad_h = torch.randn(TOKENS, n, n, generator=generator).to(dtype)  # exact in either dtype
    h = birkhoff_mix(logits, n)
    h.backward(grad_h.to(DEVICE))
    assert h.dtype == dtype and logits.grad.dtype == dtype

    # The ground truth: the same logits (after their rounding to dtype) and output gradient,
    # plain autograd, float64, on the CPU.
    logits64 = logits.detach().cpu().double().requires_grad_()
    h64 = birkhoff_reference(logits64, n)
    h64.backward(grad_h.double())

    # fp32 arithmetic. H: entries in [0, 1], each a sum of (n-1)! softmax weights whose fp32
    # error is ~n! eps32 relative to their sum: 4 n! eps32 absolute (n=6: 3.4e-4, loose, yet
    # 10x below one bf16 ulp at 1). grad: w * (dw - Σ w dw), dw sums n output-gradient
    # entries (|dw| <= n max|grad_h|); the n!-term reduction Σ w dw carries ~n! eps32 of that.
    h_atol = 4 * math.factorial(n) * EPS32
    g_atol = h_atol * n * grad_h.abs().max().item()
    # bf16 in, bf16 out: on top, one rounding of the result to bf16, at most half an ulp
    # (2^-9 relative); 2^-8 leaves a factor 2.
    rtol = 2.0**-8 if dtype == torch.bfloat16 else 0.0
    torch.testing.assert_close(h.cpu().double(), h64.detach(), rtol=rtol, atol=h_atol)
    torch.testing.assert_close(logits.grad.cpu().double(), logits64.grad, rtol=rtol, atol=g_atol)
    assert logits64.grad.abs().max() > 1e-3  # the gradient being compared is not ~0


# ----------------------------------------------------------------------------- mHC stats
N, H, LAYERS, VOCAB, SEQ = 4, 64, 3, 64, 16


@pytest.fixture
def one_gpu_model_parallel():
    import megatron_ext
    from megatron_ext.testing.distributed import model_parallel

    megatron_ext.install()
    if DEVICE.type == "cuda":
        torch.cuda.set_device(DEVICE)
    with model_parallel(seed=2):
        yield


def _gpt(method: str):
    """A 3-layer GPT with mHC (n=4) on the device, its hyper-connection parameters drawn away
    from init so H_res is far from uniform."""
    from megatron_ext.models.gpt import GPTModel, get_gpt_layer_local_spec
    from megatron_ext.testing.configs import small_config

    config = small_config(
        num_layers=LAYERS,
        hidden_size=H,
        num_attention_heads=4,
        enable_mhc_connections=True,
        mhc_num_residual_streams=N,
        mhc_h_res_method=method,
    )
    torch.manual_seed(5)
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(enable_mhc_connections=True),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
    )
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "hyper_connection" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 2.0)
    return model.to(DEVICE)


def _forward(model) -> None:
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=generator).to(DEVICE)
    positions = torch.arange(SEQ, device=DEVICE).unsqueeze(0).expand(2, SEQ)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool, device=DEVICE), diagonal=1)
    model.train()
    model(tokens, positions, mask)


def _float64_on_cpu(connection):
    """What reference_mappings reads of a hyper connection, as float64 CPU copies."""
    params = {
        name: getattr(connection, name).detach().cpu().double()
        for name in ("alpha_pre", "alpha_post", "alpha_res", "bias")
    }
    return SimpleNamespace(
        n=connection.n,
        h_res_method=connection.h_res_method,
        sinkhorn_iterations=connection.sinkhorn_iterations,
        maps_form=connection.maps_form,
        mapping_proj=SimpleNamespace(weight=connection.mapping_proj.weight.detach().cpu().double()),
        **params,
    )


def _cpu_figures(inputs):
    """The figures recomputed on the CPU in float64 from the streams each connection saw."""
    from megatron_ext.mhc import stats
    from megatron_ext.mhc.reference import reference_mappings

    figures, operators = {}, []
    for connection, x in inputs:
        sample = x[: stats.SAMPLE_TOKENS, :1].cpu().double()
        h_pre, h_post, h_res = reference_mappings(_float64_on_cpu(connection), sample)
        h_pre, h_post, h_res = h_pre.reshape(-1, N), h_post.reshape(-1, N), h_res.reshape(-1, N, N)
        name = f"mhc/layer{connection.layer_number:02d}.{connection.stats_sublayer}"
        figures[f"{name}/h_res_row_err"] = (h_res.sum(-1) - 1).abs().max().item()
        figures[f"{name}/h_res_col_err"] = (h_res.sum(-2) - 1).abs().max().item()
        eye = torch.eye(N, dtype=h_res.dtype)
        figures[f"{name}/h_res_identity_dist"] = max(((m - eye) ** 2).sum().sqrt() for m in h_res)
        figures[f"{name}/h_res_uniform_dist"] = max(((m - 1 / N) ** 2).sum().sqrt() for m in h_res)
        figures[f"{name}/h_pre_min"], figures[f"{name}/h_pre_max"] = h_pre.min(), h_pre.max()
        figures[f"{name}/h_post_min"], figures[f"{name}/h_post_max"] = h_post.min(), h_post.max()
        figures[f"{name}/h_pre_sum_max"] = h_pre.sum(-1).max().item()
        figures[f"{name}/h_post_sum_max"] = h_post.sum(-1).max().item()
        rms = sample.reshape(-1, N, sample.shape[-1] // N).square().mean(-1).sqrt()
        figures[f"{name}/stream_rms_min"], figures[f"{name}/stream_rms_max"] = rms.min(), rms.max()
        operators.append(h_res.transpose(-1, -2))  # a sub-layer maps the streams by H_resᵀ
    composite = operators[0]
    for operator in operators[1:]:  # explicit products in layer order
        composite = torch.einsum("tij,tjk->tik", operator, composite)
    figures["mhc/forward_gain"] = composite.abs().sum(-1).max().item()
    figures["mhc/backward_gain"] = composite.abs().sum(-2).max().item()
    return {k: float(v) for k, v in figures.items()}


@pytest.mark.parametrize("method", ["birkhoff", "sinkhorn"])
def test_stats_on_cuda_match_a_cpu_float64_recomputation(
    one_gpu_model_parallel, monkeypatch, method
):
    from megatron_ext.mhc import HyperConnectionModule, stats

    inputs = []
    streams_in = HyperConnectionModule.streams_in

    def capturing(self, x):
        inputs.append((self, x.detach().clone()))
        return streams_in(self, x)

    monkeypatch.setattr(HyperConnectionModule, "streams_in", capturing)
    recorder = stats.enable()
    try:
        _forward(_gpt(method))
        figures = stats.collect(recorder)
    finally:
        stats.disable()
    assert len(inputs) == 2 * LAYERS
    assert all(x.device.type == DEVICE.type for _, x in inputs)
    # The maps the recorder took were computed on the device.
    samples = [s for _, s in recorder.samples.values()]
    assert samples and all(s.h_res.device.type == DEVICE.type for s in samples)

    expected = _cpu_figures(inputs)
    assert figures.keys() == expected.keys()
    # fp32 maps on CUDA against float64: each map is a few fp32 reductions over n*h = 256
    # terms (relative error ~1e-6), then 6 composed 4x4 operators (the gains); 1e-4 relative
    # (1e-5 absolute for the residuals, which are ~0 for birkhoff) has two decades of margin.
    for name, value in expected.items():
        assert figures[name] == pytest.approx(value, rel=1e-4, abs=1e-5), name
    if method == "birkhoff":  # doubly stochastic: composite gains are 1
        assert figures["mhc/forward_gain"] == pytest.approx(1.0, abs=1e-5)
        assert figures["mhc/backward_gain"] == pytest.approx(1.0, abs=1e-5)

    # stats.compose/gains on device tensors (what the figures use, on the CPU) agree too.
    ordered = [recorder.samples[id(c)][1].h_res for c, _ in inputs]
    on_device = stats.gains(stats.compose([h.transpose(-1, -2) for h in ordered]))
    on_cpu = stats.gains(stats.compose([h.cpu().transpose(-1, -2) for h in ordered]))
    for name, value in on_cpu.items():
        assert on_device[name] == pytest.approx(value, rel=1e-12), name
