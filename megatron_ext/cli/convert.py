"""``megatron-ext convert-checkpoint IN OUT --model M --to T``: mHC keys upstream <->
megatron-ext."""

from __future__ import annotations

import argparse
import sys

NAME = "convert-checkpoint"
HELP = "rename mHC checkpoint keys between upstream Megatron-LM (PR #6401/dev) and megatron-ext"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", help="a torch.save'd model state dict or model_optim_rng.pt")
    parser.add_argument("output", help="where to write the converted file")
    parser.add_argument(
        "--model", choices=("gpt", "hybrid"), required=True, help="the model the checkpoint holds"
    )
    parser.add_argument(
        "--to",
        choices=("upstream", "megatron-ext"),
        required=True,
        help="the key naming to write: upstream Megatron-LM's or megatron-ext's",
    )
    parser.add_argument(
        "--source",
        choices=("main", "pr6401", "dev", "megatron-ext"),
        default="pr6401",
        help="where the input comes from: main's H_res orientation differs (a note "
        "says so); default: %(default)s",
    )


def main(args: argparse.Namespace) -> int:
    from megatron_ext.checkpoint.convert import ConversionError, convert_file

    try:
        notes = convert_file(args.input, args.output, args.model, args.to, args.source)
    except (ConversionError, OSError) as exc:
        print(f"megatron-ext convert-checkpoint: {exc}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"note: {note}")
    print(f"wrote {args.output} ({args.model}, {args.to} layout)")
    return 0
