"""Megatron-LM's functional test cases as recipes: ``model_config.yaml`` in, a recipe out.

Megatron-LM keeps each functional test as ``tests/functional_tests/test_cases/<model>/<name>/
model_config.yaml`` with four keys, and its golden values beside it as
``golden_values_<environment>_<platform>.json`` (e.g. ``golden_values_dev_dgx_h100.json``):

- ``ENV_VARS``: the ranks' environment -> ``launch.env``;
- ``MODEL_ARGS``: Megatron flags. A flag a schema field writes (:data:`flags.FIELD_FLAGS`) goes
  to that field, never into ``extra_args``; mHC flags in either upstream spelling go to
  ``model.mhc``; flags the runner owns (``--save``, ``--load``, ``--tensorboard-dir``,
  ``--log-interval``, ...) are left to it; every other flag goes to ``extra_args``;
- ``TEST_TYPE``: ``regular`` and ``ckpt-resume`` are run; ``frozen-start``, ``frozen-resume``,
  ``release`` and ``checkpoint-consistency`` are refused with the reason;
- ``METRICS``: ``test.metrics`` (upstream's default: lm loss and num-zeros);
- ``LAUNCHER`` (``ft_launcher`` or ``torchrun``): read with a note; megatron-ext starts the ranks
  itself;
- ``MODE``: ``pretraining`` is run; ``inference`` and ``rl`` cases are refused with the reason.

Only GPT and Hybrid cases are read: the other families (BERT, T5, LLaVA, MIMO, NeMo) train
with other entry points and are refused naming them. A key given twice keeps its last value,
as upstream's loader (``yaml.safe_load``) does, with a note.

``${NAME}`` placeholders: the paths upstream's CI fills per job (``CHECKPOINT_SAVE_PATH``,
``CHECKPOINT_LOAD_PATH``, ``TENSORBOARD_PATH``, ``DATA_CACHE_PATH``, ``OUTPUT_PATH``) become
paths in the run directory; any other (``DATA_PATH``) is read from the environment. The
world size comes from the parallel sizes (tp * pp * cp; upstream takes it from its job).

The case's own sizes become a platform named after its golden files (``dgx_h100`` when there
are none). The recipe's top-level sections, the ``cpu`` platform, are the **cpu overlay**
(:func:`cpu_overlay`): the same model shrunk so it trains on a few CPU cores, every change
listed in the notes that ``validate``/``run`` print.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_ext.errors import Problem, suggestion
from megatron_ext.mhc_flags import MHC_ALIASES
from megatron_ext.parallel_plan import (
    OPTIMIZER_INSTANCES_FLAG,
    ParallelPlan,
    smallest_instances_dp,
)
from megatron_ext.recipe_flags import (
    DEFAULT_PLATFORM,
    FIELD_FLAGS,
    PATTERN_LIST_FLAGS,
    PIPELINE_SPLIT_FLAGS,
    RUNNER_FLAGS,
    layer_list,
    layer_list_text,
)

UPSTREAM_KEYS = ("ENV_VARS", "MODEL_ARGS", "TEST_TYPE", "METRICS", "LAUNCHER", "MODE")
REFUSED_KEYS = {
    "BEFORE_SCRIPT": "shell that upstream's CI runs before the job; megatron-ext never runs a "
    "recipe's shell: remove the key (and do by hand what it did, if the case needs it)",
    "AFTER_SCRIPT": "shell that upstream's CI runs after the job; megatron-ext never runs a "
    "recipe's shell: remove the key",
}
# Keys upstream's CI reads that megatron-ext does not use (notes, not problems):
# MODEL_ARGS_N is the configuration of run N of a multi-run test (tests/functional_tests/
# shell_test_utils/run_ci_test.sh: run 2 of ckpt-resume uses MODEL_ARGS_2 when present).
RUN_ARGS_KEY = re.compile(r"MODEL_ARGS_([2-5])")
IGNORED_KEYS = {
    "TEST_EVALUATION": "read by Megatron-LM's CI around the job; megatron-ext evaluates with "
    "training.eval_interval and compares test.metrics: the key is not used",
    # run_ci_test.sh: a checkpoint-consistency test reads each run's GPUS_PER_NODE here.
    "MODEL_ENV_VARS": "the GPU count of each MODEL_ARGS_N run, read by Megatron-LM's CI; "
    "megatron-ext takes the world size from the parallel sizes: the key is not used",
    # python_test_utils/compute_golden_statistics.py: the step a throughput test starts at.
    "THROUGHPUT_TEST_PARAMS": "the settings of upstream's throughput statistics; megatron-ext "
    "does not measure throughput against golden values: the key is not used",
}
SUPPORTED_MODES = ("pretraining",)
REFUSED_MODES = {
    "inference": "upstream runs it with its inference scripts (examples/inference/), not a "
    "training entry; megatron-ext runs pretraining cases",
    "rl": "upstream runs it with train_rl.py (reinforcement learning); megatron-ext runs "
    "pretraining cases",
}
LAUNCHERS = {
    "ft_launcher": "nvidia-resiliency-ext's fault-tolerant torchrun",
    "torchrun": "torchrun",
}
# Test-case families (the directory above the case) that are not GPT/Hybrid models, with the
# entry point upstream trains them with.
OTHER_FAMILIES = {
    "multimodal-llava": "a vision-language model; use Megatron-LM's pretrain_vlm.py (an encoder "
    "+ LLM pipeline with mHC is a megatron-ext multimodule recipe, e.g. "
    "recipes/multimodule_encoder_llm_mhc_pp2.yaml)",
    "mimo": "a multimodal MIMO model; use Megatron-LM's examples/mimo/train.py (an encoder + "
    "LLM pipeline with mHC is a megatron-ext multimodule recipe)",
    "bert": "a BERT model; use Megatron-LM's examples/bert/pretrain_bert.py",
    "t5": "a T5 model; use Megatron-LM's examples/t5/pretrain_t5.py",
    "gpt-nemo": "a NeMo recipe; use NeMo's `nemo llm pretrain`",
}
# Flags only a vision-language entry parses: a case carrying them is a VLM whatever its folder.
VLM_FLAGS = ("--img-h", "--img-w", "--patch-dim", "--vision-model-type")
# Asynchronous checkpoint saving: megatron's default strategy for it is nvidia-resiliency-ext's.
ASYNC_SAVE_FLAGS = ("--async-save", "--use-persistent-ckpt-worker")
ASYNC_SAVE_PACKAGE = "nvidia_resiliency_ext"
TEST_CASE_FILE = "model_config.yaml"
DEFAULT_METRICS = ["lm loss", "num-zeros"]
DEFAULT_GPU_PLATFORM = "dgx_h100"
GOLDEN_FILE = re.compile(
    r"^golden_values_(?P<env>[A-Za-z0-9]+)_(?P<platform>[A-Za-z0-9_.-]+)\.json$"
)
PREFERRED_ENVIRONMENTS = ("dev", "lts")

SUPPORTED_TEST_TYPES = ("regular", "ckpt-resume")
REFUSED_TEST_TYPES = {
    "frozen-start": "trains from a frozen checkpoint that only Megatron-LM's CI stores; "
    "run it as TEST_TYPE: regular",
    "frozen-resume": "resumes a frozen checkpoint that only Megatron-LM's CI stores; "
    "use TEST_TYPE: ckpt-resume to test save and resume",
    "release": "a full-size release run (many nodes, days) judged by release golden values, "
    "not a functional test",
    "checkpoint-consistency": "compares checkpoints of two configurations, which the runner "
    "does not do",
}

# Values upstream's CI gives per job that do not name a path (run_ci_test.sh): REPEAT is the
# repeat number (1..N_REPEAT); a megatron-ext run is one repeat, the first.
CI_VALUES = {"REPEAT": 1}

RUN_DIR_PLACEHOLDERS = {
    "CHECKPOINT_SAVE_PATH": "@RUN_DIR@/checkpoints",
    "CHECKPOINT_LOAD_PATH": "@RUN_DIR@/checkpoints",
    "TENSORBOARD_PATH": "@RUN_DIR@/tensorboard",
    "DATA_CACHE_PATH": "@RUN_DIR@/data_cache",
    "OUTPUT_PATH": "@RUN_DIR@",
}
PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")

# Both upstream spellings of the aliased mHC flags -> the model.mhc field they set.
MHC_FLAGS = {
    flag: alias.recipe_field for alias in MHC_ALIASES for flag in (alias.dev_flag, alias.main_flag)
}

# The hybrid pattern flag in both spellings: megatron-core 0.19.2 reads the deprecated
# --hybrid-override-pattern as --hybrid-layer-pattern (training/arguments.py, validate_args).
HYBRID_PATTERN_FLAGS = ("--hybrid-layer-pattern", "--hybrid-override-pattern")

# Flags that exist for GPUs only (CUDA graphs, TE's RNG tracker, fused kernels, FP8, memory
# counters of the CUDA allocator): the cpu overlay leaves them out.
GPU_ONLY_FLAGS = (
    "--cuda-graph-",
    "--te-rng-tracker",
    "--moe-grouped-gemm",
    "--moe-permute-fusion",  # Transformer Engine's fused permutation
    "--attention-backend",
    "--log-memory-to-tensorboard",
    "--data-cache-path",
    "--overlap-moe-expert-parallel-comm",
    "--use-flash-attn",
    "--fp8",
    "--tp-comm-overlap",
    "--enable-cuda-graph",
    "--external-cuda-graph",
    # Deferred weight gradients: the embedding's rides on the fused gradient accumulation (a
    # CUDA kernel), the layers' on Transformer Engine (megatron-core 0.19.2 refuses both
    # without them: TransformerConfig.__post_init__, validate_args).
    "--defer-embedding-wgrad-compute",
    "--wgrad-deferral-limit",
    "--delay-wgrad-compute",
)

# The fill-in-the-middle data set: a transformation of an indexed corpus with the tokenizer's
# FIM tokens (megatron-core 0.19.2's validate_args refuses it with mock data).
FIM_FLAGS = "--fim-"

CPU = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "seq_length": 32,
    "iterations": 8,
    "micro_batch_size": 2,
    "micro_batches": 4,
    "vocab_size": 128,
    "moe_ffn_hidden_size": 256,
}
"""The cpu overlay's sizes: those of the shipped CPU recipes (recipes/*.yaml)."""


