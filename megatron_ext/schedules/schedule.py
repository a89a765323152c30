"""megatron-core 0.19.2's pipeline schedules as data: what every rank does, in order.

For a plan (pipeline size ``pp``, virtual chunks ``vpp``, micro-batches ``m``, optionally a
multi-module plan) :func:`build_schedule` returns, per rank, the exact sequence of steps the
schedule function runs: forward (``F``) and backward (``B``) of a micro-batch on a model
chunk, and every call into the P2P communicator with the messages it posts. It follows the
rules of megatron-core's own code, not a textbook picture:

- 1F1B (``forward_backward_pipelining_without_interleaving``): ``pp - rank - 1`` warm-up
  forwards (capped at ``m``; for multi-module pipelines the builder's per-rank count, the
  number of stages downstream of the rank), one ``recv_forward`` before the steady state,
  ``send_forward_recv_backward`` after each steady forward, ``send_backward_recv_forward``
  after each steady backward except the last (``send_backward``), then the cool-down;
- interleaved (``forward_backward_pipelining_with_interleaving``, ``overlap_p2p_comm`` off,
  the default with batched P2P): the chunk order of ``get_schedule_table`` with
  ``microbatch_group_size_per_vp_stage``, the warm-up ``2 * (pp - rank - 1) + (vpp - 1) * g``,
  the receive rules of ``recv_tensor_from_previous_stage`` (the leading stage lags by
  ``pp - 1`` steps; the last chunk's output wraps from the last rank to the first rank's next
  chunk), the combined four-way exchange that ends the warm-up and every steady step, and the
  cool-down's ``send_backward_recv_backward``; with ``overlap_p2p_comm`` on (what megatron's
  training arguments set for every interleaved run unless ``--no-overlap-p2p-communication``;
  they require it at PP=2) the warm-up ends with ``send_forward_recv_forward`` then a
  ``send_backward_recv_backward`` that posts the first gradient receive, and every steady step
  has two exchanges, ``send_forward_recv_forward`` after its forward and
  ``send_backward_recv_backward`` after its backward (``overlap_p2p_comm_warmup_flush`` off);
- ZB-H1 (megatron-ext's zero-bubble schedule, :mod:`megatron_ext.pipeline.zero_bubble`): the
  1F1B skeleton with the backward split into ``B`` (input gradient, sent upstream at once) and
  ``W`` (weight gradient, local). Rank ``r`` keeps at most ``r`` weight gradients pending:
  after every ``B`` it runs the oldest ``W`` while more than ``r`` wait, and the rest at the
  end. A ``W`` holds a micro-batch's activations as long as its forward did, so every rank's
  peak in-flight count is ``pp``, 1F1B's peak on the first stage (the ZB-H1 rule of
  arXiv 2401.10241). When a steady ``B`` is followed by a ``W``, 1F1B's
  ``send_backward_recv_forward`` is split into ``send_backward``, the ``W``, then
  ``recv_forward``: the gradient leaves before the weight gradient is computed and the ``W``
  fills the wait for the next activation.

A received tensor is labelled with the step that consumes it: the schedule queues received
activations (gradients) per chunk and its forwards (backwards) of a chunk take them in
micro-batch order. Within one call the messages are listed in the order megatron-ext's
batched P2P posts them (forward pair first: send_next, recv_prev, send_prev, recv_next).

:func:`simulate` places the steps on a time axis (forward 1 unit, backward 2 by default) to
get the bubble fraction, and :class:`Schedule` reports peak in-flight micro-batches per rank
and bytes per step on each pipeline edge. :mod:`megatron_ext.schedules.trace` records the same
steps from a real run; :func:`compare` says where they differ.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_ext.errors import MegatronExtError, Problem

# The order megatron-ext's batched P2P posts one call's messages (megatron_ext.pipeline.p2p).
DIRECTIONS = ("send_next", "recv_prev", "send_prev", "recv_next")
# What each direction carries: activations travel forward, gradients backward.
CARRIES = {"send_next": "F", "recv_prev": "F", "send_prev": "B", "recv_next": "B"}


@dataclass(frozen=True)
class Compute:
    """A forward or backward pass of one micro-batch through one model chunk."""

    kind: str  # "F" | "B" | "W" (ZB-H1's deferred weight gradient)
    microbatch: int
    chunk: int = 0

    def label(self, chunks: int = 1) -> str:
        return f"{self.kind}{self.microbatch}" + (f"c{self.chunk}" if chunks > 1 else "")


@dataclass(frozen=True)
class Message:
    """One tensor a P2P call sends or receives: its direction, and the micro-batch and chunk
    (on this rank) that produced it (sends) or will consume it (receives)."""

    direction: str  # one of DIRECTIONS
    microbatch: int | None
    chunk: int | None

    def label(self, chunks: int = 1) -> str:
        verb = "s" if self.direction.startswith("send") else "r"
        where = "" if self.microbatch is None else str(self.microbatch)
        if chunks > 1 and self.chunk is not None:
            where += f"c{self.chunk}"
        return f"{verb}{CARRIES[self.direction]}{where or '?'}"


@dataclass(frozen=True)
class Exchange:
    """One call into the P2P communicator (``send_forward_recv_backward`` ...) and the
    messages it posts; a call at the model's ends may post nothing."""

    call: str
    messages: tuple[Message, ...] = ()

    def label(self, chunks: int = 1) -> str:
        return "+".join(m.label(chunks) for m in self.messages) or "-"


