"""``megatron-ext validate``: every check a recipe can fail, before any process starts.

Three layers, each reporting every problem it finds:

1. the schema (:mod:`megatron_ext.recipes.loader`): unknown keys, types, choices, overrides;
2. the plan (:func:`megatron_ext.recipes.checks.plan_problems`): fields that depend on each other;
3. Megatron itself, in this process and without process groups: the recipe's exact command
   line goes through the entry's argument parser and ``validate_args`` (with the world size
   the run will have), then the model's TransformerConfig is built from the parsed arguments
   (:class:`megatron_ext.config.MHCTransformerConfig` runs upstream's mHC checks and
   megatron-ext's pipeline guards in ``__post_init__``), then the model-level guards of
   :mod:`megatron_ext.guards` run on it. Megatron stops at its first failed assertion, so
   this layer reports at most one problem, and only when layers 1 and 2 found none.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import importlib.util
import inspect
import io
import os
import re
import sys
import types
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from megatron_ext import registry
from megatron_ext.launch import env_policy, shell
from megatron_ext.recipes import checks, command, entries, safety
from megatron_ext.recipes.loader import LoadedRecipe
from megatron_ext.recipes.schema import DEFAULT_ENTRIES, Problem

# What a recipe's Megatron checks fall back to when its own entry module is not importable
# (e.g. a hybrid recipe before megatron_ext.pretrain_hybrid exists): Megatron's parser is the
# same, only the entry's extra flags and config class may differ.
FALLBACK_ENTRY = DEFAULT_ENTRIES["gpt"]


@dataclass
class Validation:
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def entry_importable(module: str | None) -> bool:
    """Whether ``python -m module`` would find it (finding it imports its parent packages,
    whose import-time warnings are not this question's business)."""
    if not module:
        return False
    sink = io.StringIO()
    try:
        with contextlib.redirect_stderr(sink), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


# Sizes and counts that must be at least 1 (the plan checks divide by them), and those that
# must not be negative; None (unset) is always fine.
POSITIVE_FIELDS = (
    "model.num_layers",
    "model.hidden_size",
    "model.ffn_hidden_size",
    "model.num_attention_heads",
    "model.num_query_groups",
    "model.seq_length",
    "model.max_position_embeddings",
    "model.mtp_num_layers",
    "model.num_experts",
    "model.moe_router_topk",
    "model.mhc.num_residual_streams",
    "model.mhc.recompute_layer_num",
    "parallelism.tp",
    "parallelism.pp",
    "parallelism.vpp",
    "parallelism.cp",
    "parallelism.ep",
    "parallelism.dp",
    "training.iterations",
    "training.micro_batch_size",
    "training.global_batch_size",
    "training.lr_decay_iters",
    "training.eval_interval",
    "data.tokenizer.vocab_size",
    "launch.nodes",
    "launch.nproc",
    "launch.timeout_s",
    "launch.startup_timeout_s",
    "launch.slurm.gpus_per_node",
)
NON_NEGATIVE_FIELDS = (
    "training.lr_warmup_iters",
    "training.seed",
    "training.eval_iters",
    "launch.stall_timeout_s",
)


# Upper bounds far beyond any model trained today (hidden 25,600, 128 layers, vocab 256k,
# seq 1M, lr 1e-2): a value past one is a typo, and checks below would build a plan
# (or Megatron its model) for it.
UPPER_BOUNDS = {
    "model.num_layers": 10_000,
    "model.hidden_size": 1 << 20,
    "model.ffn_hidden_size": 1 << 22,
    "model.num_attention_heads": 1 << 16,
    "model.seq_length": 1 << 24,
    "model.max_position_embeddings": 1 << 24,
    "model.mtp_num_layers": 1_000,
    "model.mhc.num_residual_streams": 1_000,
    "model.mhc.sinkhorn_iterations": 100_000,
    "model.mhc.recompute_layer_num": 10_000,  # a layer count (2**63 validated, issue 34)
    "parallelism.tp": 1 << 16,
    "parallelism.pp": 1 << 16,
    "parallelism.vpp": 1 << 16,
    "parallelism.cp": 1 << 16,
    "parallelism.ep": 1 << 16,
    "parallelism.dp": 1 << 20,
    "training.iterations": 10**10,
    "training.micro_batch_size": 1 << 24,
    "training.global_batch_size": 1 << 30,
    "training.lr_decay_iters": 10**10,
    "training.lr_warmup_iters": 10**10,
    "data.tokenizer.vocab_size": 1 << 26,
    "launch.nodes": 1 << 20,
    "launch.nproc": 1 << 16,
}
LEARNING_RATE_FIELDS = ("training.lr", "training.min_lr")
MAX_LEARNING_RATE = 100.0


def _field(loaded: LoadedRecipe, path: str) -> Any:
    node: Any = loaded.recipe
    for part in path.split("."):
        node = getattr(node, part, None)
    return node


def bound_problems(loaded: LoadedRecipe) -> list[Problem]:
    """Sizes past :data:`UPPER_BOUNDS` and learning rates that are not finite numbers in
    [0, 100]."""
    import math

    problems = []
    for path, high in UPPER_BOUNDS.items():
        value = _field(loaded, path)
        if isinstance(value, int) and not isinstance(value, bool) and value > high:
            problems.append(
                Problem(path, f"{value} is past the limit of {high}: a typo? give a real size")
            )
    for path in LEARNING_RATE_FIELDS:
        value = _field(loaded, path)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value) or not 0 <= value <= MAX_LEARNING_RATE:
                problems.append(
                    Problem(path, f"{value} is not a learning rate: give a number in [0, 100]")
                )
    extra_args = loaded.recipe.extra_args if isinstance(loaded.recipe.extra_args, dict) else {}
    for flag, value in extra_args.items():
        values = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(v, float) and not math.isfinite(v) for v in values):
            problems.append(
                Problem(
                    f"extra_args.{flag}",
                    f"{value} is not a finite number; give a number, true (a switch) or remove it",
                )
            )
    return problems


