"""A/B of mHC against a plain residual on real text: held-out loss and gradient spikes.

Arms (the same GPT, data order and seed in each; only the residual changes):

* ``plain``       megatron-core's single residual stream
* ``mhc``         mHC with the default maps (``mhc_variant="megatron"``, upstream main's)
* ``deepseek-v4`` mHC with DeepSeek-V4's maps (``mhc_variant="deepseek-v4"``, learned head)
* ``single-pass`` DeepSeek-V4.1's single pass on DeepSeek's maps (``mhc_single_pass=True``,
                  ``mhc_variant="deepseek-v4"``: upstream Megatron-LM's single pass)

Each arm trains ``--steps`` steps for every ``--seeds`` seed, in one process on one CPU rank
(megatron-ext's GPTModel with the local spec, AdamW, gradient clipping at 1.0 as megatron's
default), on the offline example corpus (``megatron-ext prepare-data --example DIR``; its
byte-level BPE tokenizer): the token stream is cut into sequences, the last
``--held-out-fraction`` of them are held out and never trained on. Every step records the
loss, the gradient norm before clipping, how that norm splits between the mHC parameters and
the rest, the share of it in the first layer (``grad_share_layer0``), the
smallest token's residual RMS relative to the median token's at the inputs of layers 2..L
(``residual_min_ratio``: a token whose residual nearly cancels), and (mHC arms) the mHC
statistics of :mod:`megatron_ext.mhc.stats` (H_pre/H_post ranges and amplitudes, Sinkhorn
residual, per-stream residual RMS); the held-out loss is measured every ``--eval-interval``
steps and at the end.

A *spike* is a step whose gradient norm exceeds ``--spike-factor`` × the median of the
preceding ``--spike-window`` steps (fewer at the start; from step 6 on). For each arm the
script prints the final held-out loss (mean and per seed), the spike count, and, for every
spike, what moved at that step relative to the step before (the biggest relative changes
among the recorded statistics), then writes ``mhc_ab.json`` (every per-step record) and
``mhc_ab.png`` (training loss, gradient norm with the spikes marked, held-out loss) under
``--out``. Its last line is one JSON object with the summary.

    nice -n 10 .venv/bin/python bench/mhc_ab.py --data example_data      # the defaults
    .venv/bin/python bench/mhc_ab.py --data example_data --steps 60 --seeds 1234   # quick

Not a test: figures depend on the machine only through time; losses are deterministic for a
given torch build and thread count.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ARMS = {
    "plain": {},
    "mhc": dict(enable_mhc_connections=True),
    "deepseek-v4": dict(enable_mhc_connections=True, mhc_variant="deepseek-v4"),
    "single-pass": dict(
        enable_mhc_connections=True, mhc_variant="deepseek-v4", mhc_single_pass=True
    ),
}
DATASET = "data/huggingface/stdlib_a_m_text_document"
TOKENIZER = "tokenizers/huggingface"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--data",
        default=os.environ.get("MEGATRON_EXT_EXAMPLE_DATA", "example_data"),
        help="the DIR given to `megatron-ext prepare-data --example`",
    )
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[1234, 1235, 1236])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (one micro-batch)")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--clip-grad", type=float, default=1.0)
    parser.add_argument("--eval-interval", type=int, default=50)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--held-out-fraction", type=float, default=0.05)
    parser.add_argument("--spike-factor", type=float, default=2.5)
    parser.add_argument("--spike-window", type=int, default=20)
    parser.add_argument("--out", default="bench/results/mhc_ab")
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- data


def load_sequences(data_dir: Path, seq: int) -> tuple[torch.Tensor, int]:
    """The example corpus as ``[N, seq + 1]`` token rows (one token of overlap for the labels)
    and the tokenizer's vocabulary size."""
    from tokenizers import Tokenizer

    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix = data_dir / DATASET
    if not Path(f"{prefix}.idx").exists():
        sys.exit(
            f"mhc_ab: no example corpus at {prefix}.idx; make it with "
            f"`megatron-ext prepare-data --example {data_dir}` or pass --data DIR"
        )
    dataset = IndexedDataset(str(prefix))
    stream = torch.cat([torch.from_numpy(dataset[i].astype("int64")) for i in range(len(dataset))])
    rows = (stream.numel() - 1) // seq
    starts = torch.arange(rows) * seq
    sequences = torch.stack([stream[s : s + seq + 1] for s in starts.tolist()])
    vocab = Tokenizer.from_file(str(data_dir / TOKENIZER / "tokenizer.json")).get_vocab_size()
    return sequences, vocab


