"""``megatron-ext runs [--runs-root DIR]``: the run directories (name, recipe, status, steps,
last loss, when); ``megatron-ext runs show RUN``: one run, its segments and checkpoints."""

from __future__ import annotations

import argparse
import sys

NAME = "runs"
HELP = "list run directories, or show one (runs show RUN)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "words", nargs="*", metavar="show RUN", help="'show RUN': one run (a path or a name)"
    )
    parser.add_argument(
        "--runs-root", default="runs", help="where run directories are (default: %(default)s)"
    )


def main(args: argparse.Namespace) -> int:
    from pathlib import Path

    from megatron_ext.runs import listing as runs

    try:
        if not args.words:
            found = runs.find(Path(args.runs_root))
            if not found:
                print(f"no run directories in {args.runs_root}")
                return 0
            print("\n".join(runs.table(found)))
            return 0
        if args.words[0] != "show" or len(args.words) != 2:
            print("megatron-ext runs: expected nothing or 'show RUN'", file=sys.stderr)
            return 2
        print("\n".join(runs.details(runs.resolve(args.words[1], Path(args.runs_root)))))
        return 0
    except runs.RunDirError as exc:
        print(f"megatron-ext runs: {exc}", file=sys.stderr)
        return 2
