"""Pipeline efficiency of one training step: measured T(PP=1) / (p * T(PP=p)) next to the
theoretical m / (m + p - 1), for p = 2 and m = 4, 8 micro-batches, plain and mHC.

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
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist


def _plan(args, pp: int, microbatches: int, mhc: bool):
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
    )


def _time_block(
    args, pp: int, microbatches: int, mhc: bool, traced: bool = False
) -> tuple[float, list]:
    """Median seconds of one training step (forward and backward of every micro-batch) and,
    with ``traced``, this rank's recorded events of one extra step."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_ext.config import MHCTransformerConfig
    from megatron_ext.schedules.trace import Tracer, tracing
    from megatron_ext.testing.distributed import model_parallel
    from megatron_ext.testing.equivalence import (
        build_model_chunks,
        gpt_forward_step,
        gpt_model_factory,
        make_microbatches,
        transformer_config,
    )

    plan = _plan(args, pp, microbatches, mhc)
    with model_parallel(pp=pp, seed=plan.seed):
        config = transformer_config(
            plan, parallel=True, config_class=MHCTransformerConfig if mhc else None
        )
        chunks = build_model_chunks(plan, config, gpt_model_factory(plan))
        data = make_microbatches(plan, 0)[:microbatches]

        def step():
            for chunk in chunks:
                chunk.zero_grad(set_to_none=True)
            get_forward_backward_func()(
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
                dist.barrier()
                step()
            events = tracer.events
        return statistics.median(times), events


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
    args = parser.parse_args()

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
            _, events = _time_block(args, p, m, mhc, traced=True)
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


if __name__ == "__main__":
    main()
