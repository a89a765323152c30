"""A pipeline schedule as text: one line per rank, one compute action per token.

The tokens are the labels ``megatron-ext schedule`` draws in its grid (:meth:`Compute.label`):
``F3`` is the forward of micro-batch 3, ``B3`` its backward (under ZB-H1 the input gradient),
``W3`` its deferred weight gradient; with virtual stages every token names its chunk,
``F3c1``. Lines starting with ``#`` are comments, blank lines are skipped, and the n-th
remaining line is rank n::

    # ZB-H1, 2 pipeline ranks, 3 micro-batches
    F0 F1 B0 W0 F2 B1 W1 B2 W2
    F0 B0 F1 B1 W0 F2 B2 W1 W2

torch.distributed.pipelining's spelling is read too (``_ComputationType``, ``_Action``): ``I``
is its input-gradient step (our ZB-H1 ``B``), ``W`` the weight step, ``B`` a whole backward
(our 1F1B ``B``; torch refuses a ``W`` after it), and a token may start with the stage index,
stage ``s`` being chunk ``s // pp`` of rank ``s % pp``; commas may separate the tokens (its
CSV). A text is in torch's spelling when a token writes ``I`` or a stage; ZB-H1 splits every
micro-batch, so such a text with ``I``/``W`` steps cannot also hold a whole ``B``.
:func:`format_text` writes either spelling (``megatron-ext schedule --format torch-text``)::

    # the same ZB-H1 order in torch's spelling
    0F0 0F1 0I0 0W0 0F2 0I1 0W1 0I2 0W2
    1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1W2

Only compute actions are written: the P2P calls follow from them. For one chunk per rank the
calls are derived here by the rules of megatron's 1F1B (:func:`derive_exchanges`), which give
exactly :func:`~megatron_ext.schedules.schedule.build_schedule`'s calls for the built 1F1B and
ZB-H1 orders, so the ZB-H1 runtime (:mod:`megatron_ext.pipeline.zero_bubble`) can execute a
schedule handed in as text. Interleaved and multi-module schedules run megatron-core's own
order: their text is read back only when it is that order.

:func:`schedule_from_text` refuses, in one line naming the rank and the token, a text that is
not a complete and runnable order: an unknown token, a missing or repeated action, a backward
before its forward or out of micro-batch order, an order whose ranks wait on each other (by
their compute dependencies or by their P2P calls, taken as blocking until the peer posts the
matching call), or a rank holding more micro-batches in flight than the built schedule's
fullest rank (ZB-H1: ``pp``, 1F1B's first stage). torch's ``_Action.from_str`` and its CSV
load/dump (``torch.distributed.pipelining.schedules``) were read for the idea; this format is
one line per rank so that two schedules diff line by line.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from megatron_ext.errors import MegatronExtError
from megatron_ext.schedules.schedule import (
    ONE_F_ONE_B,
    ZB_H1,
    Compute,
    Exchange,
    Schedule,
    SchedulePlan,
    Step,
    _dependencies,
    _RankBuilder,
    _stage_of,
    build_schedule,
)

__all__ = [
    "MAX_TEXT_BYTES",
    "SPELLINGS",
    "ScheduleTextError",
    "Spelling",
    "derive_exchanges",
    "format_text",
    "parse_text",
    "place_stages",
    "infer_plan",
    "read_schedule_file",
    "read_text",
    "schedule_of",
    "schedule_from_text",
    "spelling_of",
]

# A text schedule of 64 ranks x 312 micro-batches x 3 actions is under 400 KB.
MAX_TEXT_BYTES = 4 * 1024 * 1024
# [stage (torch's form)] letter micro-batch [c chunk (ours)]: F3, B3c1, 1I3.
_TOKEN = re.compile(r"(\d{1,5})?([FBIW])(\d{1,7})(?:c(\d{1,4}))?")
# torch's non-compute actions (its CSV "comms" form): the P2P calls follow from the computes.
_TORCH_NON_COMPUTE = re.compile(r"\d*(SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD)\d*")
_LETTERS = (
    "F (forward), B (backward; the input gradient when W steps are given), W (weight gradient); "
    "or torch's: I (input gradient), W, B (whole backward), a stage first (1F0)"
)
SPELLINGS = ("megatron-ext", "torch")


@dataclass(frozen=True)
class Spelling:
    """How a text writes our step kinds. megatron-ext's: F, B (under ZB-H1 the input-gradient
    backward), W. torch.distributed.pipelining's (``_ComputationType``): F, I for the input
    gradient and W for the weight gradient, B only for a whole backward (a W after it is
    invalid there), and a token may start with the stage index (``1I0``)."""

    name: str
    letters: dict[str, str]  # our kind -> the letter this spelling writes

    def label(self, step: Compute, chunks: int = 1) -> str:
        return replace(step, kind=self.letters[step.kind]).label(chunks)


OURS = Spelling("megatron-ext", {"F": "F", "B": "B", "W": "W"})
TORCH_SPLIT = Spelling("torch", {"F": "F", "B": "I", "W": "W"})  # torch's text with I and W
TORCH_WHOLE = Spelling("torch", {"F": "F", "B": "B", "W": "W"})  # torch's 1F1B: B is whole


class ScheduleTextError(MegatronExtError, ValueError):
    """A schedule text that is not a complete, runnable order (the message names the rank and
    the token)."""


@dataclass(frozen=True)
class _Token:
    """One action of the text: where it stands (rank, 1-based position) and what it says."""

    rank: int
    position: int
    text: str
    step: Compute
    stage: int | None = None  # torch's form names the stage (1F0); ours the chunk (F0c1)

    def where(self) -> str:
        return f"rank {self.rank}, token {self.position} {self.text!r}"


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------
def format_text(
    schedule: Schedule, comment: str | None = None, spelling: str = "megatron-ext"
) -> str:
    """``schedule``'s compute actions, one line per rank (``comment``: a first ``#`` line), in
    megatron-ext's spelling (``F0 B0 W0``, ``F0c1``) or torch's (``0F0 0I0 0W0``: the stage
    first, I the input gradient, B only for a whole backward)."""
    if spelling not in SPELLINGS:
        raise ScheduleTextError(f"spelling {spelling!r}: use one of {', '.join(SPELLINGS)}")
    lines = [f"# {comment}"] if comment else []
    # torch writes ZB-H1's input-gradient backward I; any other backward is its whole B
    torch = TORCH_SPLIT if schedule.plan.schedule == ZB_H1 else TORCH_WHOLE
    for rank in range(len(schedule.ranks)):
        computes = schedule.computes(rank)
        if spelling == "torch":
            lines.append(" ".join(_torch_token(schedule, rank, s, torch) for s in computes))
        else:
            lines.append(" ".join(s.label(schedule.chunks) for s in computes))
    return "\n".join(lines) + "\n"


def _torch_token(schedule: Schedule, rank: int, step: Compute, torch: Spelling) -> str:
    """torch's ``_Action`` text of one compute step: stage, letter, micro-batch (``1I0``)."""
    return f"{_stage_of(schedule, rank, step.chunk)}{torch.letters[step.kind]}{step.microbatch}"


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------
def parse_text(text: str) -> list[list[_Token]]:
    """The tokens of every rank line, in our step kinds whichever spelling the text uses
    (:func:`spelling_of`); refuses a token that is not an action. Tokens are separated by
    spaces or commas (torch's CSV), empty cells skipped."""
    ranks: list[list[_Token]] = []
    for line in text.splitlines():
        words = [w for w in re.split(r"[\s,]+", line) if w]
        if not words or words[0].startswith("#"):
            continue
        rank = len(ranks)
        ranks.append([_read_token(rank, position, w) for position, w in enumerate(words, 1)])
    if not ranks:
        raise ScheduleTextError("no rank line: write one line of actions per pipeline rank")
    spelling = spelling_of(ranks)
    if spelling is TORCH_SPLIT:
        _check_no_whole_backward(ranks)
    return [[replace(t, step=_our_step(t, spelling)) for t in tokens] for tokens in ranks]


