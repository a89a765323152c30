"""``megatron-ext schedule --pp P [--vpp V] --microbatches M [--schedule zb-h1] [...]`` or
``--recipe RECIPE``: megatron-core's pipeline schedule (or megatron-ext's ZB-H1) as a grid, its
bubble, peak in-flight micro-batches and bytes per pipeline edge, without starting anything."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

NAME = "schedule"
HELP = "print megatron-core's pipeline schedule: grid, bubble, in-flight, bytes per edge"


def _time(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def _count(number: int) -> str:
    """A count for a message: 1e308 / 2 is a 300-digit number (issue 34, item 17)."""
    return str(number) if number < 10**9 else "over 10**9"


SIZE_FLAGS = ("mhc_streams", "hidden", "seq", "micro_batch_size", "dtype_bytes")


def _size_flag_problem(args: argparse.Namespace) -> str | None:
    """A size given on the command line (hidden, sequence, batch, bytes, streams) must be a
    whole number from 1 to 2**31: -64 or 0 made negative byte counts (issue 34, item 17)."""
    for name in SIZE_FLAGS:
        value = getattr(args, name, None)
        if value is not None and not 1 <= value <= 2**31:
            return f"--{name.replace('_', '-')} {value}: give a whole number from 1 to 2**31"
    return None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from megatron_ext.schedules.schedule import SCHEDULES

    parser.add_argument(
        "--schedule",
        help=f"pipeline schedule: {' or '.join(SCHEDULES)} (default: the recipe's "
        "parallelism.schedule, else 1f1b); zb-h1 also shows 1F1B's figures beside its own",
    )
    parser.add_argument(
        "--forward-time", type=_time, default=1.0, help="time of a forward (default: 1)"
    )
    parser.add_argument(
        "--backward-time",
        type=_time,
        default=2.0,
        help="time of a whole backward, input and weight gradients (default: 2)",
    )
    parser.add_argument(
        "--weight-time",
        type=_time,
        help="the weight-gradient part of it, ZB-H1's W step (default: half the backward, "
        "so F = B = W at the default times)",
    )
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
    parser.add_argument(
        "--mhc-single-pass",
        action="store_true",
        help="single-pass mHC: edges also carry the next sub-layer's coefficients [s, b, n] fp32",
    )
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
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="report",
        help="report: grid, bubble, in-flight, bytes (default); text: the schedule's text "
        "form, one line per rank, one action per token (F0 B0 W0; --from-text reads it); "
        "torch-text: the same in torch.distributed.pipelining's spelling (0F0 0I0 0W0: the "
        "stage first, I the input gradient, B only a whole backward)",
    )
    parser.add_argument(
        "--from-text",
        metavar="FILE",
        help="read the order from a schedule text (--format text's, or torch's spelling: "
        "F, I, W, B with or without the stage, 1I0) and report on it; the plan is the "
        "text's own, or --recipe's / the flags' when given (checked against it)",
    )
    parser.set_defaults(targets=[])


# Every step of every rank is built, simulated and printed: beyond this many compute steps per
# pass (stages x chunks x micro-batches) the answer takes minutes and gigabytes, and no grid is
# readable anyway. 64 stages x 4 chunks x 64 micro-batches fits.
MAX_COMPUTE_STEPS = 20_000
PLOT_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg")
FORMATS = ("report", "text", "torch-text")


def _size_problem(plan, costs) -> str | None:
    """Checked before any schedule is built: the number of steps (ZB-H1 has three per
    micro-batch and is simulated beside 1F1B, about 2 s together at the bound), and the grid's
    size (ranks x columns; the costs' ratio decides a column's time)."""
    from megatron_ext.schedules.report import (
        MAX_COLUMNS_PER_STEP,
        MAX_GRID_CELLS,
        columns_per_step,
        grid_cells,
    )

    if plan.multimodule is not None:
        return None
    steps = max(plan.pp, 1) * max(plan.vpp or 1, 1) * max(plan.microbatches, 1)
    if steps > MAX_COMPUTE_STEPS:
        return (
            f"--pp {plan.pp} x --vpp {plan.vpp or 1} x --microbatches {plan.microbatches} = "
            f"{steps} steps per pass, more than the {MAX_COMPUTE_STEPS} this tool draws; the bubble "
            "depends on pp, vpp and m only through their ratios: try fewer micro-batches"
        )
    times = costs.describe(plan.schedule == "zb-h1")
    if (width := columns_per_step(plan, costs)) > MAX_COLUMNS_PER_STEP:
        return (
            f"step times {times} make one step {_count(width)} grid columns wide (more than "
            f"{MAX_COLUMNS_PER_STEP}): use times in small whole ratios, such as --forward-time 1 "
            "--backward-time 2 --weight-time 1"
        )
    cells = grid_cells(plan, costs)
    if cells > MAX_GRID_CELLS:
        return (
            f"--pp {plan.pp} x --microbatches {plan.microbatches} with step times {times} make a "
            f"grid of about {_count(cells)} cells, more than the {MAX_GRID_CELLS} this tool draws: try "
            "fewer stages or micro-batches"
        )
    return None


def _plot_problem(path: str) -> str | None:
    """Checked before any work, so a bad path does not end in a traceback after it."""
    from pathlib import Path

    target = Path(path)
    if target.suffix.lower() not in PLOT_SUFFIXES:
        return f"--plot {path}: give a file ending in one of {', '.join(PLOT_SUFFIXES)}"
    if target.is_dir():
        return f"--plot {path} is a directory; give a file name such as {path}/timeline.png"
    if not target.parent.is_dir():
        return f"--plot {path}: directory {target.parent} does not exist; create it first"
    return None


def _error(message: str) -> int:
    print(f"megatron-ext schedule: {message}", file=sys.stderr)
    return 2


def main(args: argparse.Namespace) -> int:
    from megatron_ext.pipeline.message_size import MessageSize
    from megatron_ext.recipes import RecipeError
    from megatron_ext.recipes.schedule import plan_from_recipe
    from megatron_ext.schedules import report as rep
    from megatron_ext.schedules.schedule import SCHEDULES, SchedulePlan
    from megatron_ext.schedules.text import (
        ScheduleTextError,
        format_text,
        read_schedule_file,
        schedule_of,
    )

    overrides = list(getattr(args, "targets", None) or [])
    if args.plot and (problem := _plot_problem(args.plot)):
        return _error(problem)
    if problem := _size_flag_problem(args):
        return _error(problem)
    if args.schedule is not None and args.schedule not in SCHEDULES:
        return _error(f"--schedule {args.schedule}: use one of {', '.join(SCHEDULES)}")
    weight = args.backward_time / 2 if args.weight_time is None else args.weight_time
    costs = rep.Costs(args.forward_time, args.backward_time, weight)
    if cost_problems := costs.problems():
        return _error(str(cost_problems[0]))
    try:
        if args.recipe:
            plan, size = plan_from_recipe(args.recipe, overrides, args.platform)
            if args.microbatches is not None:
                plan.microbatches = args.microbatches
            if args.schedule is not None:
                plan.schedule = args.schedule
        elif args.from_text and args.pp is None:
            plan, size = _plan_of_text(args.from_text), None
        else:
            if args.pp is None or args.microbatches is None:
                return _error("give --pp and --microbatches (or --recipe RECIPE)")
            plan = SchedulePlan(
                pp=args.pp,
                vpp=args.vpp,
                microbatches=args.microbatches,
                microbatch_group_size=args.microbatch_group_size,
                schedule=args.schedule or "1f1b",
            )
            size = None
            if args.hidden is not None:
                if args.seq is None or args.micro_batch_size is None:
                    return _error("--hidden needs --seq and --micro-batch-size")
                size = MessageSize(
                    args.hidden,
                    args.seq,
                    args.micro_batch_size,
                    args.mhc_streams or 1,
                    args.dtype_bytes,
                    single_pass=args.mhc_single_pass,
                )
                if args.mhc_single_pass and not args.mhc_streams:
                    return _error("--mhc-single-pass needs --mhc-streams")
            elif args.mhc_streams or args.mhc_single_pass:
                return _error("--mhc-streams needs --hidden, --seq and --micro-batch-size")
        if plan_problems := plan.problems():
            return _error(str(plan_problems[0]))
        if plan.schedule == "zb-h1" and plan.pp == 1 and not args.recipe:
            # the library draws it (one stage, nothing to fill); asked for here it is a slip
            return _error(
                "--schedule zb-h1 --pp 1: one stage has no pipeline to fill; give --pp 2 or "
                "more, or --schedule 1f1b"
            )
        if problem := _size_problem(plan, costs):
            return _error(problem)
        order, source = None, args.from_text or plan.order_file
        if args.from_text:  # a plan of the text's own: the text's interleaving group too
            text_plan = not args.recipe and args.pp is None
            given = None if text_plan else replace(plan, order_file=None)
            order = read_schedule_file(args.from_text, given)
            plan = order.plan
        elif plan.order_file:  # the recipe's parallelism.schedule_file
            order = schedule_of(plan)
        if args.format in ("text", "torch-text"):
            spelling = "torch" if args.format == "torch-text" else "megatron-ext"
            shown = order or rep.build_schedule(plan)
            print(format_text(shown, _text_comment(plan), spelling), end="")
            return 0
        lines, schedule = rep.report(plan, size, steps=args.steps, costs=costs, schedule=order)
        if order is not None:
            lines.insert(2, _order_line(source, order, rep.build_schedule(plan)))
    except RecipeError as exc:
        return _error(f"{exc.source}: {exc.problems[0]}")
    except ScheduleTextError as exc:
        where = f"--from-text {args.from_text}" if args.from_text else "parallelism.schedule_file"
        return _error(f"{where}: {exc}")
    except ValueError as exc:
        return _error(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    print("\n".join(lines))
    if args.plot:
        from megatron_ext.schedules.timeline import plot_timeline

        timeline = costs.simulate(schedule)
        split = plan.schedule == "zb-h1"
        note = f"bubble {timeline.bubble():.1%}"
        if split:
            baseline = rep.build_schedule(replace(plan, schedule="1f1b"))
            note += f" (1F1B: {costs.simulate(baseline).bubble():.1%})"
        title = (
            f"{rep.kind_of(plan).split(' (')[0]}: {len(schedule.ranks)} ranks"
            + (f" x {plan.vpp} chunks" if plan.vpp else "")
            + f", {plan.microbatches} micro-batches"
        )
        try:
            plot_timeline(
                timeline,
                args.plot,
                title,
                schedule.chunks,
                unit=f"time ({costs.describe(split)})",
                note=note,
            )
        except OSError as exc:
            return _error(f"--plot {args.plot} cannot be written: {exc.strerror or exc}")
        print(f"timeline: {args.plot}")
    return 0


def _plan_of_text(path: str):
    """The plan a schedule text describes on its own (ranks, micro-batches, chunks, W steps),
    read before any schedule is built so that the size limits apply first."""
    from megatron_ext.schedules.text import infer_plan, parse_text, read_text

    return infer_plan(parse_text(read_text(path)))


def _text_comment(plan) -> str:
    from megatron_ext.schedules import report as rep

    return (
        f"{rep.kind_of(plan).split(' (')[0]}: {plan.pp if plan.multimodule is None else 'multi-module'}"
        f" pipeline rank(s)"
        + (f" x {plan.vpp} chunks" if plan.vpp else "")
        + f", {plan.microbatches} micro-batch(es); one line per rank"
    )


def _order_line(path: str | None, order, built) -> str:
    """Whether the text's order is the built schedule's, and where it first differs."""
    for rank in range(len(built.ranks)):
        for index, (mine, theirs) in enumerate(
            zip(order.computes(rank), built.computes(rank), strict=True)
        ):
            if mine != theirs:
                chunks = built.chunks
                return (
                    f"order: from {path}; differs from the built schedule first at rank {rank}, "
                    f"token {index + 1}: {mine.label(chunks)} (built: {theirs.label(chunks)})"
                )
    return f"order: from {path}, the built schedule's exactly"
