"""Recording what megatron-core's pipeline schedules really do, step by step.

``with tracing() as tracer:`` applies the registry's ``"trace"`` patches (nothing is wrapped
outside the block, so tracing off costs nothing) and records, on this rank, every forward
and backward pass (micro-batch and chunk) and every call into the P2P communicator with the
messages it posts, each with wall-clock start and end times. Received tensors are labelled
with the forward or backward that consumes them (by identity), sent ones with the step that
produced them, so the recorded order can be compared with
:func:`megatron_ext.schedules.schedule.build_schedule` action for action.

The patched targets (megatron-core 0.19.2, ``pipeline_parallel.schedules``):
``forward_step``, ``backward_step``, ``backward_step_multimodule`` (the passes) and the two
pipelined schedule functions, whose P2P communicator is handed over wrapped in a recorder
(the default one is built exactly as the schedule would build it). megatron-ext's ZB-H1
schedule (:mod:`megatron_ext.pipeline.zero_bubble`) runs its forwards and input-gradient
backwards through the same two passes; its schedule function is wrapped like megatron's, and
its ``weight_gradient_step`` is recorded as a pass of kind ``W`` (micro-batch, chunk).

When a pass or an exchange raises, the error gets a note naming where it happened --
"rank 2, chunk 1, step 7: B3" -- and, if the tracer knows the theoretical schedule, that
rank's order with the step marked.

``megatron-ext run RECIPE --trace`` turns this on in every rank through the
``MEGATRON_EXT_TRACE_DIR`` environment variable (:func:`start_from_environment`); each rank
writes ``trace-rank-N.json`` when it exits and the runner merges them into ``trace.json``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_ext import registry
from megatron_ext.schedules.schedule import (
    DIRECTIONS,
    Compute,
    Exchange,
    Message,
    Schedule,
    Step,
    describe_step,
    format_steps,
)

log = logging.getLogger(__name__)

TRACE_ENV = "MEGATRON_EXT_TRACE_DIR"
SCHEDULES = "megatron.core.pipeline_parallel.schedules"


@dataclass
class _Message:
    direction: str
    microbatch: int | None = None
    chunk: int | None = None
    nbytes: int = 0  # of the tensors a send carries (0 for receives)


@dataclass
class Event:
    """One recorded step: a pass (``kind`` F/B/W) or an exchange (``call`` and messages)."""

    iteration: int
    index: int
    start_ns: int
    end_ns: int = 0
    kind: str | None = None
    microbatch: int | None = None
    chunk: int | None = None
    call: str | None = None
    messages: list[_Message] = field(default_factory=list)
    error: str | None = None  # the exception this step raised

    def step(self) -> Step:
        if self.call is None:
            # A pass: _event(kind=..., microbatch=...) set both.
            assert self.kind is not None and self.microbatch is not None
            return Compute(self.kind, self.microbatch, self.chunk or 0)
        return Exchange(
            self.call, tuple(Message(m.direction, m.microbatch, m.chunk) for m in self.messages)
        )

    def to_dict(self) -> dict:
        return {
            "iteration": self.iteration,
            "index": self.index,
            "start_ns": self.start_ns,
            "end_ns": self.end_ns,
            "kind": self.kind,
            "microbatch": self.microbatch,
            "chunk": self.chunk,
            "call": self.call,
            "messages": [[m.direction, m.microbatch, m.chunk, m.nbytes] for m in self.messages],
            "error": self.error,
        }

    @classmethod
    def from_dict(cls, data: dict) -> Event:
        messages = [_Message(*m) for m in data.pop("messages")]
        return cls(**data, messages=messages)


class Tracer:
    """This rank's recording. ``schedule``: the theory, to mark a failing step in errors."""

    def __init__(self, rank: int | None = None, schedule: Schedule | None = None) -> None:
        self.rank = rank
        self.schedule = schedule
        self.events: list[Event] = []
        self.iteration = -1
        self._index = 0
        self._produced: dict[
            int, tuple[Any, int | None, int | None]
        ] = {}  # id -> (object, mb, chunk)
        self._received: dict[int, tuple[Any, _Message]] = {}  # id -> (object, its message)
        self.module: str | None = None  # multi-module: the rank's module names
        self.pipeline_rank: int | None = None  # the theory's rank (world rank if multi-module)

    # ------------------------------------------------------------------ bookkeeping
    def begin_iteration(self) -> None:
        self.iteration += 1
        self._index = 0
        self._produced.clear()
        self._received.clear()

    def _event(self, **kwargs: Any) -> Event:
        event = Event(self.iteration, self._index, time.time_ns(), **kwargs)
        self._index += 1
        self.events.append(event)
        return event

    def _remember(self, obj: Any, microbatch: int | None, chunk: int | None) -> None:
        for item in _flatten(obj):
            self._produced[id(item)] = (item, microbatch, chunk)

    def _origin(self, obj: Any) -> tuple[int | None, int | None]:
        for item in _flatten(obj):
            if id(item) in self._produced:
                _, mb, chunk = self._produced[id(item)]
                return mb, chunk
        return None, None

    def _consume(self, obj: Any, microbatch: int | None, chunk: int | None) -> None:
        """A pass takes ``obj``: label the message that brought it."""
        for item in _flatten(obj):
            entry = self._received.pop(id(item), None)
            if entry is not None:
                entry[1].microbatch, entry[1].chunk = microbatch, chunk

    def steps(self, iteration: int = 0) -> list[Step]:
        return [e.step() for e in self.events if e.iteration == iteration]

    # ------------------------------------------------------------------ errors
    def where(self, event: Event) -> str:
        chunks = (
            self.schedule.chunks
            if self.schedule is not None
            else max((e.chunk or 0 for e in self.events), default=0) + 1
        )
        text = describe_step(self._rank(), event.index, event.step(), chunks, self.module)
        return text + f" (iteration {event.iteration})"

    def _rank(self) -> int:
        if self.rank is None:
            import torch.distributed as dist

            self.rank = dist.get_rank() if dist.is_initialized() else 0
        return self.rank

    def annotate(self, error: BaseException, event: Event) -> None:
        if getattr(error, "_megatron_ext_step", None) is not None:
            return  # an inner step already named itself
        error._megatron_ext_step = self.where(event)  # type: ignore[attr-defined]  # our mark
        note = f"pipeline step: {error._megatron_ext_step}"  # type: ignore[attr-defined]
        if self.schedule is not None and self._rank() < len(self.schedule.ranks):
            note += f"\nrank {self._rank()}'s schedule (megatron-core's rules):\n"
            note += format_steps(self.schedule, self._rank(), mark=event.index)
        error.add_note(note)

    # ------------------------------------------------------------------ output
    def dump(self, path: Path) -> None:
        Path(path).write_text(
            json.dumps(
                {
                    "rank": self._rank(),
                    "module": self.module,
                    "pipeline_rank": self.pipeline_rank,
                    "events": [e.to_dict() for e in self.events],
                }
            )
        )


