"""The recipe schema, version 1: named, typed fields with defaults, and their checking.

A recipe is YAML with the sections below (recipes/README.md documents every field). Each
section is a dataclass; :func:`build` turns a plain mapping into a :class:`Recipe` and
collects every structural problem (unknown key, wrong type, value outside its choices) as a
:class:`Problem` with the dotted path of the field, instead of stopping at the first one.

Nothing here imports torch or megatron: loading and checking a recipe is instant.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from megatron_ext.errors import MegatronExtError, Problem, suggestion
from megatron_ext.mhc_flags import MHC_DEFAULTS
from megatron_ext.parallel_plan import ParallelPlan

SCHEMA_VERSION = 1
"""The schema version this megatron-ext reads; a recipe states it as ``version: 1``."""

MODEL_TYPES = ("gpt", "hybrid", "multimodule")
DEFAULT_ENTRIES = {"gpt": "megatron_ext.pretrain_gpt", "hybrid": "megatron_ext.pretrain_hybrid"}
"""The training module each model type runs when the recipe names none (``model.entry``)."""


class RecipeError(MegatronExtError, ValueError):
    """A recipe that cannot be used; ``problems`` lists every reason, one per line."""

    def __init__(self, source: str, problems: list[Problem]):
        self.source = source
        self.problems = list(problems)
        super().__init__("\n".join(f"{source}: {p}" for p in self.problems))


class RecipeFieldError(MegatronExtError, ValueError):
    """A recipe value that a helper given the recipe (not its file) cannot use: a layout
    symbol, a multi-module plan, a batch that does not split. The message names the dotted
    field; whoever knows the file reports it (``RecipeError`` carries the file itself)."""


def _doc(text: str, **kwargs: Any) -> Any:
    return field(metadata={"doc": text}, **kwargs)


# ---- sections ------------------------------------------------------------------------------------
@dataclass
class MHC:
    """Manifold-constrained hyper-connections (upstream Megatron-LM's mHC flags)."""

    # Defaults: MHCTransformerConfig's, from the one declaration both read.
    enabled: bool = _doc("--enable-mhc-connections", default=MHC_DEFAULTS["enable_mhc_connections"])
    num_residual_streams: int = _doc(
        "--mhc-num-residual-streams (n)", default=MHC_DEFAULTS["mhc_num_residual_streams"]
    )
    sinkhorn_iterations: int = _doc(
        "--mhc-sinkhorn-iterations", default=MHC_DEFAULTS["mhc_sinkhorn_iterations"]
    )
    h_res_method: Literal["sinkhorn", "birkhoff"] = _doc(
        "--mhc-h-res-method (birkhoff: mHC-lite, exact doubly-stochastic H_res, n <= 6)",
        default=MHC_DEFAULTS["mhc_h_res_method"],
    )
    variant: Literal["megatron", "deepseek-v4", "glm5"] = _doc(
        "--mhc-variant (deepseek-v4 / glm5: DeepSeek-V4's maps; learned / mean head)",
        default=MHC_DEFAULTS["mhc_variant"],
    )
    init_gating_factor: float = _doc(
        "--mhc-init-gating-factor", default=MHC_DEFAULTS["mhc_init_gating_factor"]
    )
    recompute: bool = _doc(
        "--recompute-granularity selective --recompute-modules mhc", default=False
    )
    recompute_layer_num: int | None = _doc(
        "--mhc-recompute-layer-num (None: one group per stage)",
        default=MHC_DEFAULTS["mhc_recompute_layer_num"],
    )
    fused: bool = _doc(
        "--use-fused-mhc (Triton kernels; CUDA only)", default=MHC_DEFAULTS["use_fused_mhc"]
    )
    single_pass: bool = _doc(
        "--mhc-single-pass (DeepSeek-V4.1: each sub-layer uses the previous one's coefficients)",
        default=MHC_DEFAULTS["mhc_single_pass"],
    )
    log_stats: bool = _doc(
        "--log-mhc-stats (mhc/... scalars: H_res residuals, H_pre/H_post ranges, gains)",
        default=False,
    )


@dataclass
class Module:
    """One module of a multimodule recipe: its kind, its grid and its size."""

    kind: Literal["vision_encoder", "projector", "language_model"] | None = _doc(
        "what the module is (required; exactly one language_model)", default=None
    )
    tp: int = _doc("tensor-parallel size of the module's grid", default=1)
    pp: int = _doc("pipeline stages of the module", default=1)
    dp: int = _doc("data-parallel replicas of the module", default=1)
    cp: int = _doc("context-parallel size of the module's grid", default=1)
    first_rank: int = _doc("the module's first rank (its ranks are contiguous)", default=0)
    output_ndim: int | None = _doc(
        "ndim of what its last stage sends on (None: the built module's, else 3)", default=None
    )
    num_layers: int = _doc("transformer layers", default=2)
    hidden_size: int = _doc("hidden size", default=64)
    num_attention_heads: int = _doc("attention heads", default=4)
    mhc: MHC = field(default_factory=MHC, metadata={"doc": "mHC residual streams of this module"})
    patch_dim: int = _doc("vision_encoder: features per image token", default=48)
    image_lengths: list[int] = _doc(
        "vision_encoder: image tokens per micro-batch, cycled", default_factory=lambda: [8]
    )
    flatten_output: bool = _doc(
        "vision_encoder: hand on [N, h] instead of [s, b, h]", default=False
    )
    text_pattern: Literal["random", "arithmetic"] = _doc(
        "language_model: synthetic text; arithmetic is learnable", default="random"
    )


@dataclass
class Model:
    type: Literal["gpt", "hybrid", "multimodule"] = _doc(
        "which model family (and default entry)", default="gpt"
    )
    entry: str | None = _doc("python module run with -m; None: the type's default", default=None)
    num_layers: int | None = _doc("--num-layers (hybrid: derived from the pattern)", default=None)
    hidden_size: int = _doc("--hidden-size", default=64)
    ffn_hidden_size: int | None = _doc("--ffn-hidden-size (None: 4 * hidden_size)", default=None)
    num_attention_heads: int = _doc("--num-attention-heads", default=4)
    num_query_groups: int | None = _doc(
        "--num-query-groups (sets --group-query-attention)", default=None
    )
    seq_length: int = _doc("--seq-length", default=32)
    max_position_embeddings: int | None = _doc(
        "--max-position-embeddings (None: seq_length)", default=None
    )
    position_embedding: Literal["learned_absolute", "rope", "none"] = _doc(
        "--position-embedding-type (MTP needs rope or none)", default="learned_absolute"
    )
    normalization: Literal["LayerNorm", "RMSNorm"] = _doc("--normalization", default="LayerNorm")
    hidden_dropout: float = _doc("--hidden-dropout", default=0.1)
    attention_dropout: float = _doc("--attention-dropout", default=0.1)
    untie_embeddings: bool = _doc("--untie-embeddings-and-output-weights", default=False)
    transformer_impl: Literal["auto", "local", "transformer_engine"] = _doc(
        "--transformer-impl; auto: the entry's machine default (TE when importable)", default="auto"
    )
    pipeline_layout: str | None = _doc(
        "gpt: --pipeline-model-parallel-layout, e.g. 'E|tt|tt|L' (sets the virtual stages)",
        default=None,
    )
    hybrid_layer_pattern: str | None = _doc(
        "hybrid: --hybrid-layer-pattern; '|' separates pipeline segments, '/' starts MTP depths",
        default=None,
    )
    mtp_num_layers: int | None = _doc(
        "gpt: --mtp-num-layers (hybrid: the pattern's '/' depths)", default=None
    )
    num_experts: int | None = _doc("--num-experts (MoE)", default=None)
    moe_router_topk: int = _doc("--moe-router-topk", default=2)
    mhc: MHC = field(default_factory=MHC, metadata={"doc": "mHC residual streams"})
    modules: dict[str, Module] | None = _doc(
        "multimodule: the modules by name (fields: model.modules.NAME.*)", default=None
    )
    topology: dict[str, list[str]] | None = _doc(
        "multimodule: module graph, {module: [modules it feeds]}", default=None
    )
    recipe_flag: str | None = _doc(
        "multimodule: flag that hands the resolved recipe file to the entry (None: not passed)",
        default="--recipe",
    )


@dataclass
class Parallelism:
    tp: int = _doc("--tensor-model-parallel-size", default=1)
    pp: int = _doc("--pipeline-model-parallel-size", default=1)
    vpp: int | None = _doc(
        "virtual stages per pipeline rank (--num-virtual-stages-per-pipeline-rank); with a "
        "pipeline layout or hybrid '|' segments it is derived and only checked",
        default=None,
    )
    cp: int = _doc("--context-parallel-size", default=1)
    ep: int = _doc("--expert-model-parallel-size", default=1)
    sp: bool = _doc("--sequence-parallel (needs tp > 1)", default=False)
    dp: int = _doc("data-parallel replicas; world size = tp * pp * cp * dp", default=1)
    schedule: Literal["1f1b", "zb-h1"] = _doc(
        "--pipeline-schedule: 1f1b (megatron's 1F1B, interleaved when vpp gives virtual "
        "stages) or zb-h1 (zero bubble: backward split into input and weight gradients, the "
        "weight gradients fill the bubble; needs pp > 1 and no virtual stages)",
        default="1f1b",
    )
    schedule_file: str | None = _doc(
        "--pipeline-schedule-file: with schedule zb-h1, a schedule text whose order ZB-H1 "
        "runs (one line per rank, F0 B0 W0 ...; megatron-ext schedule --format text writes "
        "one), relative to the recipe file; None: the built order",
        default=None,
    )


@dataclass
class Training:
    iterations: int = _doc("--train-iters", default=10)
    micro_batch_size: int = _doc("--micro-batch-size", default=2)
    global_batch_size: int = _doc("--global-batch-size", default=8)
    lr: float = _doc("--lr", default=1.0e-3)
    min_lr: float = _doc("--min-lr", default=0.0)
    lr_schedule: Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"] = _doc(
        "--lr-decay-style", default="constant"
    )
    lr_warmup_iters: int = _doc("--lr-warmup-iters", default=0)
    lr_warmup_fraction: float | None = _doc(
        "--lr-warmup-fraction (of lr_decay_iters; instead of lr_warmup_iters)", default=None
    )
    lr_decay_iters: int | None = _doc("--lr-decay-iters (None: iterations)", default=None)
    weight_decay: float = _doc("--weight-decay", default=0.01)
    clip_grad: float = _doc("--clip-grad", default=1.0)
    seed: int = _doc("--seed", default=1234)
    dtype: Literal["fp32", "bf16", "fp16"] = _doc("--bf16 / --fp16 (fp32: neither)", default="fp32")
    eval_interval: int | None = _doc(
        "--eval-interval; None: no evaluation (--eval-iters 0)", default=None
    )
    eval_iters: int = _doc("--eval-iters when eval_interval is set", default=1)
    deterministic: bool = _doc(
        "--deterministic-mode (GPU: bitwise-reproducible kernels)", default=False
    )


