"""The plan checks that need no process: :func:`plan_problems` checks the parallel plan and the
fields that depend on each other (world size, layer split over pipeline and virtual stages, the
layout and hybrid pattern, batch sizes, sequence and context parallelism, MoE, mHC, data paths,
the test's metrics and golden values) and returns every problem, each naming the fields, their
values and the fix. It reads only the recipe.

The checks that need Megatron itself (its argument validation, the TransformerConfig and
megatron-ext's guards) are in :mod:`megatron_ext.recipes.validate`.
"""

from __future__ import annotations

import importlib.util
import math
import re
import string
from dataclasses import replace
from typing import Any

from megatron_ext.errors import suggestion
from megatron_ext.launch import shell
from megatron_ext.parallel_plan import OPTIMIZER_INSTANCES_FLAG, ParallelPlan
from megatron_ext.recipe_flags import (
    PATTERN_LIST_FLAGS,
    PIPELINE_SPLIT_FLAGS,
    conflicts,
    layer_list,
)
from megatron_ext.recipes.loader import LoadedRecipe
from megatron_ext.recipes.schedule import plan_from_loaded
from megatron_ext.recipes.schema import (
    HYBRID_SYMBOLS,
    Problem,
    Recipe,
    hybrid_layer_count,
    hybrid_segments,
    layout_stages,
)
from megatron_ext.schedules.schedule import ZB_H1
from megatron_ext.schedules.text import ScheduleTextError, schedule_of

KNOWN_METRICS = (
    "lm loss",
    "num-zeros",
    "iteration-time",
    "grad-norm",
    "learning-rate",
    "mem-allocated-bytes",
    "mem-max-allocated-bytes",
    "lm loss validation",
    "lm loss test",
)
MTP_METRIC = re.compile(r"^mtp_\d+ loss$")


# ---- plan checks ---------------------------------------------------------------------------------
def plan_problems(loaded: LoadedRecipe) -> list[Problem]:
    """Every inconsistency of the recipe's fields, each with the values involved and the fix."""
    r = loaded.recipe
    problems: list[Problem] = []
    add = lambda where, what: problems.append(Problem(where, what))  # noqa: E731
    m = r.model

    for problem in r.parallel_plan.size_problems():
        add(f"parallelism.{problem.where}", problem.what)
    if problems:
        return problems

    if m.type == "multimodule":
        if not m.entry:
            add(
                "model.entry",
                "a multimodule recipe names its training module, e.g. "
                "entry: megatron_ext.pretrain_multimodule",
            )
        if r.launch.nproc is None:
            add(
                "launch.nproc",
                "a multimodule recipe states its number of ranks (the modules' "
                "grids decide it, not tp * pp * cp * dp)",
            )
        # the same field checks as every recipe kind (issue 34, item 9)
        from megatron_ext.recipes.multimodule import extra_args_problems

        _check_probabilities(r, add)
        for problem in extra_args_problems(r):
            add(problem.where, problem.what)
    else:
        _check_model(r, add)
        _check_parallel_plan(r, add)
    _check_schedule(r, add)
    _check_schedule_file(loaded, add)
    _check_training(r, add)
    _check_data(loaded, add)
    _check_test(r, add)
    if r.launch.nodes < 1 or r.world_size % r.launch.nodes:
        add("launch.nodes", f"{r.launch.nodes} nodes cannot split {r.world_size} ranks evenly")
    for name, value in r.launch.env.items():
        if isinstance(value, (dict, list)):
            shown = shell.REDACTED if shell.is_secret(name) else repr(value)  # never echo a secret
            add(f"launch.env.{name}", f"must be a string or number, got {shown}")
    for name in r.extra_args:
        if not str(name).startswith("--"):
            add(
                f"extra_args.{name}",
                "keys are Megatron flags spelled with their dashes, e.g. '--use-flash-attn'",
            )
    problems += conflicts(r.extra_args)
    return problems


def _check_probabilities(r: Recipe, add) -> None:
    """Dropout probabilities, for every model type (a multi-module run with 1.5 deadlocked)."""
    for name in ("hidden_dropout", "attention_dropout"):
        value = getattr(r.model, name)
        if (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and not 0.0 <= value < 1.0
        ):
            add(f"model.{name}", f"is a probability in [0, 1), got {value}")


