"""Reading and writing Megatron ``torch_dist`` checkpoints in one process, for
``convert-checkpoint`` (no ranks, no process group).

A ``torch_dist`` save (megatron-core ``dist_checkpointing``, strategy ``torch_dist``) is a torch
DCP directory: ``.metadata`` (global shape and chunks of every tensor), ``__R_S.distcp`` data
files and megatron's ``metadata.json`` (``{"sharded_backend": "torch_dist", ...}``). Tensors are
stored at their global shape, whatever TP/PP wrote them; the layers of a GPT's
``TransformerBlock`` are stacked along a leading axis (``decoder.layers.<name>`` of shape
``[num_layers, ...]``, megatron-core's ``sharded_offsets``). Values that are not tensors
(megatron's ``ShardedObject``: RNG state, the common state with the args, ``_extra_state``) are
``torch.save`` byte items, keyed ``<key>/shard_<offset>_<count>``.

:func:`read` loads every tensor at its global shape and every byte item through
:mod:`megatron_ext.checkpoint.safe_pickle` (the directory is checked first); :func:`write`
saves them back with DCP's default planner, so megatron's own resharding loads the result.
Keys are renamed by :func:`rename_keys`: model keys, ``optimizer.state.<kind>.<param>`` and
byte items of a parameter's module, all with the same map.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from megatron_ext.checkpoint import safe_pickle
from megatron_ext.errors import MegatronExtError

BACKEND_FILE = "metadata.json"
BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
OPTIMIZER_STATE = re.compile(r"^(?P<head>optimizer\.state\.[^.]+\.)(?P<name>.+)$")
SHARD_SUFFIX = re.compile(r"^(?P<name>.+?)(?P<tail>/shard_[\d._]+)$")


class TorchDistError(MegatronExtError, ValueError):
    """A directory that is not a readable torch_dist checkpoint, or a conversion that cannot
    be written (one line)."""


def iteration_dir(path: str | Path) -> Path:
    """The saved iteration PATH names: itself (holds ``.metadata``), a checkpoint root's
    tracker iteration, or a run directory's ``checkpoints/`` tracker iteration."""
    path = Path(path)
    if (path / "checkpoints").is_dir() and not (path / safe_pickle.METADATA_FILE).exists():
        path = path / "checkpoints"
    try:
        target = safe_pickle.iteration_to_load(path)
    except safe_pickle.UnsafeCheckpoint as exc:  # a tracker that is a FIFO, socket or device
        raise TorchDistError(str(exc)) from None
    if target is None or not (target / safe_pickle.METADATA_FILE).is_file():
        raise TorchDistError(
            f"{path} is not a torch_dist checkpoint (no .metadata, and no "
            f"{safe_pickle.TRACKER} naming an iteration that has one)"
        )
    return target


def is_torch_dist(path: str | Path) -> bool:
    try:
        iteration_dir(path)
    except TorchDistError:
        return False
    return True


def _load_planner(trust_pickle: bool) -> Any:
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        """DCP's default planner, reading byte items with the checked rules instead of
        ``torch.load(weights_only=False)``."""

        def load_bytes(self, read_item, value):
            self.state_dict[read_item.dest_index.fqn] = safe_pickle.load_torch_save(
                value, f"item {read_item.dest_index.fqn!r}"
            )

    planner = DefaultLoadPlanner if trust_pickle else SafeLoadPlanner
    return planner(flatten_state_dict=False, flatten_sharded_tensors=False)


def read(path: str | Path, trust_pickle: bool = False) -> tuple[dict[str, Any], Path]:
    """Every tensor (global shape) and object of the torch_dist checkpoint PATH names, and the
    iteration directory read. Every pickle is checked before anything is loaded, unless
    ``trust_pickle`` (``--trust-pickle``: the user's opt-in)."""
    import pickle

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    directory = iteration_dir(path)
    if trust_pickle:
        with open(directory / safe_pickle.METADATA_FILE, "rb") as stream:
            metadata = pickle.load(stream)
    else:
        safe_pickle.check_iteration_dir(directory)
        metadata = safe_pickle.load_metadata(directory / safe_pickle.METADATA_FILE)
    state: dict[str, Any] = {}
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            state[key] = torch.empty(md.size, dtype=md.properties.dtype)
        else:
            state[key] = None  # a byte item: the planner puts the object here
    dcp.load(state, checkpoint_id=str(directory), planner=_load_planner(trust_pickle), no_dist=True)
    return state, directory


