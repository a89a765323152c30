"""Forward+backward time of one mHC transformer layer vs one plain layer, on CPU.

Both layers come from megatron-ext's local GPT spec with the same sizes; the mHC layer
works on the n-stream residual [s, b, n*h], the plain one on [s, b, h]. Runs are
interleaved (plain, mHC, mHC+recompute, plain, ...) so drift hits all alike, and the median
is reported. Not a test: numbers depend on the machine.

    .venv/bin/python bench/mhc_layer_cpu.py [--hidden 256 --seq 256 --batch 2 --streams 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _config(args, mhc: bool):
    from megatron_ext.testing.configs import small_config

    return small_config(
        num_layers=1,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        enable_mhc_connections=mhc,
        mhc_num_residual_streams=args.streams,
    )


def _layer(args, mhc: bool):
    from megatron.core.transformer.spec_utils import build_module

    from megatron_ext.models.gpt import get_gpt_layer_local_spec

    torch.manual_seed(0)
    spec = get_gpt_layer_local_spec(enable_mhc_connections=mhc)
    return build_module(spec, config=_config(args, mhc), layer_number=1)


def _step(layer, x, mask, recompute: bool) -> float:
    from megatron_ext.mhc.recompute import LayerRecompute, MHCRecomputeGroup

    if recompute:  # what HyperConnectionTransformerBlock does for a one-layer group
        layer.mhc_recompute = LayerRecompute(MHCRecomputeGroup(), ends_group=True)
    start = time.perf_counter()
    output, _ = layer(x, attention_mask=mask)
    output.backward(torch.ones_like(output))
    elapsed = time.perf_counter() - start
    layer.zero_grad(set_to_none=True)
    x.grad = None
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()

    from megatron_ext.testing.distributed import model_parallel

    with model_parallel():
        plain, mhc = _layer(args, False), _layer(args, True)
        s, b, h, n = args.seq, args.batch, args.hidden, args.streams
        mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
        x_plain = torch.randn(s, b, h, requires_grad=True)
        x_mhc = torch.randn(s, b, n * h, requires_grad=True)
        runs = {
            "plain": lambda: _step(plain, x_plain, mask, False),
            "mhc": lambda: _step(mhc, x_mhc, mask, False),
            "mhc+recompute": lambda: _step(mhc, x_mhc, mask, True),
        }
        times = {name: [] for name in runs}
        for iteration in range(args.warmup + args.iters):
            for name, run in runs.items():
                elapsed = run()
                if iteration >= args.warmup:
                    times[name].append(elapsed)

    medians = {name: statistics.median(values) * 1e3 for name, values in times.items()}
    params = {
        "plain": sum(p.numel() for p in plain.parameters()),
        "mhc": sum(p.numel() for p in mhc.parameters()),
    }
    print(
        f"one layer, fwd+bwd, CPU ({torch.get_num_threads()} threads), fp32: s={s} b={b} h={h} "
        f"heads={args.heads} n={n}, median of {args.iters}"
    )
    for name, ms in medians.items():
        print(f"  {name:<14} {ms:8.2f} ms   ({ms / medians['plain']:.2f}x plain)")
    print(
        f"  parameters: plain {params['plain']:,}  mhc {params['mhc']:,} "
        f"(+{params['mhc'] - params['plain']:,} in the two hyper connections)"
    )


if __name__ == "__main__":
    main()