def _read_token(rank: int, position: int, word: str) -> _Token:
    """One token as written (its letter still the text's own)."""
    where = f"rank {rank}, token {position} {_shown(word)}"
    match = _TOKEN.fullmatch(word)
    if match is None:
        if _TORCH_NON_COMPUTE.fullmatch(word):
            raise ScheduleTextError(
                f"{where}: torch's communication action; a schedule text holds the compute "
                "actions only (the P2P calls follow from them): remove it"
            )
        raise ScheduleTextError(
            f"{where}: not an action; write {_LETTERS} and the micro-batch, e.g. F0 B0 W0 "
            "(F0c1 on chunk 1) or torch's 0F0 0I0 0W0"
        )
    stage, kind, microbatch, chunk = match.groups()
    if stage is not None and chunk is not None:
        raise ScheduleTextError(
            f"{where}: names both a stage (torch's form, 1F0) and a chunk (ours, F0c1); "
            "write one of them"
        )
    step = Compute(kind, int(microbatch), int(chunk or 0))
    return _Token(rank, position, word, step, None if stage is None else int(stage))


def spelling_of(ranks: Sequence[Sequence[_Token]]) -> Spelling:
    """torch's spelling when a token writes I (its input-gradient step) or starts with a stage
    index: then B is a whole backward; ours otherwise. The two agree on a text without W."""
    tokens = [t for line in ranks for t in line]
    if any(_letter(t) == "I" for t in tokens):
        return TORCH_SPLIT
    if any(t.stage is not None for t in tokens):
        return TORCH_SPLIT if any(_letter(t) == "W" for t in tokens) else TORCH_WHOLE
    return OURS


