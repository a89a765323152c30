"""Training continued from a torch_dist checkpoint under another parallel layout, in one
process world (the in-process counterpart of ``megatron-ext run --resume RUN parallelism.*=V``).

:func:`run_chain` walks a list of :class:`Link` s (a layout and schedule, each a
:class:`~megatron_ext.testing.equivalence.TrainPlan`):

1. the first layout starts from seeded weights, trains ``warmup`` steps with megatron's own
   DDP, schedules and optimizer (Adam), saves model and optimizer sharded state dicts with
   megatron's ``dist_checkpointing`` (what ``--ckpt-format torch_dist`` writes), then trains
   on at the same layout through every later step: the same-layout continuation;
2. each next layout is built afresh (other seed, no perturbation), loads the previous
   layout's checkpoint (model and optimizer), trains the next ``span`` steps on the same
   batches and saves for the layout after it. Its losses are compared with the same steps
   of the same-layout continuation (:func:`max_difference`): the first step after loading
   checks the weights, the next ones the optimizer state too.

The optimizer is megatron's plain one (what the recipes train with), its torch_dist state keyed
by parameter, so it reshards with the weights. Not the distributed optimizer: without Apex or
Transformer Engine (CPU) megatron-core 0.19.2 cannot load its reshardable state (a fresh one
has no Adam states to build the loading state dict from, and torch's Adam keeps a tensor
'step' that the fully_reshardable loader takes for a missing one), and a plain optimizer's
checkpoint lacks the fp32 parameters the distributed one loads.
"""

from __future__ import annotations

import shutil
import tempfile
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_ext.errors import ConfigError
from megatron_ext.testing.distributed import init_distributed, model_parallel
from megatron_ext.testing.equivalence import (
    ModelFactory,
    TrainPlan,
    build_sharded_training,
    forget_moe_metrics,
    gpt_forward_step,
    reports_are_mine,
    sharded_forward_backward,
)
from megatron_ext.testing.shards import shard_index

SOURCE_SEED, FRESH_SEED = 1234, 4321  # weight initialisation; batches come from plan.seed


@dataclass
class Link:
    """One layout of a chain: its plan, the model factory and forward step for it."""

    name: str
    plan: TrainPlan
    factory: ModelFactory
    forward_step: Callable = gpt_forward_step
    config_class: Any = None


@dataclass
class Continued:
    """What one layout of a chain measured: the losses of the steps it trained after loading
    (``loaded``; None for the first layout) and, for the first layout only, those of every
    later step after its save (``continued``: the same-layout continuation)."""

    name: str
    loaded: list[float] | None
    continued: list[float]


@dataclass
class Trainer:
    """A built sharded training at one layout (inside its model_parallel)."""

    link: Link
    chunks: list
    optimizer: Any
    metadata: dict = field(default_factory=dict)

    def train(self, steps: range) -> list[float]:
        """Train ``steps`` (their batches); each step's mean lm loss, the same on every rank."""
        losses = []
        counted = reports_are_mine()
        for step in steps:
            self.optimizer.zero_grad()
            reports = sharded_forward_backward(
                self.link.plan, self.link.forward_step, self.chunks, step
            )
            self.optimizer.step()
            losses.append(_global_mean([r["lm loss"] for r in reports] if counted else []))
        return losses

    def sharded_state_dict(self, is_loading: bool, optimizer: bool = True) -> dict:
        """Megatron's checkpoint layout: ``model{i}`` per chunk (``model`` for one) and
        ``optimizer`` built from them, with megatron's content metadata. (Building the
        optimizer's loading state dict fills in its states: only when it will be loaded.)"""
        models = [chunk.module.sharded_state_dict(metadata=self.metadata) for chunk in self.chunks]
        state = {"model": models[0]} if len(models) == 1 else {}
        if len(models) > 1:
            state.update({f"model{i}": m for i, m in enumerate(models)})
        if optimizer:
            state["optimizer"] = self.optimizer.sharded_state_dict(
                state, is_loading=is_loading, metadata=self.metadata
            )
        return state

    def save(self, directory: Path) -> None:
        from megatron.core import dist_checkpointing

        if dist.get_rank() == 0:
            directory.mkdir()
        dist.barrier()
        dist_checkpointing.save(self.sharded_state_dict(is_loading=False), str(directory))
        dist.barrier()

    def load(self, directory: Path, optimizer: bool = True) -> None:
        """Load the model (and the optimizer unless ``optimizer`` is False: then it stays
        fresh, as ``--no-load-optim`` leaves it)."""
        from megatron.core import dist_checkpointing

        wanted = self.sharded_state_dict(is_loading=True, optimizer=optimizer)
        state = dist_checkpointing.load(wanted, str(directory))
        keys = ["model"] if "model" in state else [f"model{i}" for i in range(len(self.chunks))]
        for chunk, key in zip(self.chunks, keys, strict=True):
            chunk.module.load_state_dict(state[key])
        if optimizer:
            self.optimizer.load_state_dict(state["optimizer"])