@dataclass
class Conversion:
    """A test case read as a recipe mapping (``version: 1``, the cpu sections on top and the
    case's own sizes under ``platforms``), with what was mapped or changed and what is wrong."""

    recipe: dict
    notes: dict[str, list[str]] = field(default_factory=dict)
    """Per platform ("cpu", the GPU platform): one line per mapping decision or change."""
    problems: list[Problem] = field(default_factory=list)
    unresolved: dict[str, str] = field(default_factory=dict)
    """Placeholder variable -> the flag that uses it, for variables the environment lacks."""
    secrets: dict[str, str] = field(default_factory=dict)
    """Placeholder naming a secret (or filled with one's value) -> the flag that uses it:
    never filled in (:func:`secret_problems`)."""
    gpu_platforms: list[str] = field(default_factory=list)
    refused: bool = False
    """The case is not one megatron-ext trains (its family, mode or test type, or no flags):
    its one problem says why, and nothing else of it is read."""


def is_test_case(raw: Any) -> bool:
    """Whether a parsed YAML document is in Megatron-LM's test-case format."""
    return isinstance(raw, dict) and "version" not in raw and "MODEL_ARGS" in raw


# ---- golden files ----------------------------------------------------------------------------------
def golden_files(case_dir: Path) -> dict[str, list[str]]:
    """platform -> its golden-value file names in ``case_dir`` (preferred environment first)."""
    found: dict[str, list[str]] = {}
    for path in sorted(Path(case_dir).glob("golden_values_*.json")):
        match = GOLDEN_FILE.match(path.name)
        if match:
            found.setdefault(match["platform"], []).append(path.name)

    def rank(name: str) -> int:
        match = GOLDEN_FILE.match(name)
        assert match is not None  # only names GOLDEN_FILE matched were collected
        env = match["env"]
        return (
            PREFERRED_ENVIRONMENTS.index(env)
            if env in PREFERRED_ENVIRONMENTS
            else len(PREFERRED_ENVIRONMENTS)
        )

    return {platform: sorted(names, key=rank) for platform, names in found.items()}


