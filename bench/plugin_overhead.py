"""What megatron-ext costs when mHC is off (goal: <= 1%).

Two measurements, each alternating the two variants in one process so load and drift hit
both alike, medians and the ratio reported:

* ``model`` (plain ``python``): one GPT forward+backward, megatron-core's own ``GPTModel``
  with megatron-core's local layer spec and ``TransformerConfig``, against megatron-ext's
  ``GPTModel`` with its local spec and ``MHCTransformerConfig`` (mHC off). Same sizes, same
  seed.
* ``pp`` (``torchrun``, 2 ranks, gloo): one PP=2 1F1B training step of megatron-ext's GPT
  (mHC off) with ``megatron_ext.install()``'s core patches applied against the same step
  with them undone (``registry.undo("core")``; the CPU runtime, needed to run megatron's
  schedules on CPU at all, stays on in both). Blocks of ``--steps`` steps alternate.

    OMP_NUM_THREADS=1 .venv/bin/python bench/plugin_overhead.py [--iters 30]
    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node 2 bench/plugin_overhead.py

Each variant is timed twice: wall clock, and this process's CPU time (``time.process_time``),
which a loaded machine perturbs much less (time spent descheduled or blocked in a receive is
not counted): on a shared machine read the CPU-time ratio. Not a test. Text first; the LAST
line is one JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time

import torch


def _timed(fn) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of ``fn()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def _result(kind: str, args, times: dict, extra: dict) -> dict:
    """Medians and second-over-first ratios of ``{variant: [(wall, cpu), ...]}``."""
    names = list(times)
    wall = {name: statistics.median(t[0] for t in values) for name, values in times.items()}
    cpu = {name: statistics.median(t[1] for t in values) for name, values in times.items()}
    return {
        "bench": "plugin_overhead",
        "part": kind,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": platform.node(),
        "load_average": os.getloadavg()[0],
        "threads": torch.get_num_threads(),
        "sizes": dict(hidden=args.hidden, seq=args.seq, layers=args.layers, batch=args.batch),
        "median_wall_s": wall,
        "median_cpu_s": cpu,
        "ratio_wall": wall[names[1]] / wall[names[0]],
        "ratio_cpu": cpu[names[1]] / cpu[names[0]],
        **extra,
    }


def _print_rows(result: dict, label: str) -> None:
    for name in result["median_wall_s"]:
        print(
            f"  {name:18} wall {result['median_wall_s'][name] * 1e3:9.2f} ms   "
            f"CPU {result['median_cpu_s'][name] * 1e3:9.2f} ms"
        )
    print(f"  {label}: wall {result['ratio_wall']:.4f}, CPU time {result['ratio_cpu']:.4f}")


# ----------------------------------------------------------------------------- model part


def _models(args):
    from megatron.core.models.gpt import GPTModel as CoreGPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec as core_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.models.gpt import GPTModel, get_gpt_layer_local_spec
    from megatron_ext.testing.configs import small_config

    fields = dict(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads)
    built = {}
    for name, config, model_class, spec in (
        ("megatron-core", small_config(TransformerConfig, **fields), CoreGPTModel, core_spec()),
        ("megatron-ext", small_config(**fields), GPTModel, get_gpt_layer_local_spec()),
    ):
        torch.manual_seed(0)
        built[name] = model_class(config, spec, vocab_size=args.vocab, max_sequence_length=args.seq)
    return built


def _model_part(args) -> None:
    from megatron_ext.testing.distributed import model_parallel

    with model_parallel():
        models = _models(args)
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
        positions = torch.arange(args.seq).unsqueeze(0).expand(args.batch, args.seq)
        mask = torch.triu(torch.ones(1, 1, args.seq, args.seq, dtype=torch.bool), diagonal=1)
        times = {name: [] for name in models}
        for iteration in range(args.warmup + args.iters):
            for name, model in models.items():
                elapsed = _timed(
                    # Called at once, inside this iteration: the loop variable is the one meant.
                    lambda: model(tokens, positions, mask, labels=tokens).float().mean().backward()  # noqa: B023
                )
                model.zero_grad(set_to_none=True)
                if iteration >= args.warmup:
                    times[name].append(elapsed)
    result = _result("model", args, times, {"iters": args.iters})
    print(
        f"GPT fwd+bwd, CPU ({torch.get_num_threads()} threads), fp32, h={args.hidden} "
        f"s={args.seq} b={args.batch} layers={args.layers}, mHC off, median of {args.iters} "
        "interleaved runs"
    )
    _print_rows(result, "megatron-ext / megatron-core")
    print(json.dumps(result))


# ----------------------------------------------------------------------------- PP=2 part


def _pp_part(args) -> None:
    import torch.distributed as dist

    from megatron_ext import registry, runtime
    from megatron_ext.testing.distributed import init_distributed, model_parallel
    from megatron_ext.testing.equivalence import (
        TrainPlan,
        build_model_chunks,
        forward_backward,
        gpt_forward_step,
        gpt_model_factory,
        make_microbatches,
        transformer_config,
    )

    init_distributed()
    runtime.use_cpu()  # megatron's schedules on CPU; applies install() too
    torch.set_num_threads(1)
    plan = TrainPlan(
        pp=2,
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        seq_length=args.seq,
        micro_batch_size=args.batch,
        global_batch_size=args.batch * args.microbatches,
        vocab_size=args.vocab,
    )
    times = {"without install()": [], "with install()": []}
    with model_parallel(pp=2, seed=plan.seed):
        chunks = build_model_chunks(
            plan, transformer_config(plan, parallel=True), gpt_model_factory(plan)
        )
        data = make_microbatches(plan, 0)[: args.microbatches]

        def run():
            forward_backward(plan, gpt_forward_step, chunks, iter(data), args.microbatches)
            dist.barrier()

        def step() -> tuple[float, float]:
            for chunk in chunks:
                chunk.zero_grad(set_to_none=True)
            dist.barrier()
            return _timed(run)

        step()  # warm-up
        for _ in range(args.repeats):
            for name in times:
                if name == "with install()":
                    registry.apply("core")
                else:
                    registry.undo("core")
                times[name] += [step() for _ in range(args.steps)]
        registry.apply("core")
    # Rank 0's wall clock is the step's; CPU time is summed over both ranks.
    gathered = [None, None]
    dist.all_gather_object(gathered, times)
    times = {
        name: [(wall, cpu + other[name][k][1]) for k, (wall, cpu) in enumerate(values)]
        for name, values in gathered[0].items()
        for other in [gathered[1]]
    }
    if dist.get_rank() == 0:
        result = _result(
            "pp",
            args,
            times,
            {"repeats": args.repeats, "steps": args.steps, "microbatches": args.microbatches},
        )
        print(
            f"PP=2 1F1B training step, CPU gloo 2 ranks, fp32, h={args.hidden} s={args.seq} "
            f"micro-batch {args.batch} x {args.microbatches}, {args.layers} layers, mHC off; "
            f"median of {args.repeats} x {args.steps} alternating steps"
        )
        _print_rows(result, "with / without (CPU: both ranks)")
        print(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--iters", type=int, default=30, help="model part: timed runs")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--microbatches", type=int, default=4, help="pp part")
    parser.add_argument("--repeats", type=int, default=8, help="pp part: alternations")
    parser.add_argument("--steps", type=int, default=3, help="pp part: steps per block")
    args = parser.parse_args()
    if "WORLD_SIZE" in os.environ:
        if os.environ["WORLD_SIZE"] != "2":
            raise SystemExit("the pp part runs on exactly 2 ranks (torchrun --nproc_per_node 2)")
        _pp_part(args)
    else:
        _model_part(args)


if __name__ == "__main__":
    main()