Step = Compute | Exchange


def step_label(step: Step, chunks: int = 1) -> str:
    return step.label(chunks)


class SchedulePlanError(MegatronExtError, ValueError):
    """A plan megatron-core would refuse, or step times that cannot be simulated."""


ONE_F_ONE_B = "1f1b"
ZB_H1 = "zb-h1"
SCHEDULES = (ONE_F_ONE_B, ZB_H1)


# ---------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------
@dataclass
class SchedulePlan:
    """What decides a schedule. ``multimodule`` is a
    :class:`~megatron_ext.multimodule.plan.MultiModulePlan` (then ``pp`` and ``vpp`` are
    ignored: every rank runs 1F1B with its own warm-up). ``microbatch_group_size`` is
    megatron's ``microbatch_group_size_per_vp_stage`` (None: ``pp``, megatron's default)."""

    pp: int = 1
    vpp: int | None = None
    microbatches: int = 1
    microbatch_group_size: int | None = None
    multimodule: Any = None
    schedule: str = "1f1b"  # or "zb-h1" (recipe parallelism.schedule, --pipeline-schedule)
    # megatron's config.overlap_p2p_comm (interleaved only): separate forward and backward
    # exchanges instead of the combined four-way one.
    overlap_p2p_comm: bool = False
    # A schedule text whose order the run executes instead of the built one (ZB-H1 only:
    # recipe parallelism.schedule_file); megatron_ext.schedules.text.schedule_of reads it.
    order_file: str | None = None

    @property
    def chunks(self) -> int:
        return self.vpp or 1

    @property
    def group_size(self) -> int:
        return self.microbatch_group_size or self.pp

    def problems(self) -> list[Problem]:
        """Why megatron-core would refuse this plan (one each, with the fix)."""
        problems: list[Problem] = []
        if self.schedule not in SCHEDULES:
            problems.append(
                Problem(f"schedule {self.schedule!r}", f"use one of {', '.join(SCHEDULES)}")
            )
        elif self.schedule == ZB_H1 and (self.vpp is not None or self.multimodule is not None):
            what = "--vpp" if self.vpp is not None else "a multi-module plan"
            problems.append(
                Problem(
                    f"schedule zb-h1 with {what}",
                    "ZB-H1 is defined for one chunk per rank of one pipeline; use "
                    "schedule 1f1b for interleaving and multi-module pipelines",
                )
            )
        if problems or self.multimodule is not None:
            return problems
        if self.pp < 1:
            problems.append(Problem(f"--pp {self.pp}", "the pipeline needs at least one stage"))
        if self.microbatches < 1:
            problems.append(
                Problem(f"--microbatches {self.microbatches}", "at least one micro-batch")
            )
        if self.vpp is not None and self.vpp < 1:
            problems.append(
                Problem(f"--vpp {self.vpp}", "at least one chunk per rank (or leave it out)")
            )
        if problems or self.vpp is None:
            return problems
        if self.pp == 1:
            problems.append(
                Problem("--vpp needs --pp > 1", "megatron interleaves chunks only across stages")
            )
        g, m = self.group_size, self.microbatches
        if g > m or g < self.pp:
            problems.append(
                Problem(
                    f"microbatch_group_size_per_vp_stage={g}",
                    f"must lie in [pp={self.pp}, microbatches={m}] (megatron-core raises "
                    f"otherwise); use at least {self.pp} micro-batches",
                )
            )
        elif 0 < m % g < self.pp:
            problems.append(
                Problem(
                    f"--microbatches {m}",
                    f"leaves a last group of {m % g} < pp={self.pp} (megatron-core raises: "
                    f"dependency bubbles); use a multiple of {g} or a remainder >= {self.pp}",
                )
            )
        return problems