def _flatten(obj: Any) -> list:
    if obj is None:
        return []
    if isinstance(obj, dict):
        return [obj] + [x for v in obj.values() for x in _flatten(v)]
    if isinstance(obj, (list, tuple)):
        return [obj] + [x for v in obj for x in _flatten(v)]
    return [obj]


def _nbytes(obj: Any) -> int:
    """Bytes of the tensors in ``obj`` (a tensor or nested lists/dicts of them)."""
    return sum(
        item.numel() * item.element_size()
        for item in _flatten(obj)
        if hasattr(item, "element_size")
    )


_ACTIVE: Tracer | None = None
_ENVIRONMENT_BLOCK: Any = None


def active() -> Tracer | None:
    return _ACTIVE


@contextlib.contextmanager
def tracing(tracer: Tracer | None = None) -> Iterator[Tracer]:
    """Record every pipelined schedule run inside the block (see the module docstring)."""
    global _ACTIVE
    if _ACTIVE is not None:
        raise RuntimeError("tracing() is already active")
    _ACTIVE = tracer or Tracer()
    registry.apply("trace")
    try:
        yield _ACTIVE
    finally:
        registry.undo("trace")
        _ACTIVE = None


def start_from_environment() -> Tracer | None:
    """With ``MEGATRON_EXT_TRACE_DIR`` set: trace for the rest of the process and write
    ``trace-rank-N.json`` there at exit. Does nothing otherwise."""
    directory = os.environ.get(TRACE_ENV)
    if not directory or _ACTIVE is not None:
        return _ACTIVE
    global _ENVIRONMENT_BLOCK
    # Kept for the life of the process: a collected generator would close and end tracing.
    _ENVIRONMENT_BLOCK = tracing()
    tracer = _ENVIRONMENT_BLOCK.__enter__()

    def write() -> None:
        rank = int(os.environ.get("RANK", tracer.rank or 0))
        tracer.rank = rank
        Path(directory).mkdir(parents=True, exist_ok=True)
        tracer.dump(Path(directory) / f"trace-rank-{rank}.json")

    atexit.register(write)
    log.info("tracing this rank's pipeline schedule into %s", directory)
    return tracer


