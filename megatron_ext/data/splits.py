"""Whether an indexed corpus can give every split the samples a run asks for, before any rank.

Megatron builds its train/valid/test datasets on rank 0 once the ranks have started; a split
it cannot fill is found there or never: a split that receives no token makes GPTDataset's epoch
loop (``_get_num_epochs``: add an epoch until the tokens cover the samples) run forever, even
when the run asks that split for no sample. This module reads the ``.idx`` document lengths
and repeats megatron-core 0.19.2's arithmetic (read in ``megatron/core/datasets``; the code here
is our own):

* the split string: the numbers in it, padded with zeros to three, divided by their sum
  (``parse_and_normalize_split``); split *k* covers the cumulative shares ``[s_k, s_k+1)`` and
  a zero share is no split at all (``convert_split_vector_to_split_matrix``);
* the documents of split *k* are ``round(s_k * N) .. round(s_k+1 * N)``
  (``BlendedMegatronDatasetBuilder._build_megatron_dataset_splits``; N counts the ``.idx``
  sequences, ``GPTDataset.numel_low_level_dataset``); a per-split blend
  (``--train/valid/test-data-path``) reads each of its prefixes whole;
* a weighted blend asks each prefix for ``ceil(ceil(n * w) * 1.005)`` samples
  (``_get_size_per_split_per_dataset`` with ``mid_level_dataset_surplus``), repeating its
  epochs; a blend without weights builds one epoch of each prefix and is as large as those
  epochs (``(tokens - 1) // seq_length`` samples each: one extra token per sample);
* the samples a run asks for (``megatron.training.get_train_valid_test_num_samples``): train
  ``iterations * global_batch``, valid ``(iterations // eval_interval + 1) * eval_iters *
  global_batch``, test ``eval_iters * global_batch``; 0 and 0 without evaluation
  (``--eval-iters 0``), yet every split with a share is still built, and its data loader's
  sampler stops the ranks at start-up if it holds no sample (``no sample to consume: 0``):
  a lone path asked for 0 is one epoch, an unweighted blend is one epoch of each path and
  refuses a path without a sample (``BlendedDataset``: every weight > 0), and any blend asked
  for 0 is sized 0 (see :class:`_SplitFill`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import numpy as np

from megatron_ext.errors import DataError

SPLITS = ("train", "valid", "test")
BLEND_SURPLUS = 0.005
"""megatron-core's ``mid_level_dataset_surplus`` default: each prefix of a weighted blend is
asked for this much more than its share."""


@dataclass(frozen=True)
class Source:
    """One prefix of a blend: where the recipe names it, its weight (None: no weights) and the
    token count of each of its documents."""

    where: str
    prefix: str
    weight: float | None
    lengths: np.ndarray


def split_shares(text: str) -> list[float]:
    """``"98,1,1"`` -> ``[0.98, 0.01, 0.01]`` as Megatron reads it (missing shares are 0)."""
    numbers = [float(x) for x in re.findall(r"[.0-9]+", text)]
    if len(numbers) > len(SPLITS) or not numbers or sum(numbers) <= 0:
        raise DataError(f"{text!r} is not a train,valid,test split such as 98,1,1")
    numbers += [0.0] * (len(SPLITS) - len(numbers))
    total = sum(numbers)
    return [x / total for x in numbers]


def split_bounds(shares: list[float]) -> list[tuple[float, float] | None]:
    """Each split's cumulative share range, None for a split whose share is 0."""
    bounds: list[tuple[float, float] | None] = []
    start = 0.0
    for share in shares:
        end = start + share
        bounds.append((start, end) if end > start else None)
        start = end
    return bounds


def document_range(bounds: tuple[float, float], documents: int) -> tuple[int, int]:
    return int(round(bounds[0] * documents)), int(round(bounds[1] * documents))


def samples_needed(
    iterations: int, global_batch: int, eval_interval: int | None, eval_iters: int
) -> tuple[int, int, int]:
    """The (train, valid, test) samples Megatron asks its datasets for."""
    if not eval_interval:
        return iterations * global_batch, 0, 0
    evaluations = iterations // eval_interval + 1
    return (
        iterations * global_batch,
        evaluations * eval_iters * global_batch,
        eval_iters * global_batch,
    )


def read_lengths(prefix: str) -> np.ndarray:
    """The token count of every document (``.idx`` sequence) of ``PREFIX``, from the index
    checked against its .bin (:func:`megatron_ext.data.checks.read_index`)."""
    from megatron_ext.data.checks import read_index

    return read_index(prefix).lengths


def _share_text(shares: list[float], documents: int, minimum: int = 1) -> str:
    """A split string, in documents, that gives every split with a share at least ``minimum``
    documents (an example for the fix; ``documents`` > 1)."""
    counts = [max(minimum, round(s * documents)) if s > 0 else 0 for s in shares]
    counts[0] = max(1, documents - sum(counts[1:]))
    return ",".join(str(c) for c in counts)