def _check_model(r: Recipe, add) -> None:
    m, p = r.model, r.parallelism
    if m.type == "gpt":
        if m.hybrid_layer_pattern:
            add(
                "model.hybrid_layer_pattern",
                "is for model.type: hybrid; a GPT uses num_layers (and pipeline_layout)",
            )
        if m.num_layers is None:
            add("model.num_layers", "a GPT recipe sets num_layers")
        elif m.num_layers < 1:
            add("model.num_layers", f"must be >= 1, got {m.num_layers}")
    else:
        if m.pipeline_layout:
            add(
                "model.pipeline_layout",
                "is for GPT; a hybrid pattern places its pipeline "
                "segments with '|' (megatron rejects both together)",
            )
        if not m.hybrid_layer_pattern:
            add(
                "model.hybrid_layer_pattern",
                "a hybrid recipe sets its layer pattern, e.g. '*-*-|*-*-/*-'",
            )
        else:
            _check_hybrid_pattern(r, add)
        if m.mtp_num_layers is not None:
            add(
                "model.mtp_num_layers",
                "a hybrid model's MTP depths are the '/' parts of "
                "hybrid_layer_pattern; leave mtp_num_layers null",
            )
    if m.hidden_size % m.num_attention_heads:
        add(
            "model.hidden_size",
            f"{m.hidden_size} is not divisible by num_attention_heads ({m.num_attention_heads})",
        )
    if m.num_attention_heads % p.tp:
        add(
            "model.num_attention_heads",
            f"{m.num_attention_heads} heads do not split over tp={p.tp}",
        )
    if m.ffn_hidden_size is not None and m.ffn_hidden_size % p.tp:
        # Megatron finds this only when it builds the MLP, a minute into start-up.
        add(
            "model.ffn_hidden_size",
            f"{m.ffn_hidden_size} does not split over tp={p.tp} (the MLP's columns are "
            "divided between the tensor-parallel ranks)",
        )
    if m.num_query_groups is not None and (
        m.num_attention_heads % m.num_query_groups or m.num_query_groups % p.tp
    ):
        add(
            "model.num_query_groups",
            f"{m.num_query_groups} must divide num_attention_heads "
            f"({m.num_attention_heads}) and be divisible by tp={p.tp}",
        )
    if m.max_position_embeddings is not None and m.max_position_embeddings < m.seq_length:
        add(
            "model.max_position_embeddings",
            f"{m.max_position_embeddings} < seq_length {m.seq_length}",
        )
    if r.mtp_depths and m.position_embedding == "learned_absolute":
        add(
            "model.position_embedding",
            "multi-token prediction needs rope or none (megatron "
            "rejects learned_absolute with MTP)",
        )
    if m.num_experts is None and p.ep > 1:
        add("parallelism.ep", f"ep={p.ep} needs model.num_experts")
    if m.num_experts is not None and m.num_experts % p.ep:
        add("model.num_experts", f"{m.num_experts} experts do not split over ep={p.ep}")
    _check_probabilities(r, add)
    _check_attention_variant(r, add)
    _check_layer_lists(r, add)
    mhc = m.mhc
    if mhc.enabled:
        _check_mhc_extra_args(r, add)
    if mhc.recompute_layer_num is not None and not mhc.recompute:
        add("model.mhc.recompute_layer_num", "is only read with model.mhc.recompute: true")
    if mhc.recompute and not mhc.enabled:
        add("model.mhc.recompute", "mHC recompute needs model.mhc.enabled: true")
    if mhc.single_pass and not mhc.enabled:
        add("model.mhc.single_pass", "single-pass mHC needs model.mhc.enabled: true")


