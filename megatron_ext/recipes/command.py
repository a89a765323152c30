"""The command line a recipe becomes: the exact Megatron flags after ``-m ENTRY``
(:func:`megatron_args`), the flags each ``ckpt-resume`` phase and a resumable long run add, the
ranks' environment, and the one line that says what a recipe runs (:func:`describe`).

It reads only the recipe; the checks that a recipe can fail are in
:mod:`megatron_ext.recipes.checks`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, overload

from megatron_ext.recipes.loader import LoadedRecipe
from megatron_ext.recipes.request import RECIPE_PLACEHOLDER, RUN_DIR_PLACEHOLDER
from megatron_ext.schedules.schedule import ONE_F_ONE_B

__all__ = ["RECIPE_PLACEHOLDER"]  # the run directory's recipe.yaml in a multimodule command line


# ---- the command line -----------------------------------------------------------------------------
def _flag(args: list[str], name: str, value: Any) -> None:
    if value is None or value is False:
        return
    if value is True:
        args.append(name)
    elif isinstance(value, (list, tuple)):
        args += [name, *[str(v) for v in value]]
    else:
        args += [name, _number(value)]


def _number(value: Any) -> str:
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return repr(value)  # validation refuses these; a dry run still prints them
        return repr(value) if value != int(value) or abs(value) >= 1e16 else str(value)
    return str(value)


@overload
def path_for_ranks(loaded: LoadedRecipe, text: str) -> str: ...
@overload
def path_for_ranks(loaded: LoadedRecipe, text: None) -> None: ...
@overload
def path_for_ranks(loaded: LoadedRecipe, text: str | None) -> str | None: ...
def path_for_ranks(loaded: LoadedRecipe, text: str | None) -> str | None:
    """A data or tokenizer path as the ranks get it: ``${VAR}``/``${VAR:-default}`` filled,
    relative to the recipe's directory (left as written when a variable is unset: the
    check reports it)."""
    from megatron_ext.data.checks import UnsetVariable, resolve_path

    if not text:
        return text
    try:
        return resolve_path(text, loaded.base_dir)
    except UnsetVariable:
        return text


def data_path_flags(d: Any) -> list[tuple[str, list[str]]]:
    """(flag, entries): ``--data-path`` split by data.split, or Megatron's per-split flags when
    data.valid_paths or data.test_paths is set (data.paths is then the training blend)."""
    if not (d.valid_paths or d.test_paths):
        return [("--data-path", d.paths)]
    flags = [("--train-data-path", d.paths), ("--valid-data-path", d.valid_paths)]
    return [*flags, ("--test-data-path", d.test_paths)]


def _blend_words(loaded: LoadedRecipe, entries: list[str]) -> list[str]:
    words = [entry.split() for entry in entries]
    return [w for ws in words for w in ws[:-1] + [path_for_ranks(loaded, ws[-1])] if ws]


def megatron_args(loaded: LoadedRecipe, extra: Sequence[str] = ()) -> list[str]:
    """The flags every rank's ``python -m ENTRY`` receives for this recipe (one run; the
    ckpt-resume phases append :func:`save_args` / :func:`load_args`)."""
    r = loaded.recipe
    m, p, t, d = r.model, r.parallelism, r.training, r.data
    args: list[str] = []
    if m.type != "multimodule":
        _flag(args, "--tensor-model-parallel-size", p.tp)
        _flag(args, "--pipeline-model-parallel-size", p.pp)
        if p.cp != 1:
            _flag(args, "--context-parallel-size", p.cp)
        if p.ep != 1:
            _flag(args, "--expert-model-parallel-size", p.ep)
        _flag(args, "--sequence-parallel", p.sp)
        if p.schedule != ONE_F_ONE_B:  # megatron's 1F1B needs no flag (and older runs had none)
            _flag(args, "--pipeline-schedule", p.schedule)
        if p.schedule_file:
            _flag(args, "--pipeline-schedule-file", path_for_ranks(loaded, p.schedule_file))
        if m.type == "gpt":
            _flag(args, "--num-layers", m.num_layers)
            if m.pipeline_layout:
                _flag(args, "--pipeline-model-parallel-layout", m.pipeline_layout)
            elif p.vpp and p.vpp > 1:
                _flag(args, "--num-virtual-stages-per-pipeline-rank", p.vpp)
            _flag(args, "--mtp-num-layers", m.mtp_num_layers)
        else:  # hybrid: layers, virtual stages and MTP depths come from the pattern
            _flag(args, "--hybrid-layer-pattern", m.hybrid_layer_pattern)
        _flag(args, "--hidden-size", m.hidden_size)
        _flag(args, "--ffn-hidden-size", m.ffn_hidden_size)
        _flag(args, "--num-attention-heads", m.num_attention_heads)
        if m.num_query_groups:
            _flag(args, "--group-query-attention", True)
            _flag(args, "--num-query-groups", m.num_query_groups)
        _flag(args, "--seq-length", m.seq_length)
        _flag(args, "--max-position-embeddings", m.max_position_embeddings or m.seq_length)
        _flag(args, "--position-embedding-type", m.position_embedding)
        _flag(args, "--normalization", m.normalization)
        _flag(args, "--hidden-dropout", m.hidden_dropout)
        _flag(args, "--attention-dropout", m.attention_dropout)
        _flag(args, "--untie-embeddings-and-output-weights", m.untie_embeddings)
        if m.transformer_impl != "auto":
            _flag(args, "--transformer-impl", m.transformer_impl)
        if m.num_experts:
            _flag(args, "--num-experts", m.num_experts)
            _flag(args, "--moe-router-topk", m.moe_router_topk)
        if m.mhc.enabled:
            _flag(args, "--enable-mhc-connections", True)
            _flag(args, "--mhc-num-residual-streams", m.mhc.num_residual_streams)
            _flag(args, "--mhc-sinkhorn-iterations", m.mhc.sinkhorn_iterations)
            if m.mhc.h_res_method != "sinkhorn":
                _flag(args, "--mhc-h-res-method", m.mhc.h_res_method)
            if m.mhc.variant != "megatron":
                _flag(args, "--mhc-variant", m.mhc.variant)
            _flag(args, "--mhc-init-gating-factor", m.mhc.init_gating_factor)
            if m.mhc.fused:
                _flag(args, "--use-fused-mhc", True)
            if m.mhc.single_pass:
                _flag(args, "--mhc-single-pass", True)
            if m.mhc.log_stats:
                _flag(args, "--log-mhc-stats", True)
            if m.mhc.recompute:
                args += ["--recompute-granularity", "selective", "--recompute-modules", "mhc"]
                _flag(args, "--mhc-recompute-layer-num", m.mhc.recompute_layer_num)
    elif m.recipe_flag:
        _flag(args, m.recipe_flag, RECIPE_PLACEHOLDER)  # the run dir's recipe.yaml at launch
    _flag(args, "--train-iters", t.iterations)
    _flag(args, "--micro-batch-size", t.micro_batch_size)
    _flag(args, "--global-batch-size", t.global_batch_size)
    _flag(args, "--lr", t.lr)
    _flag(args, "--min-lr", t.min_lr)
    _flag(args, "--lr-decay-style", t.lr_schedule)
    if t.lr_warmup_fraction is not None:
        _flag(args, "--lr-warmup-fraction", t.lr_warmup_fraction)
    else:
        _flag(args, "--lr-warmup-iters", t.lr_warmup_iters)
    _flag(args, "--lr-decay-iters", t.lr_decay_iters or t.iterations)
    _flag(args, "--weight-decay", t.weight_decay)
    _flag(args, "--clip-grad", t.clip_grad)
    _flag(args, "--seed", t.seed)
    _flag(args, "--bf16", t.dtype == "bf16")
    _flag(args, "--fp16", t.dtype == "fp16")
    _flag(args, "--deterministic-mode", t.deterministic)
    if t.eval_interval:
        _flag(args, "--eval-interval", t.eval_interval)
        _flag(args, "--eval-iters", t.eval_iters)
    else:
        _flag(args, "--eval-iters", 0)
    if d.type == "mock":
        _flag(args, "--mock-data", True)
    else:
        blends = {flag: _blend_words(loaded, paths) for flag, paths in data_path_flags(d)}
        for flag, words in blends.items():
            if words:  # an empty per-split flag would be an empty blend, not no blend
                _flag(args, flag, words)
        if "--data-path" in blends:  # a per-split blend has no split (megatron refuses both)
            _flag(args, "--split", d.split)
        # Megatron caches its sample indices next to the data by default; a run keeps its own.
        if "--data-cache-path" not in r.extra_args:
            _flag(args, "--data-cache-path", f"{RUN_DIR_PLACEHOLDER}/data_cache")
    _flag(args, "--tokenizer-type", d.tokenizer.type)
    _flag(args, "--vocab-size", d.tokenizer.vocab_size)
    _flag(args, "--tokenizer-model", path_for_ranks(loaded, d.tokenizer.model))
    _flag(args, "--vocab-file", path_for_ranks(loaded, d.tokenizer.vocab_file))
    _flag(args, "--merge-file", path_for_ranks(loaded, d.tokenizer.merge_file))
    if r.test.ckpt_format != "torch_dist":  # megatron's default; ckpt-resume passes it anyway
        _flag(args, "--ckpt-format", r.test.ckpt_format)
    # Every iteration logged: the metrics and golden values are per step.
    _flag(args, "--log-interval", 1)
    _flag(args, "--log-num-zeros-in-grad", "num-zeros" in r.test.metrics)
    if r.launch.device == "cpu":
        _flag(args, "--distributed-backend", "gloo")
    for name, value in r.extra_args.items():
        _flag(args, name, value)
    return [*args, *extra]


def save_args(loaded: LoadedRecipe, checkpoint_dir: str) -> list[str]:
    """ckpt-resume, first run: save at iterations/2 (and at the end), as Megatron's CI does."""
    t = loaded.recipe.training
    return [
        "--save",
        checkpoint_dir,
        "--save-interval",
        str(t.iterations // 2),
        "--ckpt-format",
        loaded.recipe.test.ckpt_format,
        "--exit-interval",
        str(t.iterations),
    ]


def long_run_args(loaded: LoadedRecipe, checkpoint_dir: str, load: bool) -> list[str]:
    """A resumable run: save every checkpoint.save_interval iterations (else at the end only)
    and on the stop signal (megatron's exit-signal handler); ``load``: continue from the
    latest complete checkpoint."""
    from megatron_ext.launch import stop_signals

    r = loaded.recipe
    args = [
        "--save",
        checkpoint_dir,
        "--save-interval",
        str(r.checkpoint.save_interval or r.training.iterations),
        "--ckpt-format",
        r.test.ckpt_format,
        *stop_signals.megatron_args(),
    ]
    if load:
        return args + ["--load", checkpoint_dir]
    if r.checkpoint.load:  # the first start of a run from another checkpoint
        from megatron_ext.checkpoint import start_from

        return args + start_from.megatron_args(r)
    return args


def load_args(loaded: LoadedRecipe, checkpoint_dir: str) -> list[str]:
    """ckpt-resume, second run: load the iterations/2 checkpoint and train to the end."""
    return ["--load", checkpoint_dir, "--ckpt-format", loaded.recipe.test.ckpt_format]


FSDP_FLAGS = ("--use-megatron-fsdp", "--use-torch-fsdp2")
"""Megatron's FSDP flags: both assert CUDA_DEVICE_MAX_CONNECTIONS is not 1."""


def run_environment(loaded: LoadedRecipe) -> dict[str, str]:
    """Variables every rank gets on top of the launcher's own (torchrun-style rank variables)."""
    from megatron_ext.data import tokenizer_files

    env: dict[str, str] = {}
    fsdp = any(loaded.recipe.extra_args.get(f) for f in FSDP_FLAGS)
    if loaded.recipe.launch.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU runtime, even where a GPU exists
        env["OMP_NUM_THREADS"] = "1"  # several ranks share few cores
    elif not fsdp:  # FSDP refuses 1 (megatron's validate_args), and wants it unset on GPU
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    if fsdp and loaded.recipe.launch.device == "cpu":
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "32"  # not 1 (the CPU runtime's default); inert
    tokenizer = loaded.recipe.data.tokenizer
    model = path_for_ranks(loaded, tokenizer.model)
    vocab, merges = (
        path_for_ranks(loaded, f) for f in (tokenizer.vocab_file, tokenizer.merge_file)
    )
    env.update(tokenizer_files.run_environment(tokenizer.type, model, vocab, merges))
    env.update({k: env_value(v) for k, v in loaded.recipe.launch.env.items()})
    return env


def env_value(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return "" if value is None else str(value)


def describe(loaded: LoadedRecipe) -> str:
    """One line: what the recipe runs."""
    r = loaded.recipe
    m, p = r.model, r.parallelism
    parts = [f"{m.type}"]
    if m.type == "gpt":
        parts.append(f"{m.num_layers}x{m.hidden_size}")
    elif m.type == "hybrid":
        parts.append(f"pattern {m.hybrid_layer_pattern!r}")
    if m.type != "multimodule":
        plan = f"tp{p.tp} pp{p.pp}"
        vpp = r.virtual_stages
        plan += f" vpp{vpp}" if vpp else ""
        plan += f" cp{p.cp}" if p.cp > 1 else ""
        plan += f" ep{p.ep}" if p.ep > 1 else ""
        plan += f" dp{p.dp}" + (" sp" if p.sp else "")
        plan += f" {p.schedule}" if p.schedule != ONE_F_ONE_B else ""
        parts.append(plan)
        if m.pipeline_layout:
            parts.append(f"layout {m.pipeline_layout!r}")
        if m.mhc.enabled:
            parts.append(
                f"mHC n={m.mhc.num_residual_streams}" + (" +recompute" if m.mhc.recompute else "")
            )
        if r.mtp_depths:
            parts.append(f"MTP {r.mtp_depths}")
    parts.append(f"{r.world_size} ranks on {r.launch.device}")
    parts.append(f"{r.training.iterations} iterations ({r.test.type})")
    return ", ".join(parts)