def _working_share_text(
    blend: list[Source], shares: list[float], needed: tuple[int, int, int], seq_length: int
) -> str | None:
    """The first of :func:`_share_text`'s examples, at 1, 2, 4... documents a split, with which
    every split passes :func:`split_problems`; None if none does."""
    documents = min(len(source.lengths) for source in blend)
    minimum = 1
    while documents > 1 and minimum * (len(SPLITS) - 1) < documents:
        text = _share_text(shares, documents, minimum)
        if not split_problems(blend, text, needed, seq_length, suggest=False):
            return text
        minimum *= 2
    return None


def one_epoch_samples(tokens: int, seq_length: int) -> int:
    """Samples of ``seq_length``+1 tokens that one epoch of ``tokens`` gives (the documents
    concatenated; consecutive samples share a token: ``add_extra_token_to_sequence``)."""
    return max(0, tokens - 1) // seq_length


def split_problems(
    blend: list[Source],
    split: str | None,
    needed: tuple[int, int, int],
    seq_length: int,
    split_name: str | None = None,
    suggest: bool = True,
    alone: bool = False,
) -> list[tuple[str, str]]:
    """(field, one line) for each split of ``blend`` that cannot give the samples ``needed``.

    ``split`` is data.split for a blend shared by the three splits; for a per-split blend
    (``split_name`` given: train, valid or test) it is None and each prefix is read whole.
    ``suggest``: offer a split string as a fix only after checking that it passes. ``alone``:
    this per-split blend is the recipe's only evaluation list (without it, data.paths would be
    shared by the splits under data.split)."""
    if split_name is not None:
        index = SPLITS.index(split_name)
        bounds: list[tuple[float, float] | None] = [None] * len(SPLITS)
        bounds[index] = (0.0, 1.0)
        shares = None
    else:
        shares = split_shares(split or "")
        bounds = split_bounds(shares)
    fills = [
        _SplitFill.of(blend, i, bound, shares is not None, needed[i], seq_length)
        for i, bound in enumerate(bounds)
        if bound is not None
    ]
    without_sample = [f for f in fills if f.empty is None and f.stops_at_start_up]
    shortest = min((f.longest_fitting for f in without_sample if f.short), default=None)
    # the evaluation splits the run asks nothing of and Megatron cannot build: zeroing their
    # shares together only widens the other splits (shares are normalised), so it fixes them all
    unbuildable = [
        f.index
        for f in fills
        if f.index > 0 and f.needed == 0 and (f.empty is not None or f.stops_at_start_up)
    ]
    zeroed = _zeroed_split(split, unbuildable) if split is not None and unbuildable else None
    problems = []
    for fill in fills:
        if fill.empty is not None:
            source, documents = fill.empty
            problems.append(
                _empty_split_problem(
                    source, fill, documents, shares, split, zeroed, suggest and (blend, needed)
                )
            )
        elif fill.stops_at_start_up:
            problems.append(_no_sample_problem(fill, split, seq_length, zeroed, shortest, alone))
        elif fill.unweighted_blend and fill.available < fill.needed:
            documents = sum(d for _, d, _ in fill.counts)
            tokens = sum(t for _, _, t in fill.counts)
            problems.append(
                (
                    _field(blend[0], split),
                    f"the {fill.name} split of the unweighted blend gets {documents} documents, "
                    f"{tokens} tokens: one epoch of each path, {fill.available} samples of "
                    f"{seq_length}+1 tokens, but the run needs {fill.needed}; give each path a "
                    "weight ('WEIGHT PREFIX': Megatron then repeats epochs) or add documents",
                )
            )
    return problems


@dataclass(frozen=True)
class _SplitFill:
    """What megatron-core 0.19.2's builder makes of one split of a blend.

    ``blended``: the split is a BlendedDataset (several paths, or a weighted path shared by
    the splits; a per-split blend of one path is a lone GPTDataset whatever its weight).
    A lone GPTDataset asked for n > 0 samples repeats epochs until it has them; asked for 0
    (the run evaluates nothing, yet every split with a share is built) it is one epoch. An
    unweighted blend is one epoch of each path, and BlendedDataset refuses a path with no
    sample (every weight > 0); asked for 0, any blend is sized 0. Either way the split's data
    loader then stops the ranks at start-up (``no sample to consume: 0``)."""

    index: int
    counts: list[tuple[Source, int, int]]  # (path, its documents, its tokens) in this split
    blended: bool
    unweighted_blend: bool
    needed: int
    seq_length: int

    @classmethod
    def of(
        cls,
        blend: list[Source],
        index: int,
        bounds: tuple[float, float],
        shared: bool,
        needed: int,
        seq_length: int,
    ) -> _SplitFill:
        counts = []
        for source in blend:
            begin, end = document_range(bounds, len(source.lengths))
            counts.append((source, end - begin, int(source.lengths[begin:end].sum())))
        weighted = blend[0].weight is not None
        blended = len(blend) > 1 or (shared and weighted)
        return cls(index, counts, blended, blended and not weighted, needed, seq_length)

    @property
    def name(self) -> str:
        return SPLITS[self.index]

    @property
    def empty(self) -> tuple[Source, int] | None:
        """The first path that gives this split no token, and its documents."""
        for source, documents, tokens in self.counts:
            if tokens == 0:
                return source, documents
        return None

    @property
    def asked_nothing(self) -> bool:
        return self.blended and self.needed == 0

    @property
    def short(self) -> list[tuple[Source, int, int]]:
        """Paths whose one epoch of this split makes no sample, where one epoch is all Megatron
        builds of them (an unweighted blend; a lone path the run asks nothing of)."""
        if self.unweighted_blend or (not self.blended and self.needed == 0):
            return [c for c in self.counts if one_epoch_samples(c[2], self.seq_length) == 0]
        return []

    @property
    def stops_at_start_up(self) -> bool:
        return bool(self.short) or self.asked_nothing

    @property
    def longest_fitting(self) -> int:
        """The longest seq_length with which every short path still makes one sample."""
        return min(tokens for _, _, tokens in self.short) - 1

    @property
    def available(self) -> int:
        return sum(one_epoch_samples(t, self.seq_length) for _, _, t in self.counts)


