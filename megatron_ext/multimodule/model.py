"""The joint wrapper: every module stage on one rank as the one model the schedule drives.

megatron-core's non-interleaved schedule takes one model per rank. In a multi-module pipeline
that model must take a dict of received tensors through ``set_input_tensor``, return
``{module name: output}`` on every stage that sends, and return the loss function's input on
the language model's last stage. :class:`MultiModuleModel` does that around the rank's
modules (each in megatron-core's DDP with its own groups) and adds what megatron's DDP gives
one model: a joint ``no_sync``, ``zero_grad_buffer`` and the collections finalisation needs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron.core.enums import ModelType

# forward(module, batch, inputs, stage) -> output tensor. ``inputs`` is ``{predecessor: tensor}``
# on the first stage of a module that has predecessors and None everywhere else (later stages
# get their input through the module's own set_input_tensor).
StageForward = Callable[[torch.nn.Module, Any, dict | None, "StageContext"], Any]


@dataclass
class StageContext:
    """What a module factory and forward function know about the stage they build or run."""

    name: str
    config: Any
    pg_collection: Any
    pp_rank: int
    pp_size: int
    tp_rank: int
    dp_rank: int
    dp_size: int
    predecessors: list[str] = field(default_factory=list)
    successors: list[str] = field(default_factory=list)
    is_language_model: bool = False

    @property
    def pre_process(self) -> bool:
        """The module's first pipeline stage (where its own inputs enter)."""
        return self.pp_rank == 0

    @property
    def post_process(self) -> bool:
        """The module's last pipeline stage (where it hands its output on)."""
        return self.pp_rank == self.pp_size - 1


def default_forward(module: torch.nn.Module, batch: Any, inputs: dict | None, stage: StageContext):
    """``module(batch, inputs)``: for modules written against this package's contract."""
    return module(batch, inputs)


def core_module(module: torch.nn.Module) -> Any:
    """The model inside megatron's wrappers (DDP, Float16Module); Any: its methods are
    megatron's (set_input_tensor, embedding ...), which ship no types."""
    while hasattr(module, "module") and isinstance(module.module, torch.nn.Module):
        module = module.module
    return module


def _single(tensor: Any) -> Any:
    if isinstance(tensor, list):
        assert len(tensor) == 1, f"expected one tensor per module, got {len(tensor)}"
        return tensor[0]
    return tensor


class MultiModuleModel(torch.nn.Module):
    """The rank's module stages behind one ``forward(batch)`` (see the module docstring).

    ``local_modules`` (name -> DDP-wrapped module) is in the plan's topological order, so a
    rank holding several modules runs them in dependency order.
    """

    def __init__(
        self,
        plan: Any,
        local_modules: dict[str, torch.nn.Module],
        stages: dict[str, StageContext],
        forwards: dict[str, StageForward],
        config: Any,
        finalize_pg_collections: dict[str, Any],
        reports_loss: bool,
    ) -> None:
        super().__init__()
        self.plan = plan
        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        # A ModuleDict, so that their parameters are this module's; Any: its values are
        # megatron's DDP modules (no_sync, zero_grad_buffer ...), which ship no types.
        self.local_modules: Any = torch.nn.ModuleDict(local_modules)
        self.stages = stages
        self.forwards = forwards
        self.finalize_pg_collections = finalize_pg_collections
        self.reports_loss = reports_loss
        self._inputs: dict[str, dict] = {}
        lm = plan.language_model
        self.returns_loss_input = lm in stages and stages[lm].post_process

    def set_input_tensor(self, input_tensor: Any) -> None:
        received = _single(input_tensor) if isinstance(input_tensor, list) else input_tensor
        received = received or {}
        self._inputs = {}
        for name, stage in self.stages.items():
            if stage.pp_rank > 0:
                core_module(self.local_modules[name]).set_input_tensor(_single(received.get(name)))
            elif stage.predecessors:
                missing = [p for p in stage.predecessors if p not in received]
                if missing:
                    raise KeyError(
                        f"module {name!r} expected activations from {missing}, received "
                        f"{sorted(received)}"
                    )
                self._inputs[name] = {p: _single(received[p]) for p in stage.predecessors}

    def forward(self, batch: Any) -> Any:
        outputs = {}
        for name, module in self.local_modules.items():
            stage = self.stages[name]
            outputs[name] = self.forwards[name](module, batch, self._inputs.get(name), stage)
        self._inputs = {}
        if self.returns_loss_input:
            return outputs[self.plan.language_model]
        return outputs

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Every module's DDP ``no_sync`` at once (the schedule's ``config.no_sync_func``)."""
        with contextlib.ExitStack() as stack:
            for module in self.local_modules.values():
                stack.enter_context(module.no_sync())
            yield

    def zero_grad_buffer(self) -> None:
        for module in self.local_modules.values():
            module.zero_grad_buffer()

    def core_modules(self) -> dict[str, torch.nn.Module]:
        return {name: core_module(m) for name, m in self.local_modules.items()}