# ---------------------------------------------------------------------------------------------
# Per-rank step lists
# ---------------------------------------------------------------------------------------------
class _RankBuilder:
    """Collects one rank's steps, labelling received tensors with the step consuming them
    (the schedule's per-chunk FIFO queues of received activations and gradients)."""

    def __init__(self) -> None:
        self.steps: list[Step] = []
        # kind -> chunk -> tensors received (consumed) so far
        self._received: dict[str, dict[int, int]] = {"F": {}, "B": {}}
        self._consumed: dict[str, dict[int, int]] = {"F": {}, "B": {}}

    def compute(self, kind: str, microbatch: int, chunk: int) -> None:
        self.steps.append(Compute(kind, microbatch, chunk))

    def exchange(
        self, call: str, sends: dict[str, tuple[int, int]], receives: dict[str, int]
    ) -> None:
        """``sends``: direction -> (micro-batch, chunk) sent; ``receives``: direction -> the
        chunk whose queue the tensor joins."""
        messages = []
        for direction in DIRECTIONS:
            if direction in sends:
                mb, chunk = sends[direction]
                messages.append(Message(direction, mb, chunk))
            elif direction in receives:
                kind, chunk = CARRIES[direction], receives[direction]
                queue = self._received[kind].setdefault(chunk, 0)
                self._received[kind][chunk] = queue + 1
                messages.append(Message(direction, queue, chunk))
        self.steps.append(Exchange(call, tuple(messages)))


def one_f_one_b(microbatches: int, warmup: int, first: bool, last: bool) -> list[Step]:
    """One rank of ``forward_backward_pipelining_without_interleaving`` (training): the
    skeleton ZB-H1 shares, with each backward whole (no ``W`` steps)."""
    return zero_bubble_h1(microbatches, warmup, first, last, pending_limit=None)


def zero_bubble_h1(
    microbatches: int, warmup: int, first: bool, last: bool, pending_limit: int | None
) -> list[Step]:
    """One rank of ZB-H1 (training): 1F1B's forwards and input-gradient backwards, with the
    weight gradients ``W`` deferred while at most ``pending_limit`` (the rank's position in
    the pipeline) wait; the module docstring gives the P2P calls. ``pending_limit=None``:
    whole backwards, no ``W`` steps, which is 1F1B (:func:`one_f_one_b`)."""
    rank = _RankBuilder()
    warmup = min(warmup, microbatches)
    remaining = microbatches - warmup
    pending: list[int] = []

    def recv_forward():
        rank.exchange("recv_forward", {}, {} if first else {"recv_prev": 0})

    def send_backward(mb: int):
        rank.exchange("send_backward", {} if first else {"send_prev": (mb, 0)}, {})

    def backward(mb: int) -> list[int]:
        """B of ``mb``; returns the weight gradients now due (oldest first)."""
        rank.compute("B", mb, 0)
        if pending_limit is None:
            return []
        pending.append(mb)
        due = []
        while len(pending) > pending_limit:
            due.append(pending.pop(0))
        return due

    def weight_gradients(mbs: list[int]):
        for mb in mbs:
            rank.compute("W", mb, 0)

    for i in range(warmup):
        recv_forward()
        rank.compute("F", i, 0)
        rank.exchange("send_forward", {} if last else {"send_next": (i, 0)}, {})
    if remaining > 0:
        recv_forward()
    for i in range(remaining):
        f = warmup + i
        rank.compute("F", f, 0)
        rank.exchange(
            "send_forward_recv_backward",
            {} if last else {"send_next": (f, 0)},
            {} if last else {"recv_next": 0},
        )
        due = backward(i)
        if i == remaining - 1:
            send_backward(i)
            weight_gradients(due)
        elif due:
            send_backward(i)
            weight_gradients(due)
            recv_forward()
        else:
            rank.exchange(
                "send_backward_recv_forward",
                {} if first else {"send_prev": (i, 0)},
                {} if first else {"recv_prev": 0},
            )
    for i in range(warmup):
        b = remaining + i
        rank.exchange("recv_backward", {}, {} if last else {"recv_next": 0})
        due = backward(b)
        send_backward(b)
        weight_gradients(due)
    weight_gradients(pending)
    return rank.steps


