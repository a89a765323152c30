"""Checks on data and tokenizer files before any rank starts, each problem in one line.

Used by ``megatron-ext validate``/``run`` (a recipe's ``data`` section) and by
``prepare-data``: dataset prefixes whose ``.bin``/``.idx`` are missing, tokenizer files that do
not exist, a vocabulary smaller than the largest token id a dataset holds, and tokenizer types
that need the HuggingFace hub (megatron's ``GPT2BPETokenizer`` loads ``gpt2``'s tokenizer
configuration from the hub even when ``--vocab-file``/``--merge-file`` are local).

Paths in a recipe may hold ``${VAR}`` or ``${VAR:-default}``; a relative path is relative to
the recipe's directory (:func:`resolve_path`).
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megatron_ext import files
from megatron_ext.data.tokenizer_files import hub_cached
from megatron_ext.errors import MegatronExtError

PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
SCAN_LIMIT_BYTES = 1 << 30
"""A ``.bin`` larger than this is not scanned for its largest token id (it would take long)."""

FILE_FIELDS = {
    # tokenizer type -> (field, flag) that must name an existing file or directory
    "GPT2BPETokenizer": (("vocab_file", "--vocab-file"), ("merge_file", "--merge-file")),
    "HuggingFaceTokenizer": (("model", "--tokenizer-model"),),
    "SentencePieceTokenizer": (("model", "--tokenizer-model"),),
    "GPTSentencePieceTokenizer": (("model", "--tokenizer-model"),),
    "Llama2Tokenizer": (("model", "--tokenizer-model"),),
    "TikTokenizer": (("model", "--tokenizer-model"),),
}
DIRECTORY_TYPES = ("HuggingFaceTokenizer", "TikTokenizer")
"""Tokenizers whose --tokenizer-model may be a directory (the others read one file)."""
HUB_NAMES = {"GPT2BPETokenizer": "gpt2"}
OFFLINE_ALTERNATIVE = (
    "offline: HuggingFaceTokenizer with --tokenizer-model DIR, a directory with tokenizer.json, "
    "or vocab.json + merges.txt + a tokenizer_config.json naming GPT2Tokenizer "
    "(`megatron-ext prepare-data --example` writes both)"
)


class UnsetVariable(MegatronExtError, ValueError):
    """A ``${VAR}`` in a path names a variable the environment lacks (and gives no default)."""


def expand(text: str) -> str:
    """``${VAR}`` and ``${VAR:-default}`` from the environment; an unset VAR without a default
    raises :class:`UnsetVariable` naming it."""

    def fill(match: re.Match) -> str:
        name, default = match.group(1), match.group(2)
        if name in os.environ:
            return os.environ[name]
        if default is not None:
            return default
        raise UnsetVariable(f"${{{name}}} is not set in the environment")

    return PLACEHOLDER.sub(fill, text)


def resolve_path(text: str, base_dir: Path) -> str:
    """A recipe's path with placeholders filled, relative ones made relative to ``base_dir``."""
    path = Path(expand(text)).expanduser()
    return str(path if path.is_absolute() else base_dir / path)


