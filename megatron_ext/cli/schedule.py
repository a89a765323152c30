"""``megatron-ext schedule --pp P [--vpp V] --microbatches M [...]`` or ``--recipe RECIPE``:
megatron-core's pipeline schedule as a grid, its bubble, peak in-flight micro-batches and bytes
per pipeline edge, without starting anything."""

from __future__ import annotations

import argparse
import sys

NAME = "schedule"
HELP = "print megatron-core's pipeline schedule: grid, bubble, in-flight, bytes per edge"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pp", type=int, help="pipeline stages (--pipeline-model-parallel-size)")
    parser.add_argument(
        "--vpp", type=int, help="chunks per rank (--num-virtual-stages-per-pipeline-rank)"
    )
    parser.add_argument(
        "--microbatches", type=int, help="micro-batches per iteration and data-parallel rank"
    )
    parser.add_argument(
        "--microbatch-group-size",
        type=int,
        help="--microbatch-group-size-per-virtual-pipeline-stage (default: pp)",
    )
    parser.add_argument("--mhc-streams", type=int, help="mHC residual streams n (edges carry n*h)")
    parser.add_argument("--hidden", type=int, help="hidden size h (for bytes per edge)")
    parser.add_argument("--seq", type=int, help="sequence length (for bytes per edge)")
    parser.add_argument(
        "--micro-batch-size", type=int, help="micro-batch size (for bytes per edge)"
    )
    parser.add_argument(
        "--dtype-bytes", type=int, default=4, help="bytes per element (default: %(default)s)"
    )
    parser.add_argument("--recipe", help="take the plan from a recipe (multi-module recipes too)")
    parser.add_argument(
        "--platform", default="cpu", help="the recipe's platform overlay (default: %(default)s)"
    )
    parser.add_argument(
        "--steps", action="store_true", help="also list every rank's steps with its P2P calls"
    )
    parser.add_argument("--plot", metavar="FILE.png", help="draw the timeline with matplotlib")
    parser.set_defaults(targets=[])


def _error(message: str) -> int:
    print(f"megatron-ext schedule: {message}", file=sys.stderr)
    return 2


def main(args: argparse.Namespace) -> int:
    from megatron_ext.recipes.schedule import plan_from_recipe
    from megatron_ext.schedules import report as rep
    from megatron_ext.schedules.schedule import SchedulePlan

    overrides = list(getattr(args, "targets", None) or [])
    try:
        if args.recipe:
            plan, size = plan_from_recipe(args.recipe, overrides, args.platform)
            if args.microbatches is not None:
                plan.microbatches = args.microbatches
        else:
            if args.pp is None or args.microbatches is None:
                return _error("give --pp and --microbatches (or --recipe RECIPE)")
            plan = SchedulePlan(
                pp=args.pp,
                vpp=args.vpp,
                microbatches=args.microbatches,
                microbatch_group_size=args.microbatch_group_size,
            )
            size = None
            if args.hidden is not None:
                if args.seq is None or args.micro_batch_size is None:
                    return _error("--hidden needs --seq and --micro-batch-size")
                size = rep.MessageSize(
                    args.hidden,
                    args.seq,
                    args.micro_batch_size,
                    args.mhc_streams or 1,
                    args.dtype_bytes,
                )
            elif args.mhc_streams:
                return _error("--mhc-streams needs --hidden, --seq and --micro-batch-size")
        lines, schedule = rep.report(plan, size, steps=args.steps)
    except ValueError as exc:
        return _error(str(exc))
    print("\n".join(lines))
    if args.plot:
        from megatron_ext.schedules.schedule import simulate
        from megatron_ext.schedules.timeline import plot_timeline

        timeline = simulate(schedule)
        title = (
            f"{rep.kind_of(plan).split(' (')[0]}: {len(schedule.ranks)} ranks"
            + (f" x {plan.vpp} chunks" if plan.vpp else "")
            + f", {plan.microbatches} micro-batches"
        )
        plot_timeline(
            timeline,
            args.plot,
            title,
            schedule.chunks,
            unit="time (forward = 1, backward = 2)",
            note=f"bubble {timeline.bubble():.1%}",
        )
        print(f"timeline: {args.plot}")
    return 0
