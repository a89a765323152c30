"""Interventions on the mHC gradient spike of ``bench/mhc_ab.py`` (issue 42, item 2).

One run of an ``mhc_ab`` arm (same model, corpus, data order and optimiser) with one of:

* ``--init-from ARM``  start from the dense weights (embeddings, attention, MLP, norms) that ARM
  draws from the same seed: the mHC model's ``mapping_proj`` initialisations consume the RNG, so
  from decoder layer 0's MLP on, an mHC arm's dense weights differ from plain's for the same seed
* ``--freeze-mhc``     leave the mHC parameters out of the optimiser (the maps stay at their
  near-uniform initial values: H_pre = 0.5, H_post = 1, H_res = 1/n, to about 1 %)
* ``--embedding-scale K``  multiply the embedding's output (word + position) by K

Every step prints the loss, the gradient norm before clipping, the layer-0 share of the squared
gradient norm, the median token's embedding RMS, and (per token, after layer 0, the mean over
streams) what layer 0 wrote relative to the embedding (median) and the smallest residual
relative to its embedding. The last line is a JSON summary.

    .venv/bin/python bench/mhc_spike_probe.py --data example_data --arm mhc --seed 1236 --steps 23
    .venv/bin/python bench/mhc_spike_probe.py --data example_data --arm mhc --seed 1236 --steps 23 --init-from plain
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import torch

AB = Path(__file__).resolve().parent / "mhc_ab.py"


def _ab():
    spec = importlib.util.spec_from_file_location("mhc_ab", AB)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _is_mhc(name: str) -> bool:
    return "hyper_connection" in name or "hc_head" in name


def _rms(t: torch.Tensor) -> torch.Tensor:
    return t.square().mean(-1).sqrt()


def _build(ab, args, arm, seed, vocab):
    from megatron_ext.config import MHCTransformerConfig
    from megatron_ext.testing.equivalence import gpt_model_factory, transformer_config

    plan = ab._plan(args, seed, vocab, ab.ARMS[arm])
    config = transformer_config(plan, parallel=False, config_class=MHCTransformerConfig)
    return plan, gpt_model_factory(plan)(config, True, True, None)


def _copy_dense_init(model, donor) -> None:
    """Load the donor's initial dense weights (every same-named, same-shaped tensor)."""
    mine = model.state_dict()
    shared = {
        k: v
        for k, v in donor.state_dict().items()
        if k in mine and torch.is_tensor(v) and v.shape == mine[k].shape and not _is_mhc(k)
    }
    model.load_state_dict(shared, strict=False)


def probe(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="example_data")
    parser.add_argument("--arm", default="mhc")
    parser.add_argument("--seed", type=int, default=1236)
    parser.add_argument("--steps", type=int, default=23)
    parser.add_argument("--init-from", default=None)
    parser.add_argument("--freeze-mhc", action="store_true")
    parser.add_argument("--embedding-scale", type=float, default=1.0)
    own = parser.parse_args(argv)
    ab = _ab()
    args = ab.parse_args(["--data", own.data, "--steps", str(own.steps)])
    sequences, vocab = ab.load_sequences(Path(args.data), args.seq)
    train, _ = ab.split_held_out(sequences, args.held_out_fraction)
    from megatron_ext.testing.distributed import model_parallel
    from megatron_ext.testing.equivalence import forward_backward, gpt_forward_step

    n = args.streams if ab.ARMS[own.arm].get("enable_mhc_connections") else 1
    order = torch.Generator().manual_seed(own.seed)
    records, seen = [], {}
    donor = None
    if own.init_from:  # drawn first, from a fresh RNG state, as that arm's own run draws it
        with model_parallel(seed=own.seed):
            donor = _build(ab, args, own.init_from, own.seed, vocab)[1]
    with model_parallel(seed=own.seed):
        plan, model = _build(ab, args, own.arm, own.seed, vocab)
        if donor is not None:
            _copy_dense_init(model, donor)
        trained = [
            p
            for name, p in model.named_parameters()
            if p.requires_grad and not (own.freeze_mhc and _is_mhc(name))
        ]
        every = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trained, lr=plan.lr, betas=(0.9, 0.999), weight_decay=0.0)

        def scale_embedding(_module, _inputs, output):
            output = output * own.embedding_scale
            seen["embedding"] = output.detach().float()
            return output

        def after_layer0(_layer, inputs, kwargs):
            hidden = (inputs[0] if inputs else kwargs["hidden_states"]).detach().float()
            s, b, width = hidden.shape
            seen["after0"] = hidden.view(s, b, n, width // n).mean(2)

        model.embedding.register_forward_hook(scale_embedding)
        model.decoder.layers[1].register_forward_pre_hook(after_layer0, with_kwargs=True)
        for step in range(1, own.steps + 1):
            rows = train[torch.randint(0, len(train), (args.batch,), generator=order)]
            optimizer.zero_grad(set_to_none=False)
            batch = iter([ab.as_batch(rows)])
            reports = forward_backward(plan, gpt_forward_step, [model], batch, 1)
            share = ab._layer0_share(model)["grad_share_layer0"]
            split = ab._grad_norms(model)
            embedding, after0 = seen["embedding"], seen["after0"]
            written = _rms(after0 - embedding) / _rms(embedding)
            record = dict(
                step=step,
                loss=round(float(reports[0]["lm loss"]), 3),
                grad_norm=round(float(torch.nn.utils.clip_grad_norm_(every, plan.clip_grad)), 2),
                grad_norm_mhc=round(split["grad_norm_mhc"], 2),
                grad_share_layer0=round(share, 3),
                embedding_rms=round(float(_rms(embedding).median()), 4),
                layer0_write_over_embedding=round(float(written.median()), 2),
                min_residual_over_embedding=round(float((_rms(after0) / _rms(embedding)).min()), 3),
            )
            records.append(record)
            print(record, flush=True)
            optimizer.step()
    norms = [r["grad_norm"] for r in records]
    spikes = ab.spike_steps(norms, args.spike_factor, args.spike_window)
    summary = {**vars(own), "spikes": {records[i]["step"]: norms[i] for i in spikes}}
    print(json.dumps(summary), flush=True)
    return records


if __name__ == "__main__":
    probe()