def _check_hybrid_pattern(r: Recipe, add) -> None:
    m, p = r.model, r.parallelism
    pattern = m.hybrid_layer_pattern
    assert pattern is not None  # _check_model calls this only when the pattern is set
    segments, mtp = hybrid_segments(pattern)
    bad = sorted(
        {ch for ch in pattern.replace("|", "").replace("/", "") if ch not in HYBRID_SYMBOLS}
    )
    if bad:
        add(
            "model.hybrid_layer_pattern",
            f"unknown symbol(s) {', '.join(map(repr, bad))}; known: "
            + ", ".join(f"{k}={v}" for k, v in HYBRID_SYMBOLS.items())
            + ", '|' segment, '/' MTP depth",
        )
        return
    if any("|" in depth for depth in mtp):
        add("model.hybrid_layer_pattern", "MTP depths (after '/') cannot contain '|'")
    if len(set(mtp)) > 1:
        add(
            "model.hybrid_layer_pattern", f"every MTP depth must repeat the same pattern, got {mtp}"
        )
    if m.num_layers is not None and m.num_layers != hybrid_layer_count(pattern):
        add(
            "model.num_layers",
            f"{m.num_layers} disagrees with the pattern's "
            f"{hybrid_layer_count(pattern)} layers; leave it null",
        )
    if len(segments) > 1:
        if len(segments) % p.pp:
            add(
                "model.hybrid_layer_pattern",
                f"{len(segments)} pipeline segments do not split over pp={p.pp}",
            )
        elif p.vpp is not None and p.vpp != len(segments) // p.pp:
            add(
                "parallelism.vpp",
                f"{p.vpp} disagrees with the pattern: {len(segments)} segments "
                f"over pp={p.pp} give vpp={len(segments) // p.pp}",
            )
    elif p.vpp and p.vpp > 1:
        add(
            "parallelism.vpp",
            "virtual stages of a hybrid model come from '|' segments in hybrid_layer_pattern",
        )
    if r.launch.device == "cpu":
        for symbol, what in (("M", "Mamba"), ("G", "GDN")):
            if symbol in pattern and importlib.util.find_spec("mamba_ssm") is None:
                add(
                    "model.hybrid_layer_pattern",
                    f"{what} layers ('{symbol}') need mamba_ssm's "
                    "CUDA kernels; on CPU use '*', '-' and 'E'",
                )


def _check_optimizer_instances(r: Recipe, add) -> None:
    """--num-distributed-optimizer-instances must divide dp * cp (every rank failed at start)."""
    instances = r.extra_args.get(OPTIMIZER_INSTANCES_FLAG)
    if not isinstance(instances, int) or isinstance(instances, bool) or instances <= 1:
        return
    if problem := r.parallel_plan.optimizer_instances_problem(instances):
        add("parallelism.dp", problem)
    if importlib.util.find_spec("einops") is None:  # parallel_state.create_hierarchical_groups
        add(
            f"extra_args.{OPTIMIZER_INSTANCES_FLAG}",
            f"{instances} instances: megatron-core lays out their groups with einops, which is "
            "not importable here (every rank would fail at start-up): pip install einops, or "
            "use 1",
        )


def _check_parallel_plan(r: Recipe, add) -> None:
    m, p = r.model, r.parallelism
    plan = r.parallel_plan
    for problem in plan.problems():
        add(
            "launch.nproc" if problem.where == "world_size" else f"parallelism.{problem.where}",
            problem.what,
        )
    _check_optimizer_instances(r, add)
    if p.cp > 1:
        _check_context_parallel(r, add)
    elif seq_problem := plan.seq_length_problem(m.seq_length):
        add("model.seq_length", seq_problem)
    if m.type == "gpt" and m.num_layers:
        if m.pipeline_layout:
            try:
                stages = layout_stages(m.pipeline_layout)
            except ValueError as exc:
                add("model.pipeline_layout", str(exc))
                return
            layers = sum(s.count("t") for s in stages)
            if layers != m.num_layers:
                add(
                    "model.pipeline_layout",
                    f"places {layers} transformer layers ('t'), but num_layers is {m.num_layers}",
                )
            if len(stages) % p.pp:
                add("model.pipeline_layout", f"{len(stages)} stages do not split over pp={p.pp}")
            elif p.vpp is not None and p.vpp != len(stages) // p.pp:
                add(
                    "parallelism.vpp",
                    f"{p.vpp} disagrees with the layout: {len(stages)} stages "
                    f"over pp={p.pp} give vpp={len(stages) // p.pp}",
                )
            if sum(s.count("m") for s in stages) != (m.mtp_num_layers or 0):
                add(
                    "model.pipeline_layout",
                    f"places {sum(s.count('m') for s in stages)} MTP "
                    f"layers ('m'), but mtp_num_layers is {m.mtp_num_layers}",
                )
        elif pipeline_split_flags(r.extra_args):
            if split_problem := accounted_split_problem(r):
                add("model.num_layers", split_problem)
        else:
            if layers_problem := plan.layers_problem(m.num_layers):
                add("model.num_layers", layers_problem)
            if p.vpp and p.vpp > 1 and p.pp == 1:
                add("parallelism.vpp", "virtual stages need pp > 1")


