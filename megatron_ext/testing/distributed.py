"""Process-group and model-parallel set-up for tests (one pytest session per rank).

Under ``torchrun`` every rank runs the same pytest session; each test enters
:func:`model_parallel` with the sizes it needs and leaves it torn down, like megatron-core's
``Utils.initialize_model_parallel``. Without torchrun the process is a world of one.
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket
from collections.abc import Iterator
from datetime import timedelta

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


_DDP_SEAM = "megatron.core.distributed.distributed_data_parallel:DistributedDataParallel"


def _release_finished_ddps() -> None:
    """megatron-core's DDP keeps every parameter's grad-accumulator node (``grad_accs``) and
    hangs on each a hook that refers back to the DDP. The cycle runs through C++, where Python's
    collector cannot see it, so a finished test's model, optimizer, process-group collection
    and groups were never freed: each multi-rank test left its gloo threads running. Called
    when every DDP alive belongs to a finished block."""
    from megatron.core.distributed import DistributedDataParallel

    for obj in gc.get_objects():
        # type(), not isinstance(): a dead weakref.proxy among the objects raises on the latter
        if issubclass(type(obj), DistributedDataParallel):
            registry.assign(obj, "grad_accs", [], seam=_DDP_SEAM)
            vars(obj).clear()  # and whatever else anchors it: nothing of it is used again


# Nesting of releasing_new_process_groups, and whether a group was destroyed since the last
# collection (an inner block, e.g. a test's model_parallel, destroys while the test's models
# still refer to the group; the outermost collects).
_release_depth = 0
_destroyed_since_collection = False


@contextlib.contextmanager
def releasing_new_process_groups() -> Iterator[None]:
    """Destroy the process groups created inside the block.

    megatron-core's ``destroy_model_parallel()`` only forgets its groups. A gloo group keeps its
    transport threads alive and waking, so a session that sets up model parallelism for test
    after test accumulates them: 40 set-ups in one process left ~2,400 threads that burned more
    than one of our two cores while idle (0.01 core once released). Destroying a gloo subgroup
    is local to the rank, so this needs no agreement between ranks.
    """
    global _release_depth, _destroyed_since_collection
    before = _live_process_groups()
    _release_depth += 1
    try:
        yield
    finally:
        _release_depth -= 1
        for group in _live_process_groups() - before:
            dist.destroy_process_group(group)
            _destroyed_since_collection = True
        if _release_depth == 0 and _destroyed_since_collection:
            _release_finished_ddps()
            # A destroyed gloo group's transport threads end only when its C++ object is freed,
            # and the models, optimizers and collections that refer to it sit in reference
            # cycles (one through DDP's hooks, above) until a full collection. So the outermost
            # block (a test, under pytest) collects once, when what the block made is out of
            # scope: without this a 2-rank session grew ~57 threads a test (1,700 by its end,
            # 2/3 of the CPU in the kernel).
            _destroyed_since_collection = False
            gc.collect()


def world_size() -> int:
    return (
        dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    )


@contextlib.contextmanager
def model_parallel(
    tp: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    cp: int = 1,
    ep: int = 1,
    etp: int | None = None,
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
