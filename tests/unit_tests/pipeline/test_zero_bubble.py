"""ZB-H1's forward-backward function on one process, CPU only: each unsupported combination
is refused before any step runs (one line: the field, the reason and the fix), and against a
recording stand-in communicator and stand-in passes the function executes build_schedule's
steps for the rank exactly, with grad sync switched on right before the last B."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from megatron_ext.errors import MegatronExtError, Problem
from megatron_ext.pipeline import wgrad, zero_bubble
from megatron_ext.pipeline.zero_bubble import (
    ZeroBubbleUnsupportedError,
    check_zero_bubble,
    forward_backward_pipelining_zero_bubble_h1,
    rank_steps,
    zero_bubble_problems,
)
from megatron_ext.schedules.schedule import (
    Compute,
    Exchange,
    SchedulePlan,
    build_schedule,
)

SCHEDULES = "megatron.core.pipeline_parallel.schedules"


def plain_config(**fields):
    """What the guards and the function read of a config (megatron's names and defaults)."""
    values = dict(
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=None,
        overlap_p2p_comm=False,
        overlap_moe_expert_parallel_comm=False,
        cuda_graph_impl="none",
        enable_cuda_graph=False,
        external_cuda_graph=False,
        moe_paged_stash=False,
        fine_grained_activation_offloading=False,
        gradient_accumulation_fusion=False,
        finalize_model_grads_func=None,
        timers=None,
        no_sync_func=None,
        grad_sync_func=None,
        num_microbatches_with_partial_activation_checkpoints=None,
        deallocate_pipeline_outputs=False,
        calculate_per_token_loss=False,
        variable_seq_lengths=False,
        sequence_parallel=False,
        hidden_size=4,
        enable_mhc_connections=False,  # megatron-core 0.20's get_tensor_shapes reads it
    )
    values.update(fields)
    return SimpleNamespace(**values)


# ---------------------------------------------------------------------------------------------
# Guards
# ---------------------------------------------------------------------------------------------
REFUSED = [
    (dict(virtual_pipeline_model_parallel_size=2), "virtual_pipeline_model_parallel_size=2"),
    (dict(overlap_p2p_comm=True), "overlap_p2p_comm=True"),
    (dict(overlap_moe_expert_parallel_comm=True), "overlap_moe_expert_parallel_comm=True"),
    (dict(cuda_graph_impl="local"), "cuda_graph_impl='local'"),
    (dict(cuda_graph_impl="transformer_engine"), "cuda_graph_impl='transformer_engine'"),
    (dict(enable_cuda_graph=True), "CUDA graphs"),
    (dict(external_cuda_graph=True), "CUDA graphs"),
    (dict(moe_paged_stash=True), "moe_paged_stash=True"),
    (dict(fine_grained_activation_offloading=True), "fine_grained_activation_offloading=True"),
    (dict(pipeline_model_parallel_size=1), "pipeline_model_parallel_size=1"),
    (dict(variable_seq_lengths=True), "variable_seq_lengths=True"),
    (dict(gradient_accumulation_fusion=True), "gradient_accumulation_fusion=True"),
]


def test_a_supported_config_has_no_problem():
    assert zero_bubble_problems(plain_config()) == []
    assert zero_bubble_problems(plain_config(virtual_pipeline_model_parallel_size=1)) == []


def test_a_real_transformer_config_is_read_too():
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=4,
        hidden_size=16,
        num_attention_heads=2,
        pipeline_model_parallel_size=2,
        pipeline_dtype=torch.float32,
    )
    assert zero_bubble_problems(config) == []
    assert [p.where for p in zero_bubble_problems(config, pipeline_parallel_size=1)] == [
        "pipeline_model_parallel_size=1"
    ]


@pytest.mark.parametrize("fields, where", REFUSED, ids=[w for _, w in REFUSED])
def test_each_unsupported_combination_is_one_problem_with_a_fix(fields, where):
    problems = zero_bubble_problems(plain_config(**fields))
    assert [p.where for p in problems] == [where]
    (problem,) = problems
    assert isinstance(problem, Problem)
    line = str(problem)
    assert "\n" not in line and "; " in line, line  # the reason; then the fix
    assert line.endswith("or keep pipeline_schedule 1f1b"), line  # the way back is named
    with pytest.raises(ZeroBubbleUnsupportedError, match="pipeline_schedule zb-h1: ") as info:
        check_zero_bubble(plain_config(**fields))
    assert isinstance(info.value, MegatronExtError) and isinstance(info.value, ValueError)
    assert where in str(info.value)