# extra_args flags ZB-H1 does not run with, and why (megatron_ext.pipeline.selection refuses
# the same settings on the command line and in a config).
ZB_H1_EXTRA_ARGS = {
    "--overlap-moe-expert-parallel-comm": (
        "its overlapped MoE schedule replaces the pipeline schedule (and delays weight "
        "gradients its own way)"
    ),
    **dict.fromkeys(
        ("--cuda-graph-impl", "--enable-cuda-graph", "--external-cuda-graph"),
        "CUDA graphs capture a whole backward, which ZB-H1 splits into input and weight gradients",
    ),
}


def _virtual_stages_source(r: Recipe) -> str:
    """The field that gives the recipe its virtual stages."""
    if r.model.type == "gpt" and r.model.pipeline_layout:
        return "model.pipeline_layout"
    if r.model.type == "hybrid" and r.model.hybrid_layer_pattern:
        return "model.hybrid_layer_pattern"
    return "parallelism.vpp"


def schedule_problems(r: Recipe) -> list[Problem]:
    """What :func:`_check_schedule` finds, for entries that load a recipe themselves."""
    problems: list[Problem] = []
    _check_schedule(r, lambda where, what: problems.append(Problem(where, what)))
    return problems


def _check_schedule(r: Recipe, add) -> None:
    """``parallelism.schedule: zb-h1`` only where ZB-H1 runs: a pipeline of more than one
    stage without virtual stages, outside multi-module recipes (whose top-level parallelism is
    not used), without the settings of :data:`ZB_H1_EXTRA_ARGS`."""
    p = r.parallelism
    if p.schedule != ZB_H1:
        return
    if r.model.type == "multimodule":
        add(
            "parallelism.schedule",
            "zb-h1 is not available for multimodule recipes (their pipeline runs megatron's "
            "1F1B across the modules' grids); set parallelism.schedule: 1f1b",
        )
        return
    if p.pp < 2:
        add(
            "parallelism.schedule",
            f"zb-h1 needs pp > 1 (pp={p.pp}: one stage has no pipeline bubble to fill); set "
            "parallelism.pp to 2 or more, or parallelism.schedule: 1f1b",
        )
    vpp = r.virtual_stages
    if vpp:
        source = _virtual_stages_source(r)
        add(
            source,
            f"gives {vpp} virtual stages per pipeline rank, but zb-h1 is a non-interleaved "
            f"schedule; remove the virtual stages from {source}, or set parallelism.schedule: "
            "1f1b (interleaved)",
        )
    for flag, why in ZB_H1_EXTRA_ARGS.items():
        if r.extra_args.get(flag) not in (None, False, "none"):
            add(
                f"extra_args.{flag}",
                f"is not supported with parallelism.schedule: zb-h1 ({why}); remove it or set "
                "parallelism.schedule: 1f1b",
            )


def _check_schedule_file(loaded: LoadedRecipe, add) -> None:
    """``parallelism.schedule_file``: with zb-h1 only, and a schedule text of this recipe's
    plan that passes every check ZB-H1 makes before running it (read here, so a bad file is
    refused before any rank starts)."""
    r = loaded.recipe
    p = r.parallelism
    if not p.schedule_file:
        return
    if p.schedule != ZB_H1:
        add(
            "parallelism.schedule_file",
            f"only ZB-H1 runs an order given as text (parallelism.schedule is {p.schedule}); "
            "set parallelism.schedule: zb-h1 or remove the file",
        )
        return
    plan, _ = plan_from_loaded(loaded)
    if replace(plan, order_file=None).problems():
        return  # reported by the schedule and batch checks
    try:
        schedule_of(plan)
    except ScheduleTextError as exc:
        add("parallelism.schedule_file", f"{p.schedule_file}: {exc}")


