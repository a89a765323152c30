"""A multimodule recipe's plan and its checks, read from the typed :class:`Recipe`.

The recipe is megatron-ext's recipe YAML with ``model.type: multimodule``, read by the one
recipe loader (:func:`megatron_ext.recipes.load`: schema with a typed ``model.modules``
section, overrides, platforms), so every default is the schema's and a typo such as
``model.modules.llm.hidden_sizee=64`` is an error naming the field. This module turns its
module section into a :class:`~megatron_ext.multimodule.plan.MultiModulePlan` and finds,
without starting anything, what the plan accepts but the entry
(:mod:`megatron_ext.pretrain_multimodule`) would fail on or train wrong after its ranks start:

- ``model.modules``: ``{name: Module}`` with ``kind`` one of ``vision_encoder``
  (``patch_dim``, ``image_lengths``: image tokens per micro-batch, cycled; ``flatten_output``),
  ``projector`` or ``language_model`` (``mhc``, ``text_pattern``); exactly one language model;
- ``model.topology``: ``{module: [modules it feeds]}``;
- ``training``: the language model's ``micro_batch_size``, ``global_batch_size`` and a
  constant ``lr_schedule``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from megatron_ext.multimodule.plan import ModulePlan, MultiModulePlan
from megatron_ext.recipes.loader import load
from megatron_ext.recipes.schema import Module, Problem, Recipe, RecipeError, RecipeFieldError

KINDS = ("vision_encoder", "projector", "language_model")
PARALLEL_KEYS = ("tp", "pp", "dp", "cp", "first_rank", "output_ndim")
ENTRY = "megatron_ext.pretrain_multimodule"
# The Megatron flags the multi-module entry honours: flag -> (type, the recipe's training field).
HONOURED_FLAGS = {
    "--train-iters": (int, "iterations"),
    "--micro-batch-size": (int, "micro_batch_size"),
    "--global-batch-size": (int, "global_batch_size"),
    "--lr": (float, "lr"),
    "--weight-decay": (float, "weight_decay"),
    "--clip-grad": (float, "clip_grad"),
    "--seed": (int, "seed"),
    "--lr-decay-style": (str, "lr_schedule"),
}


def extra_args_problems(recipe: Recipe) -> list[Problem]:
    """An ``extra_args`` flag the multi-module entry would ignore (it reads only
    :data:`HONOURED_FLAGS`): refused, as Megatron refuses an unknown flag of the other
    entries, instead of a run that silently trains without it."""
    extra = recipe.extra_args if isinstance(recipe.extra_args, dict) else {}
    honoured = ", ".join(HONOURED_FLAGS)
    return [
        Problem(
            f"extra_args.{flag}",
            f"the multi-module entry does not read {flag}; it honours only {honoured}; "
            "remove it (or set the recipe's own field)",
        )
        for flag in extra
        if flag not in HONOURED_FLAGS
    ]


def plan_of(recipe: Recipe, world_size: int | None = None) -> MultiModulePlan:
    """The modules' grids and graph; raises RecipeFieldError listing what makes it no plan."""
    modules = recipe.model.modules or {}
    problems = []
    if not modules:
        problems.append("model.modules is empty: name the modules and their parallel sizes")
    lms = [name for name, m in modules.items() if m.kind == "language_model"]
    for name, m in modules.items():
        if m.kind not in KINDS:
            problems.append(f"model.modules.{name}.kind must be one of {KINDS}, got {m.kind!r}")
    if modules and len(lms) != 1:
        problems.append(f"exactly one module must have kind: language_model, found {lms}")
    if problems:
        raise RecipeFieldError("; ".join(problems))
    if world_size is None:
        world_size = recipe.launch.nproc or int(os.environ.get("WORLD_SIZE", "1"))
    return MultiModulePlan(
        modules={
            name: ModulePlan(**{k: getattr(m, k) for k in PARALLEL_KEYS})
            for name, m in modules.items()
        },
        topology={k: list(v or []) for k, v in (recipe.model.topology or {}).items()},
        language_model=lms[0],
        world_size=world_size,
    )


def num_microbatches(recipe: Recipe, plan: MultiModulePlan) -> int:
    """Micro-batches per iteration: the language model's data-parallel replicas share the
    global batch."""
    t = recipe.training
    lm_dp = plan.modules[plan.language_model].dp
    per_step = t.micro_batch_size * lm_dp
    if t.global_batch_size % per_step:
        raise RecipeFieldError(
            f"training.global_batch_size ({t.global_batch_size}) must be a "
            f"multiple of micro_batch_size ({t.micro_batch_size}) x the "
            f"language model's dp ({lm_dp})"
        )
    return t.global_batch_size // per_step


def validate_recipe(
    path: str, overrides: Sequence[str] = (), world_size: int | None = None
) -> list[str]:
    """Every problem of a multimodule recipe file, found without starting anything."""
    try:
        recipe = load(path, overrides=list(overrides)).recipe
    except RecipeError as error:
        return ["; ".join(str(p) for p in error.problems)]
    return recipe_problems(recipe, world_size)