def _letter(token: _Token) -> str:
    """The letter the token was written with (its step may already be in our kinds)."""
    match = _TOKEN.fullmatch(token.text)
    assert match is not None
    return match.group(2)


def _check_no_whole_backward(ranks: Sequence[Sequence[_Token]]) -> None:
    """torch's B is a whole backward: it cannot stand in a text whose backwards are split
    into I and W (megatron-ext's ZB-H1 splits every micro-batch, and torch itself refuses a W
    after a B)."""
    tokens = [t for line in ranks for t in line]
    whole = next((t for t in tokens if _letter(t) == "B"), None)
    if whole is None:
        return
    split = next(t for t in tokens if _letter(t) in "IW")
    mb = whole.step.microbatch
    raise ScheduleTextError(
        f"{whole.where()}: in torch's spelling (this text has {split.where()}) B is the whole "
        f"backward, and ZB-H1 splits every micro-batch into I and W: write I{mb} for the input "
        f"gradient and W{mb} for the weight gradient"
    )


def _our_step(token: _Token, spelling: Spelling) -> Compute:
    ours = {letter: kind for kind, letter in spelling.letters.items()}
    return replace(token.step, kind=ours[_letter(token)])


def _shown(word: str) -> str:
    """A token as quoted in a message: short, and one printable line."""
    text = word if len(word) <= 20 else word[:20] + "..."
    return repr("".join(ch if ch.isprintable() else "?" for ch in text))


def infer_plan(ranks: Sequence[Sequence[_Token]]) -> SchedulePlan:
    """The plan a text describes on its own: one pipeline of one line per rank, micro-batches
    and chunks up to the largest named, ZB-H1 when it has W steps."""
    steps = [t.step for tokens in place_stages(ranks, len(ranks)) for t in tokens]
    chunks = max(s.chunk for s in steps) + 1
    split = any(s.kind == "W" for s in steps)
    return SchedulePlan(
        pp=len(ranks),
        vpp=chunks if chunks > 1 else None,
        microbatches=max(s.microbatch for s in steps) + 1,
        schedule=ZB_H1 if split else ONE_F_ONE_B,
    )


