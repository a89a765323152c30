"""Shared pieces of the mHC pipeline tests: plans and a recorder of P2P tensor shapes."""

from __future__ import annotations

import contextlib
from functools import partial

import torch
import torch.distributed as dist

from megatron_ext.config import MHCTransformerConfig
from megatron_ext.mhc.stats import GAIN_NAMES
from megatron_ext.testing.distributed import init_distributed
from megatron_ext.testing.equivalence import TrainPlan, check_equivalence
from megatron_ext.testing.mhc_stats import StatsCheck

STREAMS = 4
# mHC's alpha_res/res-bias gradients are rounding noise at init (every stream is the same
# copy of the embedding); Adam turns noise into full-size steps, so a small lr keeps the
# weight comparison after 3 steps meaningful. Loss and gradients use the usual 1e-5.
MHC_LR = 1e-4


def mhc_plan(**kwargs) -> TrainPlan:
    overrides = dict(enable_mhc_connections=True, mhc_num_residual_streams=STREAMS)
    overrides.update(kwargs.pop("config_overrides", {}))
    return TrainPlan(lr=MHC_LR, config_overrides=overrides, **kwargs)


def check_mhc(plan: TrainPlan, **kwargs):
    return check_equivalence(plan, config_class=MHCTransformerConfig, **kwargs)


def check_mhc_and_stats(plan: TrainPlan, run=None) -> StatsCheck:
    """:func:`check_mhc` (or ``run(on_gradients=...)``), and the mHC statistics of the sharded
    run's first step equal the single-rank reference's (the same run; the statistics cost only
    their own computation)."""
    check = StatsCheck(plan.steps)
    try:
        (run or partial(check_mhc, plan))(on_gradients=check.on_gradients)
    finally:
        check.close()
    problems = check.problems()
    assert not problems, "\n".join(problems)
    return check


def assert_birkhoff_gains_are_one(check: StatsCheck, extra: tuple[str, ...] = ()) -> None:
    """A birkhoff model's composite gains are 1 within 1e-5, at the first and the last step."""
    for figures in (check.first, check.last):
        for name in GAIN_NAMES + extra:
            assert abs(figures[name] - 1) <= 1e-5, (name, figures[name])


@contextlib.contextmanager
def recorded_p2p_shapes(monkeypatch):
    """Record the shape of every tensor sent and every buffer received through megatron's
    P2P communicator (after megatron-ext's width correction)."""
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    init_distributed()  # installs megatron-ext first, so the recorder wraps the patched method
    communicate = P2PCommunicator._communicate
    seen: list[tuple[str, tuple[int, ...]]] = []

    def recording(self, *, tensor_send_next, tensor_send_prev, **kwargs):
        for tensor in (tensor_send_next, tensor_send_prev):
            if tensor is not None:
                seen.append(("sent", tuple(tensor.shape)))
        received = communicate(
            self, tensor_send_next=tensor_send_next, tensor_send_prev=tensor_send_prev, **kwargs
        )
        for tensor in received[:2]:
            if isinstance(tensor, torch.Tensor):
                seen.append(("received", tuple(tensor.shape)))
        return received

    monkeypatch.setattr(P2PCommunicator, "_communicate", recording)
    yield seen


def all_ranks(records: list) -> list[list]:
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, records)
    return gathered


def expected_p2p_shape(plan: TrainPlan) -> tuple[int, int, int]:
    seq = plan.seq_length // plan.cp
    if plan.sequence_parallel:
        seq //= plan.tp
    return (seq, plan.micro_batch_size, plan.hidden_size * STREAMS)


def assert_every_exchange_is_n_streams_wide(plan: TrainPlan, records_per_rank: list[list]) -> None:
    expected = expected_p2p_shape(plan)
    sent = [shape for records in records_per_rank for kind, shape in records if kind == "sent"]
    received = [
        shape for records in records_per_rank for kind, shape in records if kind == "received"
    ]
    assert sent and len(sent) == len(received), (len(sent), len(received))
    wrong = {shape for shape in sent + received if shape != expected}
    assert not wrong, f"P2P tensors {wrong} differ from [s', b, n*h] = {expected}"