def _global_mean(mine: list[float]) -> float:
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    losses = [loss for rank in every for loss in rank]
    return sum(losses) / len(losses)


def perturb_weights(modules: list, scale: float = 0.3) -> None:
    """Add seeded noise to every parameter, drawn per global key over the global shape, so
    every layout gets the same weights (and replicas, TP shards and tied copies agree). At
    initialisation mHC's streams are copies of one another and their mixing weights get only
    rounding-noise gradients, which Adam would turn into layout-dependent steps."""
    with torch.no_grad():
        for entry in shard_index(modules, first_entry_only=True):
            generator = torch.Generator().manual_seed(zlib.crc32(entry.key.encode()))
            noise = torch.randn(entry.global_shape, generator=generator) * scale
            entry.param.add_(noise[entry.region_slices()].reshape(entry.param.shape))


def _metadata() -> dict:
    """What megatron's training loop passes to the state-dict builders (checkpointing.py's
    _build_sharded_state_dict_metadata without the distributed optimizer)."""
    from megatron.core import parallel_state as ps

    return dict(
        singleton_local_shards=False,
        chained_optim_avoid_prefix=True,
        dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True),
    )


@contextmanager
def trainer_at(link: Link, seed: int, perturb: bool) -> Iterator[Trainer]:
    plan = link.plan
    if plan.use_distributed_optimizer:
        raise ConfigError(
            f"{link.name}: use_distributed_optimizer cannot load on CPU (module docstring)"
        )
    forget_moe_metrics()
    _forget_mtp_losses()
    with model_parallel(plan.tp, plan.pp, plan.vpp, plan.cp, plan.ep, seed=seed):
        _, chunks, optimizer = build_sharded_training(
            plan, link.factory, link.config_class, perturb_weights if perturb else None
        )
        yield Trainer(link, chunks, optimizer, _metadata())


def _forget_mtp_losses() -> None:
    """megatron's MTP loss tracker is process-wide and sized by the first model's depth."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker.clear()


@contextmanager
def shared_directory(prefix: str) -> Iterator[Path]:
    """A temporary directory rank 0 makes, known to every rank, removed at the end."""
    init_distributed()
    root: list[str | None] = [tempfile.mkdtemp(prefix=prefix) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(root, src=0)
    directory = root[0]
    assert directory is not None  # rank 0 made it
    try:
        yield Path(directory)
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(directory, ignore_errors=True)


def run_chain(links: list[Link], root: Path, warmup: int = 1, span: int = 2) -> list[Continued]:
    """Walk ``links`` as the module docstring says; every layout's losses."""
    results = []
    for i, link in enumerate(links):
        with trainer_at(link, FRESH_SEED if i else SOURCE_SEED, perturb=not i) as trainer:
            if i == 0:
                trainer.train(range(warmup))
                trainer.save(root / "0")
                later = range(warmup, warmup + span * (len(links) - 1))
                results.append(Continued(link.name, None, trainer.train(later)))
                continue
            trainer.load(root / str(i - 1))
            first = warmup + span * (i - 1)
            results.append(Continued(link.name, trainer.train(range(first, first + span)), []))
            if i + 1 < len(links):
                trainer.save(root / str(i))
    return results


def fresh_optimizer_losses(link: Link, checkpoint: Path, steps: range) -> list[float]:
    """The losses of ``steps`` at ``link`` after loading only the model from ``checkpoint``
    (the optimizer fresh): what a lost optimizer state looks like."""
    with trainer_at(link, FRESH_SEED, perturb=False) as trainer:
        trainer.load(checkpoint, optimizer=False)
        return trainer.train(steps)


def max_difference(results: list[Continued], span: int = 2) -> list[tuple[str, float]]:
    """For each layout B after the first: ('A -> B', max |B's losses after loading A's
    checkpoint - the same-layout continuation's same steps|), A the layout before B."""
    reference = results[0].continued
    pairs = []
    for i, (before, after) in enumerate(zip(results, results[1:], strict=False)):
        assert after.loaded is not None
        same_steps = reference[i * span : (i + 1) * span]
        gap = max(abs(a - b) for a, b in zip(after.loaded, same_steps, strict=True))
        pairs.append((f"{before.name} -> {after.name}", gap))
    return pairs
