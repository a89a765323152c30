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
  global_batch``, test ``eval_iters * global_batch``.
"""

from __future__ import annotations

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


def _share_text(shares: list[float], documents: int) -> str:
    """A split string, in documents, that gives every split with a share at least one document
    (an example for the fix; ``documents`` > 1)."""
    counts = [max(1, round(s * documents)) if s > 0 else 0 for s in shares]
    counts[0] = max(1, documents - sum(counts[1:]))
    return ",".join(str(c) for c in counts)


def split_problems(
    blend: list[Source],
    split: str | None,
    needed: tuple[int, int, int],
    seq_length: int,
    split_name: str | None = None,
) -> list[tuple[str, str]]:
    """(field, one line) for each split of ``blend`` that cannot give the samples ``needed``.

    ``split`` is data.split for a blend shared by the three splits; for a per-split blend
    (``split_name`` given: train, valid or test) it is None and each prefix is read whole."""
    if split_name is not None:
        index = SPLITS.index(split_name)
        bounds: list[tuple[float, float] | None] = [None] * len(SPLITS)
        bounds[index] = (0.0, 1.0)
        shares = None
    else:
        shares = split_shares(split or "")
        bounds = split_bounds(shares)
    problems = []
    for i, bound in enumerate(bounds):
        if bound is not None:
            problem = _one_split(blend, i, bound, shares, needed[i], seq_length, split)
            if problem:
                problems.append(problem)
    return problems


def _one_split(
    blend: list[Source],
    index: int,
    bounds: tuple[float, float],
    shares: list[float] | None,
    needed: int,
    seq_length: int,
    split: str | None,
) -> tuple[str, str] | None:
    name = SPLITS[index]
    counts = []
    for source in blend:
        begin, end = document_range(bounds, len(source.lengths))
        counts.append((source, end - begin, int(source.lengths[begin:end].sum())))
    for source, documents, tokens in counts:
        if tokens == 0:
            return _empty_split_problem(source, name, index, documents, shares, needed, split)
    if len(blend) > 1 and blend[0].weight is None:  # one epoch of each prefix, no more
        available = sum(max(0, tokens - 1) // seq_length for _, _, tokens in counts)
        if available < needed:
            documents = sum(d for _, d, _ in counts)
            tokens = sum(t for _, _, t in counts)
            field = _field(blend[0], split)
            return (
                field,
                f"the {name} split of the unweighted blend gets {documents} documents, {tokens} "
                f"tokens: one epoch of each path, {available} samples of {seq_length}+1 tokens, "
                f"but the run needs {needed}; give each path a weight ('WEIGHT PREFIX': Megatron "
                "then repeats epochs) or add documents",
            )
    return None


def _field(source: Source, split: str | None) -> str:
    return "data.split" if split is not None else source.where


def _empty_split_problem(
    source: Source,
    name: str,
    index: int,
    documents: int,
    shares: list[float] | None,
    needed: int,
    split: str | None,
) -> tuple[str, str]:
    total = len(source.lengths)
    what = (
        f"the {name} split of {source.where} ({source.prefix}) gets {documents} of {total} "
        f"documents, 0 tokens"
    )
    if split is not None:
        what += f" under split {split}"
    what += (
        f"; the run needs {needed} samples from it and Megatron's epoch loop never ends on an "
        "empty split"
    )
    if shares is None or split is None:
        return source.where, what + "; give it a prefix with documents"
    if needed == 0:
        written = re.findall(r"[.0-9]+", split) + ["0"] * len(SPLITS)
        zeroed = ",".join("0" if i == index else written[i] for i in range(len(SPLITS)))
        fix = f"set its share to 0 (data.split: {zeroed})"
        if total > 1:
            fix += f" or give it documents (e.g. data.split: {_share_text(shares, total)})"
    elif total > 1:
        fix = f"give it documents, e.g. data.split: {_share_text(shares, total)}"
    else:
        fix = "add documents to the corpus (one document cannot be split)"
    return "data.split", f"{what}; {fix}"
