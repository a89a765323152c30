"""The training entries a recipe may name: megatron-ext's own, plus those a user registers.

A recipe is data, possibly someone else's: ``validate`` must not import (run) a module that
only the recipe names. ``model.entry`` is therefore checked against a known set before any
import: megatron-ext's entries, and modules that an installed distribution registers
explicitly in the ``megatron_ext.entries`` entry-point group, e.g. in ``pyproject.toml``::

    [project.entry-points."megatron_ext.entries"]
    my_vlm = "my_package.train"

Reading entry-point metadata imports nothing.
"""

from __future__ import annotations

from importlib import metadata
from typing import Optional

from megatron_ext.recipes.schema import DEFAULT_ENTRIES, Problem

ENTRY_POINT_GROUP = "megatron_ext.entries"
OUR_ENTRIES = (*DEFAULT_ENTRIES.values(), "megatron_ext.pretrain_multimodule")


def registered_entries() -> dict[str, str]:
    """module -> who registered it (entry-point name and distribution)."""
    found: dict[str, str] = {}
    for point in metadata.entry_points(group=ENTRY_POINT_GROUP):
        module = point.value.split(":", 1)[0].strip()
        dist = getattr(point, "dist", None)
        found[module] = f"entry point {point.name!r}" + (f" of {dist.name}" if dist else "")
    return found


def known_entries() -> dict[str, str]:
    return {**{m: "megatron-ext" for m in OUR_ENTRIES}, **registered_entries()}


def entry_problem(entry: Optional[str]) -> Optional[Problem]:
    """None when ``entry`` is one of :func:`known_entries`; else why it will not be run."""
    if entry is None:
        return None  # plan_problems reports a missing entry
    if entry in known_entries():
        return None
    return Problem(
        "model.entry",
        (
            f"{entry!r} is not a known training entry; megatron-ext runs its own "
            f"({', '.join(OUR_ENTRIES)}) and modules registered in the {ENTRY_POINT_GROUP!r} "
            "entry-point group of an installed package, and never imports a module named only by a "
            "recipe"
        ),
    )