# Megatron flags that give attention a non-causal mask, which the local context-parallel
# attention (megatron_ext.models.context_parallel) does not support.
NON_CAUSAL_MASK_FLAGS = {
    "--reset-attention-mask": "per-document attention masks",
    "--window-size": "sliding-window attention",
}


# Flags the mHC guards refuse (megatron_ext.guards), checked in a recipe's extra_args so that a
# GPU recipe is refused here too, where Megatron's own argument checks cannot run without a GPU.
MHC_CUDA_GRAPH_FLAGS = ("--cuda-graph-impl", "--enable-cuda-graph", "--external-cuda-graph")


def _check_mhc_extra_args(r: Recipe, add) -> None:
    """The guards' mHC refusals that a recipe states in extra_args: the overlapped EP schedule
    under PP (guards.check_mhc_pipeline) and CUDA graphs (guards.check_mhc_layer_features)."""
    flag = "--overlap-moe-expert-parallel-comm"
    if r.parallelism.pp > 1 and r.extra_args.get(flag) not in (None, False):
        add(
            f"extra_args.{flag}",
            f"is not supported with mHC and pp={r.parallelism.pp}: its overlapped schedule "
            "does not carry the n-stream residual; remove it (or set pp=1)",
        )
    for flag in MHC_CUDA_GRAPH_FLAGS:
        if r.extra_args.get(flag) not in (None, False, "none"):
            add(
                f"extra_args.{flag}",
                "mHC layers are not qualified with CUDA graphs (their static inputs would be "
                "single-stream); remove it",
            )


def pipeline_split_flags(extra_args: dict) -> list[str]:
    """The accounting flags a recipe sets (they count as a layer each in the split)."""
    return [flag for flag in PIPELINE_SPLIT_FLAGS if extra_args.get(flag) not in (None, False)]


