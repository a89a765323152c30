"""Bytes per training step on each pipeline edge, mHC vs plain, from a real PP=2 run.

Run on two ranks (gloo, CPU):

    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node 2 bench/p2p_volume.py \\
        [--hidden 128 --seq 64 --layers 4 --microbatches 4 --streams 4]

One training step of a small GPT (local layers, fp32) with megatron-core's 1F1B schedule,
traced by :mod:`megatron_ext.schedules.trace`, whose recording communicator notes the bytes of
every tensor a stage sends. Edge 0->1 carries the activations (forward), edge 1->0 their
gradients (backward). Next to each measured figure: the expected ``m * s * b * width * 4``
bytes with width h (plain) or n*h (mHC's n-stream residual). Not a test. Text first; the LAST
line is one JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform

import torch
import torch.distributed as dist


def _plan(args, mhc: bool):
    from megatron_ext.testing.equivalence import TrainPlan

    overrides = (
        dict(enable_mhc_connections=True, mhc_num_residual_streams=args.streams) if mhc else {}
    )
    return TrainPlan(
        pp=2,
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        seq_length=args.seq,
        micro_batch_size=args.micro_batch_size,
        global_batch_size=args.micro_batch_size * args.microbatches,
        vocab_size=256,
        config_overrides=overrides,
    )


def _traced_step(args, mhc: bool) -> list:
    """This rank's trace events of one PP=2 training step."""
    from megatron_ext.config import MHCTransformerConfig
    from megatron_ext.schedules.trace import Tracer, tracing
    from megatron_ext.testing.distributed import model_parallel
    from megatron_ext.testing.equivalence import (
        build_model_chunks,
        forward_backward,
        gpt_forward_step,
        gpt_model_factory,
        make_microbatches,
        transformer_config,
    )

    plan = _plan(args, mhc)
    with model_parallel(pp=2, seed=plan.seed):
        config = transformer_config(
            plan, parallel=True, config_class=MHCTransformerConfig if mhc else None
        )
        chunks = build_model_chunks(plan, config, gpt_model_factory(plan))
        data = make_microbatches(plan, 0)[: args.microbatches]
        tracer = Tracer()
        with tracing(tracer):
            forward_backward(plan, gpt_forward_step, chunks, iter(data), args.microbatches)
        return tracer.events


def _edge_bytes(events_by_rank: list) -> dict:
    """``{"0->1": bytes, "1->0": bytes}`` summed over the sends of one step."""
    edges = {"0->1": 0, "1->0": 0}
    for rank, events in enumerate(events_by_rank):
        for event in events:
            for message in event.messages:
                if message.direction == "send_next":
                    edges[f"{rank}->{rank + 1}"] += message.nbytes
                elif message.direction == "send_prev":
                    edges[f"{rank}->{rank - 1}"] += message.nbytes
    return edges


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--streams", type=int, default=4)
    args = parser.parse_args()

    from megatron_ext.testing.distributed import init_distributed

    init_distributed()
    if dist.get_world_size() != 2:
        raise SystemExit("run p2p_volume.py on exactly 2 ranks (torchrun --nproc_per_node 2)")
    torch.set_num_threads(1)
    rows = {}
    for mhc in (False, True):
        gathered = [None] * 2
        dist.all_gather_object(gathered, _traced_step(args, mhc))
        width = args.hidden * (args.streams if mhc else 1)
        expected = args.microbatches * args.seq * args.micro_batch_size * width * 4
        rows["mhc" if mhc else "plain"] = {
            "measured_bytes": _edge_bytes(gathered),
            "expected_bytes_per_edge": expected,
        }
    if dist.get_rank() == 0:
        print(
            f"P2P bytes per training step, PP=2 1F1B, CPU gloo: hidden {args.hidden}, seq "
            f"{args.seq}, micro-batch {args.micro_batch_size}, {args.microbatches} "
            f"micro-batches, fp32, mHC n={args.streams}"
        )
        for name, row in rows.items():
            for edge, nbytes in row["measured_bytes"].items():
                print(
                    f"  {name:6} edge {edge}: {nbytes:>12,} B   (expected "
                    f"{row['expected_bytes_per_edge']:,} B)"
                )
        plain, mhc = rows["plain"]["measured_bytes"], rows["mhc"]["measured_bytes"]
        ratios = {edge: mhc[edge] / plain[edge] if plain[edge] else None for edge in plain}
        print("  mHC / plain: " + ", ".join(f"{e} {r:.2f}x" for e, r in ratios.items() if r))
        print(
            json.dumps(
                {
                    "bench": "p2p_volume",
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                        timespec="seconds"
                    ),
                    "machine": platform.node(),
                    "load_average": os.getloadavg()[0],
                    "sizes": dict(
                        hidden=args.hidden,
                        seq=args.seq,
                        layers=args.layers,
                        micro_batch_size=args.micro_batch_size,
                        microbatches=args.microbatches,
                        streams=args.streams,
                    ),
                    "edges": rows,
                    "mhc_over_plain": ratios,
                }
            )
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
