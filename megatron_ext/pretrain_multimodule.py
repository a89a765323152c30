"""Train a multi-module recipe: ``python -m megatron_ext.multimodule.train RECIPE [KEY=VALUE ...]``.

Launch it under torchrun with the recipe's number of ranks (``launch.nproc``). The recipe is
megatron-ext's recipe YAML with ``model.type: multimodule``; this entry reads:

- ``model.modules``: ``{name: {kind, tp, pp, dp, cp, first_rank, output_ndim, num_layers,
  hidden_size, num_attention_heads, ...}}`` with ``kind`` one of ``vision_encoder``
  (``patch_dim``, ``image_lengths``: image tokens per micro-batch, cycled; ``flatten_output``),
  ``projector`` or ``language_model`` (``mhc: {enabled, num_residual_streams,
  sinkhorn_iterations, init_gating_factor}``, ``text_pattern``: ``random`` or ``arithmetic``,
  a learnable sequence); exactly one language model;
- ``model.topology``: ``{module: [modules it feeds]}``;
- ``model.seq_length`` (text tokens per sample), ``model.hidden_dropout``,
  ``model.attention_dropout``, ``data.tokenizer.vocab_size``;
- ``training``: ``iterations``, ``micro_batch_size`` (of the language model),
  ``global_batch_size``, ``lr`` (constant), ``weight_decay``, ``clip_grad`` (global norm over
  every module), ``seed``.

The recipe is read by the one recipe loader (:func:`megatron_ext.recipes.load`: schema with
a typed ``model.modules`` section, overrides, platforms), so a typo such as
``model.modules.llm.hidden_sizee=64`` is an error naming the field, here and in
``megatron-ext validate``, which also runs :func:`recipe_problems` (the plan) without
starting anything. ``KEY=VALUE`` overrides use dotted paths (``training.iterations=20``,
``model.modules.llm.pp=1``; values are YAML). The Megatron flags the recipe runner appends
(``--recipe PATH``, ``--train-iters``, ``--micro-batch-size``, ``--global-batch-size``,
``--lr``, ``--weight-decay``, ``--clip-grad``, ``--seed``, ``--tensorboard-dir``) are
honoured; other Megatron flags are ignored. Data is the deterministic synthetic VLM data of
:class:`~megatron_ext.multimodule.vlm.VLMData`.

Metrics go where Megatron's go: the last rank writes TensorBoard scalars under Megatron's tags
("lm loss", "grad-norm", "iteration-time" in seconds, "learning-rate", "batch-size") into
``--tensorboard-dir``, which the runner reads. Progress is logged as a plain line per
iteration (``multimodule: iteration N/M | lm loss X | grad norm G | T ms``).
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Optional

from megatron_ext.multimodule.plan import ModulePlan, MultiModulePlan

KINDS = ("vision_encoder", "projector", "language_model")
PARALLEL_KEYS = ("tp", "pp", "dp", "cp", "first_rank", "output_ndim")


# ------------------------------------------------------------------------------ recipe
logger = logging.getLogger(__name__)


def load_recipe(path: str, overrides: list[str] = ()) -> dict:
    """The recipe through the one recipe loader (schema, overrides), as a plain mapping with
    every field; ValueError lists every problem."""
    from megatron_ext.recipes import RecipeError, load

    try:
        loaded = load(path, overrides=list(overrides))
    except RecipeError as error:
        raise ValueError("; ".join(str(p) for p in error.problems)) from None
    return loaded.recipe.to_dict()


@dataclass
class TrainingSettings:
    iterations: int = 10
    micro_batch_size: int = 2
    global_batch_size: int = 8
    lr: float = 1e-3
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    seed: int = 1234
    lr_schedule: str = "constant"

    @classmethod
    def from_recipe(cls, recipe: dict) -> "TrainingSettings":
        t = recipe.get("training", {}) or {}
        defaults = cls()
        # YAML reads 3e-3 (no dot) as a string: coerce to each field's type.
        fields = {k: type(getattr(defaults, k))(t[k]) for k in cls.__dataclass_fields__ if k in t}
        return cls(**fields)


@dataclass
class MultiModuleRecipe:
    plan: MultiModulePlan
    modules: dict[str, dict]
    training: TrainingSettings
    text_length: int
    vocab_size: int
    hidden_dropout: float
    attention_dropout: float

    @property
    def language_model(self) -> str:
        return self.plan.language_model

    def num_microbatches(self) -> int:
        lm_dp = self.plan.modules[self.language_model].dp
        per_step = self.training.micro_batch_size * lm_dp
        if self.training.global_batch_size % per_step:
            raise ValueError(
                f"training.global_batch_size ({self.training.global_batch_size}) must be a "
                f"multiple of micro_batch_size ({self.training.micro_batch_size}) x the "
                f"language model's dp ({lm_dp})"
            )
        return self.training.global_batch_size // per_step


def read_recipe(recipe: dict, world_size: Optional[int] = None) -> MultiModuleRecipe:
    """The plan and settings of a multimodule recipe; raises ValueError listing problems."""
    model = recipe.get("model", {}) or {}
    modules = copy.deepcopy(model.get("modules") or {})
    problems = []
    if not modules:
        problems.append("model.modules is empty: name the modules and their parallel sizes")
    lms = [name for name, m in modules.items() if (m or {}).get("kind") == "language_model"]
    for name, m in modules.items():
        if (m or {}).get("kind") not in KINDS:
            problems.append(
                f"model.modules.{name}.kind must be one of {KINDS}, got {(m or {}).get('kind')!r}"
            )
    if modules and len(lms) != 1:
        problems.append(f"exactly one module must have kind: language_model, found {lms}")
    if problems:
        raise ValueError("; ".join(problems))
    if world_size is None:
        launch = recipe.get("launch", {}) or {}
        world_size = launch.get("nproc") or int(os.environ.get("WORLD_SIZE", "1"))
    plan = MultiModulePlan(
        modules={
            name: ModulePlan(**{k: m[k] for k in PARALLEL_KEYS if k in m})
            for name, m in modules.items()
        },
        topology={k: list(v or []) for k, v in (model.get("topology") or {}).items()},
        language_model=lms[0],
        world_size=world_size,
    )
    tokenizer = (recipe.get("data", {}) or {}).get("tokenizer", {}) or {}
    return MultiModuleRecipe(
        plan=plan,
        modules=modules,
        training=TrainingSettings.from_recipe(recipe),
        text_length=int(model.get("seq_length", 32)),
        vocab_size=int(tokenizer.get("vocab_size") or 128),
        hidden_dropout=float(model.get("hidden_dropout", 0.0)),
        attention_dropout=float(model.get("attention_dropout", 0.0)),
    )


def validate_recipe(
    path: str, overrides: list[str] = (), world_size: Optional[int] = None
) -> list[str]:
    """Every problem of a multimodule recipe file, found without starting anything."""
    try:
        recipe = load_recipe(path, list(overrides))
    except ValueError as error:
        return [str(error)]
    return recipe_problems(recipe, world_size)


def recipe_problems(recipe: dict, world_size: Optional[int] = None) -> list[str]:
    """Every problem of a loaded multimodule recipe's plan (``megatron-ext validate``)."""
    try:
        mm = read_recipe(recipe, world_size)
    except (ValueError, TypeError) as error:
        return [str(error)]
    problems = mm.plan.problems() + module_problems(mm)
    if mm.training.lr_schedule != "constant":
        problems.append(
            f"training.lr_schedule={mm.training.lr_schedule!r}: this entry trains "
            "with a constant learning rate"
        )
    try:
        mm.num_microbatches()
        for name in mm.plan.modules:
            mm.plan.micro_batch_size(name, mm.training.micro_batch_size)
    except ValueError as error:
        problems.append(str(error))
    return problems


