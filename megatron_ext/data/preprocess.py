"""JSONL -> Megatron's indexed format, as Megatron-LM's ``tools/preprocess_data.py`` makes it.

The flags and the files are upstream's (core_v0.19.0) for what GPT pretraining uses: one
document per JSONL line, the text under each ``--json-keys`` key (a string, or a list of strings
that are tokenized one by one and concatenated), optionally followed by the tokenizer's EOD
token (``--append-eod``), written to ``{output_prefix}_{key}_document.bin/.idx`` through
megatron-core's ``IndexedDatasetBuilder`` with the dtype megatron picks for the vocabulary. The
tokenizer is megatron's own (``build_tokenizer``) with upstream's tokenizer flags.

What differs is how failure looks: a line that is not JSON, not UTF-8 or lacks a key stops the
run with one line naming the file and the line number; files are written under temporary names
and renamed only when every document is in, so a final name never holds half a dataset.
Sentence splitting (``--split-sentences``, NLTK) and ``--partitions`` are not offered.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_ext import files
from megatron_ext.errors import MegatronExtError

TOKENIZER_ARGS_SEAM = "megatron.training.arguments:_add_tokenizer_args"
CHUNK_SIZE = 32
"""Lines handed to a worker at a time (upstream's ``imap`` chunk)."""


class PrepareDataError(MegatronExtError, ValueError):
    """Bad input for prepare-data; the message is one line."""


TOKENIZER_TYPES = (
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "TikTokenizer",
    "NullTokenizer",
)
TOKENIZER_FIELDS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file", "vocab_size")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Upstream's flags for GPT pretraining data (declared here so that ``megatron-ext --help``
    does not import megatron; :func:`tokenizer_namespace` fills megatron's other tokenizer
    fields from megatron's own parser)."""
    group = parser.add_argument_group(title="tokenizer")
    group.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, help="megatron's tokenizer")
    group.add_argument("--tokenizer-model", help="SentencePiece .model file or HuggingFace dir")
    group.add_argument("--vocab-file", help="GPT2BPETokenizer: vocab.json")
    group.add_argument("--merge-file", help="GPT2BPETokenizer: merges.txt")
    group.add_argument("--vocab-size", type=int, help="NullTokenizer: vocabulary size")
    group = parser.add_argument_group(title="input data")
    group.add_argument("--input", type=str, help="path to the input JSONL (one document a line)")
    group.add_argument(
        "--json-keys", nargs="+", default=["text"], help="keys of each line to tokenize"
    )
    group = parser.add_argument_group(title="tokenization process")
    group.add_argument(
        "--append-eod", action="store_true", help="append the EOD token to every document"
    )
    group = parser.add_argument_group(title="output data")
    group.add_argument(
        "--output-prefix", type=str, help="output path without the _{key}_document.bin suffix"
    )
    group = parser.add_argument_group(title="runtime")
    group.add_argument(
        "--workers", type=int, default=1, help="tokenizer processes (default 1: in this process)"
    )
    group.add_argument(
        "--log-interval", type=int, default=1000, help="documents between progress lines"
    )


def tokenizer_namespace(args: argparse.Namespace) -> argparse.Namespace:
    """What ``build_tokenizer`` reads: megatron's own tokenizer defaults (its parser, as
    upstream's script uses it), our flags over them, and the training-side fields set as
    upstream's script sets them (rank, vocabulary padding for the dtype choice)."""
    from megatron_ext import registry

    parser = registry.private(TOKENIZER_ARGS_SEAM)(argparse.ArgumentParser(add_help=False))
    namespace = parser.parse_args([])
    for name in TOKENIZER_FIELDS:
        setattr(namespace, name, getattr(args, name))
    namespace.rank = 1
    namespace.make_vocab_size_divisible_by = 128
    namespace.tensor_model_parallel_size = 1
    namespace.vocab_extra_ids = 0
    return namespace


def check_args(args: argparse.Namespace) -> None:
    """One-line errors for what upstream's parser would accept and then crash on."""
    required = (
        ("--tokenizer-type", args.tokenizer_type),
        ("--input", args.input),
        ("--output-prefix", args.output_prefix),
    )
    for flag, value in required:
        if not value:
            raise PrepareDataError(f"{flag} is required")
    if args.workers < 1:
        raise PrepareDataError(f"--workers must be a positive number, got {args.workers}")
    if problem := _input_file_problem(args.input):
        raise PrepareDataError(f"--input {problem}")
    if not os.access(args.input, os.R_OK):
        raise PrepareDataError(f"--input {args.input}: not readable")
    if args.log_interval < 1:
        raise PrepareDataError(f"--log-interval must be positive, got {args.log_interval}")
    from megatron_ext.data.input_limits import argument_problem

    vocab = args.vocab_size if args.tokenizer_type == "NullTokenizer" else None
    if problem := argument_problem(args.json_keys, args.output_prefix, vocab, args.workers):
        raise PrepareDataError(problem)
    from megatron_ext.data.checks import tokenizer_problems

    problems = tokenizer_problems(
        args.tokenizer_type,
        args.tokenizer_model,
        args.vocab_file,
        args.merge_file,
        need_eos=bool(getattr(args, "append_eod", False)),
    )
    if problems:
        raise PrepareDataError(problems[0])


