"""The CPU runtime: megatron-core's real parallel code on machines without a GPU.

``use_cpu()`` switches it on explicitly (the launchers do it when asked for CPU, or when no
GPU exists). It is one bounded set of redirections and nothing else:

- the ``"cpu"`` group of :mod:`megatron_ext.declarations` (each entry names its target and why):
  ``torch.cuda`` device queries, synchronisation, streams and events, the CUDA RNG state used
  by megatron's RNG tracker, and three ``megatron.training`` start-up steps that assume a GPU;
- :class:`megatron_ext.runtime.cpu.CudaToCpuMode`, pushed as a torch function mode, which
  sends ``device='cuda'`` placements to the CPU and reports CUDA tensor type strings.

It refuses to start where CUDA is available: on a GPU the real calls must run.
``torch.cuda.is_available()`` stays False, so megatron keeps taking its CPU branches.
"""

from __future__ import annotations

import logging
import os

import torch

from megatron_ext import registry
from megatron_ext.runtime.cpu import CudaToCpuMode

_mode: CudaToCpuMode | None = None


class GpuPresentError(RuntimeError):
    """The CPU runtime was asked for on a machine where CUDA is available."""


def use_cpu() -> None:
    """Switch the CPU runtime on (idempotent). Also applies megatron_ext.install()."""
    global _mode
    if torch.cuda.is_available():
        raise GpuPresentError(
            "megatron_ext.runtime.use_cpu() refuses to run where CUDA is available: the CPU "
            "redirections would shadow the real GPU calls. Hide the GPUs "
            "(CUDA_VISIBLE_DEVICES='') to train on CPU, or drop use_cpu() to train on the GPU."
        )
    from megatron_ext.installer import install

    install()
    registry.apply("cpu")
    # megatron.training asserts this for TP/CP > 1 on pre-Blackwell GPUs (the architecture
    # the runtime reports); it only orders CUDA work queues, so it is inert here.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    if _mode is None:
        _mode = CudaToCpuMode()
        _mode.__enter__()
    # Every dropout under the tracker's fork() warns that the CPU generator changed: it is
    # the stand-in CUDA generator here, so that is expected.
    logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)


def stop_cpu() -> None:
    """Switch the CPU runtime off and restore every redirected attribute."""
    global _mode
    if _mode is not None:
        _mode.__exit__(None, None, None)
        _mode = None
    registry.undo("cpu")


def cpu_active() -> bool:
    return _mode is not None


def describe() -> list[str]:
    """One line per redirection, for `megatron-ext doctor` and the docs."""
    lines = [f"{p.target}: {p.why}" for p in registry.patches("cpu")]
    lines.append(
        "torch function mode CudaToCpuMode: device='cuda' placements -> cpu, Tensor.cuda() -> "
        "self, Tensor.type() -> torch.cuda.<X>Tensor (megatron's optimizers assert it)."
    )
    return lines