def size_problems(loaded: LoadedRecipe) -> list[Problem]:
    """Zero or negative sizes, and sizes past any real model's (:func:`bound_problems`),
    named before any check divides by them or builds anything of that size."""
    problems = bound_problems(loaded)
    for path in (*POSITIVE_FIELDS, *NON_NEGATIVE_FIELDS):
        node: Any = loaded.recipe
        for part in path.split("."):
            node = getattr(node, part, None)
        if not isinstance(node, int) or isinstance(node, bool):
            continue  # unset, or a type problem the schema reported
        low = 1 if path in POSITIVE_FIELDS else 0
        if node < low:
            problems.append(Problem(path, f"must be at least {low}, got {node}"))
    return problems


# Megatron flags that log through an optional package: without it Megatron fails on the
# last rank only, after every other rank has started.
LOGGING_FLAG_PACKAGES = {
    "--wandb-project": "wandb",
    "--wandb-exp-name": "wandb",
    "--wandb-save-dir": "wandb",
    "--wandb-entity": "wandb",
}


def _module_importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def logging_problems(loaded: LoadedRecipe) -> list[Problem]:
    """A logging flag whose package is not importable here."""
    problems = []
    for flag, package in LOGGING_FLAG_PACKAGES.items():
        if loaded.recipe.extra_args.get(flag) not in (None, False) and not _module_importable(
            package
        ):
            problems.append(
                Problem(
                    f"extra_args.{flag}",
                    f"needs the {package} package, which is not "
                    f"importable here; pip install 'megatron-ext[{package}]' "
                    "or remove the flag",
                )
            )
    return problems


# Megatron's --optimizer choices beyond adam and sgd are built by the emerging-optimizers
# package (megatron/core/optimizer/emerging_optimizers.py); without it every rank fails when
# the optimizer is built, after the model.
EMERGING_OPTIMIZERS_PACKAGE = "emerging_optimizers"


def optimizer_problems(loaded: LoadedRecipe) -> list[Problem]:
    """An --optimizer that needs the emerging-optimizers package, which is not importable."""
    extra_args = loaded.recipe.extra_args if isinstance(loaded.recipe.extra_args, dict) else {}
    optimizer = extra_args.get("--optimizer")
    if optimizer in (None, "adam", "sgd") or _module_importable(EMERGING_OPTIMIZERS_PACKAGE):
        return []
    return [
        Problem(
            "extra_args.--optimizer",
            f"{optimizer} is built by the emerging-optimizers package, which is not importable "
            "here (every rank would fail building the optimizer); pip install "
            "emerging-optimizers, or use adam",
        )
    ]


