"""The checkpoints a run will load, named before any rank starts, and their pickles checked.

A run loads from three places: its own ``checkpoints/`` on ``run --resume``, the recipe's
``checkpoint.load`` (:mod:`megatron_ext.checkpoint.start_from`), and Megatron's
``--pretrained-checkpoint`` (or ``--load``) given through ``extra_args``. Each is checked with
:func:`megatron_ext.checkpoint.safe_pickle.check_checkpoint`; the first refusal is the run's
one-line reason not to start.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_ext.checkpoint import safe_pickle

LOAD_FLAGS = ("--pretrained-checkpoint", "--load")


def _step(extra_args: dict[str, Any]) -> int | None:
    value = extra_args.get("--ckpt-step")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def checkpoints_to_load(recipe: Any, resume_from: Path | None = None) -> list[tuple[str, Path]]:
    """(where it is named, directory) of every checkpoint this run will open."""
    found: list[tuple[str, Path]] = []
    if resume_from is not None:
        found.append(("run --resume", Path(resume_from)))
    load = getattr(getattr(recipe, "checkpoint", None), "load", None)
    if load:
        found.append(("checkpoint.load", Path(str(load))))
    for flag in LOAD_FLAGS:
        value = recipe.extra_args.get(flag)
        if isinstance(value, str) and value:
            found.append((f"extra_args.{flag}", Path(value)))
    return found


def pickle_problem(
    recipe: Any, resume_from: Path | None = None, trust_pickle: bool = False
) -> str | None:
    """Why the run must not start because a checkpoint it loads could run code (None: none
    can). ``trust_pickle``: the user's explicit opt-in, nothing is checked."""
    if trust_pickle:
        return None
    step = _step(recipe.extra_args)
    for where, directory in checkpoints_to_load(recipe, resume_from):
        try:
            safe_pickle.check_checkpoint(
                directory, step if where.startswith("extra_args") else None
            )
        except safe_pickle.UnsafeCheckpoint as exc:
            return f"{where}: {exc}"
    return None
