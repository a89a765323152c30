"""``megatron-ext train-tokenizer --input F.jsonl --output DIR --vocab-size N [--type T]``: a
tokenizer with an end-of-document token trained on your own JSONL (the file ``prepare-data``
reads), so a corpus needs nothing downloaded. ``--type bpe`` (default): a byte-level BPE written
as a HuggingFace tokenizer directory (DIR/huggingface, for ``--tokenizer-type
HuggingFaceTokenizer``) and as GPT-2 files (DIR/gpt2); ``--type sentencepiece``: a SentencePiece
BPE model (DIR/sentencepiece/tokenizer.model). It prints the prepare-data flags to use next."""

from __future__ import annotations

import argparse
import sys
import time

NAME = "train-tokenizer"
HELP = "train a BPE or SentencePiece tokenizer (with an eos token) on a JSONL corpus"

TYPES = ("bpe", "sentencepiece")
MIN_VOCAB, MAX_VOCAB = 260, 1_000_000
"""A byte-level BPE needs its 256 bytes and the eos token; above a million is no small model."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", required=True, help="JSONL, one document a line")
    parser.add_argument("--output", required=True, metavar="DIR", help="where the tokenizer goes")
    parser.add_argument("--vocab-size", type=int, default=4096, help="default: %(default)s")
    parser.add_argument("--type", choices=TYPES, default="bpe", help="default: %(default)s")
    parser.add_argument(
        "--json-key", default="text", help="the field holding the text (default: %(default)s)"
    )


def read_texts(path: str, key: str) -> list[str]:
    """Every document's ``key`` text; a line that is not a JSON object with a string there is
    refused with its line number (PrepareDataError)."""
    import json

    from megatron_ext.data.preprocess import PrepareDataError, _numbered_lines

    texts = []
    try:
        for line_no, line in _numbered_lines(path):
            if not line.strip():
                continue
            try:
                document = json.loads(line)
            except (ValueError, RecursionError):
                raise PrepareDataError(f"{path}:{line_no}: not a JSON line") from None
            text = document.get(key) if isinstance(document, dict) else None
            if not isinstance(text, str):
                raise PrepareDataError(
                    f"{path}:{line_no}: no string field {key!r}; name the field with --json-key"
                )
            texts.append(text)
    except OSError as exc:
        raise PrepareDataError(f"--input {path}: {exc.strerror}") from None
    if not texts:
        raise PrepareDataError(f"--input {path}: no documents")
    return texts


def train(texts: list[str], kind: str, vocab_size: int, output) -> dict[str, str]:
    """Train one tokenizer; returns the prepare-data flags that use it."""
    from megatron_ext.data import tokenizer_training as training

    if kind == "bpe":
        paths = training.interruptible(training.train_byte_level_bpe, texts, vocab_size, output)
        return {
            "--tokenizer-type": "HuggingFaceTokenizer",
            "--tokenizer-model": str(paths["hf_dir"]),
        }
    model = training.interruptible(
        training.train_sentencepiece, texts, vocab_size, output / "sentencepiece"
    )
    return {"--tokenizer-type": "SentencePieceTokenizer", "--tokenizer-model": str(model)}


def main(args: argparse.Namespace) -> int:
    from pathlib import Path

    from megatron_ext.data.preprocess import PrepareDataError

    if not MIN_VOCAB <= args.vocab_size <= MAX_VOCAB:
        print(
            f"megatron-ext train-tokenizer: --vocab-size {args.vocab_size}: give "
            f"{MIN_VOCAB} to {MAX_VOCAB}",
            file=sys.stderr,
        )
        return 2
    output = Path(args.output)
    if output.exists() and not output.is_dir():
        print(f"megatron-ext train-tokenizer: --output {output}: a file", file=sys.stderr)
        return 2
    started = time.monotonic()
    try:
        texts = read_texts(args.input, args.json_key)
        print(
            f"train-tokenizer: {len(texts)} documents, training a {args.type} tokenizer of "
            f"{args.vocab_size} tokens",
            file=sys.stderr,
            flush=True,
        )
        flags = train(texts, args.type, args.vocab_size, output)
    except (PrepareDataError, ValueError, RuntimeError) as exc:
        print(f"megatron-ext train-tokenizer: {exc}", file=sys.stderr)
        return 2
    print(f"trained in {time.monotonic() - started:.1f} s; prepare-data with:")
    print("  " + " ".join(f"{flag} {value}" for flag, value in flags.items()) + " --append-eod")
    return 0
