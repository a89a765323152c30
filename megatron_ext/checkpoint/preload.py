"""The checkpoints a run will load, named before any rank starts, and their pickles checked.

:func:`directories_to_load` is the one place that decides which saved iteration directories
Megatron can open for a run. It follows megatron-core 0.19.2's
``megatron.training.checkpointing`` (``load_checkpoint`` and ``_load_base_checkpoint``) on the
flags the ranks will get, the last of a repeated flag winning as in argparse:

- the load root: the run's own ``checkpoints/`` on ``run --resume`` (its ``--load`` comes after
  ``extra_args``), else the root ``checkpoint.load`` names
  (:mod:`megatron_ext.checkpoint.start_from`), else ``extra_args.--load``;
- ``--pretrained-checkpoint`` replaces that root when the root has no tracker file;
- in the root, the tracker's iteration (or ``release``), replaced by ``--ckpt-step`` when that
  is set and not 0 (Megatron parses it with ``int()``, so ``5`` and ``"5"`` are the same), the
  ``release`` directory winning whatever the step;
- a non-persistent save (``--non-persistent-ckpt-type global``: the tracker of
  ``--non-persistent-global-ckpt-dir``, else of ``ROOT/non_persistent``) replaces all of that
  when its iteration is at least the persistent one. ``local`` non-persistent saves are read by
  ``nvidia_resiliency_ext`` in a format this check cannot read, so a run that would load one is
  refused unless ``--trust-pickle``.

Each directory is checked with :func:`megatron_ext.checkpoint.safe_pickle.check_iteration_dir`
(:func:`pickle_problem`); the first refusal is the run's one-line reason not to start. A
tracker that is a FIFO, socket or device is refused without being opened for a blocking read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_ext import files
from megatron_ext.checkpoint import safe_pickle

LOAD_FLAGS = ("--pretrained-checkpoint", "--load")
NON_PERSISTENT_SUBDIR = "non_persistent"  # megatron's _NON_PERSISTENT_CKPT_SUBDIR
TRACKER_READ_LIMIT = 4096  # a tracker holds one number; anything longer is not one


class LoadRefused(safe_pickle.UnsafeCheckpoint):
    """What a run would load cannot be checked (a tracker that is no file, a local
    non-persistent save): one line."""


@dataclass(frozen=True)
class LoadFlags:
    """The flags of a run that choose what Megatron loads, as the ranks will see them."""

    load: str | None
    load_named_by: str
    ckpt_step: int | None
    pretrained: str | None
    non_persistent_type: str | None
    non_persistent_global_dir: str | None


def _extra(recipe: Any) -> dict[str, Any]:
    return dict(getattr(recipe, "extra_args", None) or {})


def _as_megatron_int(value: Any) -> int | None:
    """``--ckpt-step`` as Megatron's argparse reads it (``int()`` of its text); None when it
    would not parse (Megatron then refuses the command line) or is not given."""
    if value is None or isinstance(value, bool):
        return None
    try:
        return int(str(value))
    except ValueError:
        return None


def _path_flag(value: Any) -> str | None:
    return str(value) if isinstance(value, str | Path) and str(value) else None


def load_flags(recipe: Any, resume_from: Path | None = None) -> LoadFlags:
    """The load root, step, pretrained root and non-persistent settings of this run."""
    extra = _extra(recipe)
    load, named_by = _path_flag(extra.get("--load")), "extra_args.--load"
    step = _as_megatron_int(extra.get("--ckpt-step"))
    start = getattr(getattr(recipe, "checkpoint", None), "load", None)
    if resume_from is not None:
        load, named_by = str(resume_from), "run --resume"
    elif start:
        from megatron_ext.checkpoint import start_from

        named_by = "checkpoint.load"
        try:
            source = start_from.resolve(start)
            load = str(source.root)
            if source.step is not None:  # its --ckpt-step comes after extra_args
                step = source.step
        except start_from.StartFromError:
            load = str(start)  # named by start_from's own check; nothing to load from it here
    return LoadFlags(
        load=load,
        load_named_by=named_by,
        ckpt_step=step,
        pretrained=_path_flag(extra.get("--pretrained-checkpoint")),
        non_persistent_type=_path_flag(extra.get("--non-persistent-ckpt-type")),
        non_persistent_global_dir=_path_flag(extra.get("--non-persistent-global-ckpt-dir")),
    )


def _tracker_exists(root: str | None) -> bool:
    """Megatron's ``checkpoint_exists``: a tracker file (``isfile``) in ROOT. A tracker that
    exists but is no regular file is refused here rather than skipped: it is not the user's
    intent, and reading one could block."""
    if root is None:
        return False
    path = Path(root) / safe_pickle.TRACKER
    if not os.path.lexists(path):
        return False
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False  # a dangling link: megatron's isfile is False too
    import stat

    if not stat.S_ISREG(mode):
        raise LoadRefused(f"{files.not_regular(path, mode).strerror}")
    return True


def read_tracker(root: str | os.PathLike) -> tuple[int, bool] | None:
    """(iteration, release) of ROOT's tracker as Megatron's ``read_metadata`` reads it; None
    when there is none or it holds neither a number nor ``release`` (Megatron then exits, which
    :func:`megatron_ext.checkpoint.tracker.tracker_problem` turns into a named failure)."""
    if not _tracker_exists(str(root)):
        return None
    path = Path(root) / safe_pickle.TRACKER
    try:
        text = files.read_bounded(path, TRACKER_READ_LIMIT, "tracker").decode(errors="replace")
    except OSError as exc:
        raise LoadRefused(f"{path} cannot be read: {files.failure_reason(exc)}") from None
    text = text.strip()
    if text == "release":
        return 0, True
    parsed = _as_megatron_int(text)
    return (parsed, False) if parsed is not None and parsed >= 0 else None


def _persistent_dir(root: str, step: int | None) -> tuple[int, Path | None]:
    """(iteration, directory) Megatron loads from ROOT without non-persistent saves; -1 and
    None when it loads nothing."""
    tracked = read_tracker(root)
    iteration, release = tracked if tracked is not None else (-1, False)
    if step:  # megatron: `if getattr(args, 'ckpt_step', None)`
        iteration = step
    if iteration == -1:
        return -1, None
    return iteration, Path(root) / ("release" if release else f"iter_{iteration:07d}")


def directories_to_load(recipe: Any, resume_from: Path | None = None) -> list[tuple[str, Path]]:
    """(what names it, iteration directory) of every checkpoint Megatron can open for this run
    (at most one persistent or non-persistent directory; see the module docstring). Raises
    :class:`LoadRefused` when that cannot be decided safely."""
    flags = load_flags(recipe, resume_from)
    root, named_by = flags.load, flags.load_named_by
    if flags.pretrained is not None and not _tracker_exists(root):
        root, named_by = flags.pretrained, "extra_args.--pretrained-checkpoint"
    if root is None and flags.pretrained is None:
        return []
    if flags.non_persistent_type == "local":
        raise LoadRefused(
            "extra_args.--non-persistent-ckpt-type local: those saves are loaded by "
            "nvidia_resiliency_ext in a format this check cannot read; remove the flag, or "
            f"rerun with {safe_pickle.TRUST_FLAG} if you made them"
        )
    iteration, directory = _persistent_dir(root, flags.ckpt_step) if root else (-1, None)
    if flags.non_persistent_type == "global":
        np_root = flags.non_persistent_global_dir or (
            os.path.join(root, NON_PERSISTENT_SUBDIR) if root else None
        )
        tracked = read_tracker(np_root) if np_root else None
        if tracked is not None and not tracked[1] and tracked[0] >= iteration:
            return [
                (
                    f"{named_by} (its newer non-persistent save)",
                    Path(np_root or "") / f"iter_{tracked[0]:07d}",
                )
            ]
    return [(named_by, directory)] if directory is not None else []


def checkpoints_to_load(recipe: Any, resume_from: Path | None = None) -> list[tuple[str, Path]]:
    """Kept for callers that name roots: the directories of :func:`directories_to_load`."""
    return directories_to_load(recipe, resume_from)


def pickle_problem(
    recipe: Any, resume_from: Path | None = None, trust_pickle: bool = False
) -> str | None:
    """Why the run must not start because a checkpoint it loads could run code (None: none
    can). ``trust_pickle``: the user's explicit opt-in, nothing is checked."""
    if trust_pickle:
        return None
    try:
        found = directories_to_load(recipe, resume_from)
    except LoadRefused as exc:
        return str(exc)
    for where, directory in found:
        try:
            if directory.is_dir():
                safe_pickle.check_iteration_dir(directory)
        except safe_pickle.UnsafeCheckpoint as exc:
            return f"{where}: {exc}"
    return None