@dataclass
class Tokenizer:
    type: str = _doc("--tokenizer-type", default="NullTokenizer")
    vocab_size: int | None = _doc("--vocab-size (NullTokenizer)", default=128)
    model: str | None = _doc("--tokenizer-model (a path, as data.paths)", default=None)
    vocab_file: str | None = _doc("--vocab-file", default=None)
    merge_file: str | None = _doc("--merge-file", default=None)


@dataclass
class Data:
    type: Literal["mock", "indexed"] = _doc(
        "mock: --mock-data; indexed: --data-path", default="mock"
    )
    paths: list[str] = _doc(
        "indexed: --data-path entries, 'PREFIX' or 'WEIGHT PREFIX' (PREFIX.bin/.idx); "
        "relative to the recipe, ${VAR} / ${VAR:-default} from the environment",
        default_factory=list,
    )
    valid_paths: list[str] = _doc(
        "indexed: --valid-data-path entries (as paths); with it or test_paths, paths is "
        "--train-data-path and split is not used",
        default_factory=list,
    )
    test_paths: list[str] = _doc(
        "indexed: --test-data-path entries (as paths)", default_factory=list
    )
    split: str = _doc("--split (data.paths shared by train, valid and test)", default="949,50,1")
    tokenizer: Tokenizer = field(default_factory=Tokenizer, metadata={"doc": "the tokenizer"})