# Both FSDP flavours of megatron-core 0.19.2 build CUDA device meshes: Megatron-FSDP
# (distributed/fsdp/mcore_fsdp_adapter.py: DeviceMesh(device_type="cuda"), laid out with einops,
# which it asserts when the model is wrapped) and torch FSDP2
# (distributed/torch_fully_sharded_data_parallel.py: DeviceMesh.from_group(group, "cuda")).
# On CPU, or for Megatron-FSDP without einops, every rank fails wrapping its model.
FSDP_NAMES = {"--use-megatron-fsdp": "Megatron-FSDP", "--use-torch-fsdp2": "torch FSDP2"}
MEGATRON_FSDP_FLAG = "--use-megatron-fsdp"
EINOPS_PACKAGE = "einops"


def fsdp_problems(loaded: LoadedRecipe) -> list[Problem]:
    """FSDP on a CPU platform, or Megatron-FSDP where einops is not importable."""
    extra_args = loaded.recipe.extra_args if isinstance(loaded.recipe.extra_args, dict) else {}
    problems = []
    for flag, name in FSDP_NAMES.items():
        if not extra_args.get(flag):
            continue
        if loaded.recipe.launch.device == "cpu":
            problems.append(
                Problem(
                    f"extra_args.{flag}",
                    f"{name} builds its device mesh for CUDA (megatron-core 0.19.2): it does not "
                    "run on CPU; run it on a GPU platform, or train without it (on CPU the "
                    "distributed optimizer, --use-distributed-optimizer, shards the optimizer "
                    "state)",
                )
            )
        elif flag == MEGATRON_FSDP_FLAG and not _module_importable(EINOPS_PACKAGE):
            problems.append(
                Problem(
                    f"extra_args.{flag}",
                    f"{name} lays out its device meshes with einops, which is not importable "
                    "here (every rank would fail wrapping its model): pip install einops",
                )
            )
    return problems


def golden_notes(loaded: LoadedRecipe) -> list[str]:
    golden = loaded.golden_path()
    if golden is None:
        return ["no golden values configured (test.golden_values is null): runs are not compared"]
    if not golden.exists():
        return [
            f"no golden values at {golden}: runs are not compared until `megatron-ext run "
            f"{loaded.source} --platform {loaded.platform} --write-golden` creates them"
        ]
    return []


def _words_of(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [w for k, v in value.items() for w in (str(k), *_words_of(v))]
    if isinstance(value, (list, tuple)):
        return [w for v in value for w in _words_of(v)]
    return [str(value)]


def _rank_argv(loaded: LoadedRecipe) -> list[str]:
    """Every word the recipe may put on the ranks' command line: its Megatron flags when they
    can be derived, and every key and value of ``extra_args`` (also when they cannot)."""
    extra = loaded.recipe.extra_args if isinstance(loaded.recipe.extra_args, dict) else {}
    # a flag whose value is null or false is left off the command line, as command._flag does
    words = [
        w
        for k, v in extra.items()
        if v is not None and v is not False
        for w in (str(k), *_words_of(v))
    ]
    with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError, ZeroDivisionError):
        words += command.megatron_args(loaded)
    return words


def unused_split_note(loaded: LoadedRecipe) -> list[str]:
    """data.split set (in the file or an override) where it is not used: with valid_paths or
    test_paths, Megatron reads data.paths whole as --train-data-path and ignores --split
    (issue 41, item 6: validate said OK without a word)."""
    from megatron_ext.recipes.schema import Data

    data = loaded.recipe.data
    per_split = [name for name in ("valid_paths", "test_paths") if getattr(data, name)]
    overridden = any(o.split("=", 1)[0].strip() == "data.split" for o in loaded.overrides)
    if data.type != "indexed" or not per_split or (data.split == Data().split and not overridden):
        return []
    return [
        f"data.split {data.split!r} is not used: with data.{' and data.'.join(per_split)} set, "
        "data.paths is the whole training set (--train-data-path); remove data.split, or drop "
        f"data.{per_split[0]} to split data.paths"
    ]


