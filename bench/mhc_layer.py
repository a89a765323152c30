"""Forward+backward time of one mHC transformer layer vs one plain layer, side by side.

Variants, run interleaved in one process (plain, mhc, mhc+recompute, ..., plain, ...) so load
and drift hit all alike; medians and ratios to plain are reported:

* ``plain``          megatron-core's layer from megatron-ext's local GPT spec, ``[s, b, h]``
* ``mhc``            the mHC layer (lean native path, the default), ``[s, b, n*h]``
* ``mhc+recompute``  the same with the "mhc" selective recompute (one-layer group)
* ``mhc-birkhoff``   the lean path with mHC-lite's H_res (``mhc_h_res_method="birkhoff"``:
                     softmax over the n! permutation matrices instead of Sinkhorn)
* ``mhc-deepseek-v4`` the lean path with ``mhc_variant="deepseek-v4"`` (DeepSeek-V4's maps:
                     unweighted RMS, sigmoid+eps, softmax+eps Sinkhorn)
* ``mhc+stats``      a logged step of ``--log-mhc-stats``: the recorder armed (each hyper
                     connection's maps of its sample tokens) and the figures collected
* ``mhc-reference``  the straightforward formulas (``megatron_ext.mhc.reference``)
* ``mhc-fused``      with ``--fused``: the Triton kernels of ``megatron_ext.mhc.fused``
                     (``use_fused_mhc``), also with recompute (``mhc-fused+recompute``)

With ``--moe N`` and/or ``--mla`` the same layer is also timed with a MoE MLP (N routed experts,
top-2, one shared expert, alltoall dispatcher) and/or multi-latent attention, plain and mHC
side by side (``moe/plain``, ``moe/mhc``, ``mla/...``, ``mla+moe/...``), each mHC variant's ratio
taken to its own plain layer.

Then each mHC op alone (fwd+bwd, one sub-layer's worth, same sizes). Lean path: maps +
aggregate (RMS, the one projection, gates, sigmoids, Sinkhorn, Σ h_pre_i x_i: one Function),
Sinkhorn alone, maps + aggregate with birkhoff, merge (mixing + H_post write-back of output and
bias). Reference: maps,
aggregate, merge.

Not a test: absolute numbers depend on the machine and its load. Prints text, and as its
LAST line one JSON object with every figure.

    python bench/mhc_layer.py --device cpu --dtype fp32 --hidden 512 --seq 256 --batch 2 --heads 8
    python bench/mhc_layer.py --moe 8 --mla --no-reference     # + MoE / MLA layers, with and without
    python bench/mhc_layer.py --device cuda --dtype bf16 --hidden 4096 --seq 4096 --batch 1 \\
        --heads 32 --fused

``--fused`` on CPU runs the kernels under Triton's interpreter (set here before triton is
imported): a smoke check of the wiring at tiny sizes, its times mean nothing.
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

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _moe_mla_fields(args, moe: bool, mla: bool) -> dict:
    """The MoE MLP (top-2 of --moe experts, a shared expert) and MLA sizes (DeepSeek-V3's
    ratios to the hidden size) of a --moe / --mla variant."""
    fields: dict = {}
    if moe:
        fields.update(
            num_moe_experts=args.moe,
            moe_router_topk=2,
            moe_ffn_hidden_size=args.hidden,
            moe_shared_expert_intermediate_size=args.hidden,
            moe_token_dispatcher_type="alltoall",
            moe_aux_loss_coeff=0.01,
            add_bias_linear=False,
        )
    if mla:
        head = args.hidden // args.heads
        fields.update(
            q_lora_rank=args.hidden // 2,
            kv_lora_rank=args.hidden // 4,
            qk_head_dim=head,
            qk_pos_emb_head_dim=head // 2,
            v_head_dim=head,
            rope_type="rope",
        )
    return fields


def _config(
    args,
    mhc: bool,
    moe: bool = False,
    mla: bool = False,
    h_res_method: str = "sinkhorn",
    variant: str = "megatron",
):
    from megatron_ext.config import MHCMLATransformerConfig
    from megatron_ext.testing.configs import small_config

    fields = dict(
        num_layers=1,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        enable_mhc_connections=mhc,
        mhc_num_residual_streams=args.streams,
        mhc_h_res_method=h_res_method,
        mhc_variant=variant,
        params_dtype=DTYPES[args.dtype],
        bf16=args.dtype == "bf16",
    )
    if args.device == "cuda":
        fields["use_cpu_initialization"] = False
    fields.update(_moe_mla_fields(args, moe, mla))
    return small_config(MHCMLATransformerConfig if mla else None, **fields)


def _layer(
    args,
    mhc: bool,
    reference: bool = False,
    fused: bool = False,
    moe: bool = False,
    mla: bool = False,
    h_res_method: str = "sinkhorn",
    variant: str = "megatron",
):
    from megatron.core.transformer.spec_utils import build_module

    from megatron_ext.models.gpt import get_gpt_layer_local_spec

    torch.manual_seed(0)
    spec = get_gpt_layer_local_spec(
        enable_mhc_connections=mhc,
        num_experts=args.moe if moe else None,
        multi_latent_attention=mla,
    )
    config = _config(args, mhc, moe, mla, h_res_method, variant)
    layer = build_module(spec, config=config, layer_number=1)
    layer = layer.to(device=args.device, dtype=DTYPES[args.dtype])
    for module in layer.modules():
        if hasattr(module, "use_reference_path"):
            module.use_reference_path = reference
            module.use_fused = fused  # what use_fused_mhc=True sets
    return layer


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# What a run's time is: wall-clock, or (--clock cpu) the process's CPU time, which other jobs on
# a loaded machine do not inflate (with more than one thread it also counts threads spinning).
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = CLOCKS["wall"]


def _timed(device: str, fn) -> float:
    _sync(device)
    start = _clock()
    fn()
    _sync(device)
    return _clock() - start


def _layer_step(layer, x, mask, recompute: bool):
    from megatron_ext.mhc.recompute import LayerRecompute, MHCRecomputeGroup

    def step():
        if recompute:  # what HyperConnectionTransformerBlock does for a one-layer group
            layer.mhc_recompute = LayerRecompute(MHCRecomputeGroup(), ends_group=True)
        output, _ = layer(x, attention_mask=mask)
        output.backward(torch.ones_like(output))

    def run():
        elapsed = _timed(x.device.type, step)
        layer.zero_grad(set_to_none=True)
        x.grad = None
        return elapsed

    return run


def _logged_step(layer, x, mask):
    """A ``--log-mhc-stats`` logged step: recording armed, then the figures collected."""
    from megatron_ext.mhc import stats

    plain_step = _layer_step(layer, x, mask, False)

    def run():
        recorder = stats.enable()
        try:
            elapsed = plain_step()
            elapsed += _timed(x.device.type, lambda: stats.collect(recorder))
        finally:
            stats.disable()
        return elapsed

    return run


def _op_steps(args, connection, x, y):
    """fwd+bwd of each mHC op alone on ``connection`` (one sub-layer's worth)."""
    from megatron_ext.mhc.reference import reference_aggregate
    from megatron_ext.mhc.sinkhorn import sinkhorn_token_last

    n, tokens = args.streams, x.shape[0] * x.shape[1]
    bias = torch.zeros(args.hidden, device=x.device, dtype=x.dtype, requires_grad=True)

    def backward_of(fn):
        def step():
            out = fn()
            outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o.requires_grad]
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

        return lambda: _timed(x.device.type, step)

    if connection.use_reference_path:
        h_pre, h_post, h_res = (m.detach() for m in connection.compute_mappings(x))
        ops = {
            "maps": backward_of(lambda: connection.compute_mappings(x)),
            "aggregate": backward_of(lambda: reference_aggregate(x, h_pre.requires_grad_())),
        }
    else:
        _, h_post, h_res = (m.detach() for m in connection.streams_in(x))
        logits = torch.randn(n, n, tokens, device=x.device, requires_grad=True)
        ops = {"maps+aggregate": backward_of(lambda: connection.streams_in(x))}
        if not connection.use_fused and connection.h_res_method == "sinkhorn":
            # (the fused Sinkhorn runs inside maps+aggregate)
            ops["sinkhorn"] = backward_of(
                lambda: sinkhorn_token_last(logits, connection.sinkhorn_iterations)
            )
    h_post.requires_grad_(True)
    h_res.requires_grad_(True)
    ops["merge"] = backward_of(lambda: connection.merge_fn(h_res, x, h_post, y, bias))
    return ops


