"""Deferred weight gradients under tensor parallelism (2 ranks): a column-parallel then
row-parallel pair of megatron_ext.pipeline.wgrad's linears, captured and run, gives every
rank the input gradient and the local weight/bias gradients of megatron's own linears, with
and without sequence parallelism (the input gradient's all-reduce / reduce-scatter in B, the
input's all-gather again in W)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron.core import tensor_parallel

from megatron_ext.pipeline import wgrad
from megatron_ext.testing.configs import small_config
from megatron_ext.testing.distributed import model_parallel

HIDDEN, FFN, SEQ, BATCH, TP = 8, 16, 6, 2, 2


def _init(weight: torch.Tensor) -> None:
    torch.nn.init.normal_(weight, std=0.5)


def _pair(source, schedule: str, sequence_parallel: bool):
    config = small_config(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=2,
        tensor_model_parallel_size=TP,
        sequence_parallel=sequence_parallel,
        pipeline_schedule=schedule,
    )
    torch.manual_seed(5)  # the same master weights on every rank, each keeps its partition
    column = source.ColumnParallelLinear(
        HIDDEN, FFN, config=config, init_method=_init, bias=True, gather_output=False
    )
    row = source.RowParallelLinear(
        FFN,
        HIDDEN,
        config=config,
        init_method=_init,
        bias=True,
        input_is_parallel=True,
        skip_bias_add=False,
    )
    with torch.no_grad():
        torch.manual_seed(6)
        column.bias.normal_()
        row.bias.normal_()
    return column, row


def _inputs(sequence_parallel: bool, count: int):
    """Per micro-batch: this rank's input (its sequence shard under SP) and output gradient."""
    generator = torch.Generator().manual_seed(17)
    full = [torch.randn(SEQ, BATCH, HIDDEN, generator=generator) for _ in range(count)]
    grads = [torch.randn(SEQ, BATCH, HIDDEN, generator=generator) for _ in range(count)]
    if not sequence_parallel:
        return full, grads
    rank, shard = dist.get_rank(), SEQ // TP
    local = slice(rank * shard, (rank + 1) * shard)
    return [x[local] for x in full], [g[local] for g in grads]


def _step(column, row, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    x = x.clone().requires_grad_()
    hidden, _ = column(x)
    out, _ = row(torch.nn.functional.gelu(hidden))
    out.backward(g)
    return x.grad


@pytest.mark.world_size(2)
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tensor_parallel_deferred_grads_equal_megatron(sequence_parallel):
    wgrad.discard_pending()
    with model_parallel(tp=TP):
        ref = _pair(tensor_parallel, "1f1b", sequence_parallel)
        ours = _pair(wgrad, "zb-h1", sequence_parallel)
        xs, gs = _inputs(sequence_parallel, 2)
        ref_dx = [_step(*ref, x, g) for x, g in zip(xs, gs, strict=True)]
        dx = []
        for key, (x, g) in enumerate(zip(xs, gs, strict=True)):
            with wgrad.capture(key):
                dx.append(_step(*ours, x, g))
        assert ours[0].weight.grad is None and ours[1].weight.grad is None
        assert wgrad.pending() == [0, 1]
        wgrad.run(0)
        wgrad.run(1)
        assert wgrad.pending() == []
        for mine, theirs in zip(dx, ref_dx, strict=True):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
        for mine, theirs in zip(ours, ref, strict=True):
            for (name, p), (_, q) in zip(
                mine.named_parameters(), theirs.named_parameters(), strict=True
            ):
                torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("parallel", ["pp2", "tp2_sp"])
def test_eager_path_under_megatron_1f1b_matches_the_reference(parallel):
    """pipeline_schedule='zb-h1' under megatron's own 1F1B (no capture: W inside B, through
    the accumulators DDP hooked) trains as the single-rank reference (megatron's linears):
    loss, every gradient of every step, the final weights. mHC on."""
    from megatron_ext.config import MHCTransformerConfig
    from megatron_ext.testing.equivalence import TrainPlan, check_equivalence

    sizes = dict(pp=2) if parallel == "pp2" else dict(tp=2, sequence_parallel=True)
    plan = TrainPlan(
        **sizes,
        num_layers=2,
        steps=2,
        lr=1e-4,  # mhc_moe_mla_cases.MHC_LR: Adam turns alpha_res's rounding noise into steps
        config_overrides=dict(enable_mhc_connections=True, mhc_num_residual_streams=2),
        parallel_overrides=dict(pipeline_schedule="zb-h1"),
    )
    check_equivalence(plan, config_class=MHCTransformerConfig)
    assert wgrad.pending() == []


@pytest.mark.world_size(2)
def test_captured_b_then_w_inside_megatron_1f1b_matches_the_reference(monkeypatch):
    """Every backward_step of megatron's PP=2 1F1B runs as B inside capture(k) then W = run(k)
    at once (the stages' received tensors, megatron's custom backward, DDP and finalize_model_grads
    on the real path): the run still equals the single-rank reference. mHC on."""
    import itertools

    from megatron.core.pipeline_parallel import schedules

    from megatron_ext.config import MHCTransformerConfig
    from megatron_ext.testing.equivalence import TrainPlan, check_equivalence

    original = schedules.backward_step
    keys = itertools.count()
    stored = []

    def b_then_w(*args, **kwargs):
        key = next(keys)
        with wgrad.capture(key):
            input_grad = original(*args, **kwargs)
        stored.append(wgrad.pending() == [key])
        wgrad.run(key)
        assert wgrad.pending() == []
        return input_grad

    monkeypatch.setattr(schedules, "backward_step", b_then_w)
    plan = TrainPlan(
        pp=2,
        num_layers=2,
        steps=2,
        lr=1e-4,
        config_overrides=dict(enable_mhc_connections=True, mhc_num_residual_streams=2),
        parallel_overrides=dict(pipeline_schedule="zb-h1"),
    )
    check_equivalence(plan, config_class=MHCTransformerConfig)
    # The sharded run stored work in every backward step (the reference, 1f1b, none).
    assert any(stored) and stored.count(True) == plan.steps * plan.local_microbatches()