def schedule_table(microbatches: int, chunks: int, group_size: int) -> list[tuple[int, int]]:
    """megatron's ``get_schedule_table``: (micro-batch, chunk) of every virtual step."""
    table = []
    for start in range(0, microbatches, group_size):
        stop = microbatches if start + group_size >= microbatches else start + group_size
        table += [(mb, chunk) for chunk in range(chunks) for mb in range(start, stop)]
    return table


def interleaved_warmup(pp: int, rank: int, chunks: int, group_size: int, microbatches: int) -> int:
    """megatron's ``get_pp_rank_microbatches`` for the interleaved schedule (training)."""
    warmup = (pp - rank - 1) * 2 + (chunks - 1) * group_size
    return min(warmup, microbatches * chunks)


def interleaved(
    pp: int, rank: int, chunks: int, microbatches: int, group_size: int, overlap: bool = False
) -> list[Step]:
    """One rank of ``forward_backward_pipelining_with_interleaving`` (training; ``overlap``:
    ``config.overlap_p2p_comm`` with ``overlap_p2p_comm_warmup_flush`` off, else batched P2P)."""
    total = microbatches * chunks
    table = schedule_table(microbatches, chunks, group_size)
    warmup = interleaved_warmup(pp, rank, chunks, group_size, microbatches)
    all_warmup = warmup >= total
    remaining = total - warmup
    is_first_rank, is_last_rank = rank == 0, rank == pp - 1

    def chunk_of(k: int, forward: bool) -> int:
        chunk = table[k % total][1]
        return chunk if forward else chunks - chunk - 1

    def first_stage(chunk: int) -> bool:  # the model's very first stage: nothing to receive
        return chunk == 0 and is_first_rank

    def last_stage(chunk: int) -> bool:  # the model's very last stage: computes the loss
        return chunk == chunks - 1 and is_last_rank

    def receives(k: int, forward: bool) -> tuple[bool, int]:
        """megatron's ``recv_tensor_from_previous_stage``."""
        leading = is_first_rank if forward else is_last_rank
        if not leading:
            return True, chunk_of(k + 1, forward)
        recv = True
        last_chunk = chunks - 1 if forward else 0
        if k < pp - 1:
            recv, next_chunk = False, chunk_of(k + 1, forward)
        else:
            next_chunk = chunk_of(k - (pp - 1), forward)
        if next_chunk == last_chunk:
            recv = False
        return recv, next_chunk + (1 if forward else -1)

    forwards_done: dict[int, int] = {}
    backwards_done: dict[int, int] = {}

    def run_forward(k: int) -> tuple[int, int]:
        chunk = chunk_of(k, True)
        mb = forwards_done.get(chunk, 0)
        forwards_done[chunk] = mb + 1
        steps.compute("F", mb, chunk)
        return mb, chunk

    def run_backward(k: int) -> tuple[int, int]:
        chunk = chunk_of(k, False)
        mb = backwards_done.get(chunk, 0)
        backwards_done[chunk] = mb + 1
        steps.compute("B", mb, chunk)
        return mb, chunk

    steps = _RankBuilder()
    steps.exchange("recv_forward", {}, {} if first_stage(0) else {"recv_prev": 0})
    for k in range(warmup):
        mb, chunk = run_forward(k)
        recv_prev, next_chunk = receives(k, True)
        if k == total - 1:
            recv_prev = False
        sends = {} if last_stage(chunk) else {"send_next": (mb, chunk)}
        recvs = {"recv_prev": next_chunk} if recv_prev else {}
        ends_warmup = k == warmup - 1 and not all_warmup
        first_grad = {} if is_last_rank else {"recv_next": chunks - 1}
        if ends_warmup and not overlap:
            steps.exchange(
                "send_forward_backward_recv_forward_backward", sends, {**recvs, **first_grad}
            )
        else:
            steps.exchange("send_forward_recv_forward", sends, recvs)
        if ends_warmup and overlap:  # posts the receive of the first gradient on its own
            steps.exchange("send_backward_recv_backward", {}, first_grad)
    for k in range(remaining):
        fk = k + warmup
        f_mb, f_chunk = run_forward(fk)
        f_sends = {} if last_stage(f_chunk) else {"send_next": (f_mb, f_chunk)}
        recv_prev, next_f_chunk = receives(fk, True)
        if k == remaining - 1:
            recv_prev = False
        f_recvs = {"recv_prev": next_f_chunk} if recv_prev else {}
        if overlap:  # the forward's exchange leaves before the backward runs
            steps.exchange("send_forward_recv_forward", f_sends, f_recvs)
        b_mb, b_chunk = run_backward(k)
        b_sends = {} if first_stage(b_chunk) else {"send_prev": (b_mb, b_chunk)}
        recv_next, next_b_chunk = receives(k, False)
        b_recvs = {"recv_next": next_b_chunk} if recv_next else {}
        if overlap:
            steps.exchange("send_backward_recv_backward", b_sends, b_recvs)
        else:
            steps.exchange(
                "send_forward_backward_recv_forward_backward",
                {**f_sends, **b_sends},
                {**f_recvs, **b_recvs},
            )
    if all_warmup:
        steps.exchange(
            "recv_backward", {}, {} if last_stage(chunks - 1) else {"recv_next": chunks - 1}
        )
    for k in range(remaining, total):
        mb, chunk = run_backward(k)
        recv_next, next_chunk = receives(k, False)
        if k == total - 1:
            recv_next = False
        sends = {} if first_stage(chunk) else {"send_prev": (mb, chunk)}
        steps.exchange(
            "send_backward_recv_backward", sends, {"recv_next": next_chunk} if recv_next else {}
        )
    return steps.steps


