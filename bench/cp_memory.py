"""Per-rank activation memory of a long sequence at CP=1 and CP=2 (local CP attention), on CPU.

Run on 2 ranks; both configurations run in the same process, side by side:

    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node 2 bench/cp_memory.py \\
        [--seq 1024 --layers 2 --hidden 64 --heads 4 --groups 4 --batch 1 --mhc]

At CP=1 each rank trains the whole sequence (the two ranks are data-parallel); at CP=2 each
rank holds s/2 tokens and all-gathers keys and values per layer. For one micro-batch
forward+backward of megatron-ext's GPT (local spec) each rank reports:

* kept: bytes of the distinct non-parameter storages autograd holds for backward when the
  forward ends (torch.autograd.graph.saved_tensors_hooks);
* peak: the highest live CPU allocation during forward+backward above the level before it
  (torch.profiler memory events);
* gathered K/V (computed, not measured): the full-sequence keys and values the all-gather
  leaves saved for backward in every layer (s * b * 2 * groups * head_dim values per layer),
  which ring attention would not keep (it holds s/cp of them).

The figures are the maximum over ranks. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
from activation_memory import measure_step  # bench/ is on sys.path when run as a script


def _model(args):
    from megatron_ext.models.gpt import GPTModel, get_gpt_layer_local_spec
    from megatron_ext.testing.configs import small_config

    config = small_config(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        num_query_groups=args.groups,
        context_parallel_size=dist.get_world_size() if args.cp > 1 else 1,
        enable_mhc_connections=args.mhc,
        mhc_num_residual_streams=4,
    )
    torch.manual_seed(0)
    return GPTModel(
        config,
        get_gpt_layer_local_spec(enable_mhc_connections=args.mhc),
        vocab_size=args.vocab,
        max_sequence_length=args.seq,
        position_embedding_type="rope",
    )


def _batch(args):
    from megatron_ext.testing.equivalence import split_for_context_parallel

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=generator)
    batch = dict(
        tokens=tokens[:, :-1].contiguous(),
        labels=tokens[:, 1:].contiguous(),
        position_ids=torch.arange(args.seq).unsqueeze(0).expand(args.batch, args.seq).contiguous(),
    )
    return split_for_context_parallel(batch)


def _measure(model, batch):
    return measure_step(
        model,
        lambda: model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).sum(),
    )


def _max_over_ranks(value: float) -> float:
    tensor = torch.tensor([float(value)])
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--groups", type=int, default=4, help="query groups (GQA when < heads)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--mhc", action="store_true", help="4 mHC residual streams")
    args = parser.parse_args()

    from megatron_ext.testing.distributed import init_distributed, model_parallel

    init_distributed()
    world = dist.get_world_size()
    head_dim = args.hidden // args.heads
    results = {}
    for cp in (1, world):
        args.cp = cp
        with model_parallel(cp=cp):
            kept, peak = _measure(_model(args), _batch(args))
        gathered_kv = (
            0 if cp == 1 else args.layers * args.seq * args.batch * 2 * args.groups * head_dim * 4
        )
        results[cp] = dict(
            kept_mib=_max_over_ranks(kept) / 2**20,
            peak_mib=_max_over_ranks(peak) / 2**20,
            gathered_kv_mib=gathered_kv / 2**20,
        )
    if dist.get_rank() == 0:
        print(
            f"GPT {args.layers} layers, h={args.hidden}, heads={args.heads}, groups={args.groups}, "
            f"s={args.seq}, b={args.batch}, mHC={'n=4' if args.mhc else 'off'}, fp32, one "
            f"micro-batch fwd+bwd per rank on CPU, {world} ranks"
        )
        one = results[1]
        for cp, r in results.items():
            print(
                f"  CP={cp}: kept {r['kept_mib']:8.2f} MiB ({r['kept_mib'] / one['kept_mib']:4.2f}x)  "
                f"peak {r['peak_mib']:8.2f} MiB ({r['peak_mib'] / one['peak_mib']:4.2f}x)  "
                f"gathered full K/V in it {r['gathered_kv_mib']:6.2f} MiB"
            )
        print(json.dumps({"bench": "cp_memory", "args": vars(args), "results": results}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