@dataclass
class Test:
    type: Literal["regular", "ckpt-resume"] = _doc(
        "regular: one run; ckpt-resume: save at iterations/2 (torch_dist), resume, and the second "
        "half must equal the uninterrupted run",
        default="regular",
    )
    metrics: list[str] = _doc(
        "metrics recorded in metrics.json and compared (Megatron-LM's default list)",
        default_factory=lambda: ["lm loss", "num-zeros"],
    )
    golden_values: str | None = _doc(
        "golden-value JSON, relative to the recipe file; {name} and {platform} are filled in",
        default="golden/{name}/golden_values_{platform}.json",
    )
    tolerances: dict[str, dict[str, Any]] = _doc(
        "per-metric rule fields (deterministic, rtol, atol, max_failing_steps) over the platform's "
        "defaults (compare.py), e.g. "
        "{'lm loss': {rtol: 1.0e-3}}",
        default_factory=dict,
    )
    ckpt_format: str = _doc(
        "--ckpt-format of every checkpoint (ckpt-resume and stop-signal saves)",
        default="torch_dist",
    )


@dataclass
class Checkpoint:
    save_interval: int | None = _doc(
        "--save-interval: save every N iterations (null: at the end and on a stop signal only)",
        default=None,
    )
    most_recent_k: int | None = _doc(
        "keep the K newest complete checkpoints once the run finished (null: all)", default=None
    )
    keep_final: bool = _doc(
        "keep the checkpoint of the last iteration (false: removed once the run finished)",
        default=True,
    )
    load: str | None = _doc(
        "start from this checkpoint: a run directory, its checkpoints/, or any Megatron "
        "torch_dist checkpoint directory (megatron_ext.checkpoint.start_from)",
        default=None,
    )
    finetune: bool = _doc(
        "--finetune: load the weights only; iteration 0, fresh optimizer and scheduler",
        default=False,
    )
    load_optim: bool = _doc(
        "load the checkpoint's optimizer state (false: --no-load-optim, a fresh optimizer)",
        default=True,
    )