def _no_sample_problem(
    fill: _SplitFill,
    split: str | None,
    seq_length: int,
    zeroed: str | None,
    shortest: int | None,
    alone: bool,
) -> tuple[str, str]:
    source = fill.counts[0][0]
    paths = source.where.split("[")[0]
    under = f" under split {split}" if split is not None else ""
    fixes = []
    if fill.short and not fill.asked_nothing and shortest is not None and shortest >= 1:
        fixes.append(f"set model.seq_length to at most {shortest}")
    if zeroed is not None and fill.index > 0 and fill.needed == 0:
        fixes.append(f"set its share to 0 (data.split: {zeroed})")
    elif split is None and fill.index > 0 and fill.needed == 0:
        fixes.append(f"leave out {paths}" + (" and set data.split: 1,0,0" if alone else ""))
    if fill.unweighted_blend and fill.short and fill.needed > 0:
        fixes.append("give every path a weight ('WEIGHT PREFIX': Megatron then repeats epochs)")
    # evaluating makes Megatron repeat epochs, except an unweighted blend's (one epoch each)
    if fill.needed == 0 and (not fill.unweighted_blend or not fill.short):
        fixes.append("evaluate (training.eval_interval)")
    stop = "the ranks stop at start-up (no sample to consume: 0)"
    if not fill.short:  # a blend the run asks no sample of
        kind = "unweighted" if fill.unweighted_blend else "weighted"
        return (
            "data.split" if split is not None else paths,
            f"the {fill.name} split of the {kind} blend {paths}{under} is asked for no sample "
            f"(no evaluation) but built all the same, empty: {stop}; " + ", or ".join(fixes),
        )
    short, documents, tokens = fill.short[0]
    if fill.unweighted_blend:
        why = (
            "an unweighted blend is one epoch of each path; one without a sample stops the "
            "ranks at start-up (BlendedDataset: every weight > 0)"
        )
    else:
        why = f"built even without evaluation, {stop}"
    others = f" (and {len(fill.short) - 1} more paths)" if len(fill.short) > 1 else ""
    return (
        "model.seq_length",
        f"{seq_length} is too long for the {fill.name} split of {short.where} "
        f"({os.path.basename(short.prefix)}){under}: {documents} documents, {tokens} tokens"
        f"{others}; a sample takes seq_length+1 = {seq_length + 1}; {why}; " + ", or ".join(fixes),
    )


def _zeroed_split(split: str, indices: list[int]) -> str:
    written = re.findall(r"[.0-9]+", split) + ["0"] * len(SPLITS)
    return ",".join("0" if i in indices else written[i] for i in range(len(SPLITS)))


def _field(source: Source, split: str | None) -> str:
    return "data.split" if split is not None else source.where


def _empty_split_problem(
    source: Source,
    fill: _SplitFill,
    documents: int,
    shares: list[float] | None,
    split: str | None,
    zeroed: str | None,
    check_with: tuple[list[Source], tuple[int, int, int]] | bool,
) -> tuple[str, str]:
    """``check_with``: the blend and the samples needed, to check a suggested split string
    against (False: suggest none)."""
    total = len(source.lengths)
    what = (
        f"the {fill.name} split of {source.where} ({os.path.basename(source.prefix)}) gets "
        f"{documents} of {total} "
        f"documents, 0 tokens"
    )
    if split is not None:
        what += f" under split {split}"
    what += (
        f"; the run needs {fill.needed} samples from it and Megatron's epoch loop never ends on "
        "an empty split"
    )
    if shares is None or split is None:
        return source.where, what + "; give it a prefix with documents"
    more = None
    if isinstance(check_with, tuple):  # a split string that fills every split, checked
        blend, needed = check_with
        more = _working_share_text(blend, shares, needed, fill.seq_length)
    if fill.needed == 0:
        fix = f"set its share to 0 (data.split: {zeroed or _zeroed_split(split, [fill.index])})"
        if more is not None:
            fix += f" or give it documents (e.g. data.split: {more})"
    elif more is not None:
        fix = f"give it documents, e.g. data.split: {more}"
    elif total > 1:
        fix = "give it documents (a larger share in data.split) or add documents to the corpus"
    else:
        fix = "add documents to the corpus (one document cannot be split)"
    return "data.split", f"{what}; {fix}"