def multimodule_rank_flags(plan: Any, rank: int) -> tuple[bool, bool]:
    """megatron's ``MultiModulePipelineCommunicator.is_pp_first_stage`` / ``is_pp_last_stage``
    for ``rank``: a source module's first stage / a sink module's last stage."""
    first = last = False
    for name in plan.modules_on(rank):
        module = plan.modules[name]
        pp_rank = module.coordinates(rank)["pp"]
        first |= pp_rank == 0 and not plan.predecessors(name)
        last |= pp_rank == module.pp - 1 and not plan.successors(name)
    return first, last


@dataclass
class Schedule:
    """Every rank's steps for one training iteration, and what follows from them."""

    plan: SchedulePlan
    ranks: list[list[Step]]
    # Physical rank each rank receives from / sends to (for bytes per edge); multi-module
    # ranks may have several.
    prev_ranks: list[list[int]] = field(default_factory=list)
    next_ranks: list[list[int]] = field(default_factory=list)

    @property
    def chunks(self) -> int:
        return self.plan.chunks

    def computes(self, rank: int) -> list[Compute]:
        return [s for s in self.ranks[rank] if isinstance(s, Compute)]

    def peak_in_flight(self) -> list[int]:
        """Per rank, the most (micro-batch, chunk) forwards whose backward has not finished:
        the activations a rank holds at its fullest (under ZB-H1 a micro-batch's are held
        until its ``W``, which needs the layers' inputs). With ``vpp`` chunks each holds
        about 1/vpp of a full stage's activations."""
        peaks = []
        for rank in range(len(self.ranks)):
            computes = self.computes(rank)
            releases = "W" if any(s.kind == "W" for s in computes) else "B"
            held = peak = 0
            for step in computes:
                held += 1 if step.kind == "F" else -1 if step.kind == releases else 0
                peak = max(peak, held)
            peaks.append(peak)
        return peaks

    def messages_per_edge(self) -> dict[tuple[int, int], dict[str, int]]:
        """(sender, receiver) -> number of activations ("F") and gradients ("B") sent."""
        edges: dict[tuple[int, int], dict[str, int]] = {}
        for rank, steps in enumerate(self.ranks):
            for step in steps:
                if not isinstance(step, Exchange):
                    continue
                for message in step.messages:
                    if message.direction == "send_next":
                        peers = self.next_ranks[rank]
                    elif message.direction == "send_prev":
                        peers = self.prev_ranks[rank]
                    else:
                        continue
                    for peer in peers:
                        counts = edges.setdefault((rank, peer), {"F": 0, "B": 0})
                        counts[CARRIES[message.direction]] += 1
        return dict(sorted(edges.items()))

    def grid(self) -> list[list[str]]:
        """Per rank, the labels of its compute steps in order (PyTorch pipelining's view)."""
        return [[s.label(self.chunks) for s in self.computes(r)] for r in range(len(self.ranks))]