@dataclass
class Slurm:
    partition: str | None = _doc("#SBATCH --partition", default=None)
    account: str | None = _doc("#SBATCH --account", default=None)
    time: str = _doc("#SBATCH --time", default="00:30:00")
    gpus_per_node: int | None = _doc(
        "GPUs (= tasks) per node; None: world size / nodes", default=None
    )
    container_image: str | None = _doc("srun --container-image (pyxis/enroot)", default=None)
    container_mounts: list[str] = _doc(
        "srun --container-mounts entries (the run dir is added)", default_factory=list
    )
    sbatch_args: list[str] = _doc("extra #SBATCH options, e.g. '--exclusive'", default_factory=list)
    signal_warning_s: int = _doc(
        "#SBATCH --signal=USR1@N: the ranks save and the job requeues N s before the time limit",
        default=120,
    )
    max_requeues: int = _doc(
        "a job stopped by the warning signal requeues itself at most this often (also the bound on "
        "Slurm's requeues after a lost node; 0: a lost node ends the job)",
        default=3,
    )
    tp_within_node: bool = _doc(
        "refuse a node layout in which a tensor-parallel group spans nodes", default=False
    )


@dataclass
class Launch:
    device: Literal["cpu", "gpu"] = _doc(
        "cpu: gloo + the CPU runtime (GPUs hidden); gpu: NCCL", default="cpu"
    )
    nodes: int = _doc("nodes (Slurm); local runs use one", default=1)
    nproc: int | None = _doc(
        "ranks; None: tp * pp * cp * dp (required for multimodule)", default=None
    )
    timeout_s: int = _doc(
        "wall-clock limit of one training run; the ranks are stopped after it", default=900
    )
    stall_timeout_s: int | None = _doc(
        "no progress on any rank for this long stops the run and names the stalled rank (0: off); "
        "None: max(30 s, 10 x the slowest step)",
        default=None,
    )
    startup_timeout_s: int = _doc(
        "the stall limit during start-up, the first step and checkpoint I/O", default=300
    )
    env: dict[str, Any] = _doc(
        "environment of every rank, scalar values (cpu adds OMP_NUM_THREADS=1, CUDA_VISIBLE_DEVICES='')",
        default_factory=dict,
    )
    slurm: Slurm = field(default_factory=Slurm, metadata={"doc": "submit --slurm defaults"})