def write(state: Mapping[str, Any], directory: str | Path, tracker_iteration: str | None) -> None:
    """Save STATE as a torch_dist checkpoint. ``tracker_iteration``: DIRECTORY is a checkpoint
    root; the iteration goes to ``iter_<n>`` (or ``release``) beside a tracker naming it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner

    root = Path(directory)
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise TorchDistError(f"output {root} exists and is not an empty directory; give a new one")
    target = root
    if tracker_iteration is not None:
        name = "release" if tracker_iteration == "release" else f"iter_{int(tracker_iteration):07d}"
        target = root / name
    staging = target.with_name(f".{target.name}.converting")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir(parents=True)
        dcp.save(
            dict(state),
            checkpoint_id=str(staging),
            planner=DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
            no_dist=True,
        )
        (staging / BACKEND_FILE).write_text(json.dumps(BACKEND))
        staging.rename(target)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise TorchDistError(f"cannot write {target}: {exc.strerror or exc}") from None
    if tracker_iteration is not None:
        (root / safe_pickle.TRACKER).write_text(tracker_iteration)


def tracker_iteration(path: str | Path) -> str | None:
    """The iteration PATH's checkpoint was saved at, as a tracker writes it (``release`` or
    the number), so a converted copy is a checkpoint root Megatron's ``--load`` reads; None for
    a DCP directory with no iteration in its name."""
    directory = iteration_dir(path)
    if directory.name == "release":
        return "release"
    if safe_pickle.ITERATION_DIR.match(directory.name):
        return str(int(directory.name[len("iter_") :]))
    return None


def _split(key: str) -> tuple[str, str, str]:
    """(head, parameter or module name, tail) of a torch_dist key."""
    head, tail = "", ""
    if found := SHARD_SUFFIX.match(key):
        key, tail = found["name"], found["tail"]
    if found := OPTIMIZER_STATE.match(key):
        head, key = found["head"], found["name"]
    return head, key, tail


def parameter_name(key: str) -> str:
    """The parameter (or module) name inside a torch_dist key (optimizer and shard parts off)."""
    return _split(key)[1]


def rename_keys(
    state: Mapping[str, Any], convert: Callable[[Mapping[str, Any]], Mapping[str, Any]]
) -> dict[str, Any]:
    """STATE with every key's parameter name mapped by CONVERT (a whole-model state-dict
    conversion, given ``{name: name}`` so the map can be read off its output)."""
    stray = sorted(k for k in state if k.startswith("optimizer.") and not _split(k)[0])
    if stray:
        raise TorchDistError(
            f"the optimizer state is stored by buffer, not by parameter ({stray[0]}, "
            f"{len(stray)} keys; --use-distributed-optimizer): its parameters cannot be renamed. "
            "Convert a checkpoint saved without the distributed optimizer, or finetune from the "
            "weights (checkpoint.finetune: true)"
        )
    names = {_split(k)[1] for k in state}
    renamed = {old: new for new, old in convert({n: n for n in names}).items()}
    missing = sorted(names - renamed.keys())
    if missing:
        raise TorchDistError(f"the key conversion dropped {missing[0]} ({len(missing)} names)")
    out: dict[str, Any] = {}
    for key, value in state.items():
        head, name, tail = _split(key)
        out[f"{head}{renamed[name]}{tail}"] = value
    return out


def model_weights(state: Mapping[str, Any]) -> dict[str, Any]:
    """A plain model state dict out of a torch_dist state: tensors that are not optimizer
    state, with stacked layers (``decoder.layers.<name>``, ``[L, ...]``) split into
    ``decoder.layers.<i>.<name>`` as ``model.state_dict()`` names them."""
    import torch

    plain: dict[str, Any] = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor) or key.startswith("optimizer."):
            continue
        stacked = re.match(r"^(?P<head>(?:.*\.)?decoder\.layers\.)(?P<rest>[a-z_].*)$", key)
        if stacked:
            for i, layer in enumerate(value.unbind(0)):
                plain[f"{stacked['head']}{i}.{stacked['rest']}"] = layer.clone()
        else:
            plain[key] = value
    return plain