def build_tokenizer(args: argparse.Namespace):
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer as build

    from megatron_ext.data.tokenizer_files import offline

    try:
        # local files need no hub (nor its retries)
        with offline(
            args.tokenizer_model,
            args.tokenizer_type,
            getattr(args, "vocab_file", None),
            getattr(args, "merge_file", None),
        ):
            tokenizer = build(tokenizer_namespace(args))
    except Exception as e:  # megatron wraps every library's failure differently
        message = " ".join(str(e).split())
        raise PrepareDataError(f"tokenizer {args.tokenizer_type}: {message}") from None
    if getattr(args, "append_eod", False) and getattr(tokenizer, "eod", None) is None:
        raise PrepareDataError(
            f"--append-eod: tokenizer {args.tokenizer_type} has no end-of-document token "
            "(its eos_token); set eos_token in the tokenizer's configuration or drop --append-eod"
        )
    return tokenizer


@dataclass
class Encoded:
    line_no: int
    ids: dict  # key -> token ids of the document
    lengths: dict  # key -> lengths of its sentences (one per non-empty string)
    nbytes: int
    error: str | None = None


class Encoder:
    """Tokenizes one JSONL line; a process-wide tokenizer is built once per worker."""

    tokenizer: Any = None  # megatron's tokenizer (no stubs), built in each worker

    def __init__(self, args: argparse.Namespace):
        self.args = args

    def initializer(self) -> None:
        Encoder.tokenizer = build_tokenizer(self.args)

    def encode(self, numbered_line: tuple[int, bytes]) -> Encoded:
        line_no, raw = numbered_line
        try:
            return self._encode(line_no, raw)
        except PrepareDataError as e:
            return Encoded(line_no, {}, {}, len(raw), error=str(e))

    def _encode(self, line_no: int, raw: bytes) -> Encoded:
        where = f"{self.args.input}:{line_no}"
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise PrepareDataError(f"{where}: not UTF-8 text") from None
        except json.JSONDecodeError as e:
            raise PrepareDataError(f"{where}: not a JSON object ({e.msg})") from None
        except RecursionError:
            raise PrepareDataError(f"{where}: JSON nested too deeply") from None
        except ValueError as e:  # an integer past Python's 4300-digit limit
            raise PrepareDataError(f"{where}: not readable JSON ({e})"[:300]) from None
        if not isinstance(record, dict):
            raise PrepareDataError(f"{where}: not a JSON object (got {type(record).__name__})")
        ids, lengths = {}, {}
        for key in self.args.json_keys:
            if key not in record:
                known = ", ".join(sorted(record)) or "none"
                raise PrepareDataError(f"{where}: no key {key!r} (keys: {known}); set --json-keys")
            ids[key], lengths[key] = self._tokenize(record[key], f"{where}: {key!r}")
        return Encoded(line_no, ids, lengths, len(raw))

    def _tokenize(self, text, where: str) -> tuple[list[int], list[int]]:
        sentences = text if isinstance(text, list) else [text]
        if not all(isinstance(s, str) for s in sentences):
            raise PrepareDataError(f"{where} must be a string or a list of strings")
        doc_ids: list[int] = []
        lengths: list[int] = []
        for sentence in sentences:
            try:
                sentence_ids = Encoder.tokenizer.tokenize(sentence)
            except Exception as e:  # e.g. NullTokenizer on text that is not ids
                message = " ".join(f"{type(e).__name__}: {e}".split())
                raise PrepareDataError(f"{where}: the tokenizer failed ({message})") from None
            # NullTokenizer: the text is the ids; one past the vocabulary would not fit the
            # dtype chosen from its size (other tokenizers only emit their own ids)
            vocab = self.args.vocab_size if self.args.tokenizer_type == "NullTokenizer" else None
            if vocab and any(not 0 <= int(i) < vocab for i in sentence_ids):
                bad = next(i for i in sentence_ids if not 0 <= int(i) < vocab)
                raise PrepareDataError(
                    f"{where}: token id {str(bad)[:40]} is outside the vocabulary [0, {vocab})"
                )
            if len(sentence_ids) > 0:
                doc_ids.extend(sentence_ids)
                lengths.append(len(sentence_ids))
        if doc_ids and self.args.append_eod:
            doc_ids.append(Encoder.tokenizer.eod)
            lengths[-1] += 1
        return doc_ids, lengths


def output_prefixes(args: argparse.Namespace) -> dict[str, str]:
    """key -> the dataset prefix written for it (upstream's naming)."""
    return {key: f"{args.output_prefix}_{key}_document" for key in args.json_keys}