def schedule_from_text(text: str, plan: SchedulePlan | None = None) -> Schedule:
    """The schedule ``text`` describes, for ``plan`` (None: :func:`infer_plan`), after every
    check of the module docstring; raises :class:`ScheduleTextError` naming rank and token."""
    ranks = parse_text(text)
    if plan is None:
        plan = _interleaved_group(place_stages(ranks, len(ranks)), infer_plan(ranks))
    problems = plan.problems()
    if problems:
        raise ScheduleTextError(f"the text's plan: {problems[0]}")
    built = build_schedule(plan)
    if len(ranks) != len(built.ranks):
        raise ScheduleTextError(
            f"{len(ranks)} rank line(s) for a plan of {len(built.ranks)} pipeline rank(s): "
            "write one line of actions per rank"
        )
    spelling = spelling_of(ranks)
    ranks = place_stages(ranks, plan.pp, plan.multimodule is not None)
    for tokens in ranks:
        _check_rank(tokens, plan, spelling)
    _check_dependencies(ranks, built, spelling)
    _check_peak(ranks, built, spelling)
    if plan.multimodule is not None or plan.chunks > 1:
        _check_is_built(ranks, built, spelling)
        return built
    exchanged = [
        derive_exchanges([t.step for t in tokens], rank, plan.pp, plan.microbatches)
        for rank, tokens in enumerate(ranks)
    ]
    _check_exchanges(ranks, exchanged)
    return Schedule(plan, exchanged, built.prev_ranks, built.next_ranks)


def place_stages(
    ranks: Sequence[Sequence[_Token]], pp: int, multimodule: bool = False
) -> list[list[_Token]]:
    """Tokens that name a stage (torch's ``1F0``) given the chunk it is on that rank: stage
    ``s`` is chunk ``s // pp`` of rank ``s % pp`` (megatron's and torch's looped placement;
    a multi-module rank holds one stage, its own number). A stage on another rank is refused."""
    placed = []
    for rank, tokens in enumerate(ranks):
        line = []
        for token in tokens:
            if token.stage is not None:
                owner = token.stage if multimodule else token.stage % pp
                if owner != rank:
                    held = f"stage {rank}" if multimodule else f"stages {rank}, {rank + pp}, ..."
                    raise ScheduleTextError(
                        f"{token.where()}: stage {token.stage} does not run on rank {rank}, "
                        f"which holds {held}; move it to rank {owner}'s line"
                    )
                chunk = 0 if multimodule else token.stage // pp
                token = replace(token, step=replace(token.step, chunk=chunk))
            line.append(token)
        placed.append(line)
    return placed


def schedule_of(plan: SchedulePlan) -> Schedule:
    """The schedule a run of ``plan`` executes: its order file's (``plan.order_file``, checked)
    or the built one."""
    if plan.order_file is None:
        return build_schedule(plan)
    if plan.schedule != ZB_H1:
        raise ScheduleTextError(
            f"{plan.order_file}: only ZB-H1 runs an order given as text (the schedule is "
            f"{plan.schedule}); use schedule zb-h1"
        )
    return read_schedule_file(plan.order_file, replace(plan, order_file=None))


def read_schedule_file(path: str | Path, plan: SchedulePlan | None = None) -> Schedule:
    """:func:`schedule_from_text` of a file (plain text, at most :data:`MAX_TEXT_BYTES`)."""
    return schedule_from_text(read_text(path), plan)


def read_text(path: str | Path) -> str:
    """A schedule file's text; refuses what is not a small UTF-8 text file, in one line. The
    bound is on the bytes read (a device claims 0) and only a regular file is opened (a FIFO
    would block)."""
    from megatron_ext import files

    try:
        return files.read_text_bounded(path, MAX_TEXT_BYTES, "schedule text")
    except files.InputTooLarge:
        raise ScheduleTextError(
            f"{path}: larger than {MAX_TEXT_BYTES // 2**20} MiB; a schedule text is one "
            "line of actions per rank"
        ) from None
    except FileNotFoundError:
        raise ScheduleTextError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ScheduleTextError(f"{path} is a directory; give the schedule's text file") from None
    except files.NotRegularFile as exc:
        raise ScheduleTextError(
            f"{path} is {exc.kind}, not a regular file; give the schedule's text file"
        ) from None
    except UnicodeDecodeError:
        raise ScheduleTextError(f"{path}: not UTF-8 text") from None
    except OSError as exc:
        raise ScheduleTextError(f"{path}: cannot be read ({exc.strerror or exc})") from None


