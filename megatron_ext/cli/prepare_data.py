"""``megatron-ext prepare-data``: JSONL into Megatron's indexed format (``PREFIX.bin/.idx``)
with Megatron-LM ``tools/preprocess_data.py``'s flags and bytes; ``--example DIR`` makes a
corpus from the installed Python's docstrings, trains tokenizers on it and prepares it."""

from __future__ import annotations

import argparse
import sys

NAME = "prepare-data"
HELP = "tokenize JSONL into Megatron's .bin/.idx (as tools/preprocess_data.py); --example DIR"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from megatron_ext.data.preprocess import add_arguments as add_preprocess_arguments

    parser.add_argument(
        "--example",
        metavar="DIR",
        help="build the example: a corpus, tokenizers and indexed datasets under DIR",
    )
    add_preprocess_arguments(parser)


def main(args: argparse.Namespace) -> int:
    import shutil

    from megatron_ext import files
    from megatron_ext.data.preprocess import PrepareDataError, preprocess

    try:
        if args.example:
            from pathlib import Path

            from megatron_ext.data.example import make_example

            if Path(args.example).exists() and not Path(args.example).is_dir():
                raise PrepareDataError(f"--example {args.example}: a file; give a directory")

            created = not Path(args.example).exists()
            try:
                make_example(args.example, workers=args.workers or 1)
            except OSError as e:
                if not files.is_write_failure(e):
                    raise
                if created:  # a half-built example of ours is nothing to keep
                    shutil.rmtree(args.example, ignore_errors=True)
                failed = files.write_errno(e) or e
                raise PrepareDataError(
                    files.cannot_write(failed.filename or args.example, failed)
                ) from None
        else:
            preprocess(args)
    except PrepareDataError as e:
        print(f"megatron-ext prepare-data: {e}", file=sys.stderr)
        return 2
    return 0
