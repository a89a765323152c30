"""``megatron-ext convert-checkpoint IN OUT --model M --to T``: mHC keys upstream <->
megatron-ext."""

from __future__ import annotations

import argparse
import sys

NAME = "convert-checkpoint"
HELP = "rename mHC checkpoint keys between upstream Megatron-LM (PR #6401/dev) and megatron-ext"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "input",
        help="a torch_dist checkpoint (iteration directory, checkpoint root or run directory), "
        "a torch.save'd model state dict or model_optim_rng.pt",
    )
    parser.add_argument("output", help="where to write (a new directory for torch_dist)")
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
    parser.add_argument(
        "--format",
        dest="output_format",
        choices=("torch_dist", "torch"),
        default=None,
        help="what to write: a torch_dist directory, or torch (a plain model state dict any "
        "torch.load reads); default: the input's format",
    )
    parser.add_argument(
        "--mhc-names",
        choices=("transformers", "deepseek"),
        default=None,
        help="instead of Megatron-LM's keys, rename the mHC parameters to (--to upstream) or "
        "from (--to megatron-ext) transformers' DeepSeek-V4 names (layers.i.attn_hc.fn/base/"
        "scale, hc_head.hc_fn) or the DeepSeek release's (layers.i.hc_attn_fn, hc_head_fn); "
        "for models trained with --mhc-variant deepseek-v4 or glm5",
    )
    parser.add_argument(
        "--trust-pickle",
        action="store_true",
        help="load a legacy file whose pickle names classes beyond tensors, containers and "
        "megatron-core's safe types; unpickling such a file can run any code in it, so only for "
        "files you made or trust (default: refused)",
    )


def main(args: argparse.Namespace) -> int:
    from functools import partial

    from megatron_ext.checkpoint.convert import ConversionError, convert_path
    from megatron_ext.checkpoint.hc_names import convert_mhc_names

    names = args.mhc_names
    try:
        notes = convert_path(
            args.input,
            args.output,
            args.model,
            args.to,
            args.source,
            args.output_format,
            args.trust_pickle,
            convert=partial(convert_mhc_names, names=names) if names else None,
        )
    except (ConversionError, OSError) as exc:
        print(f"megatron-ext convert-checkpoint: {exc}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"note: {note}")
    layout = f"{args.mhc_names} mHC names" if args.mhc_names and args.to == "upstream" else None
    print(f"wrote {args.output} ({args.model}, {layout or args.to + ' layout'})")
    return 0
