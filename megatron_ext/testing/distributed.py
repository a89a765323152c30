"""Process-group and model-parallel set-up for tests (one pytest session per rank).

Under ``torchrun`` every rank runs the same pytest session; each test enters
:func:`model_parallel` with the sizes it needs and leaves it torn down, like megatron-core's
``Utils.initialize_model_parallel``. Without torchrun the process is a world of one.
"""

from __future__ import annotations

import contextlib
import os
import socket
from datetime import timedelta
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megatron_ext import registry

# A rank that fails before a collective makes the others time out instead of hanging.
COLLECTIVE_TIMEOUT = timedelta(seconds=int(os.environ.get("MEGATRON_EXT_TEST_TIMEOUT_S", "180")))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed() -> None:
    """Initialise the default gloo group from torchrun's environment (or a world of one),
    switching the CPU runtime on where no GPU exists."""
    if not torch.cuda.is_available():
        from megatron_ext import runtime

        runtime.use_cpu()
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()),
        )
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend, timeout=COLLECTIVE_TIMEOUT)


def _live_process_groups() -> set:
    if not dist.is_initialized():
        return set()
    # torch's private map is the only registry of live groups.
    live = registry.private("torch.distributed.distributed_c10d:_world.pg_map")
    return set(live) - {dist.group.WORLD}


@contextlib.contextmanager
def releasing_new_process_groups() -> Iterator[None]:
    """Destroy the process groups created inside the block.

    megatron-core's ``destroy_model_parallel()`` only forgets its groups. A gloo group keeps its
    transport threads alive and waking, so a session that sets up model parallelism for test
    after test accumulates them: 40 set-ups in one process left ~2,400 threads that burned more
    than one of our two cores while idle (0.01 core once released). Destroying a gloo subgroup
    is local to the rank, so this needs no agreement between ranks.
    """
    before = _live_process_groups()
    try:
        yield
    finally:
        for group in _live_process_groups() - before:
            dist.destroy_process_group(group)


def world_size() -> int:
    return (
        dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    )


@contextlib.contextmanager
def model_parallel(
    tp: int = 1,
    pp: int = 1,
    vpp: Optional[int] = None,
    cp: int = 1,
    ep: int = 1,
    etp: Optional[int] = None,
    seed: int = 1234,
) -> Iterator[None]:
    """megatron-core's model-parallel state for one test; data parallel takes the rest. Its
    process groups are destroyed on the way out (see releasing_new_process_groups)."""
    from megatron.core import parallel_state

    init_distributed()
    parallel_state.destroy_model_parallel()
    with (
        releasing_new_process_groups(),
        _initialized_model_parallel(tp, pp, vpp, cp, ep, etp, seed),
    ):
        yield


@contextlib.contextmanager
def _initialized_model_parallel(tp, pp, vpp, cp, ep, etp, seed) -> Iterator[None]:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        create_gloo_process_groups=False,
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
