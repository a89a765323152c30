"""Replacements that let megatron-core's CUDA-only calls run on the CPU.

Each function here stands in for one CUDA call; which attribute it replaces, and why,
is declared in :mod:`megatron_ext.declarations` (group ``"cpu"``). The tensor-level part
(``device='cuda'`` factories, ``Tensor.cuda()``, ``Tensor.type()``) cannot be reached by
attribute patches, so it is a :class:`CudaToCpuMode` that the runtime pushes while it is on.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

CPU = torch.device("cpu")


# ---- devices ---------------------------------------------------------------------------
def current_device() -> torch.device:
    # megatron passes this straight to `device=` (P2P buffers, grad buffers): make it cpu.
    return CPU


def device_count() -> int:
    # megatron.training builds its model-parallel groups only when a device is counted.
    return 1


def set_device(_device: Any) -> None:
    return None


def synchronize(_device: Any = None) -> None:
    # gloo collectives and CPU kernels are synchronous already.
    return None


# ---- random number generators ------------------------------------------------------------
# The "CUDA" generator of megatron's RNG tracker is the CPU default generator: CPU
# kernels (dropout) draw from it, so forking the tracker must swap its state.
def get_rng_state(device: Any = "cuda") -> torch.Tensor:
    return torch.get_rng_state()


def set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    torch.set_rng_state(new_state)


def megatron_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
    return torch.get_rng_state()


def megatron_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False):
    torch.set_rng_state(new_state)


def manual_seed(seed: int) -> None:
    # Seeding "the GPU" seeds the generator that stands in for it; the tracker relies on
    # this to give each tensor-parallel rank its own model-parallel stream. (Not
    # torch.manual_seed: that seeds every CUDA device through this very function.)
    torch.default_generator.manual_seed(int(seed))


# ---- streams and events -------------------------------------------------------------------
class FakeStream:
    """A CUDA stream stand-in: CPU work is already ordered, so every method is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, _stream: Any) -> None:
        return None

    def wait_event(self, _event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> FakeEvent:
        return event or FakeEvent()

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class FakeEvent:
    """A CUDA event stand-in (see :class:`FakeStream`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, _stream: Any = None) -> None:
        return None

    def wait(self, _stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def elapsed_time(self, _other: FakeEvent) -> float:
        return 0.0


_DEFAULT_STREAM = FakeStream()


def current_stream(_device: Any = None) -> FakeStream:
    return _DEFAULT_STREAM


def stream(_stream: Any) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


# ---- megatron.training ------------------------------------------------------------------------
def allow_no_cuda(initialize_megatron):
    """initialize_megatron asserts CUDA unless told otherwise; pretrain never tells it."""
    return functools.partial(initialize_megatron, allow_no_cuda=True)


def no_device_architecture(_original):
    """validate_args reads the GPU's compute capability (with TP/CP > 1, FSDP, GTP remat).

    Architecture 0 is the conservative answer: megatron then takes its pre-Blackwell path,
    which only asks for CUDA_DEVICE_MAX_CONNECTIONS=1 (set by use_cpu; meaningless on CPU).
    """

    def get_device_arch_version() -> int:
        return 0

    return get_device_arch_version


def skip_jit_warmup(_original):
    """The fused-kernel warm-up torch.compiles CUDA kernels: about 30 s on CPU, for nothing."""

    def set_jit_fusion_options(*args: Any, **kwargs: Any) -> None:
        return None

    return set_jit_fusion_options


def keep_rng_across_data_iterators(build_iterators):
    """Building the data iterators draws a DataLoader seed from the CPU generator.

    On a GPU that generator is separate from the one dropout uses; here they are the same,
    so without this a resumed run's dropout stream would shift relative to a continuous run.
    """

    @functools.wraps(build_iterators)
    def build(*args: Any, **kwargs: Any):
        with torch.random.fork_rng(devices=[]):
            return build_iterators(*args, **kwargs)

    return build


# ---- MoE -----------------------------------------------------------------------------------------
def host_copy_as_on_gpu(_original):
    """The alltoall dispatcher moves its split sizes to the host as numpy arrays, which
    all_to_all_single accepts as a sequence; its helper skips tensors already on the CPU,
    leaving torch tensors that the collective's binding rejects. Convert those too."""

    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.cpu().numpy()
        return tensor

    return maybe_move_tensor_to_cpu


# ---- tensors ----------------------------------------------------------------------------
def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare integer is a CUDA ordinal for torch factories.
    return isinstance(device, int) and not isinstance(device, bool)


class CudaToCpuMode(TorchFunctionMode):
    """Sends CUDA placements to the CPU and keeps megatron's CUDA type checks passing.

    - ``device=`` of ``cuda``, ``cuda:N`` or an ordinal becomes ``cpu`` in any torch call;
    - ``Tensor.cuda()`` returns the tensor itself and ``Tensor.to('cuda')`` goes to cpu;
    - ``Tensor.type()`` (no arguments) reports ``torch.cuda.<X>Tensor``: megatron's grad
      clipping and optimizers assert that string;
    - ``pin_memory=True`` is dropped: pinning needs a CUDA driver and only speeds up copies to
      a GPU (megatron's ``get_pos_emb_on_this_cp_rank`` pins its index under CP).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Every torch call of a CPU run comes through here (most of them small ops in a
        # layer's loop), so the common case, no placement to change, returns at once.
        if func in _TENSOR_METHODS_TO_REDIRECT:
            return _redirected_tensor_method(func, args, kwargs or {})
        if not kwargs:
            return func(*args)
        if "device" in kwargs or "pin_memory" in kwargs:
            kwargs = _on_cpu_unpinned(kwargs)
        return func(*args, **kwargs)


_TENSOR_METHODS_TO_REDIRECT = frozenset({torch.Tensor.cuda, torch.Tensor.type, torch.Tensor.to})


def _redirected_tensor_method(func, args: tuple, kwargs: dict):
    if func is torch.Tensor.cuda:
        return args[0]
    if func is torch.Tensor.type and len(args) == 1 and not kwargs:
        name = func(*args)
        return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
    if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
        args = (args[0], CPU) + tuple(args[2:])
    return func(*args, **_on_cpu_unpinned(kwargs))


def _on_cpu_unpinned(kwargs: dict) -> dict:
    """``device=`` of CUDA becomes the CPU, ``pin_memory=True`` is dropped."""
    kwargs = dict(kwargs)
    if "device" in kwargs and _is_cuda(kwargs["device"]):
        kwargs["device"] = CPU
    if kwargs.get("pin_memory"):
        kwargs["pin_memory"] = False
    return kwargs
