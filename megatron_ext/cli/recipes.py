"""``megatron-ext recipes [--copy NAME [DIR]]``: the recipes that ship with megatron-ext (also
in a pip-installed wheel), or one copied out, ready to edit and run; ``--with-golden`` also copies
the golden values measured on the shipped data (a run on other data has none: "not compared")."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

NAME = "recipes"
HELP = "list the shipped recipes, or copy one out to edit (--with-golden: and its golden values)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--copy",
        nargs="+",
        metavar=("NAME", "DIR"),
        help="copy recipe NAME into DIR (default: the current directory)",
    )
    parser.add_argument(
        "--with-golden",
        action="store_true",
        help="also copy golden/NAME/: the golden values measured on the shipped data (they "
        "fail on any other data; without them a run reports 'not compared')",
    )


def main(args: argparse.Namespace) -> int:
    from megatron_ext.recipes import shipped

    if not args.copy:
        recipes = shipped.shipped_recipes()
        if not recipes:
            print(f"megatron-ext recipes: none found in {shipped.shipped_dir()}", file=sys.stderr)
            return 2
        width = max(map(len, recipes))
        for name, path in recipes.items():
            print(f"{name:<{width}}  {shipped.summary(path)}")
        print(f"\n(in {shipped.shipped_dir()}; `megatron-ext recipes --copy NAME` copies one out)")
        return 0
    if len(args.copy) > 2:
        print("megatron-ext recipes: --copy takes NAME and at most one DIR", file=sys.stderr)
        return 2
    name, destination = args.copy[0], Path(args.copy[1] if len(args.copy) > 1 else ".")
    try:
        written = shipped.copy_out(name, destination, with_golden=args.with_golden)
    except (ValueError, OSError) as exc:
        print(f"megatron-ext recipes: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    print(f"next: megatron-ext validate {written[0]} && megatron-ext run {written[0]}")
    return 0