def test_a_multi_module_pipeline_is_refused():
    (problem,) = zero_bubble_problems(plain_config(), multimodule=True)
    assert problem.where == "multi-module pipeline" and "1f1b" in problem.what


def test_every_problem_is_reported_at_once():
    config = plain_config(overlap_p2p_comm=True, moe_paged_stash=True, cuda_graph_impl="local")
    assert len(zero_bubble_problems(config)) == 3


class _Chunk(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config


def _never(*args, **kwargs):
    raise AssertionError("a pass ran before the guard refused")


def test_the_function_refuses_before_any_step():
    """Called with overlap_p2p_comm (its communicator never touched): the guard's error."""
    config = plain_config(overlap_p2p_comm=True)
    communicator = SimpleNamespace(total_stages=2, current_stage=0)
    with pytest.raises(ZeroBubbleUnsupportedError, match="overlap_p2p_comm=True"):
        forward_backward_pipelining_zero_bubble_h1(
            forward_step_func=_never,
            data_iterator=iter([]),
            model=[_Chunk(config)],
            num_microbatches=4,
            seq_length=8,
            micro_batch_size=1,
            p2p_communicator=communicator,
            pg_collection=SimpleNamespace(),
        )


def test_two_model_chunks_are_refused():
    config = plain_config()
    with pytest.raises(ZeroBubbleUnsupportedError, match="2 model chunks"):
        forward_backward_pipelining_zero_bubble_h1(
            forward_step_func=_never,
            data_iterator=[iter([]), iter([])],
            model=[_Chunk(config), _Chunk(config)],
            num_microbatches=4,
            seq_length=8,
            micro_batch_size=1,
        )


# ---------------------------------------------------------------------------------------------
# The executor against stand-ins
# ---------------------------------------------------------------------------------------------
class _Group:
    def __init__(self, size: int = 1) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


class RecordingCommunicator:
    """Answers every call like megatron's communicator would at this rank's place, recording
    the calls as the schedule writes them (received tensors carry the micro-batch they are
    for, counted per direction)."""

    def __init__(self, pp: int, rank: int, log: list) -> None:
        self.total_stages, self.current_stage = pp, rank
        self.is_pp_first_stage, self.is_pp_last_stage = rank == 0, rank == pp - 1
        self.log = log
        self.received = {"F": 0, "B": 0}

    def _receive(self, kind: str, at_end: bool):
        if at_end:
            return None
        mb = self.received[kind]
        self.received[kind] += 1
        return torch.full((1,), float(mb), requires_grad=kind == "F")

    def _call(self, name: str, sent=None, flag=None) -> None:
        self.log.append(("call", name, None if sent is None else int(sent.flatten()[0])))

    def recv_forward(self, shapes, is_first_stage):
        self._call("recv_forward")
        return self._receive("F", is_first_stage)

    def recv_backward(self, shapes, is_last_stage):
        self._call("recv_backward")
        return self._receive("B", is_last_stage)

    def send_forward(self, output, is_last_stage):
        self._call("send_forward", output)

    def send_backward(self, grad, is_first_stage):
        self._call("send_backward", grad)

    def send_forward_recv_backward(self, output, shapes, is_last_stage):
        self._call("send_forward_recv_backward", output)
        return self._receive("B", is_last_stage)

    def send_backward_recv_forward(self, grad, shapes, is_first_stage):
        self._call("send_backward_recv_forward", grad)
        return self._receive("F", is_first_stage)


@pytest.fixture
def stand_in_passes(monkeypatch):
    """megatron's forward_step/backward_step replaced by passes that log what they get: an
    F's output and a B's input gradient carry the micro-batch number, so the sends show
    which micro-batch they carry; inputs and gradients are checked to be the right ones."""
    import importlib

    if not torch.cuda.is_available():
        from megatron_ext import runtime

        runtime.use_cpu()  # megatron's token counter is placed on "cuda"
    schedules = importlib.import_module(SCHEDULES)
    log: list = []

    def forward_step(func, data, model, n, input_tensor, store, config, **kwargs):
        mb = kwargs["current_microbatch"]
        if input_tensor is not None:
            assert int(input_tensor) == mb, (mb, input_tensor)
        log.append(("F", mb))
        store.append({"mb": mb})
        return torch.full((1,), float(mb)), torch.tensor(mb + 1, dtype=torch.int)

    def backward_step(input_tensor, output_tensor, output_tensor_grad, config):
        mb = int(output_tensor)
        if output_tensor_grad is not None:
            assert int(output_tensor_grad) == mb, (mb, output_tensor_grad)
        log.append(("B", mb))
        return torch.full((1,), float(mb))

    monkeypatch.setattr(schedules, "forward_step", forward_step)
    monkeypatch.setattr(schedules, "backward_step", backward_step)
    monkeypatch.setattr(
        zero_bubble, "weight_gradient_step", lambda chunk, mb, config: log.append(("W", mb))
    )
    return log


def _expected(steps) -> list:
    """What the log should read for a step list: passes, and calls with the sent micro-batch."""
    out = []
    for step in steps:
        if isinstance(step, Compute):
            out.append((step.kind, step.microbatch))
        else:
            assert isinstance(step, Exchange)
            sends = [m.microbatch for m in step.messages if m.direction.startswith("send")]
            out.append(("call", step.call, sends[0] if sends else None))
    return out


def _run(pp: int, rank: int, microbatches: int, log: list, config=None):
    from megatron.core.process_groups_config import ProcessGroupCollection

    config = config or plain_config(pipeline_model_parallel_size=pp)
    groups = ProcessGroupCollection()
    groups.tp, groups.cp = _Group(), _Group()
    return forward_backward_pipelining_zero_bubble_h1(
        forward_step_func=None,
        data_iterator=iter([]),
        model=_Chunk(config),
        num_microbatches=microbatches,
        seq_length=8,
        micro_batch_size=1,
        p2p_communicator=RecordingCommunicator(pp, rank, log),
        pg_collection=groups,
    )


@pytest.mark.parametrize("pp, microbatches", [(2, 5), (4, 8), (4, 3), (3, 1)])
def test_every_rank_executes_build_schedules_steps(stand_in_passes, pp, microbatches):
    schedule = build_schedule(SchedulePlan(pp=pp, microbatches=microbatches, schedule="zb-h1"))
    for rank in range(pp):
        stand_in_passes.clear()
        store = _run(pp, rank, microbatches, stand_in_passes)
        steps = rank_steps(pp, rank, microbatches)
        assert steps == schedule.ranks[rank]
        expected = _expected(steps)
        # At the model's ends megatron's calls send nothing: the stand-in still sees the tensor.
        got = [
            entry if entry[0] != "call" or _sends(steps, i) else entry[:2] + (None,)
            for i, entry in enumerate(stand_in_passes)
        ]
        assert got == expected, f"rank {rank}"
        assert [r["mb"] for r in store] == list(range(microbatches))
        assert any(s.kind == "W" for s in steps if isinstance(s, Compute))


def _sends(steps, index) -> bool:
    step = steps[index]
    return isinstance(step, Exchange) and any(m.direction.startswith("send") for m in step.messages)


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_grad_sync_is_switched_on_right_before_the_last_backward(stand_in_passes, rank):
    """DDP's no_sync is entered before the first step and left right before the last B (the
    last micro-batch's), so every later W accumulates inside the sync window."""

    @contextlib.contextmanager
    def no_sync():
        stand_in_passes.append(("no_sync", "enter"))
        yield
        stand_in_passes.append(("no_sync", "exit"))

    _run(
        4,
        rank,
        6,
        stand_in_passes,
        plain_config(pipeline_model_parallel_size=4, no_sync_func=no_sync),
    )
    events = [e for e in stand_in_passes if e[0] != "call"]
    assert events[0] == ("no_sync", "enter")
    exit_at = events.index(("no_sync", "exit"))
    assert events.count(("no_sync", "exit")) == 1
    assert events[exit_at + 1] == ("B", 5)
    after = events[exit_at + 1 :]
    assert [e for e in after if e[0] == "B"] == [("B", 5)]
    # Rank r still has r + 1 weight gradients to run after the last B, all inside the window.
    assert [e for e in after if e[0] == "W"] == [("W", mb) for mb in range(5 - rank, 6)]


def test_the_token_count_and_finalize_are_megatrons(stand_in_passes):
    """finalize_model_grads_func gets the model and, for per-token losses, every micro-batch's
    tokens (the stand-in forward gives micro-batch i i + 1 tokens)."""
    calls = []

    def finalize(models, num_tokens, pg_collection=None, force_all_reduce=False):
        calls.append((len(models), None if num_tokens is None else int(num_tokens)))

    config = plain_config(finalize_model_grads_func=finalize, calculate_per_token_loss=True)
    config.defer_embedding_wgrad_compute = False
    _run(2, 1, 4, stand_in_passes, config)
    assert calls == [(1, 1 + 2 + 3 + 4)]


def test_a_weight_gradient_left_pending_is_an_error(stand_in_passes, monkeypatch):
    """A W step that does not run its micro-batch's deferred work: the function raises
    before finalize_model_grads instead of finalizing an incomplete gradient."""
    answers = iter([[], [3], [3]])  # nothing left from before; then micro-batch 3 stays
    monkeypatch.setattr(wgrad, "pending", lambda: next(answers))
    with pytest.raises(wgrad.PendingWeightGradientError, match=r"\[3\] were never run"):
        _run(2, 0, 4, stand_in_passes)


def test_a_weight_gradient_pending_from_before_is_an_error(stand_in_passes, monkeypatch):
    monkeypatch.setattr(wgrad, "pending", lambda: [1])
    with pytest.raises(wgrad.PendingWeightGradientError, match="still pending from an earlier"):
        _run(2, 0, 4, stand_in_passes)
    assert stand_in_passes == []  # refused before any step


def test_forward_only_is_megatrons_1f1b(monkeypatch):
    """Evaluation has no weight gradient to defer: megatron's own non-interleaved schedule
    runs it, with every argument handed over unchanged and its result returned."""
    import importlib

    schedules = importlib.import_module(SCHEDULES)
    seen = {}

    def one_f_one_b(**kwargs):
        seen.update(kwargs)
        return ["reports"]

    monkeypatch.setattr(schedules, "forward_backward_pipelining_without_interleaving", one_f_one_b)
    arguments = dict(
        forward_step_func=_never,
        data_iterator=iter([]),
        model=[_Chunk(plain_config())],
        num_microbatches=3,
        seq_length=8,
        micro_batch_size=2,
        decoder_seq_length=4,
        collect_non_loss_data=True,
        first_val_step=True,
        adjust_tensor_shapes_fn=None,
        p2p_communicator="communicator",
        pg_collection="groups",
        force_all_reduce=False,
    )
    result = forward_backward_pipelining_zero_bubble_h1(forward_only=True, **arguments)
    assert result == ["reports"]
    assert seen == dict(arguments, forward_only=True)


def test_a_failing_step_discards_the_stored_weight_gradients(stand_in_passes, monkeypatch):
    """A pass that raises leaves its iteration's stored work behind: it is dropped, so the
    next iteration does not start with (or apply) a stale weight gradient."""
    import importlib

    schedules = importlib.import_module(SCHEDULES)
    discarded = []
    monkeypatch.setattr(wgrad, "discard_pending", lambda: discarded.append(True))

    def failing_backward(*args):
        raise RuntimeError("B failed")

    monkeypatch.setattr(schedules, "backward_step", failing_backward)
    with pytest.raises(RuntimeError, match="B failed"):
        _run(2, 1, 4, stand_in_passes)
    assert discarded == [True]


@pytest.mark.parametrize("rank", [0, 1])
def test_with_a_grad_sync_func_only_the_first_stage_syncs_in_the_loop(stand_in_passes, rank):
    """megatron.training sets config.grad_sync_func with overlap_grad_reduce and
    align_grad_reduce: as in megatron's 1F1B, the first stage leaves no_sync before its last B,
    the others after every W, and then call grad_sync_func on their parameters."""

    @contextlib.contextmanager
    def no_sync():
        yield
        stand_in_passes.append(("no_sync", "exit"))

    def grad_sync(params):
        stand_in_passes.append(("grad_sync", len(list(params))))

    config = plain_config(no_sync_func=no_sync, grad_sync_func=grad_sync)
    _run(2, rank, 4, stand_in_passes, config)
    events = [e for e in stand_in_passes if e[0] != "call"]
    if rank == 0:
        assert events[events.index(("no_sync", "exit")) + 1] == ("B", 3)
        assert not [e for e in events if e[0] == "grad_sync"]
    else:
        assert events[-2:] == [("no_sync", "exit"), ("grad_sync", 0)]
        assert events[-3][0] == "W"
