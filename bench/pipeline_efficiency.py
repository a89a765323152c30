"""Pipeline efficiency of one training step: measured T(PP=1) / (p * T(PP=p)) next to the
theoretical m / (m + p - 1), for p = 2 and m = 4, 8 micro-batches, plain and mHC; or, with
``--schedule zb-h1``, megatron-ext's ZB-H1 next to megatron's 1F1B at PP=p.

Run on two ranks (gloo, CPU):

    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node 2 bench/pipeline_efficiency.py \
        [--hidden 256 --seq 128 --layers 4 --repeats 3 --steps 3]

T(PP=1): both ranks train the whole model on their own micro-batches at the same time (no
gradient all-reduce), so the CPU is shared as it is under PP=2. T(PP=2): the same model split
over the two ranks with megatron-core's 1F1B schedule. Blocks of ``--steps`` steps alternate
between the two layouts ``--repeats`` times and each time is the median of its block's steps,
so drift hits both alike. One traced step per case adds the measured idle share (pipeline
bubble, P2P waits included) next to the schedule's theoretical one
(:mod:`megatron_ext.schedules.schedule`). Not a test: the numbers depend on the machine and
its load. Text first; the LAST line is one JSON object.

``--schedule zb-h1`` (any world size p >= 2, PP = p):

    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node 4 bench/pipeline_efficiency.py \
        --schedule zb-h1 [--microbatches 8 --repeats 2 --steps 2]

Blocks of 1F1B and ZB-H1 steps alternate; per case: both step times and their ratio, the
measured bubble of traced steps of each (median of max(--steps, 3)) (W steps count as busy; the recorded order is
checked against :func:`~megatron_ext.schedules.schedule.build_schedule`), the theoretical
bubbles (F = B = W, and again with the measured mean time of each kind of pass), and every rank's peak memory during one step of each (the highest live
CPU allocation above the step's start, from torch.profiler: activations held, deferred
weight-gradient inputs, received tensors and gradients).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist


def _plan(args, pp: int, microbatches: int, mhc: bool, schedule: str = "1f1b"):
    from megatron_ext.testing.equivalence import TrainPlan

    overrides = (
        dict(enable_mhc_connections=True, mhc_num_residual_streams=args.streams) if mhc else {}
    )
    return TrainPlan(
        pp=pp,
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        seq_length=args.seq,
        micro_batch_size=args.micro_batch_size,
        global_batch_size=args.micro_batch_size * microbatches,
        vocab_size=256,
        config_overrides=overrides,
        schedule=schedule,
    )


def _time_block(
    args,
    pp: int,
    microbatches: int,
    mhc: bool,
    traced: int = 0,
    schedule: str = "1f1b",
    measure_memory: bool = False,
) -> tuple[float, list, int | None]:
    """Median seconds of one training step (forward and backward of every micro-batch) and,
    with ``traced``, this rank's recorded events of that many more steps (one iteration each);
    with ``measure_memory``, this rank's peak memory during one more step."""
    from megatron_ext.config import MHCTransformerConfig
    from megatron_ext.schedules.trace import Tracer, tracing
    from megatron_ext.testing.distributed import model_parallel
    from megatron_ext.testing.equivalence import (
        build_model_chunks,
        gpt_forward_step,
        gpt_model_factory,
        make_microbatches,
        schedule_function,
        transformer_config,
    )

    plan = _plan(args, pp, microbatches, mhc, schedule)
    with model_parallel(pp=pp, seed=plan.seed):
        # Comparing schedules: megatron-ext's config for both (mHC off for plain), the class
        # with pipeline_schedule, which switches the local linears' weight-gradient deferral on.
        config = transformer_config(
            plan, parallel=True, config_class=MHCTransformerConfig if mhc or args.schedule else None
        )
        chunks = build_model_chunks(plan, config, gpt_model_factory(plan))
        data = make_microbatches(plan, 0)[:microbatches]

        def step():
            for chunk in chunks:
                chunk.zero_grad(set_to_none=True)
            schedule_function(plan)(
                forward_step_func=gpt_forward_step,
                data_iterator=iter(data),
                model=chunks,
                num_microbatches=microbatches,
                seq_length=plan.seq_length,
                micro_batch_size=plan.micro_batch_size,
                forward_only=False,
            )

        step()  # warm-up: allocator, caches
        times = []
        for _ in range(args.steps):
            dist.barrier()
            start = time.perf_counter()
            step()
            dist.barrier()
            times.append(time.perf_counter() - start)
        events = []
        if traced:
            tracer = Tracer()
            with tracing(tracer):
                for _ in range(traced):
                    dist.barrier()
                    step()
            events = tracer.events
        peak = _peak_bytes(step) if measure_memory else None
        return statistics.median(times), events, peak


