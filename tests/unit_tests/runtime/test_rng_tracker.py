"""megatron's CUDA RNG tracker on the CPU runtime: the model-parallel stream differs across
tensor-parallel ranks, the default stream does not, and reseeding reproduces both."""

import pytest
import torch
import torch.distributed as dist

from megatron_ext.testing.distributed import model_parallel

pytestmark = pytest.mark.world_size(2)


def _draws(seed: int):
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    with model_parallel(tp=2, seed=seed):
        default = torch.rand(8)
        with get_cuda_rng_tracker().fork():
            tensor_parallel = torch.rand(8)
        dropout = torch.nn.functional.dropout(torch.ones(16), p=0.5, training=True)
        group = dist.group.WORLD
        gathered = [torch.empty(8) for _ in range(2)]
        dist.all_gather(gathered, tensor_parallel, group=group)
        default_gathered = [torch.empty(8) for _ in range(2)]
        dist.all_gather(default_gathered, default, group=group)
    return gathered, default_gathered, dropout


def test_tracker_streams_per_tensor_parallel_rank_and_reseeding_reproduces():
    tp_draws, default_draws, dropout = _draws(seed=42)
    assert not torch.equal(tp_draws[0], tp_draws[1]), (
        "TP ranks must draw different model-parallel streams"
    )
    assert torch.equal(default_draws[0], default_draws[1]), (
        "the default stream must agree across TP ranks"
    )
    tp_again, default_again, dropout_again = _draws(seed=42)
    assert all(torch.equal(a, b) for a, b in zip(tp_draws, tp_again, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(default_draws, default_again, strict=True))
    assert torch.equal(dropout, dropout_again)
