"""The ZB-H1 zero-bubble pipeline schedule as a megatron-core forward-backward function.

:func:`forward_backward_pipelining_zero_bubble_h1` takes the arguments of megatron-core
0.19.2's ``forward_backward_pipelining_without_interleaving`` and returns what it returns
(the last stage's loss reports), so ``megatron.training`` and ``finalize_model_grads`` work
unchanged. The order of its steps is data: this rank's list from
:func:`megatron_ext.schedules.schedule.build_schedule` (``schedule="zb-h1"``), the same list
``megatron-ext schedule`` prints and the trace order check compares against. The function
only executes that list:

- ``F``: megatron's ``forward_step`` (looked up on megatron's schedules module at call time,
  where the tracer wraps it), its input the oldest received activation;
- ``B``: megatron's ``backward_step`` inside :func:`megatron_ext.pipeline.wgrad.capture`, so
  layers with a deferred weight gradient compute only the input gradient and keep what the
  weight gradient needs;
- ``W``: :func:`weight_gradient_step`, which runs the micro-batch's deferred weight gradients;
- an exchange: the P2P communicator's method of that name (``recv_forward``,
  ``send_forward_recv_backward`` ...), sending the output (input gradient) of the latest ``F``
  (``B``); megatron-ext's P2P width correction for mHC's n*h messages lives in the
  communicator, so it applies here as it does to 1F1B.

Around the steps it does what megatron's 1F1B function does: DDP's ``no_sync`` until the last
backward, ``config.grad_sync_func``, ``deallocate_output_tensor``, the token count for
per-token losses, deferred embedding weight gradients, ``finalize_model_grads_func`` and the
timers. Evaluation (``forward_only``) has nothing to defer and is megatron's 1F1B.

Grad sync: megatron switches DDP's grad sync back on right before the last backward, so that
with ``overlap_grad_reduce`` every parameter's grad-ready hook fires inside the sync window
exactly for the micro-batches that follow, the same set every iteration (DDP learns the
counts in the first iteration and starts a bucket's reduction when they are reached). Here
the last weight-gradient accumulation of a deferred parameter happens in the last ``W``, after
the last ``B``: sync is enabled before the last ``B`` and stays on through every later ``W``,
so the window holds the last ``B`` (parameters whose gradient stays in ``B``) and every
``W`` after it (deferred parameters); no gradient is accumulated after the window ends, so a
bucket's reduction starts only after its last contribution. Without ``overlap_grad_reduce``
the reduction happens in ``finalize_model_grads``, after every ``W`` (checked: no weight
gradient may still be pending there).

:func:`zero_bubble_problems` lists the combinations ZB-H1 does not support, each with the
reason and the fix; recipe validation and the entries call it before anything is built, and
the function itself checks again before its first step: virtual pipeline stages,
``overlap_p2p_comm``, MoE EP overlap, multi-module pipelines, CUDA graphs, the MoE paged
stash, fine-grained activation offloading, ``gradient_accumulation_fusion``, a single stage,
and ``variable_seq_lengths`` (megatron then sends each tensor's shape in a blocking exchange
of its own first; ZB-H1's ``send_backward``, ``W``, ``recv_forward`` against the neighbour's
``send_forward_recv_backward`` deadlocks on it, as a PP=2 gloo run showed).
"""

from __future__ import annotations

import contextlib
import functools
from collections import deque
from typing import Any

import torch

from megatron_ext import registry
from megatron_ext.errors import MegatronExtError, Problem
from megatron_ext.pipeline import wgrad
from megatron_ext.schedules.schedule import (
    ZB_H1,
    Compute,
    Exchange,
    Schedule,
    SchedulePlan,
    Step,
    build_schedule,
)
from megatron_ext.schedules.text import ScheduleTextError, read_schedule_file

SCHEDULES = "megatron.core.pipeline_parallel.schedules"

__all__ = [
    "ZeroBubbleUnsupportedError",
    "check_zero_bubble",
    "forward_backward_pipelining_zero_bubble_h1",
    "rank_steps",
    "weight_gradient_step",
    "zero_bubble_problems",
]


class ZeroBubbleUnsupportedError(MegatronExtError, ValueError):
    """The run asks for ZB-H1 together with something ZB-H1 does not support."""


# ---------------------------------------------------------------------------------------------
# Guards
# ---------------------------------------------------------------------------------------------
_KEEP_1F1B = "or keep pipeline_schedule 1f1b"


