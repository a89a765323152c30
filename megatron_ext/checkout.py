"""Running megatron-ext against a user's own Megatron-LM checkout instead of the wheel.

A checkout differs from the megatron-core wheel in ways that matter at start-up:

- its ``megatron/core/datasets`` has the ``Makefile`` and ``helpers.cpp`` but no built
  ``helpers_cpp`` extension until someone runs ``make`` (the wheel ships it prebuilt and
  no Makefile): :func:`ensure_dataset_helpers` uses the built one, builds it with the
  checkout's own Makefile, or stops with the command to run;
- a newer Megatron-LM declares mHC itself (``--enable-mhc-connections`` on main,
  ``--enable-hyper-connections`` on dev): :func:`refuse_upstream_mhc` stops a patched script
  with one line naming the megatron-ext entry to use instead;
- upstream's ``pretrain_gpt.py`` builds a ModelOpt model when ModelOpt is enabled, which has
  no mHC layers: :func:`refuse_modelopt_with_mhc` says so instead of dropping one of them.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
from collections.abc import Callable

from megatron_ext.errors import MegatronExtError
from megatron_ext.mhc_flags import ENABLE_ALIAS

logger = logging.getLogger(__name__)

HELPERS_MODULE = "megatron.core.datasets.helpers_cpp"

# TransformerConfig fields through which a Megatron-LM declares its own mHC, and the flag each
# one becomes through megatron's ArgumentGroupFactory.
# main's (Split 1/N of PR #3430) and dev's (DeepSeek-V4 configs) spelling of the switch.
UPSTREAM_MHC_FIELDS = {
    ENABLE_ALIAS.main_field: ENABLE_ALIAS.main_flag,
    ENABLE_ALIAS.dev_field: ENABLE_ALIAS.dev_flag,
}


class DatasetHelpersMissing(MegatronExtError, RuntimeError):
    """megatron's C++ dataset helpers are neither built nor buildable here."""


def ensure_dataset_helpers(
    build: Callable[[], None],
    datasets_dir: str,
    import_helpers: Callable[[], object] = lambda: importlib.import_module(HELPERS_MODULE),
) -> str:
    """Make megatron's dataset helpers importable; return how ("prebuilt" or "built").

    ``build`` is megatron's own ``compile_helpers`` (``make -C datasets_dir``; it exits the
    process when make fails, after megatron's own error line). It runs only where the
    extension is missing and a Makefile exists, i.e. in a Megatron-LM checkout.
    """
    try:
        import_helpers()
        return "prebuilt"
    except ImportError as exc:
        missing = exc
    makefile = os.path.join(datasets_dir, "Makefile")
    if not os.path.exists(makefile):
        raise DatasetHelpersMissing(
            f"megatron's dataset helpers ({HELPERS_MODULE}) are not importable ({missing}) and "
            f"{datasets_dir} has no Makefile to build them. Reinstall megatron-core (its wheel "
            "ships them prebuilt), or in a Megatron-LM checkout run "
            f"`make -C {datasets_dir}` (needs pybind11 and a C++ compiler)."
        )
    logger.info("building megatron's dataset helpers with %s", makefile)
    try:
        build()
    except SystemExit as exc:  # megatron's compile_helpers exits when make fails
        raise DatasetHelpersMissing(
            f"`make -C {datasets_dir}` failed (its output is above): building {HELPERS_MODULE} "
            "needs pybind11 (`pip install pybind11`), a C++ compiler and python3-config of the "
            "interpreter running megatron on PATH."
        ) from exc
    importlib.invalidate_caches()
    try:
        import_helpers()
    except ImportError as exc:
        raise DatasetHelpersMissing(
            f"`make -C {datasets_dir}` ran but {HELPERS_MODULE} is still not importable ({exc}); "
            "check that the python3 it used (python3-config) is the interpreter running megatron."
        ) from exc
    return "built"


def compile_helpers_when_missing(original: Callable[[], None]) -> Callable[[], None]:
    """The replacement of ``megatron.core.datasets.utils.compile_helpers`` (see the registry)."""

    def compile_helpers() -> None:
        utils = importlib.import_module("megatron.core.datasets.utils")
        assert utils.__file__ is not None, "megatron.core.datasets.utils is a file's module"
        ensure_dataset_helpers(original, os.path.dirname(os.path.abspath(utils.__file__)))

    return compile_helpers


def upstream_mhc_flags(config_class: type | None = None) -> list[str]:
    """The mHC flags that the imported megatron-core's TransformerConfig declares itself."""
    if config_class is None:
        from megatron.core.transformer.transformer_config import TransformerConfig

        config_class = TransformerConfig
    fields = getattr(config_class, "__dataclass_fields__", {})
    return [flag for name, flag in UPSTREAM_MHC_FIELDS.items() if name in fields]


def refuse_upstream_mhc(script: str, entry: str, config_class: type | None = None) -> None:
    """Stop a patched Megatron-LM script whose megatron-core has mHC of its own.

    megatron-ext's mHC is for megatron-core 0.19.x, which has none. Mixing both would register
    the same flags twice and build two different mHC implementations into one model.
    """
    flags = upstream_mhc_flags(config_class)
    if not flags:
        return
    from megatron_ext import registry

    try:
        where = registry.imported_megatron_core().describe()
    except Exception:
        where = "this megatron-core"
    raise SystemExit(
        f"{script}: {where} declares mHC itself ({', '.join(flags)}); the megatron-ext patch is for "
        f"Megatron-LM core_v0.19.x. Use this script unpatched for upstream's mHC, or run "
        f"`torchrun ... -m {entry}` with megatron-core 0.19.2 for megatron-ext's."
    )


def refuse_modelopt_with_mhc(args: argparse.Namespace) -> None:
    """ModelOpt builds its own GPT (no mHC layers, no deferred weight gradients for ZB-H1):
    refuse either combination by name."""
    if not getattr(args, "modelopt_enabled", False):
        return
    if getattr(args, "enable_mhc_connections", False):
        raise SystemExit(
            "--enable-mhc-connections cannot be combined with ModelOpt (modelopt_enabled: "
            "quantization, distillation or a ModelOpt checkpoint): ModelOpt builds its own GPT "
            "without mHC layers. Drop the ModelOpt flags, or train without mHC."
        )
    if getattr(args, "pipeline_schedule", "1f1b") != "1f1b":
        raise SystemExit(
            f"--pipeline-schedule {args.pipeline_schedule} cannot be combined with ModelOpt "
            "(modelopt_enabled): ModelOpt builds its own GPT, whose layers do not defer weight "
            "gradients. Drop the ModelOpt flags, or use --pipeline-schedule 1f1b."
        )
