"""Activation memory of one forward+backward, shared by the memory benchmarks.

``kept``: bytes of the distinct storages autograd saves for backward (parameters excluded);
``peak``: the highest live CPU allocation during the measured step, from torch.profiler.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile


def measure_step(
    model: torch.nn.Module, compute_loss: Callable[[], torch.Tensor]
) -> tuple[int, int]:
    """``(kept, peak)`` bytes of one ``compute_loss().backward()`` step of ``model``."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def step() -> int:
        saved = []

        def pack(tensor):
            saved.append(tensor)
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = compute_loss()
        storages = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in saved
            if t.untyped_storage().data_ptr() and t.untyped_storage().data_ptr() not in parameters
        }
        saved.clear()
        loss.backward()
        return sum(storages.values())

    step()  # allocate .grad once, so the measured step allocates only activations
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        kept = step()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return kept, peak