def zero_bubble_problems(
    config: Any, *, multimodule: bool = False, pipeline_parallel_size: int | None = None
) -> list[Problem]:
    """What in ``config`` (a TransformerConfig or megatron's parsed arguments: the same field
    names) ZB-H1 cannot run with; ``multimodule``: the run is a multi-module pipeline.
    ``pipeline_parallel_size`` defaults to the config's."""
    problems = []

    def field(name: str, default: Any = None) -> Any:
        return getattr(config, name, default)

    vpp = field("virtual_pipeline_model_parallel_size")
    if vpp is not None and vpp > 1:
        problems.append(
            Problem(
                f"virtual_pipeline_model_parallel_size={vpp}",
                "ZB-H1 runs one model chunk per pipeline rank (no interleaving); drop the "
                f"virtual stages (vpp) {_KEEP_1F1B}",
            )
        )
    if field("overlap_p2p_comm", False):
        problems.append(
            Problem(
                "overlap_p2p_comm=True",
                "ZB-H1 exchanges with blocking P2P calls, as megatron's non-interleaved 1F1B "
                f"does; set overlap_p2p_comm False {_KEEP_1F1B}",
            )
        )
    if field("overlap_moe_expert_parallel_comm", False):
        problems.append(
            Problem(
                "overlap_moe_expert_parallel_comm=True",
                "MoE EP overlap runs megatron's combined 1F1B schedule (forward and backward "
                "of two micro-batches fused), which has no separate W step; set it False "
                f"{_KEEP_1F1B}",
            )
        )
    if multimodule:
        problems.append(
            Problem(
                "multi-module pipeline",
                "ZB-H1 is defined for one pipeline of one model; use pipeline_schedule 1f1b "
                "for multi-module plans",
            )
        )
    impl = field("cuda_graph_impl", "none") or "none"
    graphs = impl != "none" or field("enable_cuda_graph", False) or field("external_cuda_graph")
    if graphs:
        problems.append(
            Problem(
                f"cuda_graph_impl={impl!r}" if impl != "none" else "CUDA graphs",
                "captured graphs replay a layer's whole backward, weight gradient included, "
                f"so W cannot be deferred; switch CUDA graphs off {_KEEP_1F1B}",
            )
        )
    if field("moe_paged_stash", False):
        problems.append(
            Problem(
                "moe_paged_stash=True",
                "the paged stash recycles expert activations after each backward, which a "
                f"deferred W still reads; set moe_paged_stash False {_KEEP_1F1B}",
            )
        )
    if field("fine_grained_activation_offloading", False):
        problems.append(
            Problem(
                "fine_grained_activation_offloading=True",
                "offloaded activations are released after each backward, which a deferred "
                f"W still reads; switch the offloading off {_KEEP_1F1B}",
            )
        )
    if field("gradient_accumulation_fusion", False):
        problems.append(
            Problem(
                "gradient_accumulation_fusion=True",
                "the fused weight-gradient GEMM writes main_grad inside B, which the deferred "
                "W replaces (megatron_ext.guards.check_pipeline_schedule refuses it too); set "
                f"it False (--no-gradient-accumulation-fusion) {_KEEP_1F1B}",
            )
        )
    if field("variable_seq_lengths", False):
        problems.append(
            Problem(
                "variable_seq_lengths=True",
                "each tensor's shape then goes first in a blocking exchange of its own, and "
                "ZB-H1's send_backward, W, recv_forward waits on the neighbour's "
                "send_forward_recv_backward, which waits on that recv_forward's shape: a "
                f"deadlock (seen on gloo); use fixed sequence lengths {_KEEP_1F1B}",
            )
        )
    pp = pipeline_parallel_size or field("pipeline_model_parallel_size", 1) or 1
    if pp < 2:
        problems.append(
            Problem(
                f"pipeline_model_parallel_size={pp}",
                "ZB-H1 fills pipeline bubbles, and one stage has none (megatron runs its "
                f"no-pipelining schedule); use at least 2 pipeline stages {_KEEP_1F1B}",
            )
        )
    return problems


def check_zero_bubble(config: Any, **kwargs: Any) -> None:
    """Raise :class:`ZeroBubbleUnsupportedError` naming every problem of ``config``."""
    problems = zero_bubble_problems(config, **kwargs)
    if problems:
        raise ZeroBubbleUnsupportedError(
            "pipeline_schedule zb-h1: " + "; ".join(str(p) for p in problems)
        )