def _peak_bytes(step) -> int:
    """The highest live CPU allocation during ``step()`` above what was live at its start
    (torch.profiler's per-operator allocations and frees, in time order)."""
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def _measured_bubble(events: list) -> float:
    from megatron_ext.schedules.timeline import measured_timeline

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, events)
    return measured_timeline(gathered, 0).bubble()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--schedule",
        choices=["zb-h1"],
        help="compare this schedule with 1F1B at PP = world size (instead of PP=1 vs PP=p)",
    )
    args = parser.parse_args()
    if args.schedule:
        return compare_schedules(args)

    from megatron_ext.schedules.schedule import SchedulePlan, build_schedule, simulate
    from megatron_ext.testing.distributed import init_distributed

    init_distributed()
    p = dist.get_world_size()
    rank = dist.get_rank()
    torch.set_num_threads(1)
    results = []
    for mhc in (False, True):
        for m in args.microbatches:
            t1, tp = [], []
            for _ in range(args.repeats):
                t1.append(_time_block(args, 1, m, mhc)[0])
                tp.append(_time_block(args, p, m, mhc)[0])
            _, events, _ = _time_block(args, p, m, mhc, traced=1)
            bubble = _measured_bubble(events)
            single, piped = statistics.median(t1), statistics.median(tp)
            results.append(
                {
                    "variant": "mhc" if mhc else "plain",
                    "pp": p,
                    "microbatches": m,
                    "t_pp1_s": round(single, 4),
                    "t_pp_s": round(piped, 4),
                    "efficiency_measured": round(single / (p * piped), 4),
                    "efficiency_theoretical": round(m / (m + p - 1), 4),
                    "bubble_measured": round(bubble, 4),
                    "bubble_theoretical": round(
                        simulate(build_schedule(SchedulePlan(pp=p, microbatches=m))).bubble(), 4
                    ),
                }
            )
    if rank == 0:
        print(
            f"pipeline efficiency, one training step, CPU gloo, {p} ranks, hidden {args.hidden}, "
            f"seq {args.seq}, {args.layers} layers, micro-batch {args.micro_batch_size}, "
            f"mHC n={args.streams}; medians of {args.repeats} x {args.steps} steps"
        )
        print(
            f"{'variant':8} {'m':>3} {'T(PP=1) s':>10} {'T(PP=2) s':>10} {'measured':>9} {'m/(m+p-1)':>10} "
            f"{'bubble meas.':>13} {'bubble theory':>14}"
        )
        for r in results:
            print(
                f"{r['variant']:8} {r['microbatches']:>3} {r['t_pp1_s']:>10.4f} {r['t_pp_s']:>10.4f} "
                f"{r['efficiency_measured']:>9.3f} {r['efficiency_theoretical']:>10.3f} "
                f"{r['bubble_measured']:>13.1%} {r['bubble_theoretical']:>14.1%}"
            )
        print(
            json.dumps(
                {
                    "benchmark": "pipeline_efficiency",
                    "world_size": p,
                    "hidden": args.hidden,
                    "seq": args.seq,
                    "layers": args.layers,
                    "results": results,
                }
            )
        )
    dist.barrier()
    dist.destroy_process_group()


def _gather(value):
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _order_matches(gathered: list, schedule, iterations: int) -> bool:
    """Every rank's recorded order is the theory's, action for action, in every iteration."""
    from megatron_ext.schedules.schedule import compare

    return all(
        not compare(
            schedule.ranks,
            [[e.step() for e in ev if e.iteration == i] for ev in gathered],
            schedule.chunks,
        )
        for i in range(iterations)
    )


def _mean_pass_seconds(gathered: list) -> dict[str, float]:
    """Mean seconds of each kind of pass (F, B, W) over every rank's traced steps."""
    spans: dict[str, list[float]] = {}
    for events in gathered:
        for e in events:
            if e.call is None:
                spans.setdefault(e.kind, []).append((e.end_ns - e.start_ns) / 1e9)
    return {kind: statistics.fmean(values) for kind, values in sorted(spans.items())}


