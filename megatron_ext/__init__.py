"""megatron-ext: pipeline features for megatron-core, installed next to the release you run.

``install()`` applies the plugin's patches to megatron-core (idempotently) and
``uninstall()`` restores every original. The patches themselves are declared, with their
reasons and verified versions, in :mod:`megatron_ext.declarations` (applied by the machinery
of :mod:`megatron_ext.registry`). :class:`MegatronExtError` is the root of every error
megatron-ext raises on purpose; :class:`Problem` is one finding of a check (where, what). The
stable API is ``__all__`` here and in the subpackages docs/registry.md ("Stable API") lists.
"""

from __future__ import annotations

__version__ = "0.3.0"

from megatron_ext import registry
from megatron_ext.errors import MegatronExtError, Problem
from megatron_ext.installer import install as install, installed as installed

# The stable API (docs/registry.md, "Stable API"): these names, and the ``__all__`` of the public
# subpackages listed there. Everything else is internal and may change between releases.
__all__ = [
    "MegatronExtError",
    "Problem",
    "__version__",
    "install",
    "installed",
    "uninstall",
]


def uninstall() -> None:
    """Undo everything megatron-ext applied, the CPU runtime and an armed fault included."""
    from megatron_ext import runtime

    runtime.stop_cpu()
    registry.undo("fault")
    registry.undo("core")