def split_held_out(sequences: torch.Tensor, fraction: float):
    held = max(1, int(len(sequences) * fraction))
    return sequences[:-held], sequences[-held:]


def as_batch(rows: torch.Tensor) -> dict:
    b, s = rows.shape[0], rows.shape[1] - 1
    return dict(
        tokens=rows[:, :-1].contiguous(),
        labels=rows[:, 1:].contiguous(),
        loss_mask=torch.ones(b, s),
        position_ids=torch.arange(s).unsqueeze(0).expand(b, s).contiguous(),
        attention_mask=torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1),
    )


# ----------------------------------------------------------------------------- one run


def _plan(args, seed: int, vocab: int, overrides: dict):
    from megatron_ext.testing.equivalence import TrainPlan

    fields = dict(overrides)
    if fields.get("enable_mhc_connections"):
        fields.setdefault("mhc_num_residual_streams", args.streams)
    return TrainPlan(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        vocab_size=vocab,
        seq_length=args.seq,
        micro_batch_size=args.batch,
        global_batch_size=args.batch,
        steps=args.steps,
        lr=args.lr,
        clip_grad=args.clip_grad,
        seed=seed,
        config_overrides=fields,
    )


def _grad_norms(model) -> dict[str, float]:
    """Gradient norm of the mHC parameters (hyper connections, hc_head) and of the rest."""
    hc, rest = [], []
    for name, param in model.named_parameters():
        if param.grad is not None:
            (hc if ("hyper_connection" in name or "hc_head" in name) else rest).append(
                param.grad.detach().double().square().sum()
            )
    norm = lambda parts: math.sqrt(float(sum(parts))) if parts else 0.0  # noqa: E731
    return {"grad_norm_mhc": norm(hc), "grad_norm_rest": norm(rest)}


def _stream_figures(figures: dict) -> dict:
    """The model-wide extremes of the mHC statistics (over every sub-layer)."""
    summary: dict[str, float] = {}
    for key, value in figures.items():
        stat = key.rsplit("/", 1)[-1]
        if stat.endswith("_min"):
            summary[stat] = min(summary.get(stat, math.inf), value)
        else:
            summary[stat] = max(summary.get(stat, -math.inf), value)
    return summary