def output_width(spec: dict) -> int:
    """Width of what a module's last stage hands on: its hidden_size. A vision_encoder's
    [s, b, h] (or flattened [b*s, h]) and a projector's Linear(h, h) keep h; mHC streams are
    contracted back to h before a language model's final norm, never sent over a bridge."""
    return int(spec.get("hidden_size", 64))


def _bridge_width_problems(mm: MultiModuleRecipe) -> list[str]:
    # The LLM's first stage concatenates every predecessor's [s, b, h] with its text
    # embeddings along the sequence (vlm.language_model_impl) and a projector is a
    # Linear(h, h): both need the predecessor's width. A mismatch fails only on the
    # receiving rank, after every rank has started (the issue saw the run hang).
    problems = []
    for src, dst in mm.plan.edges:
        sent, taken = output_width(mm.modules[src]), int(mm.modules[dst].get("hidden_size", 64))
        if sent != taken:
            problems.append(
                f"bridge {src} -> {dst}: {src!r} hands on hidden_size {sent} but {dst!r} takes "
                f"hidden_size {taken}; set model.modules.{src}.hidden_size={taken} or "
                f"model.modules.{dst}.hidden_size={sent} (a projector maps h to h, so it must "
                "match both neighbours)"
            )
    return problems


def _size_problems(name: str, spec: dict) -> list[str]:
    field = f"model.modules.{name}"
    layers, hidden = spec.get("num_layers", 2), spec.get("hidden_size", 64)
    heads, tp, pp = spec.get("num_attention_heads", 4), spec.get("tp", 1), spec.get("pp", 1)
    positive = dict(num_layers=layers, hidden_size=hidden, num_attention_heads=heads)
    if spec["kind"] == "vision_encoder":
        positive["patch_dim"] = spec.get("patch_dim", 48)
    problems = [
        f"{field}.{key}={value} must be >= 1" for key, value in positive.items() if value < 1
    ]
    if problems:
        return problems
    if spec["kind"] != "projector":  # a projector is one Linear: no layers, heads or stages
        if layers % pp:
            problems.append(
                f"{field}.num_layers={layers} does not divide over its pp={pp} stages "
                "(a stage would build a different number of layers than planned); make "
                "num_layers a multiple of pp"
            )
        if hidden % heads:
            problems.append(
                f"{field}.hidden_size={hidden} is not a multiple of num_attention_heads="
                f"{heads}; pick heads that divide the hidden size"
            )
        if heads % tp:
            problems.append(
                f"{field}.num_attention_heads={heads} does not split over tp={tp}; make it "
                "a multiple of tp"
            )
    return problems