# ---------------------------------------------------------------------------------------------
# The steps
# ---------------------------------------------------------------------------------------------
def rank_steps(
    pipeline_size: int, rank: int, microbatches: int, order_file: str | None = None
) -> list[Step]:
    """This rank's ZB-H1 steps: ``build_schedule``'s list for the rank, or with
    ``order_file`` the order of that schedule text (config.pipeline_schedule_file) with the
    P2P calls derived from it, after :func:`~megatron_ext.schedules.text.schedule_from_text`'s
    checks (every rank reads and checks the same file, so all refuse it together)."""
    plan = SchedulePlan(pp=pipeline_size, microbatches=microbatches, schedule=ZB_H1)
    problems = plan.problems()
    if problems:
        raise ZeroBubbleUnsupportedError("; ".join(str(p) for p in problems))
    if order_file is None:
        return build_schedule(plan).ranks[rank]
    return _text_schedule(order_file, pipeline_size, microbatches).ranks[rank]


@functools.lru_cache(maxsize=8)
def _text_schedule(path: str, pipeline_size: int, microbatches: int) -> Schedule:
    """The checked schedule of a text file, read once per run (every iteration asks)."""
    plan = SchedulePlan(pp=pipeline_size, microbatches=microbatches, schedule=ZB_H1)
    try:
        return read_schedule_file(path, plan)
    except ScheduleTextError as exc:
        raise ZeroBubbleUnsupportedError(f"pipeline_schedule_file {path}: {exc}") from None


def weight_gradient_step(model_chunk: Any, microbatch: int, config: Any) -> None:
    """A ``W`` step: the micro-batch's deferred weight gradients, accumulated where DDP
    expects them (its grad hooks fire here for the deferred parameters)."""
    if config.timers is not None:
        config.timers("weight-gradient-compute", log_level=2).start()
    wgrad.run(microbatch)
    if config.timers is not None:
        config.timers("weight-gradient-compute").stop()


# How each communicator call is made: what it sends ("F": the latest forward's output, "B":
# the latest backward's input gradient) and what it receives ("F": an activation, "B": a
# gradient). Calls that talk to the next stage take is_last_stage, the others is_first_stage.
_CALLS: dict[str, tuple[str | None, str | None]] = {
    "recv_forward": (None, "F"),
    "recv_backward": (None, "B"),
    "send_forward": ("F", None),
    "send_backward": ("B", None),
    "send_forward_recv_backward": ("F", "B"),
    "send_backward_recv_forward": ("B", "F"),
}


class _Run:
    """One iteration's execution of a rank's step list."""

    def __init__(self, *, schedules: Any, model: Any, config: Any, communicator: Any, **kw: Any):
        self.schedules = schedules
        self.model = model
        self.config = config
        self.communicator = communicator
        self.forward_step_func = kw["forward_step_func"]
        self.data_iterator = kw["data_iterator"]
        self.num_microbatches = kw["num_microbatches"]
        self.collect_non_loss_data = kw["collect_non_loss_data"]
        self.first_val_step = kw["first_val_step"]
        self.cp_size = kw["cp_size"]
        self.recv_shapes = kw["recv_shapes"]
        self.send_shapes = kw["send_shapes"]
        self.enable_grad_sync = kw["enable_grad_sync"]
        self.last_backward = kw["last_backward"]
        self.max_outstanding_backprops = kw["max_outstanding_backprops"]
        self.first = communicator.is_pp_first_stage
        self.last = communicator.is_pp_last_stage
        self.forward_data_store: list = []
        self.total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda")
        self.activations: deque = deque()  # received, for the next forwards in order
        self.gradients: deque = deque()  # received, for the next backwards in order
        self.in_flight: dict[int, tuple[Any, Any]] = {}  # mb -> (input, output) until its B
        self.latest: dict[str, tuple[int, Any] | None] = {"F": None, "B": None}

    def step(self, step: Step) -> None:
        if isinstance(step, Exchange):
            self.exchange(step)
        elif step.kind == "F":
            self.forward(step.microbatch)
        elif step.kind == "B":
            self.backward(step.microbatch)
        else:
            # Looked up on the module at call time: the tracer wraps it.
            weight_gradient_step(self.model, step.microbatch, self.config)

    def forward(self, mb: int) -> None:
        config = self.config
        checkpoint = None
        if self.max_outstanding_backprops is not None:
            checkpoint = (
                mb % self.max_outstanding_backprops
                >= config.num_microbatches_with_partial_activation_checkpoints
            )
        input_tensor = self.activations.popleft()
        output_tensor, num_tokens = self.schedules.forward_step(
            self.forward_step_func,
            self.data_iterator,
            self.model,
            self.num_microbatches,
            input_tensor,
            self.forward_data_store,
            config,
            cp_group_size=self.cp_size,
            collect_non_loss_data=self.collect_non_loss_data,
            checkpoint_activations_microbatch=checkpoint,
            is_first_microbatch=self.schedules.check_first_val_step(
                self.first_val_step, False, mb == 0
            ),
            current_microbatch=mb,
            is_last_stage=self.last,
        )
        self.total_num_tokens += num_tokens
        self.in_flight[mb] = (input_tensor, output_tensor)
        self.latest["F"] = (mb, output_tensor)

    def backward(self, mb: int) -> None:
        input_tensor, output_tensor = self.in_flight.pop(mb)
        output_tensor_grad = self.gradients.popleft()
        if mb == self.last_backward and (self.config.grad_sync_func is None or self.first):
            # Before the last B: the sync window then holds it and every later W (module
            # docstring).
            self.enable_grad_sync()
        with wgrad.capture(mb):
            input_tensor_grad = self.schedules.backward_step(
                input_tensor, output_tensor, output_tensor_grad, self.config
            )
        self.latest["B"] = (mb, input_tensor_grad)

    def exchange(self, step: Exchange) -> None:
        sends, receives = _CALLS[step.call]
        method = getattr(self.communicator, step.call)
        to_next = sends == "F" or receives == "B"
        args: list[Any] = []
        sent = None
        if sends is not None:
            sent = self._sent(sends, step)
            self.latest[sends] = None  # sent once; not kept alive past the send
            args.append(sent)
        if receives is not None:
            args.append(self.recv_shapes if receives == "F" else self.send_shapes)
        args.append(self.last if to_next else self.first)
        received = method(*args)
        if receives == "F":
            self.activations.append(received)
        elif receives == "B":
            self.gradients.append(received)
        if sends == "F":
            # Sent: only its grad_fn is needed from now on (as megatron's 1F1B does).
            self.schedules.deallocate_output_tensor(sent, self.config.deallocate_pipeline_outputs)

    def _sent(self, kind: str, step: Exchange) -> Any:
        """The tensor(s) ``step`` sends: the latest F's output or B's input gradient."""
        latest = self.latest[kind]
        assert latest is not None, f"{step.call} before any {kind}"
        expected = [m.microbatch for m in step.messages if m.direction.startswith("send")]
        assert expected in ([], [latest[0]]), (
            f"{step.call} should send micro-batch {expected}, the latest {kind} is {latest[0]}"
        )
        return latest[1]