def hub_offline() -> bool:
    return any(
        os.environ.get(v, "") not in ("", "0") for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def hub_note(tokenizer_type: str) -> str | None:
    """One line when the tokenizer type will download from the hub at start-up, else None."""
    name = HUB_NAMES.get(tokenizer_type)
    if name is None or hub_cached(name):
        return None
    return (
        f"{tokenizer_type} loads {name!r}'s tokenizer configuration from the HuggingFace hub "
        f"even with local files (megatron's MegatronHFTokenizer); {OFFLINE_ALTERNATIVE}"
    )


def tokenizer_problems(
    tokenizer_type: str,
    model: str | None,
    vocab_file: str | None,
    merge_file: str | None,
    where: str = "",
    need_eos: bool = True,
) -> list[str]:
    """Missing tokenizer files, a local tokenizer directory that does not read or (``need_eos``:
    training, ``--append-eod``) names no end-of-document token, and a hub download that cannot
    happen offline."""
    values = {"model": model, "vocab_file": vocab_file, "merge_file": merge_file}
    problems = []
    for field, flag in FILE_FIELDS.get(tokenizer_type, ()):
        label = f"{where}{field}" if where else flag
        value = values[field]
        if not value:
            problems.append(f"{label}: {tokenizer_type} needs {flag}")
        elif not Path(value).exists():
            fix = example_fix(value)
            problems.append(f"{label}: {value} does not exist" + (f"; {fix}" if fix else ""))
        elif problem := _not_a_file_problem(
            value, directory_allowed=tokenizer_type in DIRECTORY_TYPES
        ):
            problems.append(f"{label}: {problem}")
    if tokenizer_type == "HuggingFaceTokenizer" and model and Path(model).is_dir():
        label = f"{where}model" if where else "--tokenizer-model"
        if not any((Path(model) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
            problems.append(f"{label}: {model} has no tokenizer.json or tokenizer_config.json")
        else:
            from megatron_ext.data.tokenizer_files import directory_problems

            problems += [f"{label}: {line}" for line in directory_problems(model, need_eos)]
    note = hub_note(tokenizer_type)
    if note and hub_offline():
        problems.append(f"{where}type: {note}")
    # (a path that is not a regular file was refused above, unread)
    if tokenizer_type in SENTENCEPIECE_TYPES and model and Path(model).is_file():
        problem = sentencepiece_problem(model)
        if problem:
            problems.append(
                f"{where}model: {problem}" if where else f"--tokenizer-model: {problem}"
            )
    if tokenizer_type == "GPT2BPETokenizer" and vocab_file and Path(vocab_file).is_file():
        problem = _vocab_json_problem(vocab_file)
        if problem:
            problems.append(
                f"{where}vocab_file: {problem}" if where else f"--vocab-file: {problem}"
            )
    return problems


SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
MAX_SENTENCEPIECE_BYTES = 1 << 30


def sentencepiece_problem(model: str) -> str | None:
    """Why ``model`` is not a SentencePiece model the ranks can load (None: it is): read as a
    regular file within a bound, then parsed by sentencepiece itself (issue 40, item 13)."""
    try:
        blob = files.read_bounded(model, MAX_SENTENCEPIECE_BYTES, "SentencePiece model")
    except OSError as e:
        return f"{model} cannot be read: {files.failure_reason(e)}"
    import sentencepiece

    try:
        size = sentencepiece.SentencePieceProcessor(model_proto=blob).vocab_size()
        if size < 1:
            raise ValueError("no pieces")
    except Exception as e:  # noqa: BLE001 - sentencepiece raises RuntimeError, OSError...
        return (
            f"{model} is not a SentencePiece model ({' '.join(str(e).split())[:120]}); give the "
            ".model file sentencepiece trained"
        )
    return None


def _not_a_file_problem(path: str, directory_allowed: bool) -> str | None:
    """Why an existing tokenizer path cannot be read as the file it names (None: it can): a
    FIFO, socket or device is never opened (issue 40, items 6 and 15)."""
    kind = files.irregular_kind(path, directory_ok=directory_allowed)
    return f"{path} is {kind}, not a regular file; give the tokenizer's file" if kind else None


def _vocab_json_problem(vocab_file: str) -> str | None:
    """A GPT-2 vocab.json that is not a JSON mapping of tokens to ids (megatron reads it with
    json.load)."""
    from megatron_ext.data.tokenizer_files import read_json

    try:
        vocab = read_json(vocab_file, "vocab.json")
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        return (
            f"{vocab_file} is not JSON ({' '.join(str(e).split())}); GPT2BPETokenizer's vocab "
            "file is vocab.json, a mapping of tokens to ids"
        )
    if not isinstance(vocab, dict):
        return f"{vocab_file} is JSON but not a mapping of tokens to ids"
    return None


def tokenizer_vocab_size(
    tokenizer_type: str,
    model: str | None,
    vocab_file: str | None,
    vocab_size: int | None,
) -> int | None:
    """The vocabulary size read from the tokenizer's files with its own library (None when it
    cannot be told without building megatron's tokenizer)."""
    if tokenizer_type == "NullTokenizer":
        return vocab_size
    if tokenizer_type == "GPT2BPETokenizer" and vocab_file:
        from megatron_ext.data.tokenizer_files import read_json

        return len(read_json(vocab_file, "vocab.json"))
    if tokenizer_type == "HuggingFaceTokenizer" and model:
        tokenizer_json = Path(model) / "tokenizer.json"
        if tokenizer_json.is_file():
            from tokenizers import Tokenizer

            return Tokenizer.from_file(str(tokenizer_json)).get_vocab_size(with_added_tokens=True)
        return None
    if tokenizer_type in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        import sentencepiece

        return sentencepiece.SentencePieceProcessor(model_file=str(model)).vocab_size()
    return None


# Paths under an example directory (``prepare-data --example DIR``), as parts below DIR.
EXAMPLE_LAYOUT = (
    ("tokenizers", "huggingface"),
    ("tokenizers", "sentencepiece", "tokenizer.model"),
    ("tokenizers", "gpt2", "vocab.json"),
    ("tokenizers", "gpt2", "merges.txt"),
    *(
        ("data", tokenizer, f"{source}_text_document")
        for tokenizer in ("huggingface", "sentencepiece")
        for source in ("stdlib_a_m", "stdlib_n_z")
    ),
)


def example_fix(path: str) -> str | None:
    """For a missing path of the example data: the one command that makes it (None for any
    other path)."""
    parts = Path(os.path.normpath(path)).parts
    for tail in EXAMPLE_LAYOUT:
        if len(parts) > len(tail) and parts[-len(tail) :] == tail:
            root = Path(*parts[: -len(tail)])
            with contextlib.suppress(ValueError):
                root = root.relative_to(Path.cwd())
            return (
                f"the example data is not made yet: run `megatron-ext prepare-data --example "
                f"{root}` (or set MEGATRON_EXT_EXAMPLE_DATA to where it is)"
            )
    return None


def missing_files(prefix: str) -> list[str]:
    return [prefix + ext for ext in (".bin", ".idx") if not Path(prefix + ext).exists()]


# Megatron's indexed dataset (megatron/core/datasets/indexed_dataset.py, "MMIDIDX" format):
# a 9-byte magic, version 1 (<Q), the token dtype's code (<B), the sequence count S and the
# document-boundary count D (<Q each), then S int32 lengths, S int64 byte offsets into the
# .bin and D int64 document boundaries (0 first, S last). Read here without megatron's reader,
# whose __del__ prints a traceback for an index it could not open (issue 40, item 12).
INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_HEADER = struct.Struct("<9sQBQQ")
INDEX_DTYPES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}


class IndexProblem(MegatronExtError, ValueError):
    """A ``.bin``/``.idx`` pair that is not one Megatron indexed dataset (one line)."""


@dataclass(frozen=True)
class IndexedData:
    """What a consistent ``PREFIX.idx`` says of ``PREFIX.bin``."""

    dtype: Any
    lengths: np.ndarray  # tokens per sequence (a copy)
    documents: int
    bin_bytes: int


def _regular_size(path: str) -> int:
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise IndexProblem(f"{path} cannot be read: {e.strerror}") from None
    if not stat.S_ISREG(mode):
        raise IndexProblem(files.not_regular(path, mode).strerror)
    return os.stat(path).st_size


def read_index(prefix: str) -> IndexedData:
    """``PREFIX.idx`` read and checked against ``PREFIX.bin``: the header, the file sizes, the
    document boundaries and every sequence's place in the .bin. A ``.bin`` paired with another
    dataset's ``.idx`` fails the last; raises :class:`IndexProblem`."""
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    idx_bytes, bin_bytes = _regular_size(idx), _regular_size(bin_)
    try:
        with files.open_regular(idx) as stream:
            head = stream.read(INDEX_HEADER.size)
    except OSError as e:
        raise IndexProblem(f"{idx} cannot be read: {files.failure_reason(e)}") from None
    if len(head) < INDEX_HEADER.size or head[:9] != INDEX_MAGIC:
        raise IndexProblem(f"{idx} is not a Megatron index (no MMIDIDX header)")
    _, version, code, sequences, boundaries = INDEX_HEADER.unpack(head)
    if version != 1 or code not in INDEX_DTYPES:
        raise IndexProblem(f"{idx}: index version {version}, dtype code {code} are not Megatron's")
    dtype = np.dtype(INDEX_DTYPES[code])
    body = sequences * (4 + 8) + boundaries * 8
    if idx_bytes - INDEX_HEADER.size not in (body, body + sequences):  # (+ multimodal modes)
        raise IndexProblem(
            f"{idx} is {idx_bytes} bytes but its header describes {sequences} sequences and "
            f"{boundaries} document boundaries; it is cut short or not this dataset's index"
        )
    table = np.memmap(idx, mode="r", dtype=np.uint8)
    offset = INDEX_HEADER.size
    lengths = np.frombuffer(table, np.int32, sequences, offset).astype(np.int64)
    pointers = np.frombuffer(table, np.int64, sequences, offset + 4 * sequences)
    bounds = np.frombuffer(table, np.int64, boundaries, offset + 12 * sequences)
    expected = np.concatenate(([0], np.cumsum(lengths) * dtype.itemsize))
    if boundaries == 0 or bounds[0] != 0 or bounds[-1] != sequences or np.any(np.diff(bounds) < 0):
        raise IndexProblem(f"{idx}: its document boundaries do not cover its {sequences} sequences")
    if np.any(lengths < 0) or not np.array_equal(pointers, expected[:-1]):
        raise IndexProblem(f"{idx}: its sequence offsets do not follow its lengths")
    if int(expected[-1]) != bin_bytes:
        raise IndexProblem(
            f"{bin_} is {bin_bytes} bytes but {idx} describes {int(expected[-1])} "
            f"({int(lengths.sum())} {dtype.name} tokens in {boundaries - 1} documents): the "
            ".bin and .idx are not one dataset; prepare them again together"
        )
    return IndexedData(dtype, np.array(lengths, copy=True), boundaries - 1, bin_bytes)


def max_token_id(prefix: str) -> int | None:
    """The largest token id in ``PREFIX.bin`` (None when the file is too large to scan);
    raises :class:`IndexProblem` for a pair that is not one dataset (:func:`read_index`)."""
    data = read_index(prefix)
    if data.bin_bytes > SCAN_LIMIT_BYTES:
        return None
    if data.bin_bytes == 0:
        return -1
    tokens = np.memmap(prefix + ".bin", dtype=data.dtype, mode="r")
    return int(tokens.max()) if tokens.size else -1