def unsafe_values(loaded: LoadedRecipe) -> list[Problem]:
    """Every value of the recipe that no quoting can make safe (the rules of
    :mod:`~megatron_ext.recipes.safety` and :mod:`~megatron_ext.launch.shell`, applied to the
    recipe's names, environment keys and Slurm directives)."""
    from megatron_ext.launch.slurm import time_problem
    from megatron_ext.recipes.golden_paths import golden_values_problem

    recipe = loaded.recipe
    problems: list[Problem | None] = [
        safety.name_problem("name" if recipe.name else "name (from the file name)", loaded.name),
        safety.name_problem("platform", loaded.platform),
    ]
    for key in recipe.launch.env:
        if not shell.ENV_KEY.match(str(key)):
            problems.append(
                Problem(
                    f"launch.env.{key}",
                    f"{str(key)!r} is not an environment "
                    "variable name: use letters, digits and _, not starting with a digit",
                )
            )
    problems += env_policy.env_problems(recipe.launch.env, loaded.allowed_env)
    problems += env_policy.remote_code_problems(_rank_argv(loaded), loaded.allowed_env)
    slurm = recipe.launch.slurm
    for field_name in ("partition", "account", "time", "container_image"):
        problems.append(
            shell.directive_problem(f"launch.slurm.{field_name}", getattr(slurm, field_name))
        )
    if isinstance(slurm.time, str) and (problem := time_problem(slurm.time)):
        problems.append(Problem("launch.slurm.time", problem))
    problems.append(golden_values_problem(loaded))
    for i, value in enumerate([*slurm.sbatch_args]):
        problems.append(shell.directive_problem(f"launch.slurm.sbatch_args[{i}]", value))
    for i, value in enumerate([*slurm.container_mounts]):
        problems.append(shell.directive_problem(f"launch.slurm.container_mounts[{i}]", value))
    return [p for p in problems if p is not None]


def checkpoint_load_problems(loaded: LoadedRecipe) -> list[Problem]:
    """What ``checkpoint.load`` cannot start (another model, a layout change the optimizer
    state cannot cross: :func:`megatron_ext.checkpoint.start_from.problems`), so ``validate``
    and ``run --dry-run`` refuse what ``run`` would (issue 40, item 8). The checkpoint's
    pickles were checked before any validation reads it."""
    from megatron_ext.checkpoint import start_from

    prefix = "checkpoint.load: "
    return [
        Problem("checkpoint.load", line.removeprefix(prefix))
        if line.startswith(prefix)
        else Problem("", line)
        for line in start_from.problems(loaded.recipe)
    ]


def validate(loaded: LoadedRecipe, megatron_checks: bool = True) -> Validation:
    """Every plan check, then (when they pass) Megatron's own checks and the guards."""
    sizes = size_problems(loaded)
    if sizes:  # the plan checks would divide by them
        return Validation(problems=unsafe_values(loaded) + sizes)
    result = Validation(
        problems=unsafe_values(loaded)
        + checks.plan_problems(loaded)
        + logging_problems(loaded)
        + optimizer_problems(loaded)
        + fsdp_problems(loaded)
    )
    if not result.problems:  # the checkpoint is read only for a recipe that is right itself
        result.problems += checkpoint_load_problems(loaded)
    if not result.problems:  # worth knowing once the recipe itself is right
        result.notes += golden_notes(loaded) + unused_split_note(loaded)
    if not _module_importable("tensorboard"):
        result.notes.append(
            "tensorboard is not installed here: run metrics fall back to the log lines "
            "(pip install 'megatron-ext[tensorboard]')"
        )
    recipe = loaded.recipe
    entry = recipe.entry
    unknown = entries.entry_problem(entry)
    if unknown is not None:  # never look it up: finding a module imports its packages
        result.problems.append(unknown)
        return result
    if not entry_importable(entry):
        result.notes.append(f"entry module {entry} is not importable here; `run` needs it")
    if recipe.model.type == "multimodule":  # the plan its entry will build, without a process
        if not result.problems:
            result.problems += multimodule_problems(loaded)
        return result
    if result.problems or not megatron_checks:
        return result
    module = entry if entry_importable(entry) else FALLBACK_ENTRY
    assert module is not None  # gpt and hybrid always have a default entry
    if module != entry:
        result.notes.append(f"Megatron's checks used {module}'s arguments instead")
    result.problems += megatron_problems(loaded, module, result.notes)
    return result