# ---------------------------------------------------------------------------------------------
# The checks
# ---------------------------------------------------------------------------------------------
def _kinds(plan: SchedulePlan) -> str:
    return "FBW" if plan.schedule == ZB_H1 else "FB"


def _check_rank(tokens: Sequence[_Token], plan: SchedulePlan, spelling: Spelling = OURS) -> None:
    """Every action of the plan exactly once; a backward after its forward, a W after its B;
    forwards and backwards of a chunk in micro-batch order (the received tensors queue).
    Messages write the steps as the text does (``spelling``)."""
    kinds, chunks, microbatches = _kinds(plan), plan.chunks, plan.microbatches
    letter = spelling.letters
    seen: dict[Compute, _Token] = {}
    done: dict[tuple[str, int], int] = {}  # (kind, chunk) -> the next micro-batch in order
    for token in tokens:
        step = token.step
        if step.kind not in kinds:
            raise ScheduleTextError(
                f"{token.where()}: W steps belong to schedule zb-h1; in a {plan.schedule} "
                "schedule B is the whole backward"
                + (f" (write B{step.microbatch}, not I and W)" if spelling is TORCH_SPLIT else "")
            )
        if step.microbatch >= microbatches or step.chunk >= chunks:
            raise ScheduleTextError(
                f"{token.where()}: the plan has micro-batches 0-{microbatches - 1}"
                + (f" and chunks 0-{chunks - 1}" if chunks > 1 else "")
            )
        if step in seen:
            raise ScheduleTextError(
                f"{token.where()}: repeats token {seen[step].position} (each action once)"
            )
        seen[step] = token
        before = {"B": "F", "W": "B"}.get(step.kind)
        if before and replace(step, kind=before) not in seen:
            raise ScheduleTextError(
                f"{token.where()}: comes before its {letter[before]}{step.microbatch}; a "
                f"backward follows its forward, a W its {letter['B']}"
            )
        if step.kind in "FB":
            expected = done.get((step.kind, step.chunk), 0)
            if step.microbatch != expected:
                raise ScheduleTextError(
                    f"{token.where()}: {letter[step.kind]}{expected} comes first on this "
                    "chunk; forwards and backwards run in micro-batch order (received tensors "
                    "queue)"
                )
            done[(step.kind, step.chunk)] = expected + 1
    for chunk in range(chunks):
        for microbatch in range(microbatches):
            for kind in kinds:
                step = Compute(kind, microbatch, chunk)
                if step not in seen:
                    raise ScheduleTextError(
                        f"rank {tokens[0].rank if tokens else '?'}: "
                        f"{spelling.label(step, chunks)!r} is missing (every micro-batch needs "
                        f"{', '.join(letter[k] for k in kinds)} on every rank"
                        + (" and chunk)" if chunks > 1 else ")")
                    )


def _check_dependencies(
    ranks: Sequence[Sequence[_Token]], built: Schedule, spelling: Spelling = OURS
) -> None:
    """Every rank can take its actions in order: each waits only for steps (the previous
    stage's F, the next stage's B) that their ranks reach without waiting on it."""
    deps = _dependencies(built)
    position = [0] * len(ranks)
    finished: set[tuple[str, int, object]] = set()

    def key(rank: int, step: Compute) -> tuple[str, int, object]:
        return (step.kind, step.microbatch, _stage_of(built, rank, step.chunk))

    progressed = True
    while progressed:
        progressed = False
        for rank, tokens in enumerate(ranks):
            while position[rank] < len(tokens):
                step_key = key(rank, tokens[position[rank]].step)
                if any(w not in finished for w in deps.get(step_key, [])):
                    break
                finished.add(step_key)
                position[rank] += 1
                progressed = True
    stuck = [r for r in range(len(ranks)) if position[r] < len(ranks[r])]
    if not stuck:
        return
    rank = stuck[0]
    token = ranks[rank][position[rank]]
    missing = next(w for w in deps[key(rank, token.step)] if w not in finished)
    waits_on = _rank_of(built, missing)
    there = (
        ranks[waits_on][position[waits_on]] if position[waits_on] < len(ranks[waits_on]) else None
    )
    raise ScheduleTextError(
        f"{token.where()}: waits for {spelling.letters[missing[0]]}{missing[1]} on rank "
        f"{waits_on}, which "
        + (f"waits at token {there.position} {there.text!r}" if there else "never runs it")
        + ": the ranks' orders deadlock"
    )


