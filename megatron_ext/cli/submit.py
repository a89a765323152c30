"""``megatron-ext submit RECIPE --slurm [...]``: the recipe as a Slurm job, waited on and
compared."""

from __future__ import annotations

import argparse
import sys

from megatron_ext.cli._common import add_recipe_args, add_trust_pickle, load, split_targets

NAME = "submit"
HELP = "run a recipe as a Slurm job, wait and compare"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_recipe_args(parser, default_platform=None)
    parser.add_argument(
        "--slurm", action="store_true", help="submit with sbatch (the supported scheduler)"
    )
    parser.add_argument(
        "--nodes", type=int, help="#SBATCH --nodes (default: the recipe's launch.nodes)"
    )
    parser.add_argument(
        "--gpus-per-node",
        type=int,
        help="GPUs (= tasks) per node (default: launch.slurm.gpus_per_node, else world size / nodes)",
    )
    parser.add_argument("--partition", help="#SBATCH --partition (default: launch.slurm.partition)")
    parser.add_argument("--account", help="#SBATCH --account (default: launch.slurm.account)")
    parser.add_argument("--time", help="job time limit, e.g. 00:30:00")
    parser.add_argument("--container-image", help="run the steps in this image (pyxis)")
    parser.add_argument("--container-mounts", help="comma-separated SRC:DST mounts")
    parser.add_argument(
        "--python", help="interpreter on the nodes (default: this one; 'python' in a container)"
    )
    parser.add_argument("--run-dir", help="run directory, on a file system the nodes share")
    parser.add_argument(
        "--runs-root", default="runs", help="where run directories go (default: %(default)s)"
    )
    parser.add_argument("--dry-run", action="store_true", help="print the sbatch script and stop")
    parser.add_argument("--no-wait", action="store_true", help="return after sbatch")
    parser.add_argument(
        "--no-compare", action="store_true", help="do not compare with golden values"
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="compare with golden values even when overrides change the recipe",
    )
    parser.add_argument(
        "--skip-megatron-checks",
        action="store_true",
        help="validate the plan only (skip Megatron's argument checks and the guards)",
    )
    add_trust_pickle(parser, "the job reads")


def main(args: argparse.Namespace) -> int:
    from pathlib import Path

    from megatron_ext.recipes import RecipeError
    from megatron_ext.recipes.loader import parse_yaml
    from megatron_ext.recipes.prepare import prepare
    from megatron_ext.runs.runner import EXIT_INVALID
    from megatron_ext.runs.submit import SlurmOptions, submit

    if not args.slurm:
        print("megatron-ext submit: only --slurm is supported; pass it explicitly", file=sys.stderr)
        return EXIT_INVALID
    recipes, overrides = split_targets(args.targets)
    if len(recipes) != 1:
        print(f"megatron-ext submit: expected one recipe, got {recipes or 'none'}", file=sys.stderr)
        return EXIT_INVALID
    platform = args.platform
    if platform is None:
        try:
            from megatron_ext import files
            from megatron_ext.recipes.loader import MAX_RECIPE_BYTES

            text = files.read_text_bounded(recipes[0], MAX_RECIPE_BYTES, "recipe")
            raw = parse_yaml(text) or {}
        except Exception:
            raw = {}
        platform = "gpu-cluster" if "gpu-cluster" in (raw.get("platforms") or {}) else "cpu"
    try:
        loaded = load(recipes[0], platform, overrides, args.device, args.allow_env)
    except RecipeError as exc:
        print(exc, file=sys.stderr)
        return EXIT_INVALID
    # the pickles of the checkpoints the job will load, checked here first as run does (the
    # files are on a file system this machine shares with the nodes); --trust-pickle skips it
    request = prepare(
        loaded, megatron_checks=not args.skip_megatron_checks, trust_pickle=args.trust_pickle
    )
    options = SlurmOptions(
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        partition=args.partition,
        account=args.account,
        time=args.time,
        container_image=args.container_image,
        container_mounts=args.container_mounts.split(",") if args.container_mounts else None,
        python=args.python,
    )
    outcome = submit(
        request,
        options,
        run_dir=Path(args.run_dir) if args.run_dir else None,
        runs_root=Path(args.runs_root),
        dry_run=args.dry_run,
        wait=not args.no_wait,
        compare_golden=not args.no_compare,
        force_compare=args.compare,
    )
    return outcome.exit_code