def multimodule_problems(loaded: LoadedRecipe) -> list[Problem]:
    """The multi-module plan (grids, topology, batch sizes) of a multimodule recipe, as its
    entry will read it, checked without a process."""
    from megatron_ext.recipes.multimodule import recipe_problems

    return [
        Problem("model.modules", p)
        for p in recipe_problems(loaded.recipe, loaded.recipe.world_size)
    ]


@contextlib.contextmanager
def _as_rank_zero_of(world_size: int, argv: list[str]) -> Iterator[None]:
    saved_env = {
        k: os.environ.get(k)
        for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "CUDA_DEVICE_MAX_CONNECTIONS")
    }
    saved_argv = sys.argv
    os.environ.update(WORLD_SIZE=str(world_size), RANK="0", LOCAL_RANK="0")
    if any(flag in argv for flag in command.FSDP_FLAGS):  # as the run's environment has it
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "32"
    else:
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    sys.argv = ["megatron-ext-validate", *argv]
    try:
        yield
    finally:
        sys.argv = saved_argv
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _device_architecture_without_gpu() -> Iterator[None]:
    """validate_args asks the GPU for its architecture when TP/CP > 1; answer without one."""
    import torch

    if torch.cuda.is_available():
        yield
        return
    # The CPU runtime's own patch, applied only for the check.
    with registry.applied("megatron.training.arguments:get_device_arch_version"):
        yield


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return " ".join(text.split())


def _entry_hooks(module_name: str) -> tuple[Any, dict, type, Any]:
    """(extra args provider, parser defaults, config class, config builder) of an entry."""
    # The entry first: its own start-up measures (launch.startup) then cover megatron's imports.
    module = importlib.import_module(module_name)
    from megatron.training.arguments import core_transformer_config_from_args

    from megatron_ext.config import MHCTransformerConfig

    provider = getattr(module, "add_megatron_ext_args", None)
    defaults = dict(getattr(module, "ENTRY_DEFAULTS", {}))
    config_class = MHCTransformerConfig
    main = getattr(module, "main", None)
    if main is not None:
        parameter = inspect.signature(main).parameters.get("config_class")
        if parameter is not None and parameter.default is not inspect.Parameter.empty:
            config_class = parameter.default
    builder = getattr(module, "transformer_config", None) or (
        lambda args, cls: core_transformer_config_from_args(args, config_class=cls)
    )
    return provider, defaults, config_class, builder


# Messages of checks that depend on this machine's libraries, not on the recipe.
_MACHINE_DEPENDENT = re.compile(r"transformer.?engine|\bTE\b|apex|cuda|nccl|gpu", re.IGNORECASE)


def _with_close_flags(message: str, provider: Any) -> str:
    """Megatron's "unrecognized arguments: ..." with the flag each one was probably meant to
    be (a mistyped flag in extra_args), from the parser the entry builds."""
    if not message.startswith("unrecognized arguments:"):
        return message
    import argparse

    from megatron.training import arguments as megatron_arguments

    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    megatron_arguments.add_megatron_arguments(parser)
    if provider is not None:
        provider(parser)
    known = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    hints = []
    for flag in message.split(":", 1)[1].split():
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.8)
        if flag.startswith("--") and close:
            hints.append(f"{flag}: did you mean {close[0]}?")
    return "; ".join([message, *hints])


def _machine_dependent(exc: BaseException, message: str) -> bool:
    """Whether a check failed for want of this machine's libraries rather than for the recipe.
    A combination megatron-ext rejects (e.g. mHC with CUDA graphs) is the recipe's, whatever
    words its message uses."""
    from megatron_ext.guards import UnsupportedCombinationError

    if isinstance(exc, UnsupportedCombinationError):
        return False
    return bool(_MACHINE_DEPENDENT.search(message))


