"""``install()``: megatron-ext's core patches applied and its private seams checked.

Its own module, below both the package face and the CPU runtime: the runtime installs the
core patches before its own, and :func:`megatron_ext.uninstall` stops the runtime.
"""

from __future__ import annotations

from megatron_ext import registry


def install() -> None:
    """Apply megatron-ext's core patches to megatron-core (safe to call repeatedly) and check
    the private seams it depends on (once per process).

    With ``MEGATRON_EXT_TRACE_DIR`` set (``megatron-ext run --trace``) this process also
    records its pipeline schedule (:mod:`megatron_ext.schedules.trace`)."""
    from megatron_ext import declarations  # noqa: F401  (every Patch and Seam)

    # Patching imports the patched modules; megatron-core 0.20's hyper_connection, imported
    # that way after an entry's import window, decorates methods with torch.compile, which
    # would import torch's compiler (seconds of CPU in every rank) for functions no CPU run calls.
    with registry.applied_for("startup"):  # (megatron_ext.launch.startup)
        registry.apply("core")
        registry.verify_seams()
    from megatron_ext.schedules.trace import start_from_environment

    start_from_environment()


def installed() -> bool:
    return all(registry.is_applied(p.target) for p in registry.patches("core"))