def _one_case(args, p: int, m: int, mhc: bool) -> dict:
    """1F1B and ZB-H1 at PP=p with m micro-batches: alternating timed blocks, then one traced
    and one memory-profiled step of each."""
    from megatron_ext.schedules.schedule import SchedulePlan, build_schedule, simulate
    from megatron_ext.schedules.timeline import measured_timeline

    times: dict[str, list[float]] = {"1f1b": [], "zb-h1": []}
    names = list(times)
    for name in names:  # untimed: the first block of a process also pays one-off costs
        _time_block(args, p, m, mhc, schedule=name)
    for repeat in range(args.repeats):
        # 1F1B first on even repeats, ZB-H1 first on odd ones: drift hits both alike.
        for name in names if repeat % 2 == 0 else names[::-1]:
            times[name].append(_time_block(args, p, m, mhc, schedule=name)[0])
    result: dict = {"variant": "mhc" if mhc else "plain", "pp": p, "microbatches": m}
    for name in times:
        traced = max(args.steps, 3)
        _, events, peak = _time_block(
            args, p, m, mhc, traced=traced, schedule=name, measure_memory=True
        )
        gathered = _gather(events)
        theory = build_schedule(SchedulePlan(pp=p, microbatches=m, schedule=name))
        key = "zb" if name == "zb-h1" else "1f1b"
        result[f"t_{key}_s"] = round(statistics.median(times[name]), 4)
        result[f"bubble_{key}_measured"] = round(measured_timeline(_gather(events), 0).bubble(), 4)
        result[f"bubble_{key}_theory"] = round(simulate(theory).bubble(), 4)
        result[f"order_{key}_matches"] = _order_matches(gathered, theory, traced)
        # The theory again with the measured mean time of each kind of pass (W's real share
        # of a backward is not F = B = W's one half).
        costs = _mean_pass_seconds(gathered)
        result[f"pass_ms_{key}"] = {k: round(v * 1e3, 3) for k, v in costs.items()}
        result[f"bubble_{key}_theory_measured_costs"] = round(
            simulate(
                theory,
                forward_time=costs["F"],
                backward_time=costs["B"] + costs.get("W", 0.0),
                weight_time=costs.get("W", 0.0),
            ).bubble(),
            4,
        )
        result[f"peak_mib_{key}"] = [round(b / 2**20, 2) for b in _gather(peak)]
        passes = [e for ev in gathered for e in ev if e.call is None]
        busy = sum(e.end_ns - e.start_ns for e in passes) or 1
        # The share of compute time in W steps: 0 when nothing was deferred.
        result[f"w_share_{key}"] = round(
            sum(e.end_ns - e.start_ns for e in passes if e.kind == "W") / busy, 4
        )
    result["step_time_ratio_zb_over_1f1b"] = round(result["t_zb_s"] / result["t_1f1b_s"], 4)
    return result


def compare_schedules(args) -> None:
    from megatron_ext.testing.distributed import init_distributed

    init_distributed()
    p = dist.get_world_size()
    torch.set_num_threads(1)
    results = [_one_case(args, p, m, mhc) for mhc in (False, True) for m in args.microbatches]
    if dist.get_rank() == 0:
        print(
            f"ZB-H1 vs 1F1B, one training step, CPU gloo, PP={p}, hidden {args.hidden}, seq "
            f"{args.seq}, {args.layers} layers, micro-batch {args.micro_batch_size}, mHC "
            f"n={args.streams}; medians of {args.repeats} x {args.steps} steps, alternating"
        )
        print(
            f"{'variant':8} {'m':>3} {'T 1F1B s':>9} {'T ZB s':>9} {'ZB/1F1B':>8} "
            f"{'bubble 1F1B meas/theory/costs':>30} {'bubble ZB meas/theory/costs':>28} "
            f"{'W share':>8} {'order':>6}  "
            "peak MiB per rank 1F1B | ZB"
        )
        for r in results:
            print(
                f"{r['variant']:8} {r['microbatches']:>3} {r['t_1f1b_s']:>9.4f} {r['t_zb_s']:>9.4f} "
                f"{r['step_time_ratio_zb_over_1f1b']:>8.3f} "
                f"{r['bubble_1f1b_measured']:>14.1%} / {r['bubble_1f1b_theory']:>5.1%} / "
                f"{r['bubble_1f1b_theory_measured_costs']:>5.1%} "
                f"{r['bubble_zb_measured']:>12.1%} / {r['bubble_zb_theory']:>5.1%} / "
                f"{r['bubble_zb_theory_measured_costs']:>5.1%} "
                f"{r['w_share_zb']:>8.1%} "
                f"{'ok' if r['order_1f1b_matches'] and r['order_zb_matches'] else 'DIFF':>6}  "
                f"{' '.join(f'{x:.1f}' for x in r['peak_mib_1f1b'])} | "
                f"{' '.join(f'{x:.1f}' for x in r['peak_mib_zb'])}"
            )
        print(
            json.dumps(
                {
                    "benchmark": "pipeline_efficiency",
                    "schedule": args.schedule,
                    "world_size": p,
                    "hidden": args.hidden,
                    "seq": args.seq,
                    "layers": args.layers,
                    "results": results,
                }
            )
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