# ---------------------------------------------------------------------------------------------
# The forward-backward function
# ---------------------------------------------------------------------------------------------
def _schedules() -> Any:
    import importlib

    return importlib.import_module(SCHEDULES)


def _communicator(schedules: Any, config: Any, p2p_communicator: Any, pg_collection: Any):
    """The communicator and process groups, as megatron's 1F1B function settles them
    (single-module only); returns (communicator, pg_collection, tp_group, cp_size)."""
    if p2p_communicator is None and pg_collection is None:
        from megatron.core import parallel_state

        p2p_communicator = schedules.P2PCommunicator(
            pp_group=parallel_state.get_pipeline_model_parallel_group(), config=config
        )
        pg_collection = registry.private(f"{SCHEDULES}:_build_default_pg_collection")()
    elif p2p_communicator is None or pg_collection is None:
        raise ZeroBubbleUnsupportedError(
            "Provide both p2p_communicator and pg_collection, or neither"
        )
    multimodule = isinstance(
        pg_collection, schedules.MultiModuleProcessGroupCollection
    ) or isinstance(p2p_communicator, schedules.MultiModulePipelineCommunicator)
    check_zero_bubble(
        config, multimodule=multimodule, pipeline_parallel_size=p2p_communicator.total_stages
    )
    if not isinstance(pg_collection, schedules.ProcessGroupCollection):
        raise TypeError(f"pg_collection must be a ProcessGroupCollection, got {pg_collection!r}")
    return p2p_communicator, pg_collection, pg_collection.tp, pg_collection.cp.size()