def build_schedule(plan: SchedulePlan) -> Schedule:
    """Every rank's steps for ``plan`` (raises ValueError when megatron-core would refuse it)."""
    problems = plan.problems()
    if problems:
        raise SchedulePlanError("; ".join(map(str, problems)))
    m = plan.microbatches
    if plan.multimodule is not None:
        mm = plan.multimodule
        ranks, prev_ranks, next_ranks = [], [], []
        links = stage_links(mm)
        for rank in range(mm.world_size):
            first, last = multimodule_rank_flags(mm, rank)
            ranks.append(one_f_one_b(m, mm.warmup_on(rank), first, last))
            prev_ranks.append(links[rank][0])
            next_ranks.append(links[rank][1])
        return Schedule(plan, ranks, prev_ranks, next_ranks)
    p = plan.pp
    if plan.schedule == ZB_H1:
        ranks = [zero_bubble_h1(m, p - r - 1, r == 0, r == p - 1, r) for r in range(p)]
    elif plan.vpp is None:
        ranks = [one_f_one_b(m, p - r - 1, r == 0, r == p - 1) for r in range(p)]
    else:
        ranks = [
            interleaved(p, r, plan.vpp, m, plan.group_size, plan.overlap_p2p_comm) for r in range(p)
        ]
    return Schedule(
        plan, ranks, [[(r - 1) % p] for r in range(p)], [[(r + 1) % p] for r in range(p)]
    )


def stage_links(mm: Any) -> list[tuple[list[int], list[int]]]:
    """Per world rank of a multi-module plan, the ranks it receives activations from and
    sends them to: the same module's neighbouring stage (same tp/cp/dp coordinates), or
    across a bridge every last-stage rank of a predecessor / first-stage rank of a successor
    (the bridge's leaders gather, split and broadcast among them)."""

    def stage_ranks(name: str, pp_rank: int) -> list[int]:
        return [
            r for r in mm.modules[name].ranks if mm.modules[name].coordinates(r)["pp"] == pp_rank
        ]

    def same_place(name: str, rank: int, pp_rank: int) -> list[int]:
        here = mm.modules[name].coordinates(rank)
        return [
            r
            for r in stage_ranks(name, pp_rank)
            if {k: v for k, v in mm.modules[name].coordinates(r).items() if k != "pp"}
            == {k: v for k, v in here.items() if k != "pp"}
        ]

    links = []
    for rank in range(mm.world_size):
        prev, nxt = [], []
        for name in mm.modules_on(rank):
            module = mm.modules[name]
            pp_rank = module.coordinates(rank)["pp"]
            if pp_rank > 0:
                prev += same_place(name, rank, pp_rank - 1)
            else:
                for src in mm.predecessors(name):
                    prev += stage_ranks(src, mm.modules[src].pp - 1)
            if pp_rank < module.pp - 1:
                nxt += same_place(name, rank, pp_rank + 1)
            else:
                for dst in mm.successors(name):
                    nxt += stage_ranks(dst, 0)
        links.append((sorted(set(prev)), sorted(set(nxt))))
    return links


# ---------------------------------------------------------------------------------------------
# Timeline and bubble
# ---------------------------------------------------------------------------------------------
@dataclass
class Slot:
    rank: int
    step: Compute
    start: float
    end: float


@dataclass
class Timeline:
    """Compute steps placed on a time axis; idle time is the bubble."""

    slots: list[Slot]
    ranks: int

    @property
    def makespan(self) -> float:
        return max((s.end for s in self.slots), default=0.0) - min(
            (s.start for s in self.slots), default=0.0
        )

    def busy(self, rank: int) -> float:
        return sum(s.end - s.start for s in self.slots if s.rank == rank)

    def bubble(self) -> float:
        """Idle share of the iteration, averaged over ranks: 1 - busy / (ranks * makespan)."""
        span = self.makespan
        if span <= 0:
            return 0.0
        return 1.0 - sum(self.busy(r) for r in range(self.ranks)) / (self.ranks * span)


class ScheduleDeadlock(MegatronExtError, RuntimeError):
    """No rank can take its next step: the schedule waits on itself."""


def _stage_of(schedule: Schedule, rank: int, chunk: int) -> Any:
    if schedule.plan.multimodule is not None:
        return rank
    return chunk * schedule.plan.pp + rank


