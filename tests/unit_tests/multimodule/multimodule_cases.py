"""Shared pieces of the distributed multi-module tests: the small VLM's modules, runs against
the single-process reference, and a check that every rank raised the same error."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron_ext.multimodule import ModuleImpl, ModulePlan, MultiModulePlan, vlm
from megatron_ext.testing.distributed import init_distributed
from megatron_ext.testing.multimodule import PipelineRun, check_pipeline_equivalence, run_pipeline

HIDDEN = 32
PATCH = 12
VOCAB = 64
MAX_SEQ = 64


def encoder_config(layers: int = 2):
    return vlm.transformer_config(layers, HIDDEN, 4)


def lm_config(layers: int = 2, **overrides: Any):
    return vlm.transformer_config(layers, HIDDEN, 4, **overrides)


def encoder(
    flatten_output: bool = False, layers: int = 2, forward: Callable | None = None
) -> ModuleImpl:
    impl = vlm.encoder_impl(encoder_config(layers), PATCH, flatten_output)
    if forward is not None:
        impl.forward = forward(impl.forward)
    return impl


def language_model(
    layers: int = 2, forward: Callable | None = None, **overrides: Any
) -> ModuleImpl:
    impl = vlm.language_model_impl(lm_config(layers, **overrides), VOCAB, MAX_SEQ)
    if forward is not None:
        impl.forward = forward(impl.forward)
    return impl


def projector() -> ModuleImpl:
    return vlm.projector_impl(encoder_config())


def make_plan(modules: dict[str, ModulePlan], topology: dict[str, list[str]]) -> MultiModulePlan:
    init_distributed()
    return MultiModulePlan(modules, topology, "llm", world_size=dist.get_world_size())


def equivalence(
    modules: dict[str, ModulePlan],
    topology: dict[str, list[str]],
    impls: dict[str, ModuleImpl],
    image_lengths=(4, 6, 8),
    on_gradients=None,
    **run_kwargs: Any,
):
    """The pipeline against the single-process reference (raises on every rank on a
    difference). Image lengths vary per micro-batch, so every exchange has new shapes."""
    plan = make_plan(modules, topology)
    readers = {
        name: PATCH for name in impls if impls[name].factory is not vlm.Projector and name != "llm"
    }
    data = vlm.VLMData("llm", readers, image_lengths=image_lengths)
    settings = dict(grad_scale=4.0)
    settings.update(run_kwargs)
    return check_pipeline_equivalence(PipelineRun(plan, impls, data, **settings), on_gradients)


def raises_everywhere(error: type, run: Callable[[], Any]) -> list[str]:
    """Run on every rank; assert every rank raised ``error`` (and the world is still usable
    afterwards). Returns every rank's message."""
    try:
        run()
        outcome = ("no error", "")
    except Exception as raised:  # compared on every rank below
        outcome = (type(raised).__name__, str(raised))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, outcome)
    dist.barrier()
    names = [name for name, _ in everyone]
    assert names == [error.__name__] * len(everyone), f"per-rank outcomes: {everyone}"
    return [message for _, message in everyone]


def pipeline_only(modules, topology, impls, **run_kwargs: Any):
    """Build and run the pipeline (no reference), for error paths."""
    plan = make_plan(modules, topology)
    readers = {name: PATCH for name in impls if name != "llm"}
    data = vlm.VLMData("llm", readers, image_lengths=(4,))
    return run_pipeline(PipelineRun(plan, impls, data, steps=1, **run_kwargs))


def last_dim_one(forward: Callable) -> Callable:
    """A stage forward whose module hands on ``[..., :1]`` on its non-last stages."""

    def wrapped(module, batch, inputs, stage):
        out = forward(module, batch, inputs, stage)
        return out if stage.post_process else out[..., :1].contiguous()

    return wrapped


def flattened(forward: Callable) -> Callable:
    """A stage forward whose last stage returns 2-D although its module says 3-D."""

    def wrapped(module, batch, inputs, stage):
        out = forward(module, batch, inputs, stage)
        return out.reshape(-1, out.shape[-1]) if stage.post_process else out

    return wrapped


def record_shapes(into: list) -> Callable:
    """A stage forward that records the shape each stage hands on."""

    def wrap(forward: Callable) -> Callable:
        def wrapped(module, batch, inputs, stage):
            out = forward(module, batch, inputs, stage)
            into.append((stage.pp_rank, stage.pp_size, tuple(out.shape)))
            return out

        return wrapped

    return wrap


__all__ = [name for name in dir() if not name.startswith("_")] + ["torch"]
