"""``megatron-ext validate RECIPE ... [KEY=VALUE ...]``: every check, no process started."""

from __future__ import annotations

import argparse
import sys

from megatron_ext.cli._common import add_allow_env, add_trust_pickle, load, split_targets

NAME = "validate"
HELP = "check recipes: schema, plan, Megatron's checks, guards"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "targets",
        nargs="+",
        metavar="RECIPE [KEY=VALUE ...]",
        help="recipe YAML file(s), then overrides",
    )
    parser.add_argument(
        "--platform", default=None, help="check one platform (default: every platform)"
    )
    parser.add_argument("--device", choices=("cpu", "gpu"), help="override launch.device")
    parser.add_argument("--skip-megatron-checks", action="store_true", help="schema and plan only")
    add_allow_env(parser)
    add_trust_pickle(parser, "the recipe names")


def main(args: argparse.Namespace) -> int:
    from megatron_ext.checkpoint import preload
    from megatron_ext.recipes import RecipeError, command
    from megatron_ext.recipes.loader import platforms_of
    from megatron_ext.recipes.validate import validate

    recipes, overrides = split_targets(args.targets)
    if not recipes:
        print("megatron-ext validate: no recipe given", file=sys.stderr)
        return 2
    failed = False
    for recipe in recipes:
        platforms = [args.platform] if args.platform else platforms_of(recipe)
        for platform_name in platforms:
            label = f"{recipe} [{platform_name}]"
            try:
                loaded = load(recipe, platform_name, overrides, args.device, args.allow_env)
            except RecipeError as exc:
                failed = True
                for problem in exc.problems:
                    print(f"{label}: {problem}")
                continue
            # first, as for run: no check below may open a checkpoint that could run code
            unsafe = preload.pickle_problem(loaded.recipe, trust_pickle=args.trust_pickle)
            if unsafe is not None:
                failed = True
                print(f"{label}: {unsafe}")
                continue
            result = validate(loaded, megatron_checks=not args.skip_megatron_checks)
            for problem in result.problems:
                print(f"{label}: {problem}")
            for note in [*loaded.notes, *result.notes]:
                print(f"{label}: note: {note}")
            if result.ok:
                print(f"{label}: OK ({command.describe(loaded)})")
            failed = failed or not result.ok
    return 2 if failed else 0