def _image_problems(name: str, spec: dict) -> list[str]:
    lengths = spec.get("image_lengths", [8])
    if not lengths or any(int(n) < 1 for n in lengths):
        return [
            f"model.modules.{name}.image_lengths={list(lengths)} must be a non-empty list of "
            "image token counts >= 1 (one per micro-batch, cycled)"
        ]
    return []


# mHC fields this entry does not build (a recipe setting them would train without them).
_UNUSED_MHC = {"recompute": False, "recompute_layer_num": None, "fused": False}


def _mhc_problems(name: str, spec: dict) -> list[str]:
    mhc, field = spec.get("mhc") or {}, f"model.modules.{name}.mhc"
    if not mhc.get("enabled"):
        return []
    if spec["kind"] != "language_model":
        return [
            f"{field}.enabled: only the language_model builds mHC residual streams; the "
            f"{spec['kind']} would silently train without them. Remove {field}"
        ]
    problems = [
        f"{field}.{key}={mhc[key]} must be >= 1"
        for key in ("num_residual_streams", "sinkhorn_iterations")
        if key in mhc and mhc[key] < 1
    ]
    problems += [
        f"{field}.{key}={mhc[key]!r} is not supported by megatron_ext.multimodule.train (it "
        f"would be ignored); remove it"
        for key, default in _UNUSED_MHC.items()
        if mhc.get(key, default) != default
    ]
    return problems


def _output_ndim_problems(name: str, spec: dict) -> list[str]:
    # The built encoder reports 2 when flattening, else 3; a different plan value fails
    # the build on every rank after start-up (MultiModuleBuildError).
    declared, flatten = spec.get("output_ndim"), bool(spec.get("flatten_output", False))
    if declared is None or declared == (2 if flatten else 3):
        return []
    return [
        f"model.modules.{name}.output_ndim={declared} contradicts flatten_output={flatten} "
        f"(the encoder hands on {'[b*s, h]' if flatten else '[s, b, h]'}); set output_ndim="
        f"{2 if flatten else 3} or leave it unset"
    ]


def module_problems(mm: MultiModuleRecipe) -> list[str]:
    """Module settings that the plan accepts but that fail or train wrong after ranks start:
    sizes, image lengths, an encoder's output_ndim, mHC settings this entry would ignore,
    widths across each bridge."""
    problems = []
    for name, spec in mm.modules.items():
        problems += _size_problems(name, spec)
        if spec["kind"] == "vision_encoder":
            problems += _image_problems(name, spec) + _output_ndim_problems(name, spec)
        problems += _mhc_problems(name, spec)
    return problems + _bridge_width_problems(mm)