def megatron_problems(
    loaded: LoadedRecipe, module_name: str, notes: list[str] | None = None
) -> list[Problem]:
    """Megatron's argument validation, the config's checks and the guards, for rank 0 of the
    recipe's world. At most one problem: Megatron stops at its first.

    A GPU recipe checked on a machine without a GPU may trip a check that asks for the GPU
    machine's libraries (Transformer Engine, Apex, CUDA); that is reported as a note, since
    the recipe cannot be judged on it here.
    """
    recipe = loaded.recipe
    argv = command.megatron_args(loaded)
    if recipe.test.type == "ckpt-resume":
        argv += command.save_args(loaded, "/nonexistent/megatron-ext-validate")
    return argv_problems(
        argv, module_name, recipe.world_size, recipe.launch.device, recipe.model.type, notes
    )


def argv_problems(
    argv: list[str],
    module_name: str,
    world_size: int,
    device: str = "cpu",
    model_type: str = "gpt",
    notes: list[str] | None = None,
) -> list[Problem]:
    """:func:`megatron_problems` for a command line of Megatron flags (what the entry
    ``module_name`` would parse on rank 0 of ``world_size`` ranks), without a recipe."""
    import torch

    recipe = types.SimpleNamespace(
        launch=types.SimpleNamespace(device=device),
        model=types.SimpleNamespace(type=model_type),
        world_size=world_size,
    )
    sink = io.StringIO()
    stage = "model.entry"
    try:
        with (
            contextlib.redirect_stdout(sink),
            contextlib.redirect_stderr(sink),
            warnings.catch_warnings(),
        ):
            warnings.simplefilter("ignore")
            provider, entry_defaults, config_class, build_config = _entry_hooks(module_name)
            from megatron.training import arguments as megatron_arguments

            from megatron_ext.launch import training as launch

            parser_defaults = {
                **entry_defaults,
                **launch.machine_defaults(on_cpu=recipe.launch.device == "cpu"),
            }
            if recipe.launch.device == "gpu" and not torch.cuda.is_available():
                # Fused kernels are the GPU machine's business; judge the plan with them off.
                parser_defaults.update(
                    {
                        k: v
                        for k, v in launch.machine_defaults(on_cpu=True).items()
                        if k != "distributed_backend"
                    }
                )
            stage = "megatron arguments"
            size_problem = launch.size_flag_problem(argv)
            if size_problem:
                return [Problem(stage, size_problem)]
            with _as_rank_zero_of(recipe.world_size, argv), _device_architecture_without_gpu():
                extra = launch._with_parser_defaults(
                    [provider], {**launch.run_defaults(), **parser_defaults}
                )
                try:
                    args = megatron_arguments.parse_args(extra)
                except SystemExit:
                    errors = [line for line in sink.getvalue().splitlines() if "error:" in line]
                    return [
                        Problem(
                            stage,
                            _with_close_flags(errors[-1].split("error:", 1)[1].strip(), provider)
                            if errors
                            else "Megatron's parser rejected the command line",
                        )
                    ]
                stage = "megatron validate_args"
                megatron_arguments.validate_args(args, {})
                mhc_problem = launch.mhc_flags_without_mhc(argv, args)
                if mhc_problem:
                    return [Problem("megatron arguments", mhc_problem)]
                schedule = launch.schedule_problem_lines(args)
                if schedule:  # what the entries refuse right after parsing, one line each
                    return [Problem("megatron arguments", line) for line in schedule]
            stage = f"config ({config_class.__name__})"
            config = build_config(args, config_class)
            stage = "guard"
            _model_guards(recipe.model.type, config)
    except ImportError as exc:
        return [Problem("model.entry", f"{module_name} cannot be imported: {_first_line(exc)}")]
    except (
        AssertionError,
        ValueError,
        TypeError,
        NotImplementedError,
        RuntimeError,
        KeyError,
    ) as exc:
        message = _first_line(exc)
        elsewhere = recipe.launch.device == "gpu" and not torch.cuda.is_available()
        if elsewhere and _machine_dependent(exc, message) and stage != "guard":
            if notes is not None:
                notes.append(
                    f"{stage} could not be checked on this machine (it lacks the GPU "
                    f"platform's libraries): {message}"
                )
            return []
        return [Problem(stage, message)]
    return []


def _model_guards(model_type: str, config: Any) -> None:
    from megatron_ext import guards

    guards.check_schedule_supported(config)
    if model_type == "gpt":
        guards.check_gpt_mhc_mtp(config)
    elif model_type == "hybrid":
        guards.check_hybrid_mhc_mtp(config)