@dataclass
class Recipe:
    version: int = _doc("schema version; this megatron-ext reads 1", default=SCHEMA_VERSION)
    name: str | None = _doc("recipe name; None: the file name without .yaml", default=None)
    description: str = _doc("one paragraph: what the recipe exercises", default="")
    model: Model = field(default_factory=Model, metadata={"doc": "model"})
    parallelism: Parallelism = field(default_factory=Parallelism, metadata={"doc": "parallel plan"})
    training: Training = field(default_factory=Training, metadata={"doc": "training loop"})
    data: Data = field(default_factory=Data, metadata={"doc": "data"})
    test: Test = field(default_factory=Test, metadata={"doc": "functional test"})
    checkpoint: Checkpoint = field(
        default_factory=Checkpoint, metadata={"doc": "checkpoints of long runs"}
    )
    launch: Launch = field(default_factory=Launch, metadata={"doc": "how ranks start"})
    extra_args: dict[str, Any] = _doc(
        "more Megatron flags: {'--flag': value}; true: bare flag, false/None: left out, list: "
        "several values",
        default_factory=dict,
    )
    platforms: dict[str, Any] = _doc(
        "overlays by platform name (e.g. gpu-cluster), merged over the top-level sections",
        default_factory=dict,
    )

    # ---- derived -------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """Ranks the run starts: ``launch.nproc``, else tp * pp * cp * dp."""
        if self.launch.nproc is not None:
            return self.launch.nproc
        p = self.parallelism
        return ParallelPlan(tp=p.tp, pp=p.pp, cp=p.cp, dp_size=p.dp).world_size

    @property
    def entry(self) -> str | None:
        """The python module the ranks run."""
        return self.model.entry or DEFAULT_ENTRIES.get(self.model.type)

    @property
    def virtual_stages(self) -> int | None:
        """Virtual stages per pipeline rank the run will have (None: no interleaving)."""
        model, par = self.model, self.parallelism
        stages = None
        try:
            if model.type == "gpt" and model.pipeline_layout:
                stages = len(layout_stages(model.pipeline_layout))
            elif model.type == "hybrid" and model.hybrid_layer_pattern:
                segments = len(hybrid_segments(model.hybrid_layer_pattern)[0])
                stages = segments if segments > 1 else None
        except ValueError:
            return par.vpp
        if stages is not None:
            vpp = stages // par.pp if par.pp and stages % par.pp == 0 else None
            return vpp if vpp and vpp > 1 else None
        return par.vpp if par.vpp and par.vpp > 1 else None

    @property
    def mtp_depths(self) -> int:
        """MTP depths the run will have (a hybrid pattern's '/' parts, else mtp_num_layers)."""
        model = self.model
        if model.type == "hybrid" and model.hybrid_layer_pattern:
            return len([p for p in hybrid_segments(model.hybrid_layer_pattern)[1] if p])
        return model.mtp_num_layers or 0

    @property
    def parallel_plan(self) -> ParallelPlan:
        """The recipe's parallel plan (a multi-module recipe's top-level sizes are not used)."""
        p = self.parallelism
        etp = self.extra_args.get("--expert-tensor-parallel-size")  # megatron's default: tp
        return ParallelPlan(
            tp=p.tp,
            pp=p.pp,
            vpp=p.vpp,
            cp=p.cp,
            ep=p.ep,
            sp=p.sp,
            dp_size=p.dp,
            world=self.launch.nproc,
            etp=etp if isinstance(etp, int) and not isinstance(etp, bool) else None,
        )

    @property
    def resumable(self) -> bool:
        """A run that saves on a stop signal and can be resumed: a megatron.training entry (the
        multi-module entry has its own loop) outside the ckpt-resume test (which is a resume)."""
        return self.model.type != "multimodule" and self.test.type != "ckpt-resume"

    @property
    def logs_mhc_stats(self) -> bool:
        """Whether the run logs mHC stats: ``model.mhc.log_stats``, or a multi-module recipe's
        ``model.modules.<name>.mhc.log_stats``."""
        modules = self.model.modules or {}
        return self.model.mhc.log_stats or any(m.mhc.log_stats for m in modules.values())

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# The rule fields a test.tolerances entry may set (megatron_ext.runs.golden.Rule reads them).
TOLERANCE_FIELDS = ("deterministic", "rtol", "atol", "max_failing_steps")