def accounted_split_problem(r: Recipe) -> str | None:
    """Why the layers do not split with the embedding/loss counted as layers (None when they
    do). megatron-core 0.19.2 (TransformerConfig.__post_init__) adds one layer per flag, needs
    the sum divisible by pp and, with virtual stages, each stage's share divisible by vpp; the
    first/last stage then build one layer fewer (transformer_block.get_num_layers_to_build)."""
    p = r.parallelism
    flags = pipeline_split_flags(r.extra_args)
    counted = (r.model.num_layers or 0) + len(flags)
    vpp = p.vpp or 1
    what = " and ".join(PIPELINE_SPLIT_FLAGS[f] for f in flags)
    if counted % p.pp == 0 and (counted // p.pp) % vpp == 0:
        return None
    return (
        f"{r.model.num_layers} layers + {len(flags)} for {what} ({', '.join(flags)}) = "
        f"{counted} do not split over pp({p.pp}) * vpp({vpp}) = {p.pp * vpp} model chunks "
        "(megatron counts them as layers): make num_layers + "
        f"{len(flags)} a multiple of {p.pp * vpp}"
    )


# megatron-core 0.19.2's experimental attention variants (TransformerConfig.
# experimental_attention_variant); both build their layers from Transformer Engine modules
# (core/models/gpt/experimental_attention_variant_module_specs.py).
ATTENTION_VARIANTS = {"gated_delta_net": "gated delta net", "dsa": "DeepSeek sparse attention"}


def _check_layer_lists(r: Recipe, add) -> None:
    """A per-layer list (``--moe-layer-freq "([0]+[1]*3)"``) has one entry per layer
    (megatron-core 0.19.2 asserts it when it builds the layers)."""
    layers = r.model.num_layers
    if r.model.type != "gpt" or not layers:
        return
    for flag in PATTERN_LIST_FLAGS:
        entries = layer_list(r.extra_args.get(flag))
        if entries is not None and len(entries) != layers:
            add(
                f"extra_args.{flag}",
                f"lists {len(entries)} layers but model.num_layers is {layers}: give one "
                "entry per layer",
            )


def _check_attention_variant(r: Recipe, add) -> None:
    variant = r.extra_args.get("--experimental-attention-variant")
    if variant in (None, False):
        return
    where = "extra_args.--experimental-attention-variant"
    if variant not in ATTENTION_VARIANTS:
        add(
            where,
            f"{variant!r} does not exist in megatron-core 0.19.2 (it has "
            f"{', '.join(ATTENTION_VARIANTS)}): the case needs a newer Megatron-LM",
        )
        return
    if r.launch.device == "cpu" or importlib.util.find_spec("transformer_engine") is None:
        add(
            where,
            f"{variant!r} ({ATTENTION_VARIANTS[variant]}) layers need Transformer Engine"
            + (" and a GPU; they do not run on CPU" if r.launch.device == "cpu" else "")
            + (
                ", which this machine lacks"
                if importlib.util.find_spec("transformer_engine") is None
                else ""
            )
            + ": remove the flag, or run on a GPU platform with transformer_engine installed",
        )


def _check_context_parallel(r: Recipe, add) -> None:
    """CP's load-balanced split needs 2 * cp equal chunks (each further split over TP under
    SP); the local CP attention supports causal masks only."""
    m, p = r.model, r.parallelism
    if seq_problem := r.parallel_plan.seq_length_problem(m.seq_length):
        add("model.seq_length", seq_problem)
    if m.transformer_impl == "transformer_engine":
        return  # Transformer Engine's own CP attention handles its masks
    for flag, what in NON_CAUSAL_MASK_FLAGS.items():
        if r.extra_args.get(flag) not in (None, False):
            add(
                f"extra_args.{flag}",
                f"{what} with cp={p.cp}: megatron-ext's local context-"
                "parallel attention supports causal masks only; remove "
                f"{flag}, set cp=1, or use transformer_impl: "
                "transformer_engine",
            )


def _check_training(r: Recipe, add) -> None:
    t = r.training
    if t.iterations < 1:
        add("training.iterations", f"must be >= 1, got {t.iterations}")
    if t.micro_batch_size < 1:
        add("training.micro_batch_size", f"must be >= 1, got {t.micro_batch_size}")
        return
    # A multi-module recipe's batch is split by each module's own dp (multimodule.plan).
    plan = r.parallel_plan if r.model.type != "multimodule" else ParallelPlan()
    if batch_problem := plan.batch_problem(t.global_batch_size, t.micro_batch_size):
        add("training.global_batch_size", batch_problem)
    if t.eval_interval is not None and t.eval_interval < 1:
        add("training.eval_interval", f"must be >= 1 or null, got {t.eval_interval}")
    if t.lr_warmup_fraction is not None:
        if not 0.0 <= t.lr_warmup_fraction <= 1.0:
            add(
                "training.lr_warmup_fraction",
                f"must be between 0 and 1, got {t.lr_warmup_fraction}",
            )
        if t.lr_warmup_iters:
            add(
                "training.lr_warmup_fraction",
                f"and lr_warmup_iters ({t.lr_warmup_iters}) are both "
                "set; Megatron takes one of them",
            )
    from megatron_ext.recipes.lr_schedule import lr_schedule_problems

    extra_args = r.extra_args if isinstance(r.extra_args, dict) else {}
    for problem in lr_schedule_problems(t, extra_args):
        add(problem.where, problem.what)
    if r.test.type == "ckpt-resume" and (t.iterations < 2 or t.iterations % 2):
        add(
            "training.iterations",
            f"ckpt-resume saves at iterations/2; use an even number >= 2, got {t.iterations}",
        )
    c, slurm = r.checkpoint, r.launch.slurm
    if c.save_interval is not None and c.save_interval < 1:
        add("checkpoint.save_interval", f"must be >= 1 (or null), got {c.save_interval}")
    if c.most_recent_k is not None and c.most_recent_k < 0:
        add("checkpoint.most_recent_k", f"must be >= 0 (or null: keep all), got {c.most_recent_k}")
    if slurm.max_requeues < 0:
        add("launch.slurm.max_requeues", f"must be >= 0, got {slurm.max_requeues}")
    if not 0 < slurm.signal_warning_s <= 65535:
        add(
            "launch.slurm.signal_warning_s",
            f"must be 1..65535 (Slurm's --signal limit), got {slurm.signal_warning_s}",
        )


def _check_data(loaded: LoadedRecipe, add) -> None:
    from megatron_ext.data import checks

    d = loaded.recipe.data
    resolved: dict[str, str | None] = {}
    for key in ("model", "vocab_file", "merge_file"):
        value = getattr(d.tokenizer, key)
        try:
            resolved[key] = checks.resolve_path(value, loaded.base_dir) if value else None
        except checks.UnsetVariable as e:
            add(f"data.tokenizer.{key}", f"{value!r}: {e}")
            return
    tokenizer_problems = checks.tokenizer_problems(
        d.tokenizer.type,
        resolved["model"],
        resolved["vocab_file"],
        resolved["merge_file"],
        where="data.tokenizer.",
    )
    for problem in tokenizer_problems:
        field, _, message = problem.partition(": ")
        add(field, message)
    note = checks.hub_note(d.tokenizer.type)
    if note and not tokenizer_problems and note not in loaded.notes:
        loaded.notes.append(note)
    fields = ("paths", "valid_paths", "test_paths")
    if d.type == "mock":
        for name in fields:
            if getattr(d, name):
                add(f"data.{name}", "set with data.type: mock; use data.type: indexed to read them")
        return
    if not d.paths:
        add("data.paths", "indexed data needs at least one PREFIX (PREFIX.bin and PREFIX.idx)")
    vocab = None
    if not tokenizer_problems:
        vocab = checks.tokenizer_vocab_size(
            d.tokenizer.type, resolved["model"], resolved["vocab_file"], d.tokenizer.vocab_size
        )
    blends = {
        name: [
            _check_data_path(loaded, f"data.{name}[{i}]", entry, vocab, add)
            for i, entry in enumerate(getattr(d, name))
        ]
        for name in fields
    }
    _check_blends(loaded, blends, add)


SAMPLE_COUNT_FLAGS = (
    "--train-samples",
    "--skip-train",
    "--full-validation",
    "--start-eval-at-iter",
    "--multiple-validation-sets",
    "--eval-global-batch-size",
    "--phase-transition-iterations",
    "--dataloader-type",
    "--mid-level-dataset-surplus",
)
"""Megatron flags (in ``extra_args``) that change how many samples each split is asked for, or
how a split is built or sampled, from what :func:`megatron_ext.data.splits.samples_needed`
assumes; with one of them the split check gives no verdict."""


def _check_blends(loaded: LoadedRecipe, blends: dict[str, list], add) -> None:
    """Weights on all entries of a blend or on none (Megatron's rule), then whether each split
    can give the run its samples (:mod:`megatron_ext.data.splits`), when every path is readable."""
    from megatron_ext.data import splits

    r = loaded.recipe
    for name, sources in blends.items():
        weighted = {s.weight is not None for s in sources if s is not None}
        if len(weighted) > 1:
            add(f"data.{name}", "give every entry a weight ('WEIGHT PREFIX') or none")
            return
    if any(s is None for sources in blends.values() for s in sources) or not blends["paths"]:
        return
    if any(flag in r.extra_args for flag in SAMPLE_COUNT_FLAGS):
        return  # Megatron sizes or loads the splits otherwise: no verdict rather than a wrong one
    t = r.training
    needed = splits.samples_needed(t.iterations, t.global_batch_size, t.eval_interval, t.eval_iters)
    fields = list(blends)  # paths, valid_paths, test_paths
    per_split = bool(blends["valid_paths"] or blends["test_paths"])
    for name, split_name in zip(blends, splits.SPLITS, strict=True):
        if not blends[name] or (name != "paths" and not per_split):
            continue
        try:
            found = splits.split_problems(
                blends[name],
                None if per_split else r.data.split,
                needed,
                r.model.seq_length,
                split_name if per_split else None,
                alone=per_split and not any(blends[n] for n in fields[1:] if n != name),
            )
        except ValueError as e:  # a split string Megatron cannot read
            add("data.split", str(e))
            return
        for where, what in found:
            add(where, what)


def _check_data_path(loaded: LoadedRecipe, where: str, entry: str, vocab, add) -> Any:
    """Problems of one 'PREFIX' / 'WEIGHT PREFIX' entry; its :class:`~megatron_ext.data.splits.
    Source` when it has none."""
    from megatron_ext.data import checks, splits

    words = entry.split()
    if len(words) not in (1, 2):
        add(where, f"{entry!r}: expected 'PREFIX' or 'WEIGHT PREFIX'")
        return None
    weight = None
    if len(words) == 2:
        try:
            weight = float(words[0])
        except ValueError:
            add(where, f"{entry!r}: the weight {words[0]!r} is not a number ('WEIGHT PREFIX')")
            return None
        if not weight > 0:
            add(where, f"{entry!r}: the weight must be positive, got {words[0]}")
            return None
    try:
        prefix = checks.resolve_path(words[-1], loaded.base_dir)
    except checks.UnsetVariable as e:
        add(where, f"{words[-1]!r}: {e}")
        return None
    missing = checks.missing_files(prefix)
    if missing:
        fix = checks.example_fix(prefix)
        fix = (
            f"; {fix}"
            if fix
            else (
                " (relative paths are relative to the recipe's directory; `megatron-ext "
                "prepare-data` makes them)"
            )
        )
        add(where, f"{' and '.join(missing)} not found{fix}")
        return None
    try:
        largest = checks.max_token_id(prefix)
        lengths = splits.read_lengths(prefix)
    except checks.IndexProblem as e:  # another dataset's .idx, a cut .idx, a FIFO...
        add(where, str(e))
        return None
    except Exception as e:  # anything else the index holds that cannot be read
        add(where, f"{prefix}: not a Megatron indexed dataset ({' '.join(str(e).split())})")
        return None
    if vocab is not None and largest is not None and largest >= vocab:
        add(
            where,
            f"{prefix}.bin holds token id {largest} but the tokenizer has {vocab} tokens; "
            "prepare the data with the recipe's tokenizer",
        )
        return None
    return splits.Source(where, prefix, weight, lengths)


def _check_test(r: Recipe, add) -> None:
    from megatron_ext.recipes.schema import TOLERANCE_FIELDS

    for metric in r.test.metrics:
        if metric not in KNOWN_METRICS and not MTP_METRIC.match(metric):
            add(
                "test.metrics",
                f"unknown metric {metric!r}; known: {', '.join(KNOWN_METRICS)}, mtp_N loss",
            )
    for metric, fields in r.test.tolerances.items():
        if metric not in r.test.metrics:
            add(f"test.tolerances.{metric}", "is not one of test.metrics")
        if not isinstance(fields, dict):
            add(
                f"test.tolerances.{metric}",
                f"is a map of {', '.join(TOLERANCE_FIELDS)}, got {fields!r}",
            )
            continue
        for key, value in fields.items():
            if key not in TOLERANCE_FIELDS:
                add(
                    f"test.tolerances.{metric}.{key}",
                    "unknown key" + suggestion(key, list(TOLERANCE_FIELDS)),
                )
            else:
                problem = _tolerance_problem(key, value)
                if problem:
                    add(f"test.tolerances.{metric}.{key}", problem)
    _check_golden_pattern(r, add)
    depths = r.mtp_depths if r.model.type != "multimodule" else 0
    for metric in r.test.metrics:
        if MTP_METRIC.match(metric) and int(metric.split("_")[1].split()[0]) > depths:
            add("test.metrics", f"{metric!r} is not logged: the model has {depths} MTP depth(s)")


def _tolerance_problem(key: str, value: Any) -> str | None:
    """What is wrong with one test.tolerances value (compare.py reads them as they are)."""
    if key == "deterministic":
        return None if isinstance(value, bool) else f"is true or false, got {value!r}"
    if key == "max_failing_steps":
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
        return None if ok else f"is a whole number of steps >= 0, got {value!r}"
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value < 0:
        return f"is a finite number >= 0, got {value!r}"
    return None


GOLDEN_FIELDS = ("name", "platform")


def _check_golden_pattern(r: Recipe, add) -> None:
    """test.golden_values is formatted with {name} and {platform} only."""
    pattern = r.test.golden_values
    if not isinstance(pattern, str):
        return
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(pattern) if f is not None]
    except ValueError as exc:
        add("test.golden_values", f"{pattern!r}: {exc} (write a literal brace as {{{{ or }}}})")
        return
    unknown = [f for f in fields if f not in GOLDEN_FIELDS]
    if unknown:
        add(
            "test.golden_values",
            f"{pattern!r}: unknown placeholder {{{unknown[0]}}}; only "
            "{name} and {platform} are filled in",
        )