# ---------------------------------------------------------------------------------------------
# The patches (registry group "trace")
# ---------------------------------------------------------------------------------------------
def _run(tracer: Tracer, event: Event, call: Callable[[], Any]) -> Any:
    try:
        return call()
    except BaseException as error:
        if event.error is None and getattr(error, "_megatron_ext_step", None) is None:
            event.error = f"{type(error).__name__}: {error}"[:500]
        tracer.annotate(error, event)
        raise
    finally:
        event.end_ns = time.time_ns()


def traced_forward_step(original: Callable) -> Callable:
    def forward_step(
        forward_step_func, data_iterator, model, num_microbatches, input_tensor, *args, **kwargs
    ):
        tracer = _ACTIVE
        if tracer is None:
            return original(
                forward_step_func,
                data_iterator,
                model,
                num_microbatches,
                input_tensor,
                *args,
                **kwargs,
            )
        mb = kwargs.get("current_microbatch")
        chunk = kwargs.get("vp_stage") or 0
        tracer._consume(input_tensor, mb, chunk)
        event = tracer._event(kind="F", microbatch=mb, chunk=chunk)
        output, num_tokens = _run(
            tracer,
            event,
            lambda: original(
                forward_step_func,
                data_iterator,
                model,
                num_microbatches,
                input_tensor,
                *args,
                **kwargs,
            ),
        )
        tracer._remember(output, mb, chunk)
        return output, num_tokens

    return forward_step


def traced_backward_step(original: Callable) -> Callable:
    def backward_step(input_tensor, output_tensor, output_tensor_grad, config, *args, **kwargs):
        tracer = _ACTIVE
        if tracer is None:
            return original(
                input_tensor, output_tensor, output_tensor_grad, config, *args, **kwargs
            )
        mb, chunk = tracer._origin(output_tensor)
        tracer._consume(output_tensor_grad, mb, chunk)
        event = tracer._event(kind="B", microbatch=mb, chunk=chunk)
        grad = _run(
            tracer,
            event,
            lambda: original(
                input_tensor, output_tensor, output_tensor_grad, config, *args, **kwargs
            ),
        )
        tracer._remember(grad, mb, chunk)
        return grad

    return backward_step


def traced_weight_gradient_step(original: Callable) -> Callable:
    """ZB-H1's ``W``: the weight gradient of one micro-batch on one model chunk, deferred
    after its ``B`` (megatron_ext.pipeline.zero_bubble.weight_gradient_step(model_chunk,
    microbatch, config))."""

    def weight_gradient_step(*args, **kwargs):
        tracer = _ACTIVE
        if tracer is None:
            return original(*args, **kwargs)
        model_chunk = _argument(args, kwargs, (0, "model_chunk"))
        mb = _argument(args, kwargs, (1, "microbatch"))
        chunk = getattr(model_chunk, "vp_stage", None) or 0
        event = tracer._event(kind="W", microbatch=mb, chunk=chunk)
        return _run(tracer, event, lambda: original(*args, **kwargs))

    return weight_gradient_step


# How each communicator call says what it sends and receives: argument positions (and
# names) of the activation sent, the gradient sent, the receive flags and the end-of-model
# flags that suppress the whole call.
_CALLS: dict[str, dict[str, Any]] = {
    "recv_forward": dict(first=(1, "is_first_stage"), recv=("recv_prev",)),
    "recv_backward": dict(last=(1, "is_last_stage"), recv=("recv_next",)),
    "send_forward": dict(out=(0, "output_tensors"), last=(1, "is_last_stage")),
    "send_backward": dict(grad=(0, "input_tensor_grads"), first=(1, "is_first_stage")),
    "send_forward_recv_backward": dict(
        out=(0, "output_tensors"), last=(2, "is_last_stage"), recv=("recv_next",)
    ),
    "send_backward_recv_forward": dict(
        grad=(0, "input_tensor_grads"), first=(2, "is_first_stage"), recv=("recv_prev",)
    ),
    "send_forward_recv_forward": dict(out=(0, "output_tensor"), recv_prev=(1, "recv_prev")),
    "send_backward_recv_backward": dict(grad=(0, "input_tensor_grad"), recv_next=(1, "recv_next")),
    "send_forward_backward_recv_forward_backward": dict(
        out=(0, "output_tensor"),
        grad=(1, "input_tensor_grad"),
        recv_prev=(2, "recv_prev"),
        recv_next=(3, "recv_next"),
    ),
}
_MISSING = object()


