"""The fused mHC kernels (megatron_ext.mhc.fused) against the lean native path, at tiny sizes.

Without a GPU they run under Triton's interpreter, which tests/conftest.py switches on before
anything imports triton. With a GPU the same checks run on CUDA (tests/gpu repeats them at
real sizes). Tolerances: see megatron_ext.testing.fused_parity."""

import os

import pytest
import torch

from megatron_ext.testing import fused_parity

pytestmark = pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC recompute")

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def fused_device():
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not 1 (tests/conftest.py sets it)")
    return "cpu"


# 37 tokens: not a multiple of any token block; n=3 pads the n x n tiles to 4.
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_streams_in_matches_lean(fused_device, dtype):
    fused_parity.check_streams_in(fused_device, dtype, tokens=37, n=4, hidden=40, iterations=3)


# Every stream count the config accepts (1..MAX_FUSED_STREAMS), forward and backward, at 21
# tokens (not a power of two: one full token block and a partial one). n=3 once gave NaN
# gradients: the padding of the n x n tile grew by 1/eps per Sinkhorn backward iteration until
# inf (fp32 overflows after 7), so 8 iterations are enough to catch it and cheaper than 20.
@pytest.mark.parametrize("n", range(1, 9))
def test_every_stream_count_matches_lean(fused_device, n):
    from megatron_ext.mhc.fused import MAX_FUSED_STREAMS

    assert MAX_FUSED_STREAMS == 8, "extend the parametrization to the new maximum"
    fused_parity.check_streams_in(
        fused_device, torch.float32, tokens=21, n=n, hidden=48, iterations=8
    )
    fused_parity.check_merge(fused_device, torch.float32, tokens=21, n=n, hidden=48)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_merge_matches_lean(fused_device, dtype):
    fused_parity.check_merge(fused_device, dtype, tokens=37, n=4, hidden=72)


def test_merge_without_bias_matches_lean(fused_device):
    fused_parity.check_merge(
        fused_device, torch.float32, tokens=19, n=4, hidden=40, with_bias=False
    )


def test_merge_dropout_mask_is_consistent(fused_device):
    fused_parity.check_merge_dropout(fused_device, tokens=32, n=4, hidden=64)


def test_fused_layer_matches_lean_layer(fused_device):
    """A whole mHC layer built with use_fused_mhc=True: output and every gradient as the lean
    layer's (fp32, the default 20 Sinkhorn iterations)."""
    from megatron.core.transformer.spec_utils import build_module

    from megatron_ext.models.gpt import get_gpt_layer_local_spec
    from megatron_ext.testing.configs import small_config
    from megatron_ext.testing.distributed import model_parallel

    s, b, h, n = 6, 2, 32, 4

    def build(fused):
        config = small_config(
            num_layers=1,
            hidden_size=h,
            num_attention_heads=4,
            enable_mhc_connections=True,
            mhc_num_residual_streams=n,
            use_fused_mhc=fused,
        )
        torch.manual_seed(0)
        layer = build_module(
            get_gpt_layer_local_spec(enable_mhc_connections=True), config=config, layer_number=1
        )
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():  # away from init, so every map matters
            for name, param in layer.named_parameters():
                if "hyper_connection" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
        return layer.to(fused_device)

    results = []
    with model_parallel():
        for fused in (False, True):
            layer = build(fused)
            assert layer.mlp_hyper_connection.use_fused is fused
            x = torch.randn(s, b, n * h, generator=torch.Generator().manual_seed(2))
            x = x.to(fused_device).requires_grad_()
            mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
            out, _ = layer(x, attention_mask=mask.to(fused_device))
            grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
            out.backward(grad.to(fused_device))
            results.append([out.detach(), x.grad] + [p.grad for p in layer.parameters()])
    for k, (lean, fused) in enumerate(zip(*results)):
        fused_parity.assert_close(fused, lean, torch.float32, f"layer tensor {k}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_fused_functions_refuse_cpu_tensors_without_the_interpreter(monkeypatch):
    from megatron_ext.mhc.fused import fused_merge_rows

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.zeros(2, 1, 8)
    with pytest.raises(RuntimeError, match="use_fused_mhc=False"):
        fused_merge_rows(torch.zeros(2, 4, 4), x, torch.zeros(2, 4, 1), torch.zeros(2, 1, 2), None)