def _input_file_problem(path: str) -> str | None:
    """Why the corpus ``path`` cannot be read line by line (None: a regular file)."""
    if not os.path.exists(path):
        return f"{path}: no such file"
    if kind := files.irregular_kind(path):
        return f"{path} is {kind}, not a regular file; give the JSONL corpus file"
    return None


def _numbered_lines(path: str) -> Iterator[tuple[int, bytes]]:
    """Each line, read at most MAX_LINE_BYTES at a time (see data.input_limits)."""
    from megatron_ext.data.input_limits import MAX_LINE_BYTES, line_too_long

    with files.open_regular(path) as f:  # a FIFO would block, a device never end
        line_no = 0
        while line := f.readline(MAX_LINE_BYTES + 1):
            line_no += 1
            if len(line) > MAX_LINE_BYTES:
                raise PrepareDataError(line_too_long(line_no, len(line), path))
            yield line_no, line


class _Progress:
    """A line every ``interval`` documents, and also at the first document and whenever
    :data:`QUIET_S` passed without one (issue 41, item 11: a 2,152-document corpus printed
    nothing for two minutes, the default interval never reached)."""

    QUIET_S = 10.0

    def __init__(self, interval: int, stream=None):
        # sys.stderr is looked up now, not when the module was imported: a default bound at
        # import time keeps whatever stream was current then (pytest's capture, since closed).
        self.interval, self.stream = interval, stream if stream is not None else sys.stderr
        self.start = self.last = time.time()

    def update(self, count: int, nbytes: int) -> None:
        now = time.time()
        if count == 1 or count % self.interval == 0 or now - self.last >= self.QUIET_S:
            self.last = now
            elapsed = max(time.time() - self.start, 1e-9)
            print(
                f"Processed {count} documents ({count / elapsed:.1f} docs/s, "
                f"{nbytes / elapsed / 1024 / 1024:.2f} MB/s).",
                file=self.stream,
                flush=True,
            )


def preprocess(args: argparse.Namespace) -> dict[str, str]:
    """Tokenize ``args.input`` into one indexed dataset per JSON key; returns key -> prefix."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    check_args(args)
    tokenizer = build_tokenizer(args)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    prefixes = output_prefixes(args)
    try:
        Path(args.output_prefix).parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PrepareDataError(f"--output-prefix {args.output_prefix}: {e.strerror}") from None
    tag = f".tmp{os.getpid()}"
    temp = {key: (f"{p}.bin{tag}", f"{p}.idx{tag}") for key, p in prefixes.items()}
    encoder = Encoder(args)
    print(
        f"prepare-data: tokenizing {args.input} with {args.workers} worker(s)",
        file=sys.stderr,
        flush=True,
    )
    pool, builders = None, {}
    try:
        builders = {key: IndexedDatasetBuilder(b, dtype=dtype) for key, (b, _) in temp.items()}
        encoded: Iterator[Encoded]
        if args.workers == 1:
            Encoder.tokenizer = tokenizer
            encoded = map(encoder.encode, _numbered_lines(args.input))
        else:
            pool = multiprocessing.Pool(args.workers, initializer=encoder.initializer)
            encoded = pool.imap(encoder.encode, _numbered_lines(args.input), CHUNK_SIZE)
        progress, nbytes, count = _Progress(args.log_interval), 0, 0
        for count, doc in enumerate(encoded, start=1):
            if doc.error:
                raise PrepareDataError(doc.error)
            for key in args.json_keys:
                builders[key].add_document(doc.ids[key], doc.lengths[key])
            nbytes += doc.nbytes
            progress.update(count, nbytes)
        if count == 0:
            raise PrepareDataError(f"--input {args.input}: no documents (the file is empty)")
        for key, (_, idx_tmp) in temp.items():
            builders[key].finalize(idx_tmp)
        for key, (bin_tmp, idx_tmp) in temp.items():
            # .bin first: until the .idx is renamed too, the dataset does not exist.
            os.replace(bin_tmp, prefixes[key] + ".bin")
            os.replace(idx_tmp, prefixes[key] + ".idx")
    except OSError as e:
        if not files.is_write_failure(e):
            raise
        # name the file the user asked for, not the temporary one beside it
        written = str(e.filename or temp[args.json_keys[0]][0])
        for key, paths in temp.items():
            for final, path in zip((".bin", ".idx"), paths, strict=True):
                written = written.replace(path, prefixes[key] + final)
        raise PrepareDataError(files.cannot_write(written, e)) from None
    finally:
        for builder in builders.values():
            with contextlib.suppress(OSError):  # a full disk fails the flush again: said above
                builder.data_file.close()
        if pool is not None:
            pool.terminate()
            pool.join()
        for paths in temp.values():
            for path in paths:
                if os.path.lexists(path):  # a read-only disk answers EROFS even for none
                    os.remove(path)
    print(f"Processed {count} documents into {', '.join(prefixes.values())}", file=sys.stderr)
    return prefixes