def _moe_mla_kinds(args) -> list[tuple[str, bool, bool]]:
    """(label, moe, mla) of the extra layer kinds --moe / --mla ask for."""
    kinds = []
    if args.moe:
        kinds.append(("moe", True, False))
    if args.mla:
        kinds.append(("mla", False, True))
    if args.moe and args.mla:
        kinds.append(("mla+moe", True, True))
    return kinds


def _plain_of(name: str) -> str:
    """The plain layer a variant's ratio is taken to (``moe/mhc`` -> ``moe/plain``)."""
    return f"{name.split('/')[0]}/plain" if "/" in name else "plain"


def _interleaved(runs: dict, warmup: int, iters: int) -> dict:
    times = {name: [] for name in runs}
    for iteration in range(warmup + iters):
        for name, run in runs.items():
            elapsed = run()
            if iteration >= warmup:
                times[name].append(elapsed)
    return {name: statistics.median(values) * 1e3 for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--no-reference", action="store_true", help="skip mhc-reference")
    parser.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="CPU: glibc keeps freed memory for reuse "
        "(megatron_ext.runtime.allocator), before any tensor is made",
    )
    parser.add_argument(
        "--fused",
        action="store_true",
        help="add the fused Triton kernels (use_fused_mhc); CPU: interpreter",
    )
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="cpu: process CPU time, steadier on a loaded CPU machine (use with 1 thread)",
    )
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--moe", type=int, default=0, help="N: also time a MoE layer (N routed experts, top-2)"
    )
    parser.add_argument(
        "--mla", action="store_true", help="also time a multi-latent-attention layer"
    )
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU")
    if args.clock == "cpu" and args.device == "cuda":
        parser.error("--clock cpu times the host only: use the wall clock on a GPU")
    global _clock
    _clock = CLOCKS[args.clock]
    if args.keep_freed_memory:
        from megatron_ext.runtime.allocator import keep_freed_memory

        if not keep_freed_memory():
            parser.error("--keep-freed-memory: glibc mallopt is not available here")
    if args.fused and args.device == "cpu":
        # Triton's interpreter must be on before triton.language is imported (megatron does).
        os.environ["TRITON_INTERPRET"] = "1"
        print("--fused on CPU: Triton interpreter, a smoke check; its times mean nothing")

    from megatron_ext.testing.distributed import model_parallel

    s, b, h, n = args.seq, args.batch, args.hidden, args.streams
    dtype, device = DTYPES[args.dtype], args.device
    with model_parallel():
        plain, mhc = _layer(args, False), _layer(args, True)
        mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool, device=device), diagonal=1)
        x_plain = torch.randn(s, b, h, device=device, dtype=dtype, requires_grad=True)
        x_mhc = torch.randn(s, b, n * h, device=device, dtype=dtype, requires_grad=True)
        runs = {
            "plain": _layer_step(plain, x_plain, mask, False),
            "mhc": _layer_step(mhc, x_mhc, mask, False),
            "mhc+recompute": _layer_step(mhc, x_mhc, mask, True),
            "mhc+stats": _logged_step(mhc, x_mhc, mask),
        }
        birkhoff = _layer(args, True, h_res_method="birkhoff")
        runs["mhc-birkhoff"] = _layer_step(birkhoff, x_mhc, mask, False)
        deepseek = _layer(args, True, variant="deepseek-v4")
        runs["mhc-deepseek-v4"] = _layer_step(deepseek, x_mhc, mask, False)
        reference = None
        if not args.no_reference:
            reference = _layer(args, True, reference=True)
            runs["mhc-reference"] = _layer_step(reference, x_mhc, mask, False)
        fused = None
        if args.fused:
            fused = _layer(args, True, fused=True)
            runs["mhc-fused"] = _layer_step(fused, x_mhc, mask, False)
            runs["mhc-fused+recompute"] = _layer_step(fused, x_mhc, mask, True)
        for kind, moe, mla in _moe_mla_kinds(args):
            runs[f"{kind}/plain"] = _layer_step(
                _layer(args, False, moe=moe, mla=mla), x_plain, mask, False
            )
            runs[f"{kind}/mhc"] = _layer_step(
                _layer(args, True, moe=moe, mla=mla), x_mhc, mask, False
            )
        layer_ms = _interleaved(runs, args.warmup, args.iters)

        y = torch.randn(s, b, h, device=device, dtype=dtype, requires_grad=True)
        x_ops = x_mhc.detach().requires_grad_(True)
        op_runs = {}
        layers = (("lean", mhc), ("birkhoff", birkhoff), ("reference", reference), ("fused", fused))
        for label, layer in layers:
            if layer is None:
                continue
            connection = layer.mlp_hyper_connection
            for op, run in _op_steps(args, connection, x_ops, y).items():
                op_runs[f"{label}/{op}"] = run
        op_ms = _interleaved(op_runs, args.warmup, args.iters)

    threads = torch.get_num_threads() if device == "cpu" else None
    where = f"CPU ({threads} threads)" if device == "cpu" else torch.cuda.get_device_name()
    print(
        f"one layer, fwd+bwd, {where}, {args.dtype}: s={s} b={b} h={h} heads={args.heads} "
        f"n={n}, median of {args.iters} interleaved runs ({args.clock} clock)"
        + (", glibc keeping freed memory" if args.keep_freed_memory else "")
    )
    ratios = {name: ms / layer_ms[_plain_of(name)] for name, ms in layer_ms.items()}
    for name, ms in layer_ms.items():
        print(f"  {name:<20} {ms:9.2f} ms   ({ratios[name]:.3f}x {_plain_of(name)})")
    print("each mHC op alone, fwd+bwd, one sub-layer:")
    for name, ms in op_ms.items():
        print(f"  {name:<20} {ms:9.3f} ms")
    result = {
        "bench": "mhc_layer",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": platform.node(),
        "device": where,
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "dtype": args.dtype,
        "sizes": dict(seq=s, batch=b, hidden=h, heads=args.heads, streams=n),
        "moe_experts": args.moe or None,
        "mla": args.mla,
        "iters": args.iters,
        "clock": args.clock,
        "fused": args.fused,
        "keep_freed_memory": args.keep_freed_memory,
        "layer_ms": layer_ms,
        "ratio_to_plain": ratios,
        "op_ms": op_ms,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