def _module_impls(mm: MultiModuleRecipe) -> dict:
    from megatron_ext.multimodule import vlm

    impls = {}
    for name, spec in mm.modules.items():
        overrides = dict(hidden_dropout=mm.hidden_dropout, attention_dropout=mm.attention_dropout)
        mhc = spec.get("mhc") or {}
        if mhc.get("enabled"):
            overrides.update(
                enable_mhc_connections=True,
                mhc_num_residual_streams=mhc.get("num_residual_streams", 4),
                mhc_sinkhorn_iterations=mhc.get("sinkhorn_iterations", 20),
                mhc_init_gating_factor=mhc.get("init_gating_factor", 0.01),
            )
        config = vlm.transformer_config(
            spec.get("num_layers", 2),
            spec.get("hidden_size", 64),
            spec.get("num_attention_heads", 4),
            **overrides,
        )
        kind = spec["kind"]
        if kind == "vision_encoder":
            impls[name] = vlm.encoder_impl(
                config, spec.get("patch_dim", 48), bool(spec.get("flatten_output", False))
            )
        elif kind == "projector":
            impls[name] = vlm.projector_impl(config)
        else:
            max_seq = mm.text_length + _max_image_tokens(mm)
            impls[name] = vlm.language_model_impl(config, mm.vocab_size, max_seq)
    return impls


def _image_lengths(mm: MultiModuleRecipe) -> tuple[int, ...]:
    lengths = {
        tuple(spec.get("image_lengths", (8,)))
        for spec in mm.modules.values()
        if spec["kind"] == "vision_encoder"
    }
    if len(lengths) > 1:
        raise ValueError(
            f"every vision_encoder must use the same image_lengths, got {sorted(lengths)}"
        )
    return lengths.pop() if lengths else (8,)


def _max_image_tokens(mm: MultiModuleRecipe) -> int:
    return max(_image_lengths(mm)) * len(mm.plan.predecessors(mm.language_model))


# ------------------------------------------------------------------------------ training
def _init_distributed() -> None:
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        from megatron_ext import runtime

        runtime.use_cpu()
    else:
        import megatron_ext

        megatron_ext.install()
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")