def _rank_of(built: Schedule, key: tuple[str, int, object]) -> int:
    stage = key[2]
    assert isinstance(stage, int)
    return stage if built.plan.multimodule is not None else stage % built.plan.pp


def _check_peak(
    ranks: Sequence[Sequence[_Token]], built: Schedule, spelling: Spelling = OURS
) -> None:
    """No rank holds more micro-batches' activations (from F until B, under ZB-H1 until W)
    than the built schedule's fullest rank."""
    limit = max(built.peak_in_flight())
    releases = "W" if built.plan.schedule == ZB_H1 else "B"
    written = spelling.letters[releases]
    for tokens in ranks:
        held = 0
        for token in tokens:
            held += 1 if token.step.kind == "F" else -1 if token.step.kind == releases else 0
            if held > limit:
                bound = "pp, 1F1B's first stage" if releases == "W" else "the built schedule's"
                raise ScheduleTextError(
                    f"{token.where()}: {held} micro-batches in flight (activations held until "
                    f"their {written}), more than the limit of {limit} ({bound}); run a "
                    f"{written} earlier"
                )


def _check_is_built(
    ranks: Sequence[Sequence[_Token]], built: Schedule, spelling: Spelling = OURS
) -> None:
    """Interleaved and multi-module pipelines run megatron-core's order, nothing else."""
    for rank, tokens in enumerate(ranks):
        expected = built.computes(rank)
        for token, want in zip(tokens, expected, strict=True):
            if token.step != want:
                kind = "multi-module 1F1B" if built.plan.multimodule else "interleaved"
                raise ScheduleTextError(
                    f"{token.where()}: megatron-core's {kind} schedule runs "
                    f"{spelling.label(want, built.chunks)!r} here and no other order; a "
                    "different order runs only with one chunk per rank (schedule zb-h1)"
                )


def _interleaved_group(ranks: Sequence[Sequence[_Token]], plan: SchedulePlan) -> SchedulePlan:
    """An interleaved text read without a plan: the microbatch_group_size_per_vp_stage whose
    order it is (megatron's default, pp, when none is)."""
    if plan.vpp is None:
        return plan
    computes = [[t.step for t in tokens] for tokens in ranks]
    for size in range(plan.pp, plan.microbatches + 1):
        candidate = replace(plan, microbatch_group_size=None if size == plan.pp else size)
        if candidate.problems():
            continue
        built = build_schedule(candidate)
        if all(built.computes(r) == c for r, c in enumerate(computes)):
            return candidate
    return plan


# ---------------------------------------------------------------------------------------------
# The P2P calls of a one-chunk order
# ---------------------------------------------------------------------------------------------
def derive_exchanges(
    computes: Sequence[Compute], rank: int, pp: int, microbatches: int
) -> list[Step]:
    """``computes`` (one rank of a one-chunk pipeline) with megatron's 1F1B P2P calls between
    them: a receive right before an F (B) whose input (gradient) has not come yet; after the
    first ``pp - rank - 1`` forwards (the warm-up) ``send_forward``; after a later F that a B
    follows, ``send_forward_recv_backward``; after a B that an F follows,
    ``send_backward_recv_forward``; else ``send_forward`` / ``send_backward`` alone. The
    first and last ranks make the same calls with nothing to send or receive at their ends."""
    first, last = rank == 0, rank == pp - 1
    warmup = min(pp - rank - 1, microbatches)
    builder = _RankBuilder()
    ready = {"F": 0, "B": 0}  # inputs (gradients) received for forwards (backwards) to come
    forwards = 0
    receive = {
        "F": ("recv_forward", {} if first else {"recv_prev": 0}),
        "B": ("recv_backward", {} if last else {"recv_next": 0}),
    }
    for index, step in enumerate(computes):
        if step.kind in "FB" and not ready[step.kind]:
            call, receives = receive[step.kind]
            builder.exchange(call, {}, receives)
            ready[step.kind] += 1
        builder.compute(step.kind, step.microbatch, 0)
        if step.kind == "W":
            continue
        ready[step.kind] -= 1
        following = computes[index + 1].kind if index + 1 < len(computes) else None
        if step.kind == "F":
            forwards += 1
            sends = {} if last else {"send_next": (step.microbatch, 0)}
            if forwards > warmup and following == "B":
                builder.exchange("send_forward_recv_backward", sends, receive["B"][1])
                ready["B"] += 1
            else:
                builder.exchange("send_forward", sends, {})
        else:
            sends = {} if first else {"send_prev": (step.microbatch, 0)}
            if following == "F":
                builder.exchange("send_backward_recv_forward", sends, receive["F"][1])
                ready["F"] += 1
            else:
                builder.exchange("send_backward", sends, {})
    return builder.steps