def golden_file(case_dir: Path, platform: str) -> str:
    """The golden file of ``platform``: upstream's naming, an existing one preferred (dev,
    then lts), else where ``--write-golden`` writes it (``golden_values_dev_<platform>.json``)."""
    names = golden_files(case_dir).get(platform)
    return names[0] if names else f"golden_values_{PREFERRED_ENVIRONMENTS[0]}_{platform}.json"


# ---- MODEL_ARGS -> sections ----------------------------------------------------------------------
def _set(data: dict, path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def _get(data: dict, path: str, default: Any = None) -> Any:
    node: Any = data
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def _secret_values(env: Mapping[str, str]) -> dict[str, str]:
    """value -> name of the environment's secrets (long enough not to match by chance)."""
    from megatron_ext.launch.shell import is_secret

    return {v: k for k, v in env.items() if is_secret(k) and len(str(v)) >= MIN_SECRET_CHARS}


MIN_SECRET_CHARS = 8
"""A secret's value shorter than this is not looked for in a filled placeholder (``1``, ``on``
would match everywhere)."""


def _substitute(value: Any, flag: str, env: Mapping[str, str], conversion: Conversion) -> Any:
    """``value`` with its ``${NAME}`` placeholders filled (run-directory paths, CI values, the
    environment). A secret is never filled in: a flag's value is written to command.sh,
    recipe.yaml, the rank logs, TensorBoard and the checkpoint's arguments (issue 40, item 14),
    so a placeholder naming a secret, or filled with a secret's value, is a problem."""
    from megatron_ext.launch.shell import is_secret

    if isinstance(value, list):
        return [_substitute(v, flag, env, conversion) for v in value]
    if not isinstance(value, str):
        return value
    whole = PLACEHOLDER.fullmatch(value)
    if whole and whole.group(1) in CI_VALUES:  # "--seed: ${REPEAT}" is the number itself
        return CI_VALUES[whole.group(1)]

    def fill(match: re.Match) -> str:
        name = match.group(1)
        if name in RUN_DIR_PLACEHOLDERS:
            return RUN_DIR_PLACEHOLDERS[name]
        if name in CI_VALUES:
            return str(CI_VALUES[name])
        if is_secret(name):
            conversion.secrets.setdefault(name, flag)
            return match.group(0)
        if name in env:
            if (secret := _secret_values(env).get(str(env[name]))) is not None:
                conversion.secrets.setdefault(f"{name} (the value of {secret})", flag)
                return match.group(0)
            return env[name]
        conversion.unresolved.setdefault(name, flag)
        return match.group(0)

    return PLACEHOLDER.sub(fill, value)


def secret_problems(conversion: Conversion) -> list[Problem]:
    """One problem per MODEL_ARGS flag a secret would have been filled into."""
    return [
        Problem(
            f"MODEL_ARGS.{flag}",
            f"${{{name.split()[0]}}} would put a secret ({name}) on the ranks' command line, "
            "which is written to command.sh, recipe.yaml, the rank logs, TensorBoard and the "
            "checkpoint; remove it from MODEL_ARGS (the ranks inherit the variable from your "
            "environment)",
        )
        for name, flag in conversion.secrets.items()
    ]


def _listed(value: Any) -> Any:
    """Upstream writes several values of one flag as "[a b]" (its launcher splits them)."""
    if (
        isinstance(value, str)
        and len(value) > 2
        and value[0] == "["
        and value[-1] == "]"
        and not any(ch in value[1:-1] for ch in "[](){}")
    ):
        return value[1:-1].replace(",", " ").split()
    return value


def _module_list(value: Any) -> list[str]:
    """--recompute-modules as upstream writes it: "[mhc]", "mhc core_attn" or a list."""
    if isinstance(value, list):
        return [str(v) for v in value]
    return str(value).strip("[]").replace(",", " ").split()


def _data_paths(value: Any) -> list[str]:
    words = [str(w) for w in value] if isinstance(value, list) else str(value).split()
    if len(words) > 1 and len(words) % 2 == 0:
        try:
            float(words[0])
            return [f"{words[i]} {words[i + 1]}" for i in range(0, len(words), 2)]
        except ValueError:
            pass
    return words


def _integer(value: Any, where: str, conversion: Conversion) -> int | None:
    """An integer flag value, or None and a problem naming the flag."""
    try:
        if isinstance(value, bool) or isinstance(value, float) and not value.is_integer():
            raise ValueError(value)
        return int(value)
    except (TypeError, ValueError, OverflowError):
        conversion.problems.append(Problem(where, f"{str(value)[:60]!r} is not an integer"))
        return None


def _field_value(flag: str, value: Any) -> tuple[str, Any]:
    """(field path, value) of a flag that a schema field writes."""
    path = FIELD_FLAGS[flag]
    if flag in ("--bf16", "--fp16"):
        return path, (flag[2:] if value else "fp32")
    if flag == "--mock-data":
        return path, "mock" if value else "indexed"
    if flag == "--data-path":
        return path, _data_paths(value)
    return path, value


def _upstream_tokenizer(data: dict, notes: list[str]) -> None:
    """Pin the tokenizer fields the case leaves out, so the GPU platforms pass what upstream
    passes and never the schema's CPU defaults (NullTokenizer, vocab size 128)."""
    tokenizer = data["data"].setdefault("tokenizer", {})
    if "type" not in tokenizer and tokenizer.get("vocab_file") and tokenizer.get("merge_file"):
        tokenizer["type"] = "GPT2BPETokenizer"
        notes.append(
            "no --tokenizer-type: its --vocab-file and --merge-file are GPT-2 BPE files, so "
            "data.tokenizer.type GPT2BPETokenizer"
        )
    if tokenizer.get("type", "NullTokenizer") != "NullTokenizer":
        tokenizer.setdefault("vocab_size", None)  # the tokenizer's own size


def model_args_to_sections(
    args: dict, case: str, env: Mapping[str, str], conversion: Conversion
) -> dict:
    """The recipe sections (the case's own sizes) of ``MODEL_ARGS``."""
    data: dict = {
        "model": {"type": "gpt"},
        "parallelism": {},
        "training": {},
        "data": {},
        "test": {},
        "launch": {"device": "gpu"},
        "extra_args": {},
    }
    notes = conversion.notes.setdefault("mapping", [])
    runner_owned, layers_per_virtual_stage = [], None
    recompute_modules: list[str] | None = None
    granularity = None
    for flag, raw_value in args.items():
        where = f"MODEL_ARGS.{flag}"
        if not isinstance(flag, str) or not flag.startswith("--"):
            conversion.problems.append(
                Problem(
                    where, "MODEL_ARGS keys are Megatron flags with their dashes, e.g. --num-layers"
                )
            )
            continue
        value = _substitute(raw_value, flag, env, conversion)
        if flag not in PATTERN_LIST_FLAGS:  # a per-layer list is one value, never split
            value = _listed(value)
        if value is None or value is False:
            continue  # an unset flag: the field's (or Megatron's) default
        if flag in MHC_FLAGS:
            _set(data, f"model.mhc.{MHC_FLAGS[flag]}", value)
        elif flag == "--recompute-granularity":
            granularity = value
        elif flag == "--recompute-modules":
            recompute_modules = _module_list(value)
        elif flag == "--recompute-hyper-connections":
            recompute_modules = (recompute_modules or []) + ["mhc"]
        elif flag == "--num-layers-per-virtual-pipeline-stage":
            layers_per_virtual_stage = _integer(value, where, conversion)
        elif flag == "--group-query-attention":
            continue  # implied by model.num_query_groups
        elif flag in HYBRID_PATTERN_FLAGS:
            _set(data, "model.type", "hybrid")
            _set(data, "model.hybrid_layer_pattern", value)
            if flag != "--hybrid-layer-pattern":
                notes.append(f"{flag} -> model.hybrid_layer_pattern (its deprecated spelling)")
        elif flag == "--is-hybrid-model":
            continue  # the pattern flag makes the model hybrid
        elif flag == "--num-layers" and any(args.get(f) for f in HYBRID_PATTERN_FLAGS):
            continue  # a hybrid model's layers come from its pattern
        elif flag in FIELD_FLAGS:
            path, field_value = _field_value(flag, value)
            if flag == "--data-path" or (flag == "--mock-data" and value):
                _set(data, "data.type", "indexed" if flag == "--data-path" else "mock")
            _set(data, path, field_value)
        elif flag in RUNNER_FLAGS:
            runner_owned.append(flag)
        else:
            data["extra_args"][flag] = value
    if recompute_modules:
        if "mhc" in recompute_modules:
            _set(data, "model.mhc.recompute", True)
            rest = [m for m in recompute_modules if m != "mhc"]
            if rest:
                conversion.problems.append(
                    Problem(
                        "MODEL_ARGS.--recompute-modules",
                        f"{recompute_modules}: model.mhc.recompute covers mhc "
                        f"alone; recomputing {rest} too is not mapped",
                    )
                )
            if granularity not in (None, "selective"):
                conversion.problems.append(
                    Problem(
                        "MODEL_ARGS.--recompute-granularity",
                        f"{granularity!r} with mhc recompute; mHC recompute is selective",
                    )
                )
        else:
            data["extra_args"]["--recompute-modules"] = recompute_modules
            if granularity is not None:
                data["extra_args"]["--recompute-granularity"] = granularity
    elif granularity is not None:
        data["extra_args"]["--recompute-granularity"] = granularity
    if data["model"]["type"] == "hybrid" and _get(data, "model.mtp_num_layers") is not None:
        depths = len(
            [p for p in str(_get(data, "model.hybrid_layer_pattern", "")).split("/")[1:] if p]
        )
        if depths == _get(data, "model.mtp_num_layers"):
            del data["model"]["mtp_num_layers"]
            notes.append(
                f"--mtp-num-layers {depths}: the hybrid pattern's '/' depths say it already"
            )
    _upstream_tokenizer(data, notes)
    if _get(data, "parallelism.sp") and _get(data, "parallelism.tp", 1) == 1:
        del data["parallelism"]["sp"]
        notes.append("--sequence-parallel left out: tp is 1 (Megatron turns it off there)")
    if layers_per_virtual_stage:
        layers = _get(data, "model.num_layers") or 0
        pp = _get(data, "parallelism.pp", 1)
        if layers % (pp * layers_per_virtual_stage):
            conversion.problems.append(
                Problem(
                    "MODEL_ARGS.--num-layers-per-virtual-pipeline-stage",
                    f"{layers_per_virtual_stage} does not split {layers} layers over pp={pp}",
                )
            )
        else:
            _set(data, "parallelism.vpp", layers // (pp * layers_per_virtual_stage))
            notes.append(
                f"--num-layers-per-virtual-pipeline-stage {layers_per_virtual_stage} -> "
                f"parallelism.vpp {layers // (pp * layers_per_virtual_stage)}"
            )
    if runner_owned:
        notes.append(
            f"left to the runner: {', '.join(runner_owned)} (run directory, test type, logging)"
        )
    return data


# Sizes the world-size arithmetic and the cpu overlay compare with numbers.
NUMERIC_PATHS = (
    "model.num_layers",
    "model.hidden_size",
    "model.num_attention_heads",
    "model.seq_length",
    "parallelism.tp",
    "parallelism.pp",
    "parallelism.vpp",
    "parallelism.cp",
    "parallelism.ep",
    "parallelism.dp",
    "training.micro_batch_size",
    "training.global_batch_size",
    "training.iterations",
    "training.eval_interval",
    "data.tokenizer.vocab_size",
    "extra_args.--moe-ffn-hidden-size",
)


def _drop_non_numbers(full: dict, conversion: Conversion) -> None:
    """A size flag whose value is not a number is a problem naming the flag, and is left out
    so that the arithmetic below never meets it."""
    flags = {path: flag for flag, path in FIELD_FLAGS.items()}
    for path in NUMERIC_PATHS:
        value = _get(full, path)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if value is None or (number and math.isfinite(value)):
            continue
        where = f"MODEL_ARGS.{flags.get(path, path.rsplit('.', 1)[-1])}"
        conversion.problems.append(Problem(where, f"{str(value)[:60]!r} is not a number"))
        *parents, leaf = path.split(".")
        del _get(full, ".".join(parents))[leaf]


# ---- the cpu overlay -------------------------------------------------------------------------------
def cpu_overlay(full: dict) -> tuple[dict, list[str]]:
    """The case shrunk for a CPU (the ``cpu`` platform) and one line per change."""
    cpu = copy.deepcopy(full)
    changes: list[str] = []

    def change(path: str, new: Any, why: str) -> None:
        old = _get(cpu, path)
        if old != new:
            _set(cpu, path, new)
            changes.append(f"{path}: {old!r} -> {new!r} ({why})")

    change("launch.device", "cpu", "gloo and the CPU runtime")
    if _get(cpu, "model.transformer_impl") == "transformer_engine":
        change("model.transformer_impl", "local", "Transformer Engine needs a GPU")
    if _get(cpu, "training.dtype", "fp32") != "fp32":
        change("training.dtype", "fp32", "CPU training runs in fp32")
    if _get(cpu, "training.deterministic"):
        change("training.deterministic", False, "a GPU-kernel setting; CPU runs are deterministic")
    pp = _get(cpu, "parallelism.pp", 1)
    vpp = _get(cpu, "parallelism.vpp") or 1
    tp = _get(cpu, "parallelism.tp", 1)
    layers = _get(cpu, "model.num_layers")
    if _get(cpu, "model.type") == "gpt" and layers and not _get(cpu, "model.pipeline_layout"):
        # The embedding/loss counted as layers in the split take a layer's place each.
        counted = [f for f in PIPELINE_SPLIT_FLAGS if _get(cpu, f"extra_args.{f}")]
        target = 2 * pp * vpp - len(counted)
        if layers > target:
            change(
                "model.num_layers",
                target,
                f"two per model chunk (pp {pp} x vpp {vpp})"
                + (f", {', '.join(counted)} counted as layers" if counted else ""),
            )
    new_layers = _get(cpu, "model.num_layers")
    if layers and new_layers != layers:
        for flag in PATTERN_LIST_FLAGS:
            changes += _shrunk_layer_list(cpu.get("extra_args", {}), flag, layers, new_layers)
    if (_get(cpu, "model.hidden_size") or 0) > CPU["hidden_size"]:
        change("model.hidden_size", CPU["hidden_size"], "CPU size")
    heads = max(CPU["num_attention_heads"], tp)
    if (_get(cpu, "model.num_attention_heads") or 0) > heads:
        change("model.num_attention_heads", heads, "CPU size")
    if _get(cpu, "model.num_query_groups"):
        change("model.num_query_groups", tp, "divides the heads, divisible by tp")
    if _get(cpu, "model.ffn_hidden_size"):
        change("model.ffn_hidden_size", None, "4 x hidden_size")
    if "--moe-ffn-hidden-size" in cpu.get("extra_args", {}):
        if cpu["extra_args"]["--moe-ffn-hidden-size"] > CPU["moe_ffn_hidden_size"]:
            change("extra_args.--moe-ffn-hidden-size", CPU["moe_ffn_hidden_size"], "CPU size")
    if (_get(cpu, "model.seq_length") or 0) > CPU["seq_length"]:
        change("model.seq_length", CPU["seq_length"], "CPU size")
        if _get(cpu, "model.max_position_embeddings"):
            change("model.max_position_embeddings", None, "= seq_length")
    dp = _get(cpu, "parallelism.dp", 1)
    micro = CPU["micro_batch_size"]
    if (_get(cpu, "training.micro_batch_size") or 0) > micro:
        change("training.micro_batch_size", micro, "CPU size")
    gbs = _get(cpu, "training.global_batch_size")
    mbs = _get(cpu, "training.micro_batch_size", 2)
    if gbs and gbs > mbs * dp * CPU["micro_batches"]:
        change(
            "training.global_batch_size",
            mbs * dp * CPU["micro_batches"],
            f"{CPU['micro_batches']} micro-batches per iteration",
        )
    if (_get(cpu, "training.iterations") or 0) > CPU["iterations"]:
        change("training.iterations", CPU["iterations"], "a short CPU run")
    eval_interval = _get(cpu, "training.eval_interval")
    if eval_interval and eval_interval > _get(cpu, "training.iterations", CPU["iterations"]) // 2:
        change("training.eval_interval", None, "no evaluation in a short CPU run")
    if _get(cpu, "data.type") == "indexed":
        change("data.type", "mock", "upstream's data sets are not here")
        change("data.paths", [], "mock data")
        changes += _without_fim(cpu.get("extra_args", {}))
    for key in ("model", "vocab_file", "merge_file"):
        if _get(cpu, f"data.tokenizer.{key}"):
            change(f"data.tokenizer.{key}", None, "NullTokenizer")
    if _get(cpu, "data.tokenizer.type", "NullTokenizer") != "NullTokenizer":
        change("data.tokenizer.type", "NullTokenizer", "mock data")
    if (_get(cpu, "data.tokenizer.vocab_size") or CPU["vocab_size"] + 1) > CPU["vocab_size"]:
        change("data.tokenizer.vocab_size", CPU["vocab_size"], "CPU size")
    iterations = _get(cpu, "training.iterations") or CPU["iterations"]
    decay = _get(cpu, "training.lr_decay_iters")
    if decay and decay > iterations:
        warmup_fraction = _get(cpu, "training.lr_warmup_fraction")
        warmup = int(decay * warmup_fraction) if warmup_fraction else None
        change(
            "training.lr_decay_iters",
            None,
            f"decay over the {iterations} CPU iterations"
            + (
                f"; upstream's --lr-warmup-fraction {warmup_fraction} of {decay} would keep the "
                f"LR in warm-up ({warmup} iterations) for the whole run"
                if warmup and warmup >= iterations
                else ""
            ),
        )
    if (_get(cpu, "training.lr_warmup_iters") or 0) >= iterations:
        change(
            "training.lr_warmup_iters",
            max(1, iterations // 4),
            "a quarter of the CPU run; upstream's warm-up outlasts it",
        )
    extra = cpu.get("extra_args", {})
    if "--spec" in extra:
        spec = extra.pop("--spec")
        changes.append(
            f"extra_args: left out --spec {spec!r} (a GPU layer spec; the CPU run builds "
            "megatron-ext's local spec)"
        )
    async_flags = [flag for flag in ASYNC_SAVE_FLAGS if flag in extra]
    for flag in async_flags:
        del extra[flag]
    if async_flags:
        changes.append(
            f"extra_args: left out {', '.join(async_flags)} (asynchronous saving needs "
            "nvidia-resiliency-ext and CUDA; the CPU run saves synchronously)"
        )
    dropped = [flag for flag in cpu.get("extra_args", {}) if flag.startswith(GPU_ONLY_FLAGS)]
    for flag in dropped:
        del cpu["extra_args"][flag]
    if dropped:
        changes.append(f"extra_args: left out {', '.join(dropped)} (GPU only)")
    if "--moe-grouped-gemm" in dropped:
        changes += _without_moe_act_recompute(cpu.get("extra_args", {}))
    return cpu, changes


def _shrunk_layer_list(extra: dict, flag: str, layers: int, new_layers: int) -> list[str]:
    """A per-layer list of ``layers`` entries shrunk with the model to ``new_layers``: layer i
    of the CPU model takes the entry of layer i * layers // new_layers (the first layer's and
    the spread of the others kept); a list of another length is left for validate to refuse."""
    old = layer_list(extra.get(flag))
    if old is None or len(old) != layers:
        return []
    new = [old[i * layers // new_layers] for i in range(new_layers)]
    if 1 in old and 1 not in new:  # keep at least one layer of the kind the list marks
        new[-1] = 1
    extra[flag] = layer_list_text(new)
    return [
        f"extra_args.{flag}: {layers} entries -> {extra[flag]!r} (one per layer of the "
        f"{new_layers}-layer CPU model)"
    ]


def _without_fim(extra: dict) -> list[str]:
    """The FIM data set's flags, left out with the corpus they transform."""
    fim = [flag for flag in extra if flag.startswith(FIM_FLAGS)]
    for flag in fim:
        del extra[flag]
    if not fim:
        return []
    return [
        f"extra_args: left out {', '.join(fim)} (the fill-in-the-middle data set reorders an "
        "indexed corpus with its tokenizer's FIM tokens; the CPU run trains on mock data)"
    ]


def _without_moe_act_recompute(extra: dict) -> list[str]:
    """The ``moe_act`` recompute module runs on grouped GEMM's experts (megatron's
    TEGroupedMLP/GroupedMLP); with grouped GEMM left out it goes too."""
    modules = extra.get("--recompute-modules")
    listed = modules if isinstance(modules, list) else str(modules or "").split()
    if "moe_act" not in listed:
        return []
    kept = [m for m in listed if m != "moe_act"]
    if kept:
        extra["--recompute-modules"] = kept
    else:
        extra.pop("--recompute-modules", None)
        extra.pop("--recompute-granularity", None)
    return ["extra_args: left out moe_act from --recompute-modules (it needs grouped GEMM)"]


def _schema_default(defaults: Mapping[str, Any], path: str) -> Any:
    node: Any = defaults
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return copy.deepcopy(node)


def _overlay(full: dict, cpu: dict, defaults: Mapping[str, Any], prefix: str = "") -> dict:
    """What merged over ``cpu`` gives ``full``: changed values, and schema defaults (``defaults``:
    the default recipe as a mapping) for keys only the cpu sections set."""
    out: dict = {}
    for key, value in full.items():
        if isinstance(value, dict) and isinstance(cpu.get(key), dict):
            inner = _overlay(value, cpu[key], defaults, f"{prefix}{key}.")
            if inner:
                out[key] = inner
        elif key not in cpu or cpu[key] != value:
            out[key] = copy.deepcopy(value)
    for key in cpu:
        if key not in full:
            out[key] = (
                None
                if prefix.startswith("extra_args")
                else _schema_default(defaults, f"{prefix}{key}")
            )
    return out


# ---- the whole case ------------------------------------------------------------------------------
def _refusal(raw: dict, case_dir: Path, args: Any) -> Problem | None:
    """Why the case is not one megatron-ext trains, checked before anything else is read: its
    family, its MODE, its TEST_TYPE, or no flags at all. One line: the rest of such a case
    (inference flags, NeMo's keys, a frozen checkpoint's path) would only add noise."""
    other = _other_family(case_dir, args if isinstance(args, dict) else {})
    if other:
        return Problem("test case", f"not a GPT/Hybrid case ({other})")
    if "MODE" in raw:
        mode = str(raw["MODE"])
        if mode in REFUSED_MODES:
            return Problem("MODE", f"{mode!r} is not supported: {REFUSED_MODES[mode]}")
        if mode not in SUPPORTED_MODES:
            return Problem(
                "MODE", f"unknown mode {mode!r}; megatron-ext runs {', '.join(SUPPORTED_MODES)}"
            )
    test_type = _test_type(raw)
    if test_type in REFUSED_TEST_TYPES:
        return Problem(
            "TEST_TYPE", f"{test_type!r} is not supported: {REFUSED_TEST_TYPES[test_type]}"
        )
    if test_type not in SUPPORTED_TEST_TYPES:
        return Problem(
            "TEST_TYPE",
            f"unknown test type {test_type!r}; megatron-ext runs {', '.join(SUPPORTED_TEST_TYPES)}",
        )
    if args is None or args == {}:
        return Problem(
            "MODEL_ARGS",
            "empty: the case gives no Megatron flags (upstream's CI runs such a case with a "
            "script of its own, not a training entry); nothing to train",
        )
    return None


def _test_type(raw: dict) -> str:
    """TEST_TYPE without a trailing comment (absent: regular)."""
    return str(raw.get("TEST_TYPE", "regular")).split("#")[0].strip()


def _merged_into_model_args(value: Any, args: Any) -> bool:
    """Whether a key holds flags that MODEL_ARGS merges in (``BASE_MODEL_ARGS: &BASE`` then
    ``MODEL_ARGS: {<<: *BASE, ...}``): YAML resolves the merge, so each of its flags is in
    MODEL_ARGS, and upstream's CI reads them there."""
    if not isinstance(value, dict) or not value or not isinstance(args, dict):
        return False
    return all(isinstance(flag, str) and flag.startswith("--") for flag in value) and all(
        flag in args for flag in value
    )


def _launcher_note(raw: dict, conversion: Conversion) -> None:
    """LAUNCHER: a note (megatron-ext starts the ranks itself)."""
    if "LAUNCHER" in raw:
        launcher = str(raw["LAUNCHER"])
        what = LAUNCHERS.get(launcher, "upstream's CI launcher")
        conversion.notes.setdefault("mapping", []).append(
            f"LAUNCHER {launcher}: upstream starts the ranks with {what}; megatron-ext starts "
            "them itself (torchrun locally, srun under Slurm)"
        )


def _other_family(case_dir: Path, args: dict) -> str | None:
    """Why the case is not a GPT/Hybrid model (None when it is one)."""
    family = case_dir.parent.name
    if family in OTHER_FAMILIES:
        return f"{family}: {OTHER_FAMILIES[family]}"
    vision = [flag for flag in VLM_FLAGS if flag in args]
    if vision:
        return f"{', '.join(vision)} in MODEL_ARGS: {OTHER_FAMILIES['multimodal-llava']}"
    return None


def convert(
    raw: dict,
    case_dir: Path,
    env: Mapping[str, str] | None = None,
    duplicates: tuple[str, ...] = (),
    *,
    defaults: Mapping[str, Any],
) -> Conversion:
    """A Megatron-LM test case as a recipe mapping (see the module docstring). ``duplicates``:
    the keys the file gives twice (``section.key``), noted (the last value is read);
    ``defaults``: the default recipe as a mapping (``Recipe().to_dict()``: the schema is the
    caller's, handed in so that this package imports nothing of ``recipes/``), which a GPU
    platform resets the keys to that only the cpu overlay sets."""
    env = os.environ if env is None else env
    case_dir = Path(case_dir)
    conversion = Conversion(recipe={})
    args = raw.get("MODEL_ARGS")
    refusal = _refusal(raw, case_dir, args)
    if refusal is not None:
        conversion.problems.append(refusal)
        conversion.refused = True
        return conversion
    for key in duplicates:
        conversion.notes.setdefault("mapping", []).append(
            f"{key} is given twice: the last value is used, as upstream's loader (yaml.safe_load) "
            "does"
        )
    for key in raw:
        if key in REFUSED_KEYS:
            conversion.problems.append(Problem(str(key), f"not supported: {REFUSED_KEYS[key]}"))
        elif key in IGNORED_KEYS:
            conversion.notes.setdefault("mapping", []).append(f"{key}: {IGNORED_KEYS[key]}")
        elif isinstance(key, str) and RUN_ARGS_KEY.fullmatch(key):
            _run_args_key(raw, key, conversion)
        elif _merged_into_model_args(raw.get(key), args):
            conversion.notes.setdefault("mapping", []).append(
                f"{key}: its flags are merged into MODEL_ARGS (a YAML anchor merged with '<<'), "
                "and read there"
            )
        elif key not in UPSTREAM_KEYS:
            conversion.problems.append(
                Problem(
                    str(key),
                    "not a Megatron-LM test-case key" + suggestion(str(key), list(UPSTREAM_KEYS)),
                )
            )
    if not isinstance(args, dict):
        conversion.problems.append(
            Problem("MODEL_ARGS", "must be a mapping of Megatron flags to values")
        )
        args = {}
    _launcher_note(raw, conversion)
    case = case_dir.parent.name if case_dir.parent.name else ""
    full = model_args_to_sections(args, case, env, conversion)
    conversion.problems += secret_problems(conversion)

    env_vars = raw.get("ENV_VARS") or {}
    if not isinstance(env_vars, dict):
        conversion.problems.append(
            Problem("ENV_VARS", "must be a mapping of variable names to values")
        )
        env_vars = {}
    full["launch"]["env"] = {
        str(k): (str(v).lower() if isinstance(v, bool) else v) for k, v in env_vars.items()
    }

    full["test"]["type"] = _test_type(raw)
    metrics = raw.get("METRICS", DEFAULT_METRICS)
    if not isinstance(metrics, list):
        conversion.problems.append(Problem("METRICS", "must be a list of metric names"))
        metrics = DEFAULT_METRICS
    full["test"]["metrics"] = [str(m) for m in metrics]
    if "num-zeros" in metrics and not args.get("--log-num-zeros-in-grad"):
        conversion.notes.setdefault("mapping", []).append(
            "num-zeros in METRICS: the runner adds --log-num-zeros-in-grad"
        )

    _drop_non_numbers(full, conversion)
    dp = math.lcm(_expert_dp(full), _instances_dp(full))
    if dp > 1:  # the expert grid / the optimizer instances divide the world only so
        _set(full, "parallelism.dp", dp)
    cpu, changes = cpu_overlay(full)
    goldens = golden_files(case_dir)
    conversion.gpu_platforms = [p for p in goldens if p != DEFAULT_PLATFORM] or [
        DEFAULT_GPU_PLATFORM
    ]
    cpu["test"]["golden_values"] = golden_file(case_dir, DEFAULT_PLATFORM)
    overlay = _overlay(full, cpu, defaults)
    platforms = {}
    for platform in conversion.gpu_platforms:
        platforms[platform] = {
            **copy.deepcopy(overlay),
            "test": {**overlay.get("test", {}), "golden_values": golden_file(case_dir, platform)},
        }
    conversion.recipe = {
        "version": 1,
        "name": case_dir.name or None,
        "description": f"Megatron-LM functional test case {case_dir.name} "
        f"(imported from {TEST_CASE_FILE})",
        **cpu,
        "platforms": platforms,
    }
    mapping = conversion.notes.setdefault("mapping", [])
    tp, pp, cp = (_get(full, f"parallelism.{k}", 1) for k in ("tp", "pp", "cp"))
    dp = _get(full, "parallelism.dp", 1)
    sizes = {"tp": tp, "pp": pp, "cp": cp, "dp": dp}
    bad = {k: v for k, v in sizes.items() if not isinstance(v, int) or v < 1}
    for key, value in bad.items():  # "world size -4" was written (issue 34, item 17)
        conversion.problems.append(
            Problem(f"parallelism.{key}", f"{value} is not a parallel size: give 1 or more")
        )
    if bad:
        return conversion
    world = f"world size {tp * pp * cp * dp} = tp * pp * cp * dp"
    if _get(full, "parallelism.ep", 1) > 1:
        world += (
            f" (dp {dp}: the smallest whose world the expert grid etp * ep * pp divides; "
            "upstream takes the GPU count from its job)"
        )
    elif _instances_dp(full) > 1:
        world += (
            f" (dp {dp}: the smallest whose dp * cp the "
            f"{_get(full, 'extra_args.--num-distributed-optimizer-instances')} distributed "
            "optimizer instances divide; upstream takes the GPU count from its job)"
        )
    mapping.append(world)
    conversion.notes[DEFAULT_PLATFORM] = [f"cpu overlay: {c}" for c in changes]
    return conversion


def _run_args_key(raw: dict, key: str, conversion: Conversion) -> None:
    """MODEL_ARGS_N: the same flags as MODEL_ARGS are a note; others a problem (megatron-ext
    runs every phase of a test with one command line)."""
    run = key.rsplit("_", 1)[1]
    if raw.get(key) == raw.get("MODEL_ARGS"):
        conversion.notes.setdefault("mapping", []).append(
            f"{key}: Megatron-LM's CI runs run {run} with it; it equals MODEL_ARGS"
        )
        return
    conversion.problems.append(
        Problem(
            key,
            f"Megatron-LM's CI runs run {run} of the test with these flags instead of MODEL_ARGS; "
            "megatron-ext runs every phase with MODEL_ARGS: not supported (make it equal "
            "MODEL_ARGS or remove it)",
        )
    )


def _expert_dp(full: dict) -> int:
    """The data-parallel size the imported case needs: the smallest whose world the expert
    grid divides (expert TP defaults to TP, as megatron's does), 1 without experts."""
    sizes = {k: _get(full, f"parallelism.{k}", 1) for k in ("tp", "pp", "cp", "ep")}
    etp = _get(full, "extra_args.--expert-tensor-parallel-size", None)
    if sizes["ep"] <= 1 or not all(isinstance(v, int) and v >= 1 for v in sizes.values()):
        return 1
    etp = etp if isinstance(etp, int) and not isinstance(etp, bool) and etp >= 1 else None
    return ParallelPlan(**sizes, etp=etp).smallest_expert_dp


def _instances_dp(full: dict) -> int:
    """The smallest dp whose dp * cp --num-distributed-optimizer-instances divides (1 without)."""
    instances = _get(full, f"extra_args.{OPTIMIZER_INSTANCES_FLAG}", 1)
    cp = _get(full, "parallelism.cp", 1)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (instances, cp)):
        return 1
    return smallest_instances_dp(instances, cp)


def platform_problems(conversion: Conversion, platform: str) -> list[Problem]:
    """Problems of running ``platform``: placeholders that only the environment can fill."""
    if platform == DEFAULT_PLATFORM:
        return []  # the cpu overlay uses mock data, the run directory and synchronous saves
    return [
        Problem(
            f"MODEL_ARGS.{flag}",
            f"${{{name}}} is not set; export {name} (Megatron-LM's CI sets it to its data mount)",
        )
        for name, flag in conversion.unresolved.items()
    ]


def async_save_problems(extra_args: Any) -> list[Problem]:
    """``--async-save`` (any recipe) on a machine without the package megatron saves with.
    ``extra_args`` that is not a mapping (``extra_args=null``) is the schema's problem, named
    there; nothing to add here."""
    if not isinstance(extra_args, Mapping) or not extra_args.get("--async-save"):
        return []
    if importlib.util.find_spec(ASYNC_SAVE_PACKAGE):
        return []
    return [
        Problem(
            "extra_args.--async-save",
            "needs nvidia-resiliency-ext, which this machine lacks (the run would die at start): "
            "pip install nvidia-resiliency-ext, or set extra_args.--async-save=false and "
            "extra_args.--use-persistent-ckpt-worker=false",
        )
    ]


def notes_for(conversion: Conversion, platform: str) -> list[str]:
    return conversion.notes.get("mapping", []) + (conversion.notes.get(platform, []))
