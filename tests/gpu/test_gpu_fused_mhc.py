"""The fused mHC kernels on CUDA at real sizes (marked ``gpu``, skipped without CUDA): the same
parity checks as tests/unit_tests/mhc/test_fused_mhc.py (which runs them tiny, under Triton's
interpreter on CPU), at h=4096, n=4 and the default 20 Sinkhorn iterations. Tolerances: see
megatron_ext.testing.fused_parity."""

import pytest
import torch

from megatron_ext.testing import fused_parity

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TOKENS, STREAMS, HIDDEN = 4096, 4, 4096
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _needs_triton():
    pytest.importorskip("triton")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_streams_in_matches_lean_at_real_size(dtype):
    fused_parity.check_streams_in("cuda", dtype, TOKENS, STREAMS, HIDDEN, iterations=20)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_merge_matches_lean_at_real_size(dtype):
    fused_parity.check_merge("cuda", dtype, TOKENS, STREAMS, HIDDEN)


def test_streams_in_with_eight_streams_matches_lean():
    fused_parity.check_streams_in("cuda", torch.bfloat16, 1024, 8, 1024, iterations=20)


def test_merge_dropout_at_real_size():
    fused_parity.check_merge_dropout("cuda", TOKENS, STREAMS, HIDDEN)