class ResidualWatch:
    """Forward pre-hooks on the decoder layers 2..L: per step, the smallest token's residual
    RMS (the mean of the streams, or the plain residual) relative to the median token's, the
    smallest over those layers' inputs (``residual_min_ratio``), and the layer-0 share of the
    gradient norm is read beside it: a token whose residual nearly cancels makes the
    following layernorms' 1/σ large."""

    def __init__(self, model, streams: int):
        self.streams, self.ratios = streams, []
        self.handles = [
            layer.register_forward_pre_hook(self._record, with_kwargs=True)
            for layer in list(model.decoder.layers)[1:]
        ]

    def _record(self, _layer, args, kwargs):
        hidden = (args[0] if args else kwargs["hidden_states"]).detach().float()
        s, b, width = hidden.shape
        mean = hidden.view(s, b, self.streams, width // self.streams).mean(dim=2)
        rms = mean.square().mean(dim=-1).sqrt().flatten()
        self.ratios.append(float(rms.min() / rms.median().clamp_min(1e-30)))

    def take(self) -> dict[str, float]:
        ratios, self.ratios = self.ratios, []
        return {"residual_min_ratio": min(ratios)} if ratios else {}


def _layer0_share(model) -> dict[str, float]:
    """Fraction of the squared gradient norm in decoder layer 0 (the word embedding, which
    holds most of it at an ordinary step, is left out of the numerator)."""
    first, total = 0.0, 0.0
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        squared = float(param.grad.detach().double().square().sum())
        total += squared
        if "decoder.layers.0." in name:
            first += squared
    return {"grad_share_layer0": first / total if total else 0.0}


def _held_out_loss(model, held_out: torch.Tensor, args) -> float:
    from megatron_ext.testing.equivalence import masked_lm_loss

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(args.eval_batches):
            rows = held_out[i * args.batch : (i + 1) * args.batch]
            if len(rows) == 0:
                break
            batch = as_batch(rows)
            output = model(
                batch["tokens"],
                batch["position_ids"],
                batch["attention_mask"],
                labels=batch["labels"],
            )
            loss_sum, tokens, _ = masked_lm_loss(batch["loss_mask"], output)
            total, count = total + float(loss_sum), count + int(tokens)
    model.train()
    return total / max(count, 1)


def train_arm(args, arm: str, seed: int, train: torch.Tensor, held_out: torch.Tensor, vocab: int):
    """One run: per-step records and the held-out losses."""
    from megatron_ext.config import MHCTransformerConfig
    from megatron_ext.mhc import stats
    from megatron_ext.testing.distributed import model_parallel
    from megatron_ext.testing.equivalence import (
        forward_backward,
        gpt_forward_step,
        gpt_model_factory,
        transformer_config,
    )

    plan = _plan(args, seed, vocab, ARMS[arm])
    mhc = bool(ARMS[arm].get("enable_mhc_connections"))
    order = torch.Generator().manual_seed(seed)  # the data order: the same in every arm
    records, held = [], []
    with model_parallel(seed=seed):
        config = transformer_config(plan, parallel=False, config_class=MHCTransformerConfig)
        model = gpt_model_factory(plan)(config, True, True, None)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=plan.lr, betas=(0.9, 0.999), weight_decay=0.0)
        watch = ResidualWatch(model, args.streams if mhc else 1)
        for step in range(1, args.steps + 1):
            rows = train[torch.randint(0, len(train), (args.batch,), generator=order)]
            optimizer.zero_grad(set_to_none=False)
            recorder = stats.enable() if mhc else None
            try:
                reports = forward_backward(
                    plan, gpt_forward_step, [model], iter([as_batch(rows)]), 1
                )
                figures = stats.collect(recorder) if recorder is not None else {}
            finally:
                stats.disable()
            record = {"step": step, "loss": reports[0]["lm loss"], **_grad_norms(model)}
            record.update(watch.take(), **_layer0_share(model))
            record["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, plan.clip_grad))
            record.update(_stream_figures(figures))
            records.append(record)
            optimizer.step()
            if step % args.eval_interval == 0 or step == args.steps:
                held.append({"step": step, "loss": _held_out_loss(model, held_out, args)})
                watch.take()  # the evaluation's forwards are not a training step's
    return records, held


# ----------------------------------------------------------------------------- spikes


FIRST_SPIKE_INDEX = 5
"""Spikes are looked for from the 6th step on (the median of 5 steps is the shortest baseline)."""


def spike_steps(norms: list[float], factor: float, window: int) -> list[int]:
    """Indices whose value exceeds ``factor`` × the median of the (up to) ``window`` before."""
    return [
        i
        for i in range(FIRST_SPIKE_INDEX, len(norms))
        if norms[i] > factor * statistics.median(norms[max(0, i - window) : i])
    ]


def what_moved(records: list[dict], index: int, top: int = 4) -> list[tuple[str, float, float]]:
    """The recorded figures with the largest relative change into step ``index``."""
    before, now = records[index - 1], records[index]
    changes = []
    for key, value in now.items():
        if key in ("step", "loss") or key not in before:
            continue
        previous = before[key]
        change = abs(value - previous) / max(abs(previous), 1e-12)
        changes.append((key, previous, value, change))
    changes.sort(key=lambda c: -c[3])
    return [(k, p, v) for k, p, v, _ in changes[:top]]


# ----------------------------------------------------------------------------- report


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    colours = dict(zip(ARMS, ("black", "tab:blue", "tab:orange", "tab:green"), strict=True))
    for arm, runs in results.items():
        for k, run in enumerate(runs):
            steps = [r["step"] for r in run["records"]]
            label = arm if k == 0 else None
            axes[0].plot(
                steps,
                [r["loss"] for r in run["records"]],
                color=colours[arm],
                alpha=0.5,
                lw=0.8,
                label=label,
            )
            norms = [r["grad_norm"] for r in run["records"]]
            axes[1].plot(steps, norms, color=colours[arm], alpha=0.5, lw=0.8, label=label)
            spikes = run["spikes"]
            axes[1].scatter(
                [steps[i] for i in spikes],
                [norms[i] for i in spikes],
                color=colours[arm],
                marker="x",
            )
            axes[2].plot(
                [h["step"] for h in run["held_out"]],
                [h["loss"] for h in run["held_out"]],
                color=colours[arm],
                marker="o",
                alpha=0.7,
                label=label,
            )
    axes[0].set(title="training loss", xlabel="step")
    axes[1].set(title="gradient norm before clipping (x: spikes)", xlabel="step", yscale="log")
    axes[2].set(title="held-out loss", xlabel="step")
    for axis in axes:
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def summarise(results: dict) -> dict:
    summary = {}
    for arm, runs in results.items():
        finals = [run["held_out"][-1]["loss"] for run in runs]
        summary[arm] = {
            "held_out_loss_mean": statistics.fmean(finals),
            "held_out_loss_per_seed": finals,
            "spikes_per_seed": [len(run["spikes"]) for run in runs],
            "max_grad_norm": max(max(r["grad_norm"] for r in run["records"]) for run in runs),
            "seconds": sum(run["seconds"] for run in runs),
        }
    return summary


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    started = time.time()
    sequences, vocab = load_sequences(Path(args.data), args.seq)
    train, held_out = split_held_out(sequences, args.held_out_fraction)
    print(
        f"corpus: {len(train)} training and {len(held_out)} held-out sequences of {args.seq} tokens, vocab {vocab}"
    )
    results: dict[str, list] = {}
    for arm in args.arms:
        for seed in args.seeds:
            begin = time.time()
            records, held = train_arm(args, arm, seed, train, held_out, vocab)
            spikes = spike_steps(
                [r["grad_norm"] for r in records], args.spike_factor, args.spike_window
            )
            run = {
                "seed": seed,
                "records": records,
                "held_out": held,
                "spikes": spikes,
                "seconds": time.time() - begin,
            }
            results.setdefault(arm, []).append(run)
            print(
                f"{arm:12s} seed {seed}: held-out {held[-1]['loss']:.4f}, {len(spikes)} spikes, "
                f"max grad norm {max(r['grad_norm'] for r in records):.2f}, {run['seconds']:.0f} s"
            )
            for index in spikes:
                moved = ", ".join(f"{k} {p:.3g}->{v:.3g}" for k, p, v in what_moved(records, index))
                print(f"    spike at step {records[index]['step']}: {moved}")
                watched = ("residual_min_ratio", "grad_share_layer0", "loss")
                print(
                    "      "
                    + ", ".join(
                        f"{k} {records[index - 1].get(k, float('nan')):.3g}->{records[index].get(k, float('nan')):.3g}"
                        for k in watched
                    )
                )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarise(results)
    meta = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "args": vars(args),
        "wall_seconds": time.time() - started,
    }
    (out / "mhc_ab.json").write_text(
        json.dumps({"meta": meta, "summary": summary, "runs": results})
    )
    plot(results, out / "mhc_ab.png")
    for arm, figures in summary.items():
        print(
            f"{arm:12s} held-out {figures['held_out_loss_mean']:.4f} (seeds {', '.join(f'{v:.4f}' for v in figures['held_out_loss_per_seed'])}), "
            f"spikes {figures['spikes_per_seed']}, max grad norm {figures['max_grad_norm']:.2f}"
        )
    print(f"wrote {out / 'mhc_ab.png'} and {out / 'mhc_ab.json'} in {meta['wall_seconds']:.0f} s")
    print(json.dumps({"meta": meta, "summary": summary}))
    return summary


if __name__ == "__main__":
    main()