def _dependencies(schedule: Schedule) -> dict[tuple[str, int, Any], list[tuple[str, int, Any]]]:
    """Which (kind, micro-batch, stage) each compute step waits for."""
    deps: dict = {}
    if schedule.plan.multimodule is not None:
        for rank in range(len(schedule.ranks)):
            prev, nxt = schedule.prev_ranks[rank], schedule.next_ranks[rank]
            for mb in range(schedule.plan.microbatches):
                deps[("F", mb, rank)] = [("F", mb, r) for r in prev]
                deps[("B", mb, rank)] = [("B", mb, r) for r in nxt] + [("F", mb, rank)]
                deps[("W", mb, rank)] = [("B", mb, rank)]
        return deps
    stages = schedule.plan.pp * schedule.chunks
    for stage in range(stages):
        for mb in range(schedule.plan.microbatches):
            deps[("F", mb, stage)] = [("F", mb, stage - 1)] if stage > 0 else []
            deps[("B", mb, stage)] = (
                [("B", mb, stage + 1)] if stage < stages - 1 else [("F", mb, stage)]
            )
            deps[("W", mb, stage)] = [("B", mb, stage)]
    return deps


def simulate(
    schedule: Schedule,
    forward_time: float = 1.0,
    backward_time: float = 2.0,
    weight_time: float = 1.0,
) -> Timeline:
    """Each rank runs its compute steps in order, each as soon as the step it depends on
    (the previous stage's forward, the next stage's backward, a ``W``'s own ``B``) has
    finished; communication is free. ``backward_time`` is a whole backward (input and weight
    gradients): a schedule with ``W`` steps spends ``backward_time - weight_time`` in ``B``
    and ``weight_time`` in ``W``, so both kinds of schedule do the same work. Raises
    :class:`ScheduleDeadlock` if the order cannot complete."""
    if not 0 <= weight_time <= backward_time:
        raise SchedulePlanError(f"weight_time={weight_time} must lie in [0, backward_time]")
    split = any(s.kind == "W" for r in range(len(schedule.ranks)) for s in schedule.computes(r))
    cost = {
        "F": forward_time,
        "B": backward_time - weight_time if split else backward_time,
        "W": weight_time,
    }
    deps = _dependencies(schedule)
    queues = [schedule.computes(r) for r in range(len(schedule.ranks))]
    position = [0] * len(queues)
    clock = [0.0] * len(queues)
    finished: dict = {}
    slots = []
    while any(position[r] < len(queues[r]) for r in range(len(queues))):
        progressed = False
        for rank, queue in enumerate(queues):
            while position[rank] < len(queue):
                step = queue[position[rank]]
                key = (step.kind, step.microbatch, _stage_of(schedule, rank, step.chunk))
                waits = deps.get(key, [])
                if any(w not in finished for w in waits):
                    break
                start = max([clock[rank]] + [finished[w] for w in waits])
                end = start + cost[step.kind]
                finished[key] = end
                clock[rank] = end
                slots.append(Slot(rank, step, start, end))
                position[rank] += 1
                progressed = True
        if not progressed:
            stuck = ", ".join(
                f"rank {r} at {queues[r][position[r]].label(schedule.chunks)}"
                for r in range(len(queues))
                if position[r] < len(queues[r])
            )
            raise ScheduleDeadlock(f"the schedule cannot proceed: {stuck}")
    return Timeline(slots, len(queues))


def textbook_bubble(pp: int, microbatches: int, chunks: int = 1) -> float:
    """(p - 1) / (m + p - 1), divided by the number of chunks for interleaving."""
    return (pp - 1) / (microbatches + pp - 1) / chunks


# ---------------------------------------------------------------------------------------------
# Bytes per edge
# ---------------------------------------------------------------------------------------------
def message_bytes(
    hidden: int,
    seq: int,
    micro_batch_size: int,
    mhc_streams: int = 1,
    dtype_bytes: int = 4,
    tp: int = 1,
    cp: int = 1,
    sequence_parallel: bool = False,
) -> int:
    """One exchanged tensor [s', b, n*h]: the sequence split by CP (and TP under sequence
    parallelism), n residual streams with mHC (megatron_ext.pipeline.shapes)."""
    s = seq // cp
    if sequence_parallel:
        s //= tp
    return s * micro_batch_size * hidden * max(mhc_streams, 1) * dtype_bytes