def recipe_problems(recipe: Recipe, world_size: int | None = None) -> list[str]:
    """Every problem of a loaded multimodule recipe's plan (``megatron-ext validate``)."""
    try:
        plan = plan_of(recipe, world_size)
    except (ValueError, TypeError) as error:
        return [str(error)]
    problems = [str(p) for p in plan.problems()] + module_problems(recipe, plan)
    if recipe.training.lr_schedule != "constant":
        problems.append(
            f"training.lr_schedule={recipe.training.lr_schedule!r}: this entry trains "
            "with a constant learning rate"
        )
    try:
        num_microbatches(recipe, plan)
        for name in plan.modules:
            plan.micro_batch_size(name, recipe.training.micro_batch_size)
    except ValueError as error:
        problems.append(str(error))
    return problems


def output_width(module: Module) -> int:
    """Width of what a module's last stage hands on: its hidden_size. A vision_encoder's
    [s, b, h] (or flattened [b*s, h]) and a projector's Linear(h, h) keep h; mHC streams are
    contracted back to h before a language model's final norm, never sent over a bridge."""
    return module.hidden_size


def _bridge_width_problems(modules: dict[str, Module], plan: MultiModulePlan) -> list[str]:
    # The LLM's first stage concatenates every predecessor's [s, b, h] with its text
    # embeddings along the sequence (vlm.language_model_impl) and a projector is a
    # Linear(h, h): both need the predecessor's width. A mismatch fails only on the
    # receiving rank, after every rank has started (the issue saw the run hang).
    problems = []
    for src, dst in plan.edges:
        sent, taken = output_width(modules[src]), modules[dst].hidden_size
        if sent != taken:
            problems.append(
                f"bridge {src} -> {dst}: {src!r} hands on hidden_size {sent} but {dst!r} takes "
                f"hidden_size {taken}; set model.modules.{src}.hidden_size={taken} or "
                f"model.modules.{dst}.hidden_size={sent} (a projector maps h to h, so it must "
                "match both neighbours)"
            )
    return problems


def _size_problems(name: str, m: Module) -> list[str]:
    field = f"model.modules.{name}"
    layers, hidden, heads = m.num_layers, m.hidden_size, m.num_attention_heads
    positive = dict(num_layers=layers, hidden_size=hidden, num_attention_heads=heads)
    if m.kind == "vision_encoder":
        positive["patch_dim"] = m.patch_dim
    problems = [
        f"{field}.{key}={value} must be >= 1" for key, value in positive.items() if value < 1
    ]
    if problems:
        return problems
    if m.kind != "projector":  # a projector is one Linear: no layers, heads or stages
        if layers % m.pp:
            problems.append(
                f"{field}.num_layers={layers} does not divide over its pp={m.pp} stages "
                "(a stage would build a different number of layers than planned); make "
                "num_layers a multiple of pp"
            )
        if hidden % heads:
            problems.append(
                f"{field}.hidden_size={hidden} is not a multiple of num_attention_heads="
                f"{heads}; pick heads that divide the hidden size"
            )
        if heads % m.tp:
            problems.append(
                f"{field}.num_attention_heads={heads} does not split over tp={m.tp}; make it "
                "a multiple of tp"
            )
    return problems


def _image_problems(name: str, m: Module) -> list[str]:
    lengths = m.image_lengths
    if not lengths or any(int(n) < 1 for n in lengths):
        return [
            f"model.modules.{name}.image_lengths={list(lengths)} must be a non-empty list of "
            "image token counts >= 1 (one per micro-batch, cycled)"
        ]
    return []


# mHC fields this entry does not build (a recipe setting them would train without them).
_UNUSED_MHC = {
    "recompute": False,
    "recompute_layer_num": None,
    "fused": False,
}


def _mhc_problems(name: str, m: Module) -> list[str]:
    mhc, field = m.mhc, f"model.modules.{name}.mhc"
    if not mhc.enabled:
        return []
    if m.kind != "language_model":
        return [
            f"{field}.enabled: only the language_model builds mHC residual streams; the "
            f"{m.kind} would silently train without them. Remove {field}"
        ]
    problems = [
        f"{field}.{key}={getattr(mhc, key)} must be >= 1"
        for key in ("num_residual_streams", "sinkhorn_iterations")
        if getattr(mhc, key) < 1
    ]
    problems += [
        f"{field}.{key}={getattr(mhc, key)!r} is not supported by {ENTRY} (it "
        f"would be ignored); remove it"
        for key, default in _UNUSED_MHC.items()
        if getattr(mhc, key) != default
    ]
    return problems


def _output_ndim_problems(name: str, m: Module) -> list[str]:
    # The built encoder reports 2 when flattening, else 3; a different plan value fails
    # the build on every rank after start-up (MultiModuleBuildError).
    declared, flatten = m.output_ndim, bool(m.flatten_output)
    if declared is None or declared == (2 if flatten else 3):
        return []
    return [
        f"model.modules.{name}.output_ndim={declared} contradicts flatten_output={flatten} "
        f"(the encoder hands on {'[b*s, h]' if flatten else '[s, b, h]'}); set output_ndim="
        f"{2 if flatten else 3} or leave it unset"
    ]


def module_problems(recipe: Recipe, plan: MultiModulePlan) -> list[str]:
    """Module settings that the plan accepts but that fail or train wrong after ranks start:
    sizes, image lengths, an encoder's output_ndim, mHC settings this entry would ignore,
    widths across each bridge."""
    modules = recipe.model.modules or {}
    problems = []
    for name, m in modules.items():
        problems += _size_problems(name, m)
        if m.kind == "vision_encoder":
            problems += _image_problems(name, m) + _output_ndim_problems(name, m)
        problems += _mhc_problems(name, m)
    return problems + _bridge_width_problems(modules, plan)