def _parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str], list[str]]:
    """``RECIPE [KEY=VALUE ...]`` first, then flags: ``--recipe`` and the Megatron flags this
    entry honours; other flags (and their values) are ignored and reported."""
    parser = argparse.ArgumentParser(
        prog="python -m megatron_ext.multimodule.train", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--recipe", help="the recipe (the recipe runner passes it this way)")
    parser.add_argument("--tensorboard-dir", help="where the last rank writes TensorBoard scalars")
    for flag, kind in (
        ("--train-iters", int),
        ("--micro-batch-size", int),
        ("--global-batch-size", int),
        ("--lr", float),
        ("--weight-decay", float),
        ("--clip-grad", float),
        ("--seed", int),
        ("--lr-decay-style", str),
    ):
        parser.add_argument(flag, type=kind)
    split = next((i for i, token in enumerate(argv) if token.startswith("-")), len(argv))
    positional, flags = argv[:split], argv[split:]
    args, ignored = parser.parse_known_args(flags)
    recipe = args.recipe
    overrides = []
    for item in positional:
        if "=" in item:
            overrides.append(item)
        elif recipe is None:
            recipe = item
        else:
            parser.error(f"more than one recipe: {recipe} and {item}")
    if recipe is None:
        parser.error("give the recipe file (RECIPE.yaml or --recipe RECIPE.yaml)")
    args.recipe = recipe
    fields = {
        "train_iters": "iterations",
        "micro_batch_size": "micro_batch_size",
        "global_batch_size": "global_batch_size",
        "lr": "lr",
        "weight_decay": "weight_decay",
        "clip_grad": "clip_grad",
        "seed": "seed",
        "lr_decay_style": "lr_schedule",
    }
    for attr, field in fields.items():
        value = getattr(args, attr)
        if value is not None:
            overrides.append(f"training.{field}={value}")
    return args, overrides, [token for token in ignored if token.startswith("--")]


def _tensorboard_writer(directory: Optional[str]):
    """Megatron's choice: a SummaryWriter on the last rank only (None without a directory)."""
    if not directory:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        logger.warning(
            "tensorboard is not installed: no TensorBoard scalars (pip install tensorboard)"
        )
        return None
    return SummaryWriter(log_dir=directory, max_queue=1000)


def train(mm: MultiModuleRecipe, log=print, tensorboard_dir: Optional[str] = None) -> list[float]:
    """Train; returns the lm loss of every iteration (on every rank). The last rank writes
    TensorBoard scalars into ``tensorboard_dir`` (Megatron's tags) and logs one progress line
    per iteration through ``log``."""
    import torch
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_ext.launch import faults
    from megatron_ext.multimodule import MultiModulePipelineConfig, build, vlm
    from megatron_ext.multimodule.grads import global_grad_norm

    t = mm.training
    if t.lr_schedule != "constant":
        raise ValueError(
            f"training.lr_schedule={t.lr_schedule!r}: this entry trains with a constant lr"
        )
    num_microbatches = mm.num_microbatches()
    config = MultiModulePipelineConfig(pipeline_dtype=torch.float32)
    pipeline = build(
        mm.plan, _module_impls(mm), config, DistributedDataParallelConfig(), seed=t.seed
    )
    params = [
        p for m in pipeline.model.core_modules().values() for p in m.parameters() if p.requires_grad
    ]
    optimizer = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)
    readers = {
        name: spec.get("patch_dim", 48)
        for name, spec in mm.modules.items()
        if spec["kind"] == "vision_encoder"
    }
    data = vlm.VLMData(
        mm.language_model,
        readers,
        vocab_size=mm.vocab_size,
        text_length=mm.text_length,
        image_lengths=_image_lengths(mm),
        seed=t.seed,
        text_pattern=mm.modules[mm.language_model].get("text_pattern", "random"),
    )
    forward_step = vlm.make_forward_step(mm.language_model)
    last_rank = dist.get_rank() == dist.get_world_size() - 1
    writer = _tensorboard_writer(tensorboard_dir) if last_rank else None
    losses = []
    # No try/finally around destroy(): it starts with a barrier, which a failing rank would
    # block in while its peers wait on it. A failure ends the rank (main's fail-fast) instead.
    for iteration in range(1, t.iterations + 1):
        faults.at_step(iteration)
        start = time.perf_counter()
        pipeline.zero_grad_buffer()
        optimizer.zero_grad(set_to_none=True)
        batches = vlm.local_batches(
            pipeline, data, iteration - 1, num_microbatches, t.micro_batch_size
        )
        reports = pipeline.forward_backward(forward_step, iter(batches), num_microbatches)
        # Megatron's lm loss: the mean over micro-batches and language-model replicas.
        total = torch.tensor(
            [sum(r["lm loss"] for r in reports), len(reports)]
            if pipeline.reports_loss
            else [0.0, 0.0],
            dtype=torch.float64,
        )
        dist.all_reduce(total)
        loss = float(total[0] / total[1])
        grad_norm = global_grad_norm(pipeline)
        scale = min(1.0, t.clip_grad / (grad_norm + 1e-6)) if t.clip_grad > 0 else 1.0
        for p in params:
            p.grad = p.main_grad * scale
        optimizer.step()
        elapsed_ms = (time.perf_counter() - start) * 1e3
        losses.append(loss)
        if writer is not None:
            for tag, value in (
                ("lm loss", loss),
                ("grad-norm", grad_norm),
                ("learning-rate", t.lr),
                ("batch-size", t.global_batch_size),
                ("iteration-time", elapsed_ms / 1e3),
            ):
                writer.add_scalar(tag, value, iteration)
            writer.flush()
        if last_rank:
            log(
                f"multimodule: iteration {iteration}/{t.iterations} | lm loss {loss:.6f} "
                f"| grad norm {grad_norm:.3f} | {elapsed_ms:.0f} ms"
            )
            sys.stdout.flush()
    if writer is not None:
        writer.close()
    pipeline.destroy()
    return losses


def main(argv: Optional[list[str]] = None) -> int:
    args, overrides, ignored = _parse_args(list(sys.argv[1:] if argv is None else argv))
    _init_distributed()
    import torch.distributed as dist

    mm = read_recipe(load_recipe(args.recipe, overrides), dist.get_world_size())
    if dist.get_rank() == 0:
        modules = ", ".join(
            f"{n} (tp{m.tp} pp{m.pp} dp{m.dp}, ranks {m.ranks.start}-{m.ranks.stop - 1})"
            for n, m in mm.plan.modules.items()
        )
        print(
            f"multimodule: {modules}; topology {mm.plan.topology}; "
            f"{mm.num_microbatches()} micro-batches per iteration",
            flush=True,
        )
        if ignored:
            print(
                f"multimodule: ignoring Megatron flags this entry does not use: {' '.join(ignored)}",
                flush=True,
            )
    train(mm, tensorboard_dir=args.tensorboard_dir)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from megatron_ext.launch.faults import run_failing_fast

    sys.exit(run_failing_fast(main))