# ---------------------------------------------------------------------------------------------
# Text
# ---------------------------------------------------------------------------------------------
def format_bytes(n: float) -> str:
    """A byte count for people: 512 B, 1.5 KiB, 3.0 MiB, 2.0 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def format_timeline(
    timeline: Timeline, chunks: int = 1, unit: float = 1.0, mark: tuple[int, int] | None = None
) -> str:
    """The ranks x time-slots grid: one column per ``unit`` of time, each compute step's label
    in its first column and ``~`` in the rest, ``.`` where the rank idles. ``mark``:
    (rank, index of its compute step) to flag with ``<-- HERE``."""
    width = max([len(s.step.label(chunks)) for s in timeline.slots] + [1])
    start = min((s.start for s in timeline.slots), default=0.0)
    columns = int(round(timeline.makespan / unit))
    rows = []
    for rank in range(timeline.ranks):
        cells = ["." * 1] * columns
        for index, slot in enumerate(s for s in timeline.slots if s.rank == rank):
            first = int(round((slot.start - start) / unit))
            last = int(round((slot.end - start) / unit))
            label = slot.step.label(chunks)
            if mark == (rank, index):
                label = "[" + label + "]"
            cells[first] = label
            for col in range(first + 1, last):
                cells[col] = "~"
        rows.append(f"rank {rank} | " + " ".join(c.ljust(width) for c in cells))
    return "\n".join(rows)


def format_steps(
    schedule: Schedule, rank: int, mark: int | None = None, detail: bool = True
) -> str:
    """One rank's steps, numbered; ``mark`` flags one of them (as PyTorch pipelining does)."""
    lines = []
    for index, step in enumerate(schedule.ranks[rank]):
        if not detail and isinstance(step, Exchange):
            continue
        text = step.label(schedule.chunks)
        if isinstance(step, Exchange):
            text = f"{step.call}({text})"
        lines.append(f"  step {index:3}: {text}" + ("   <-- HERE" if index == mark else ""))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Comparing an order with the theory
# ---------------------------------------------------------------------------------------------
@dataclass
class Mismatch:
    rank: int
    index: int
    expected: Step | None
    actual: Step | None
    chunks: int = 1

    def __str__(self) -> str:
        def show(step):
            if step is None:
                return "nothing (the order ended)"
            if isinstance(step, Exchange):
                return f"{step.call}({step.label(self.chunks)})"
            return step.label(self.chunks)

        step = self.expected or self.actual
        where = f"rank {self.rank}"
        if isinstance(step, Compute) and (self.chunks > 1 or step.chunk):
            where += f", chunk {step.chunk}"
        return (
            f"{where}, step {self.index}: expected {show(self.expected)}, got {show(self.actual)}"
        )


def describe_step(
    rank: int, index: int, step: Step | None, chunks: int = 1, module: str | None = None
) -> str:
    """ "rank 2, chunk 1, step 7: B3" -- where a step sits in the schedule."""
    parts = [f"rank {rank}"]
    if module is not None:
        parts.append(f"module {module}")
    if isinstance(step, Compute):
        if chunks > 1 or step.chunk:
            parts.append(f"chunk {step.chunk}")
        return ", ".join(parts) + f", step {index}: {step.kind}{step.microbatch}"
    if isinstance(step, Exchange):
        return ", ".join(parts) + f", step {index}: {step.call}({step.label(chunks)})"
    return ", ".join(parts) + f", step {index}"


def compare(
    expected: Sequence[Sequence[Step]], actual: Sequence[Sequence[Step]], chunks: int = 1
) -> list[Mismatch]:
    """The first difference on each rank between two orders (empty: identical)."""
    mismatches = []
    want: Sequence[Step]
    got: Sequence[Step]
    for rank, (want, got) in enumerate(itertools.zip_longest(expected, actual, fillvalue=[])):
        for index, (a, b) in enumerate(itertools.zip_longest(want, got)):
            if a != b:
                mismatches.append(Mismatch(rank, index, a, b, chunks))
                break
    return mismatches


class ScheduleMismatch(MegatronExtError, AssertionError):
    """A recorded order differs from megatron-core's rules."""


def assert_same_order(schedule: Schedule, actual: Sequence[Sequence[Step]]) -> None:
    mismatches = compare(schedule.ranks, actual, schedule.chunks)
    if mismatches:
        lines = [str(m) for m in mismatches]
        first = mismatches[0]
        lines.append(f"rank {first.rank}'s expected order:")
        lines.append(format_steps(schedule, first.rank, mark=first.index))
        raise ScheduleMismatch("\n".join(lines))