def forward_backward_pipelining_zero_bubble_h1(
    *,
    forward_step_func,
    data_iterator,
    model,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: int | None = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: bool | None = None,
    adjust_tensor_shapes_fn=None,
    p2p_communicator=None,
    pg_collection=None,
    force_all_reduce: bool | None = False,
):
    """ZB-H1 (training); megatron's ``forward_backward_pipelining_without_interleaving``
    for ``forward_only``. Same arguments and return value as that function."""
    schedules = _schedules()
    if forward_only:
        return schedules.forward_backward_pipelining_without_interleaving(
            forward_step_func=forward_step_func,
            data_iterator=data_iterator,
            model=model,
            num_microbatches=num_microbatches,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            decoder_seq_length=decoder_seq_length,
            forward_only=True,
            collect_non_loss_data=collect_non_loss_data,
            first_val_step=first_val_step,
            adjust_tensor_shapes_fn=adjust_tensor_shapes_fn,
            p2p_communicator=p2p_communicator,
            pg_collection=pg_collection,
            force_all_reduce=force_all_reduce,
        )
    model = _only_chunk(model, "model")
    data_iterator = _only_chunk(data_iterator, "data_iterator")
    config = schedules.get_model_config(model)
    communicator, pg_collection, tp_group, cp_size = _communicator(
        schedules, config, p2p_communicator, pg_collection
    )
    steps = rank_steps(
        communicator.total_stages,
        communicator.current_stage,
        num_microbatches,
        getattr(config, "pipeline_schedule_file", None),
    )
    earlier = wgrad.pending()
    if earlier:
        raise wgrad.PendingWeightGradientError(
            f"weight gradients of micro-batches {earlier} are still pending from an "
            "earlier step; every W must run before the next forward-backward"
        )

    embedding_module = None
    if config.finalize_model_grads_func is not None:
        embedding_module = schedules.clear_embedding_activation_buffer(
            config, model, communicator.is_pp_last_stage
        )
    if config.timers is not None:
        config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)

    no_sync = _GradSync(config)
    shape_kwargs = dict(
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        decoder_seq_length=decoder_seq_length,
        config=config,
        tp_group=tp_group,
        cp_group=pg_collection.cp,
    )
    recv_shapes = schedules.get_tensor_shapes(**shape_kwargs)
    send_shapes = schedules.get_tensor_shapes(**shape_kwargs)
    if adjust_tensor_shapes_fn is not None:
        recv_shapes, send_shapes = adjust_tensor_shapes_fn(recv_shapes, send_shapes)
    warmup = min(communicator.total_stages - communicator.current_stage - 1, num_microbatches)
    run = _Run(
        schedules=schedules,
        model=model,
        config=config,
        communicator=communicator,
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        num_microbatches=num_microbatches,
        collect_non_loss_data=collect_non_loss_data,
        first_val_step=first_val_step,
        cp_size=cp_size,
        recv_shapes=recv_shapes,
        send_shapes=send_shapes,
        enable_grad_sync=no_sync.enable,
        last_backward=max(s.microbatch for s in steps if isinstance(s, Compute)),
        max_outstanding_backprops=(
            warmup + 1
            if config.num_microbatches_with_partial_activation_checkpoints is not None
            else None
        ),
    )
    no_sync.disable()
    try:
        for step in steps:
            run.step(step)
    except BaseException:
        # The failed iteration's stored work must not leak into the next one.
        wgrad.discard_pending()
        raise
    leftover = wgrad.pending()
    if leftover:
        wgrad.discard_pending()
        raise wgrad.PendingWeightGradientError(
            f"weight gradients of micro-batches {leftover} were never run by a W step; the "
            "gradients would be incomplete at finalize_model_grads"
        )
    # Launch any remaining grad reductions.
    if no_sync.active:
        no_sync.enable()
        if config.grad_sync_func is not None:
            config.grad_sync_func(model.parameters())

    if config.finalize_model_grads_func is not None:
        schedules.finish_embedding_wgrad_compute(
            config, embedding_module, communicator.is_pp_last_stage, tp_group
        )
        config.finalize_model_grads_func(
            [model],
            run.total_num_tokens if config.calculate_per_token_loss else None,
            pg_collection=pg_collection,
            force_all_reduce=force_all_reduce,
        )
    if config.timers is not None:
        config.timers("forward-backward").stop()
    return run.forward_data_store


def _only_chunk(value: Any, name: str) -> Any:
    if isinstance(value, list):
        if len(value) != 1:
            raise ZeroBubbleUnsupportedError(
                f"{name}: {len(value)} model chunks; ZB-H1 runs one chunk per rank (no vpp)"
            )
        return value[0]
    return value


class _GradSync:
    """DDP's ``no_sync`` context (``config.no_sync_func``), entered and left like megatron's
    schedules do."""

    def __init__(self, config: Any) -> None:
        self.no_sync_func = config.no_sync_func or contextlib.nullcontext
        self.context: Any = None

    @property
    def active(self) -> bool:
        return self.context is not None

    def disable(self) -> None:
        if self.context is None:
            self.context = self.no_sync_func()
            self.context.__enter__()

    def enable(self) -> None:
        if self.context is not None:
            self.context.__exit__(None, None, None)
            self.context = None