# ---- layouts and patterns -------------------------------------------------------------------------
HYBRID_SYMBOLS = {
    "M": "Mamba",
    "G": "GDN",
    "*": "attention",
    "D": "DS attention",
    "+": "MLA",
    "-": "MLP",
    "E": "MoE",
}
LAYOUT_SYMBOLS = {"E": "embedding", "L": "loss", "t": "transformer layer", "m": "MTP layer"}


def layout_stages(layout: str) -> list[str]:
    """The stages of a --pipeline-model-parallel-layout string, unrolled: 'E|(tt|)*2,L' ->
    ['E', 'tt', 'tt', 'L']. Raises RecipeFieldError on a symbol megatron does not know."""
    text = layout.replace(",", "")
    text = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    text = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    bad = sorted({ch for ch in text if ch not in LAYOUT_SYMBOLS and ch != "|"})
    if bad:
        raise RecipeFieldError(
            f"unknown symbol(s) {', '.join(map(repr, bad))}; a layout uses "
            + ", ".join(f"{k}={v}" for k, v in LAYOUT_SYMBOLS.items())
            + " and '|'"
        )
    return text.split("|")


def hybrid_segments(pattern: str) -> tuple[list[str], list[str]]:
    """(main decoder pipeline segments, MTP depth patterns) of a --hybrid-layer-pattern."""
    main, *mtp = pattern.split("/")
    return main.split("|"), [p for p in mtp]


def hybrid_layer_count(pattern: str) -> int:
    return sum(len(s) for s in hybrid_segments(pattern)[0])


# ---- building a Recipe from a mapping -----------------------------------------------------------
def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin in (list, dict):
        return origin.__name__
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def field_type(path: str) -> Any:
    """The declared type of a dotted schema path (raises KeyError when there is none).

    Inside free-form mappings (``extra_args``, ``launch.env``, ``model.modules`` ...) any key
    is allowed and its type is ``Any``.
    """
    tp: Any = Recipe
    for part in split_path(path):
        tp = _strip_optional(tp)
        if dataclasses.is_dataclass(tp):
            # is_dataclass also admits instances; a schema annotation is always the class
            hints = _hints(typing.cast(type, tp))
            if part not in hints:
                raise KeyError(part)
            tp = hints[part]
        elif typing.get_origin(tp) is dict:
            tp = typing.get_args(tp)[1]
        elif tp is Any:
            return Any
        else:
            raise KeyError(part)
    return tp


