"""A torch_dist checkpoint of an mHC GPT saved at one parallel layout loads at another and
gives the same loss on the same batch (fp32, 1e-6), with the same parameter names:
PP1 -> PP2 -> PP2xVPP2 -> TP2xPP2 -> PP1, each layout built in turn inside one 4-rank world
(megatron's dist_checkpointing save/load of the models' sharded state dicts, the format
`--ckpt-format torch_dist` writes). Run: torchrun --nproc_per_node 4 -m pytest <this file>."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import torch.distributed as dist

from megatron_ext.config import MHCTransformerConfig
from megatron_ext.testing.distributed import init_distributed, model_parallel
from megatron_ext.testing.equivalence import (
    TrainPlan,
    build_model_chunks,
    gpt_forward_step,
    gpt_model_factory,
    make_microbatches,
    transformer_config,
)

pytestmark = [
    pytest.mark.world_size(4),
    pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC recompute"),
]

LAYOUTS = {"PP1": {}, "PP2": dict(pp=2), "PP2xVPP2": dict(pp=2, vpp=2), "TP2xPP2": dict(tp=2, pp=2)}
CHAIN = ["PP1", "PP2", "PP2xVPP2", "TP2xPP2", "PP1"]
SAVED_SEED, FRESH_SEED = 1234, 4321  # weight initialisation; the batch is always the same


def _plan(layout: str) -> TrainPlan:
    return TrainPlan(
        num_layers=4,
        global_batch_size=4,
        **LAYOUTS[layout],
        config_overrides=dict(enable_mhc_connections=True, mhc_num_residual_streams=4),
    )


def _loss(plan: TrainPlan, chunks) -> float:
    """The mean lm loss of one fixed batch (forward only), the same on every rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    batches = make_microbatches(plan, 0)
    data = [iter(batches) for _ in chunks] if plan.vpp else iter(batches)
    reports = get_forward_backward_func()(
        forward_step_func=gpt_forward_step,
        data_iterator=data,
        model=chunks,
        num_microbatches=len(batches),
        seq_length=plan.seq_length,
        micro_batch_size=plan.micro_batch_size,
        forward_only=True,
    )
    mine = [r["lm loss"] for r in reports] if ps.is_pipeline_last_stage() and reports else []
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, sum(mine) / len(mine) if mine else None)
    losses = [x for x in every if x is not None]
    assert max(losses) - min(losses) < 1e-7, losses  # replicas agree
    return losses[0]


def _move_away_from_init(chunks) -> None:
    """At initialisation every weight is small and the loss is ~ln(vocab) whatever was loaded;
    seeded noise on every parameter (mHC's included) makes each one count."""
    import torch

    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for chunk in chunks:
            for _, param in sorted(chunk.named_parameters()):
                param.add_(torch.randn(param.shape, generator=generator) * 0.3)


def _sharded(chunks) -> dict:
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


def _parameter_names(sharded: dict) -> list[str]:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    mine = {v.key for v in nested_values(sharded) if isinstance(v, ShardedTensor)}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, sorted(mine))
    return sorted(set().union(*every))


def _at_layout(
    layout: str, load_dir: Path | None, save_dir: Path
) -> tuple[float, float, list[str]]:
    """Build ``layout`` (fresh weights unless loading), load, measure the loss, save."""
    from megatron.core import dist_checkpointing

    plan = _plan(layout)
    with model_parallel(plan.tp, plan.pp, plan.vpp, seed=FRESH_SEED if load_dir else SAVED_SEED):
        config = transformer_config(plan, parallel=True, config_class=MHCTransformerConfig)
        chunks = build_model_chunks(plan, config, gpt_model_factory(plan))
        for chunk in chunks:
            chunk.eval()
        if load_dir is None:
            _move_away_from_init(chunks)
        before = _loss(plan, chunks)
        if load_dir is not None:
            state = dist_checkpointing.load(_sharded(chunks), str(load_dir))
            for i, chunk in enumerate(chunks):
                chunk.load_state_dict(state[f"model{i}"])
        after = _loss(plan, chunks)
        sharded = _sharded(chunks)
        names = _parameter_names(sharded)
        if dist.get_rank() == 0:
            save_dir.mkdir()
        dist.barrier()
        dist_checkpointing.save(sharded, str(save_dir))
        dist.barrier()
    return before, after, names


def test_an_mhc_checkpoint_moves_between_layouts_with_the_same_loss_and_names():
    init_distributed()
    root = [tempfile.mkdtemp(prefix="megatron-ext-layouts-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(root, src=0)
    root = Path(root[0])
    try:
        _, saved_loss, saved_names = _at_layout(CHAIN[0], None, root / "0")
        for step, layout in enumerate(CHAIN[1:], start=1):
            fresh_loss, loaded_loss, names = _at_layout(
                layout, root / str(step - 1), root / str(step)
            )
            moved = f"{CHAIN[step - 1]} -> {layout}"
            assert abs(fresh_loss - saved_loss) > 1e-3, (
                f"{moved}: fresh weights must give another loss"
            )
            assert abs(loaded_loss - saved_loss) <= 1e-6, (
                f"{moved}: loss {loaded_loss} != {saved_loss}"
            )
            assert names == saved_names, f"{moved}: {sorted(set(names) ^ set(saved_names))}"
        assert any("hyper_connection" in n or "mhc" in n for n in saved_names), saved_names
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)
