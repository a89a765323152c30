"""Activation memory of an mHC GPT with and without the "mhc" selective recompute, on CPU.

Two figures per configuration, for one forward+backward of one micro-batch:

* kept: bytes of the distinct non-parameter storages autograd holds for backward when the
  forward ends (collected with torch.autograd.graph.saved_tensors_hooks; a discarded
  activation's storage has size 0 by then);
* peak: the highest live CPU allocation during forward+backward above the level before it,
  from torch.profiler's memory events. Backward refills one recompute group at a time, so
  the peak depends on the group size (mhc_recompute_layer_num).

    .venv/bin/python bench/mhc_recompute_memory.py [--layers 8 --hidden 64 --seq 128 --batch 4]
"""

from __future__ import annotations

import argparse

import torch
from activation_memory import measure_step  # bench/ is on sys.path when run as a script


def _model(args, mhc: bool, recompute: bool, layer_num):
    from megatron_ext.models.gpt import GPTModel, get_gpt_layer_local_spec
    from megatron_ext.testing.configs import small_config

    extra = {}
    if recompute:
        extra = dict(
            recompute_granularity="selective",
            recompute_modules=["mhc"],
            mhc_recompute_layer_num=layer_num,
        )
    config = small_config(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        enable_mhc_connections=mhc,
        mhc_num_residual_streams=args.streams,
        **extra,
    )
    torch.manual_seed(0)
    return GPTModel(
        config,
        get_gpt_layer_local_spec(enable_mhc_connections=mhc),
        vocab_size=args.vocab,
        max_sequence_length=args.seq,
    )


def _measure(model, batch):
    tokens, positions, mask, labels = batch
    return measure_step(model, lambda: model(tokens, positions, mask, labels=labels).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=64)
    args = parser.parse_args()

    from megatron_ext.testing.distributed import model_parallel

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=generator)
    batch = (
        tokens[:, :-1],
        torch.arange(args.seq).unsqueeze(0).expand(args.batch, args.seq),
        torch.triu(torch.ones(1, 1, args.seq, args.seq, dtype=torch.bool), diagonal=1),
        tokens[:, 1:],
    )
    cases = [("plain GPT (no mHC)", False, False, None), ("mHC, no recompute", True, False, None)]
    cases += [(f"mHC, recompute, layer_num={k}", True, True, k) for k in (None, 1, 2, 4)]
    print(
        f"GPT {args.layers} layers, h={args.hidden}, n={args.streams}, s={args.seq}, "
        f"b={args.batch}, fp32, one micro-batch fwd+bwd on CPU"
    )
    results = {}
    with model_parallel():
        for name, mhc, recompute, layer_num in cases:
            results[name] = _measure(_model(args, mhc, recompute, layer_num), batch)
    kept0, peak0 = results["mHC, no recompute"]
    for name, (kept, peak) in results.items():
        print(
            f"  {name:<32} kept {kept / 2**20:7.2f} MiB ({kept / kept0:4.2f}x)   "
            f"peak {peak / 2**20:7.2f} MiB ({peak / peak0:4.2f}x)"
        )


if __name__ == "__main__":
    main()