def _argument(args: tuple, kwargs: dict, where: tuple[int, str], default: Any = None) -> Any:
    position, name = where
    if name in kwargs:
        return kwargs[name]
    if len(args) > position:
        return args[position]
    return default


class RecordingCommunicator:
    """Wraps a P2P (or multi-module) communicator: every schedule-facing call is recorded,
    everything else is the wrapped communicator's."""

    def __init__(self, inner: Any, tracer: Tracer) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_tracer", tracer)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if name in _CALLS and callable(value):
            return lambda *args, **kwargs: self._record(name, value, args, kwargs)
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._inner, name, value)

    def _record(self, name: str, method: Callable, args: tuple, kwargs: dict) -> Any:
        spec, tracer = _CALLS[name], self._tracer
        suppressed = False
        if "first" in spec:
            suppressed = bool(_argument(args, kwargs, spec["first"], False))
        if "last" in spec:
            suppressed = bool(_argument(args, kwargs, spec["last"], False))
        planned: dict[str, Any] = {}
        if not suppressed:
            out = _argument(args, kwargs, spec["out"]) if "out" in spec else None
            grad = _argument(args, kwargs, spec["grad"]) if "grad" in spec else None
            if out is not None:
                planned["send_next"] = out
            if grad is not None:
                planned["send_prev"] = grad
            for direction in spec.get("recv", ()):
                planned[direction] = _MISSING
            for flag in ("recv_prev", "recv_next"):
                if flag in spec and _argument(args, kwargs, spec[flag], False):
                    planned[flag] = _MISSING
        messages = []
        for direction in DIRECTIONS:
            if direction not in planned:
                continue
            if direction.startswith("send"):
                mb, chunk = tracer._origin(planned[direction])
                messages.append(_Message(direction, mb, chunk, _nbytes(planned[direction])))
            else:
                messages.append(_Message(direction))
        event = tracer._event(call=name, messages=messages)
        result = _run(tracer, event, lambda: method(*args, **kwargs))
        self._label_receives(name, result, messages)
        return result

    def _label_receives(self, name: str, result: Any, messages: list[_Message]) -> None:
        """Remember each received tensor with its message, so that the pass consuming it
        labels it."""
        by_direction = {m.direction: m for m in messages if m.direction.startswith("recv")}
        if not by_direction:
            return
        if name == "send_forward_backward_recv_forward_backward":
            received = {"recv_prev": result[0], "recv_next": result[1]}
        else:
            if isinstance(result, tuple):  # overlap_p2p_comm: (tensor, wait handles)
                result = result[0]
            received = {direction: result for direction in by_direction}
        for direction, message in by_direction.items():
            for item in _flatten(received.get(direction)):
                self._tracer._received[id(item)] = (item, message)


def traced_schedule(original: Callable) -> Callable:
    """A pipelined schedule function whose communicator records (one iteration per call)."""

    def schedule(*, p2p_communicator=None, pg_collection=None, **kwargs):
        tracer = _ACTIVE
        if tracer is None or isinstance(p2p_communicator, RecordingCommunicator):
            # (ZB-H1's evaluation hands its already recording communicator to megatron's 1F1B:
            # one iteration, recorded once.)
            return original(
                p2p_communicator=p2p_communicator, pg_collection=pg_collection, **kwargs
            )
        if p2p_communicator is None and pg_collection is None:
            p2p_communicator, pg_collection = _default_communicator(kwargs["model"])
        tracer.begin_iteration()
        _describe_multimodule(tracer, p2p_communicator)
        return original(
            p2p_communicator=RecordingCommunicator(p2p_communicator, tracer),
            pg_collection=pg_collection,
            **kwargs,
        )

    return schedule


def _default_communicator(model: Any) -> tuple[Any, Any]:
    """What the schedule builds when it is given neither (``parallel_state``'s groups)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.utils import get_model_config

    first = model[0] if isinstance(model, list) else model
    communicator = P2PCommunicator(
        pp_group=parallel_state.get_pipeline_model_parallel_group(), config=get_model_config(first)
    )
    build_default = registry.private(f"{SCHEDULES}:_build_default_pg_collection")
    return communicator, build_default()


def _describe_multimodule(tracer: Tracer, communicator: Any) -> None:
    """Where this rank sits: its module(s) and the rank of the theory it follows."""
    modules = getattr(communicator, "rank_module_map", None)
    if modules:
        tracer.module = "+".join(modules)
        tracer.pipeline_rank = tracer._rank()
    else:
        tracer.pipeline_rank = communicator.pp_group.rank()