def _strip_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def split_path(path: str) -> list[str]:
    """'test.tolerances."lm loss".rtol' -> ['test', 'tolerances', 'lm loss', 'rtol']."""
    parts, current, quoted = [], "", False
    for ch in path:
        if ch == '"':
            quoted = not quoted
        elif ch == "." and not quoted:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    if quoted or any(p == "" for p in parts):
        raise KeyError(f"malformed key {path!r}")
    return parts


def _convert(value: Any, tp: Any, where: str, problems: list[Problem]) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _convert(value, inner[0], where, problems)
    if value is None:
        problems.append(Problem(where, f"must be {_type_name(tp)}, got null"))
        return None
    if dataclasses.is_dataclass(tp):
        # is_dataclass also admits instances; a schema annotation is always the class
        return _build_dataclass(typing.cast(type, tp), value, where, problems)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            problems.append(
                Problem(where, f"must be one of {', '.join(map(repr, choices))}, got {value!r}")
            )
        return value
    if origin is list:
        if not isinstance(value, list):
            problems.append(Problem(where, f"must be a list, got {value!r}"))
            return []
        (item_type,) = typing.get_args(tp)
        return [_convert(v, item_type, f"{where}[{i}]", problems) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            problems.append(Problem(where, f"must be a mapping, got {value!r}"))
            return {}
        _, value_type = typing.get_args(tp)
        return {str(k): _convert(v, value_type, f"{where}.{k}", problems) for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            problems.append(Problem(where, f"must be true or false, got {value!r}"))
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(Problem(where, f"must be an integer, got {value!r}"))
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            problems.append(Problem(where, f"must be a number, got {value!r}"))
            return value
        if not math.isfinite(value):
            problems.append(Problem(where, f"must be a finite number, got {value!r}"))
            return value
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            problems.append(Problem(where, f"must be a string, got {value!r}"))
        return value
    return value


def _build_dataclass(cls: type, data: Any, where: str, problems: list[Problem]) -> Any:
    if not isinstance(data, dict):
        problems.append(Problem(where, f"must be a mapping, got {data!r}"))
        return cls()
    hints = _hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in hints:
            problems.append(Problem(path, "unknown key" + suggestion(str(key), known)))
            continue
        kwargs[key] = _convert(value, hints[key], path, problems)
    return cls(**kwargs)


def build(data: Any) -> tuple[Recipe, list[Problem]]:
    """A Recipe from a mapping (defaults fill what is missing) and every structural problem."""
    problems: list[Problem] = []
    recipe = _build_dataclass(Recipe, data, "", problems)
    return recipe, problems


def documented_fields(cls: type = Recipe, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """(path, type, default, doc) for every leaf field: the schema table of recipes/README.md."""
    rows = []
    instance = cls()
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        tp = _hints(cls)[f.name]
        inner = _strip_optional(tp)
        if dataclasses.is_dataclass(inner):
            # is_dataclass also admits instances; a schema annotation is always the class
            rows.extend(documented_fields(typing.cast(type, inner), path + "."))
            continue
        rows.append((path, _type_name(tp), getattr(instance, f.name), f.metadata.get("doc", "")))
    return rows


def markdown_table() -> str:
    """The field table of recipes/README.md (a unit test keeps the README equal to it)."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    def default_text(value: Any) -> str:
        if isinstance(value, str):
            return f"`{value!r}`"
        if value is None:
            return "`null`"
        if isinstance(value, bool):
            return f"`{str(value).lower()}`"
        return f"`{value}`"

    rows = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for path, type_name, default, doc in documented_fields():
        type_name = type_name.replace(" | ", " / ")
        rows.append(
            f"| `{path}` | {cell(type_name)} | {cell(default_text(default))} | {cell(doc)} |"
        )
    return "\n".join(rows)
