"""``megatron-ext run RECIPE [KEY=VALUE ...]``: validate a recipe and train it on this machine."""

from __future__ import annotations

import argparse
import sys

from megatron_ext.cli._common import add_recipe_args, load, split_targets

NAME = "run"
HELP = "validate a recipe and train it on this machine"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_recipe_args(parser, required=False)
    parser.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue a stopped run (exit status 75) from its latest complete checkpoint, "
        "with its recipe and overrides; takes no recipe",
    )
    parser.add_argument(
        "--run-dir", help="the run directory (default: RUNS_ROOT/<name>-<platform>-<time>)"
    )
    parser.add_argument(
        "--runs-root", default="runs", help="where run directories go (default: %(default)s)"
    )
    parser.add_argument(
        "--no-compare", action="store_true", help="do not compare with golden values"
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="compare with golden values even when overrides change the recipe",
    )
    parser.add_argument(
        "--write-golden",
        action="store_true",
        help="write this run's metrics as the recipe's golden values for the platform",
    )
    parser.add_argument(
        "--skip-megatron-checks",
        action="store_true",
        help="validate the plan only (skip Megatron's argument checks and the guards)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="validate, then print the plan and the exact commands; start no rank",
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="record every rank's pipeline schedule: trace.json, timeline.png and the "
        "measured vs theoretical bubble in the summary",
    )
    parser.add_argument(
        "--trust-pickle",
        action="store_true",
        help="load the checkpoints the run reads (run --resume, checkpoint.load, "
        "--pretrained-checkpoint) without checking their pickles; unpickling can run any code "
        "in them, so only for checkpoints you made or trust (default: checked, refused)",
    )


def main(args: argparse.Namespace) -> int:
    from pathlib import Path

    from megatron_ext.recipes import RecipeError
    from megatron_ext.recipes.prepare import RunDirRecipes, prepare
    from megatron_ext.runs import runner

    refusal = _version_refusal()
    if refusal is not None:  # before any recipe problem: no recipe can run on this code
        print(f"megatron-ext run: {refusal}", file=sys.stderr)
        return runner.EXIT_INVALID
    if args.resume:
        recipes, overrides = split_targets(args.targets or [])
        if recipes or args.run_dir or args.dry_run or args.write_golden or args.trace:
            print(
                "megatron-ext run --resume RUN_DIR [parallelism.*=V training.iterations=N]: "
                "takes no recipe, --run-dir, --dry-run, --write-golden or --trace (the run's "
                "own are used)",
                file=sys.stderr,
            )
            return runner.EXIT_INVALID
        return runner.resume_run(
            Path(args.resume),
            RunDirRecipes(),
            _options(args),
            overrides=overrides,
            allow_env=tuple(args.allow_env),
        ).exit_code
    recipes, overrides = split_targets(args.targets)
    if len(recipes) != 1:
        print(f"megatron-ext run: expected one recipe, got {recipes or 'none'}", file=sys.stderr)
        return runner.EXIT_INVALID
    try:
        loaded = load(recipes[0], args.platform, overrides, args.device, args.allow_env)
    except RecipeError as exc:
        print(exc, file=sys.stderr)
        return runner.EXIT_INVALID
    options = _options(args)
    # the dry run reads no checkpoint; a run first checks the pickles of those it will load
    request = prepare(
        loaded,
        megatron_checks=options.megatron_checks,
        check_pickles=not args.dry_run,
        trust_pickle=options.trust_pickle,
        trace=options.trace,
    )
    if args.dry_run:
        return runner.dry_run(request, options).exit_code
    try:
        outcome = runner.run(request, options)
    except OSError as exc:  # a write under the run directory after the ranks ended (disk full)
        print(
            f"megatron-ext run: {runner.cannot_write(exc, Path(args.run_dir or '.'))}",
            file=sys.stderr,
        )
        return runner.EXIT_TRAINING_FAILED
    return outcome.exit_code


def _version_refusal() -> str | None:
    """Why megatron-ext refuses the installed megatron-core (None: it does not), the message
    install() would raise on every rank (MEGATRON_EXT_ALLOW_UNVERIFIED=1 turns it into a
    warning there and here)."""
    from megatron_ext import registry

    try:
        registry.check_megatron_core_version(registry.patches("core"))
    except registry.UnverifiedMegatronCoreError as exc:
        return str(exc)
    return None


def _options(args: argparse.Namespace):
    """The run-time switches of the command line, once."""
    from pathlib import Path

    from megatron_ext.runs.options import RunOptions

    return RunOptions(
        run_dir=Path(args.run_dir) if args.run_dir else None,
        runs_root=Path(args.runs_root),
        compare_golden=not args.no_compare,
        force_compare=args.compare,
        write_golden=args.write_golden,
        megatron_checks=not args.skip_megatron_checks,
        trace=args.trace,
        trust_pickle=args.trust_pickle,
    )
