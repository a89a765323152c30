"""megatron-ext: pipeline features for megatron-core, installed next to the release you run.

``install()`` applies the plugin's patches to megatron-core (idempotently) and
``uninstall()`` restores every original. The patches themselves are declared, with their
reasons and verified versions, in :mod:`megatron_ext.declarations` (applied by the machinery
of :mod:`megatron_ext.registry`).
"""

from __future__ import annotations

__version__ = "0.1.0"

from megatron_ext import registry
from megatron_ext.installer import install as install
from megatron_ext.installer import installed as installed


def uninstall() -> None:
    """Undo everything megatron-ext applied, the CPU runtime and an armed fault included."""
    from megatron_ext import runtime

    runtime.stop_cpu()
    registry.undo("fault")
    registry.undo("core")
