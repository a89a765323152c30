"""What every megatron-ext training entry point shares, from runtime choice to ``pretrain()``.

An entry point (for example :mod:`megatron_ext.pretrain_gpt`) does four things in order:

1. :func:`select_runtime` runs before megatron initialises. It switches the CPU runtime on
   where no GPU exists and applies ``megatron_ext.install()`` otherwise.
2. :func:`parse_megatron_args` runs Megatron's own parser with the entry's extra argument
   groups. Defaults that the machine requires (:func:`machine_defaults`) replace Megatron's,
   and flags that the user passes still win.
3. The entry builds its model, data and step functions from the parsed ``args``.
4. :func:`run_pretrain` hands everything to ``megatron.training.pretrain`` in the form that
   megatron-core 0.19.2 expects: a ``PretrainConfigContainer`` first, then the model
   provider.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

from megatron_ext import registry
from megatron_ext.launch import silence_warnings_off_rank_zero

ArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]

# Megatron-LM's eval interval before 0.19 made it optional. Since then, leaving it unset
# crashes get_train_valid_test_num_samples (train_iters // None) instead of skipping eval.
DEFAULT_EVAL_INTERVAL = 1000

# A NaN or Inf loss/grad ends the run at once with megatron's own RuntimeError ("Unexpected
# result nan (message='found NaN in local forward loss calculation')"), which the rank's
# failure marker then names. Megatron's default, ``validate_results``, instead reruns the step,
# *saves a checkpoint of the NaN state* and exits with 16 (EXIT_CODE_RESUME_TO_DISAMBIGUATE) so
# that the step can be replayed on another GPU; a NaN loss is almost always the recipe's fault
# (too high a learning rate), and a checkpoint of it would be what ``--resume`` picks up next.
# An explicit ``--rerun-mode`` still wins (issue 40 item 13).
RERUN_MODE_DEFAULT = "disabled"


def run_defaults() -> dict[str, Any]:
    """Parser defaults every megatron-ext entry applies, whatever the machine."""
    return {"eval_interval": DEFAULT_EVAL_INTERVAL, "rerun_mode": RERUN_MODE_DEFAULT}


# ---- what this machine has -------------------------------------------------------------------
def gpu_available() -> bool:
    return torch.cuda.is_available()


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except Exception:  # a broken install (missing CUDA libraries) counts as absent
        return False
    return True


@functools.cache
def transformer_engine_available() -> bool:
    return _importable("transformer_engine.pytorch")


@functools.cache
def apex_available() -> bool:
    return _importable("apex")


@functools.cache
def gradient_accumulation_fusion_kernel_available() -> bool:
    # Megatron's own linear layers raise at construction when this Apex kernel is missing.
    return _importable("fused_weight_gradient_mlp_cuda")


# ---- 1. runtime --------------------------------------------------------------------------------
def select_runtime() -> str:
    """Apply megatron-ext's patches for this machine, and return "cpu" or "gpu".

    This must run before megatron initialises. On CPU, ``initialize_megatron`` must already
    accept a machine without CUDA, and the model-parallel groups must see a device.
    """
    from megatron_ext import install, runtime

    silence_warnings_off_rank_zero()
    if gpu_available():
        install()
        return "gpu"
    runtime.use_cpu()
    return "cpu"


# ---- 2. arguments ------------------------------------------------------------------------------
def machine_defaults(on_cpu: bool) -> dict[str, Any]:
    """Parser defaults that this machine needs. Each one replaces a Megatron default that
    would fail here, and an explicit flag still overrides it."""
    defaults: dict[str, Any] = {}
    if not transformer_engine_available():
        # Megatron defaults to TE layers; without TE, megatron-core's own layers are the only option.
        defaults["transformer_impl"] = "local"
    if not gradient_accumulation_fusion_kernel_available():
        defaults["gradient_accumulation_fusion"] = False
    if not apex_available():
        # The torch norm that megatron falls back to without Apex asserts on persist_layer_norm.
        defaults["no_persist_layer_norm"] = True
    if on_cpu:
        defaults["distributed_backend"] = "gloo"  # NCCL needs GPUs
        # These fused kernels exist only for CUDA. On CPU, megatron torch.compiles stand-ins
        # for some of them, which costs about 25 s in the first iterations and gains nothing.
        defaults.update(
            masked_softmax_fusion=False,
            bias_gelu_fusion=False,
            bias_dropout_fusion=False,
            apply_rope_fusion=False,
        )
    return defaults


def _with_parser_defaults(
    providers: Iterable[ArgsProvider | None], parser_defaults: dict[str, Any]
) -> ArgsProvider:
    """One extra_args_provider that adds every entry-specific group and then the defaults."""

    def provide(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        for provider in providers:
            if provider is not None:
                parser = provider(parser)
        unknown = sorted(key for key in parser_defaults if not _parser_has_dest(parser, key))
        if unknown:
            raise ValueError(f"parser defaults name arguments the parser does not have: {unknown}")
        parser.set_defaults(**parser_defaults)
        _repair_help_strings(parser)
        return parser

    return provide


def _repair_help_strings(parser: argparse.ArgumentParser) -> None:
    """Make ``--help`` work. In megatron-core 0.19.2, one help string contains a bare "%"
    ("1.10 = 10%"), so argparse's %-formatting fails and ``--help`` crashes for every
    script. Escape the "%" in any help string that does not format."""
    formatter = registry.private("argparse:ArgumentParser._get_formatter")(parser)
    expand_help = registry.private("argparse:HelpFormatter._expand_help")
    for action in parser._actions:
        if not action.help:
            continue
        try:
            expand_help(formatter, action)
        except (ValueError, TypeError, KeyError):
            registry.assign(action, "help", action.help.replace("%", "%%"), seam="argparse:Action")


def _parser_has_dest(parser: argparse.ArgumentParser, dest: str) -> bool:
    return any(action.dest == dest for action in parser._actions)


# Sizes validate_args divides by (or takes modulo of) before checking them: 0 there is a
# ZeroDivisionError traceback, so they are checked first.
POSITIVE_SIZE_FLAGS = (
    "--tensor-model-parallel-size",
    "--pipeline-model-parallel-size",
    "--context-parallel-size",
    "--expert-model-parallel-size",
    "--expert-tensor-parallel-size",
    "--virtual-pipeline-model-parallel-size",
    "--num-layers-per-virtual-pipeline-stage",
    "--num-layers",
    "--hidden-size",
    "--num-attention-heads",
    "--num-query-groups",
    "--seq-length",
    "--micro-batch-size",
    "--global-batch-size",
    "--mhc-num-residual-streams",
    "--num-residual-streams",
    "--mhc-sinkhorn-iterations",
    "--mhc-recompute-layer-num",
    "--mtp-num-layers",
    "--num-experts",
)


def size_flag_problem(argv: Iterable[str]) -> str | None:
    """The first size flag given a whole number below 1 (``--flag N`` or ``--flag=N``)."""
    argv = list(argv)
    for i, token in enumerate(argv):
        flag, sep, value = token.partition("=")
        if flag not in POSITIVE_SIZE_FLAGS:
            continue
        if not sep:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        try:
            number = int(value)
        except ValueError:
            continue  # argparse names a value that is not a number itself
        if number < 1:
            return f"{flag} must be at least 1, got {number}"
    return None


# What megatron's validate_args (and the config checks it runs) raise for a bad command line.
ARGUMENT_ERRORS = (
    AssertionError,
    ValueError,
    TypeError,
    KeyError,
    NotImplementedError,
    RuntimeError,
)


def parse_megatron_args(
    extra_args_providers: Iterable[ArgsProvider | None] = (),
    args_defaults: dict[str, Any] | None = None,
    parser_defaults: dict[str, Any] | None = None,
) -> argparse.Namespace:
    """Parse and validate Megatron's flags from ``sys.argv``, and set megatron's global args.

    ``parser_defaults`` replace argparse defaults before parsing; unlike ``args_defaults``
    (Megatron's post-parse defaults for arguments still None) they do not warn each time the
    user's flag overrides them.
    """
    import sys

    from megatron.training.arguments import parse_and_validate_args

    defaults = {**run_defaults(), **(parser_defaults or {})}
    provider = _with_parser_defaults(extra_args_providers, defaults)
    problem = size_flag_problem(sys.argv[1:])
    if problem:
        raise SystemExit(f"error: {problem}")
    try:
        args = parse_and_validate_args(
            extra_args_provider=provider, args_defaults=args_defaults or {}
        )
    except ARGUMENT_ERRORS as exc:  # validate_args asserts: one line naming it, not a traceback
        text = " ".join((str(exc).strip() or type(exc).__name__).split())
        raise SystemExit(f"error: Megatron's argument checks: {text}") from None
    problem = mhc_flags_without_mhc(sys.argv[1:], args)
    if problem:
        raise SystemExit(f"error: {problem}")
    refuse_unsupported_schedule(args)
    return args


def schedule_problem_lines(args: argparse.Namespace) -> list[str]:
    """One line per setting of ``args`` that the chosen ``--pipeline-schedule`` does not run
    with (ZB-H1's rules; none for 1f1b)."""
    from megatron_ext.pipeline.selection import FLAG, schedule_problems, selected_schedule

    return [f"{FLAG} {selected_schedule(args)}: {p}" for p in schedule_problems(args)]


def refuse_unsupported_schedule(args: argparse.Namespace) -> None:
    """``--pipeline-schedule zb-h1`` with settings ZB-H1 does not run with stops here, one line
    per setting, before megatron initialises anything."""
    lines = schedule_problem_lines(args)
    if lines:
        raise SystemExit("\n".join(f"error: {line}" for line in lines))


def mhc_flags_without_mhc(argv: Iterable[str], args: argparse.Namespace) -> str | None:
    """``--mhc-*`` flags (and ``--use-fused-mhc``) are ignored unless mHC is on, so a forgotten
    ``--enable-mhc-connections`` would train a different model without a word: refuse."""
    if getattr(args, "enable_mhc_connections", False):
        return None
    given = sorted(
        {
            flag
            for flag in (token.split("=", 1)[0] for token in argv)
            if flag.startswith("--mhc-") or flag in ("--use-fused-mhc", "--log-mhc-stats")
        }
    )
    if not given:
        return None
    return (
        f"{', '.join(given)} given without --enable-mhc-connections, so mHC would be off and "
        "they would do nothing; add --enable-mhc-connections (recipes: model.mhc.enabled: true) "
        "or remove them"
    )


# ---- 4. pretrain ---------------------------------------------------------------------------------
def pretrain_config(args: argparse.Namespace):
    """The PretrainConfigContainer for ``args``, on the model-provider path (no ModelConfig)."""
    from megatron.training.argument_utils import pretrain_cfg_container_from_args

    with warnings.catch_warnings():
        # It warns that a ModelConfig is recommended; entry points use a model provider on purpose.
        warnings.filterwarnings("ignore", message=r"\s*It is recommended to use a ModelConfig")
        return pretrain_cfg_container_from_args(args)


def run_pretrain(
    args: argparse.Namespace,
    train_valid_test_datasets_provider: Callable,
    model_type: Any,
    forward_step: Callable,
    model_provider: Callable,
    **pretrain_kwargs: Any,
) -> None:
    """``megatron.training.pretrain`` with ``args`` as parsed by :func:`parse_megatron_args`.

    A rank that raises (model build, forward, backward, optimizer step, checkpoint I/O)
    reports where and exits at once instead of waiting on its peers
    (:func:`megatron_ext.launch.faults.run_failing_fast`); ``MEGATRON_EXT_FAULT`` is honoured
    at every training step."""
    from megatron.training import inprocess_restart, pretrain

    from megatron_ext.launch import faults

    faults.fault_from_env()  # a malformed MEGATRON_EXT_FAULT fails here, before training
    check_resume_tracker(args)
    store = None
    if getattr(args, "inprocess_restart", False):
        pretrain, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)
    faults.run_failing_fast(
        pretrain,
        pretrain_config(args),
        train_valid_test_datasets_provider,
        model_type,
        forward_step_with_faults(forward_step),
        model_provider=model_provider,
        store=store,
        **pretrain_kwargs,
    )


def check_resume_tracker(args: argparse.Namespace) -> None:
    """A ``--load`` tracker megatron would answer with a silent ``sys.exit()`` (status 0) ends
    this rank with status 1 and one line instead (every rank reads the same file)."""
    from megatron_ext.checkpoint.tracker import tracker_problem

    load = getattr(args, "load", None)
    if load and (problem := tracker_problem(load)):
        raise SystemExit(f"error: --load: {problem}")


def forward_step_with_faults(forward_step: Callable) -> Callable:
    """``forward_step`` that first tells :mod:`megatron_ext.launch.faults` the training step
    (Megatron's ``args.curr_iteration`` counts finished iterations; steps count from 1)."""
    from megatron.training import get_args

    from megatron_ext.launch import faults, nodes, stop_signals

    reported: list[bool] = []

    @functools.wraps(forward_step)
    def wrapped(*args: Any, **kwargs: Any):
        if not reported:  # once, where the rank trains: its host and megatron coordinates
            nodes.report_megatron_placement()
            reported.append(True)
        stop_signals.redeliver_pending()  # a stop held since start-up reaches Megatron's handler
        faults.at_step(int(getattr(get_args(), "curr_iteration", 0)) + 1)
        return forward_step(*args, **kwargs)

    return wrapped