# Where a direction's messages go: (peer offset, the peer's matching direction).
_PEERS = {
    "send_next": (1, "recv_prev"),
    "recv_prev": (-1, "send_next"),
    "send_prev": (-1, "recv_next"),
    "recv_next": (1, "send_prev"),
}


def _check_exchanges(
    ranks: Sequence[Sequence[_Token]], exchanged: Sequence[Sequence[Step]]
) -> None:
    """The derived P2P calls complete when every call blocks until each of its messages is
    matched by the peer's call (the strictest reading of a blocking exchange): the n-th send
    on an edge meets the n-th receive of the peer."""
    posted: dict[tuple[int, str], int] = {}  # (rank, direction) -> messages posted so far
    waiting: dict[int, list[tuple[int, str, int]]] = {}  # rank -> (peer, its direction, index)
    position = [0] * len(exchanged)
    progressed = True
    while progressed:
        progressed = False
        for rank, steps in enumerate(exchanged):
            while position[rank] < len(steps):
                step = steps[position[rank]]
                if isinstance(step, Exchange):
                    if rank not in waiting:
                        waiting[rank] = _post(rank, step, posted)
                    if any(posted.get((peer, d), 0) <= i for peer, d, i in waiting[rank]):
                        break
                    del waiting[rank]
                position[rank] += 1
                progressed = True
    stuck = [r for r in range(len(exchanged)) if position[r] < len(exchanged[r])]
    if stuck:
        rank = stuck[0]
        call = exchanged[rank][position[rank]]
        assert isinstance(call, Exchange)
        token, side = _token_of_call(ranks[rank], exchanged[rank], position[rank])
        raise ScheduleTextError(
            f"{token.where()}: the P2P call {call.call} {side} it waits for rank(s) "
            f"{sorted({p for p, _, _ in waiting[rank]})}, which wait too (each call taken as "
            "blocking until its peer posts the matching one): the ranks' exchanges deadlock; "
            "move the action so that the neighbours' sends and receives pair up"
        )


def _post(
    rank: int, call: Exchange, posted: dict[tuple[int, str], int]
) -> list[tuple[int, str, int]]:
    """Post ``call``'s messages; what each waits for: (peer, peer's direction, index)."""
    awaited = []
    for message in call.messages:
        offset, match = _PEERS[message.direction]
        index = posted.get((rank, message.direction), 0)
        posted[(rank, message.direction)] = index + 1
        awaited.append((rank + offset, match, index))
    return awaited


def _token_of_call(
    tokens: Sequence[_Token], steps: Sequence[Step], index: int
) -> tuple[_Token, str]:
    """The action a P2P call belongs to: the compute step whose output it sends (the call
    comes after it), else the one whose input it receives (the call comes before it)."""
    done = sum(isinstance(s, Compute) for s in steps[:index])
    call = steps[index]
    assert isinstance(call, Exchange)
    if done and (call.call.startswith("send") or done == len(tokens)):
        return tokens[done - 1], "after"
    return tokens[done], "before"
