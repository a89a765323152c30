"""megatron-ext: pipeline features for megatron-core, installed next to the release you run.

``install()`` applies the plugin's patches to megatron-core (idempotently) and
``uninstall()`` restores every original. The patches themselves are declared, with their
reasons and verified versions, in :mod:`megatron_ext.declarations` (applied by the machinery
of :mod:`megatron_ext.registry`).
"""

from __future__ import annotations

__version__ = "0.1.0"

from megatron_ext import registry


def install() -> None:
    """Apply megatron-ext's core patches to megatron-core (safe to call repeatedly) and check
    the private seams it depends on (once per process).

    With ``MEGATRON_EXT_TRACE_DIR`` set (``megatron-ext run --trace``) this process also
    records its pipeline schedule (:mod:`megatron_ext.schedules.trace`)."""
    from megatron_ext import declarations  # noqa: F401  (every Patch and Seam)

    registry.apply("core")
    registry.verify_seams()
    from megatron_ext.schedules.trace import start_from_environment

    start_from_environment()


def uninstall() -> None:
    """Undo everything megatron-ext applied, the CPU runtime and an armed fault included."""
    from megatron_ext import runtime

    runtime.stop_cpu()
    registry.undo("fault")
    registry.undo("core")


def installed() -> bool:
    return all(registry.is_applied(p.target) for p in registry.patches("core"))
