"""What megatron-ext lets a checkpoint's pickles name, and the scan that enforces it before any
rank starts.

A Megatron checkpoint holds pickles in three places, and not all of them are read safely by
the code that loads them:

- ``iter_N/.metadata`` (torch DCP's plan of a torch_dist save): a plain ``pickle.dump`` that
  ``FileSystemReader.read_metadata`` reads with ``pickle.load``, unrestricted, on every rank;
- the byte items inside ``*.distcp`` files (megatron's ``ShardedObject`` values, e.g. RNG
  state and optimizer step counters): ``torch.save`` blobs that torch's
  ``DefaultLoadPlanner.load_bytes`` reads with ``weights_only=False``;
- ``common.pt`` and a torch-format checkpoint's ``*.pt`` files (``torch.save`` archives).

A ``__reduce__`` payload in any of them runs arbitrary code as the training user. So every
checkpoint directory a run or ``convert-checkpoint`` will open is checked first:

- raw pickles (``.metadata``) with :class:`RestrictedUnpickler`, which resolves only the
  globals of :data:`TORCH_DIST_METADATA_GLOBALS` and torch's dtypes, layouts and ``Size``
  (what torch DCP writes; Python's documented way to restrict a pickle, "Restricting
  Globals", https://docs.python.org/3/library/pickle.html#restricting-globals);
- ``torch.save`` archives and blobs with torch's own ``weights_only=True`` rules (tensors,
  containers, dtypes) plus :func:`allowed_globals`: megatron-core's
  ``megatron.core.safe_globals.SAFE_GLOBALS`` (what megatron.training writes into
  ``common.pt``: ``argparse.Namespace`` args, enums, RNG state) and nothing else.

This module is the one place those lists live. A refusal is one line naming the file and the
global (:class:`UnsafeCheckpoint`); ``--trust-pickle`` (the CLI's) skips the check for a
checkpoint the user made or trusts.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from megatron_ext import files
from megatron_ext.errors import MegatronExtError

TRUST_FLAG = "--trust-pickle"
METADATA_FILE = ".metadata"
TRACKER = "latest_checkpointed_iteration.txt"
ITERATION_DIR = re.compile(r"^iter_\d{7}$")

# The classes torch DCP pickles into ``.metadata`` (torch 2.x,
# torch/distributed/checkpoint/metadata.py and filesystem.py). Everything else a .metadata
# file may name is a torch dtype, layout, memory format or ``torch.Size``.
TORCH_DIST_METADATA_GLOBALS = (
    "torch.distributed.checkpoint.metadata:Metadata",
    "torch.distributed.checkpoint.metadata:MetadataIndex",
    "torch.distributed.checkpoint.metadata:TensorStorageMetadata",
    "torch.distributed.checkpoint.metadata:BytesStorageMetadata",
    "torch.distributed.checkpoint.metadata:ChunkStorageMetadata",
    "torch.distributed.checkpoint.metadata:TensorProperties",
    "torch.distributed.checkpoint.metadata:StorageMeta",
    "pathlib:PosixPath",  # StorageMeta.checkpoint_id of a save given a path
    "torch.distributed.checkpoint.metadata:_MEM_FORMAT_ENCODING",
    "torch.distributed.checkpoint.filesystem:_StorageInfo",
    # megatron's MCoreSavePlanner keeps the save plans (planner_data) in the metadata
    "torch.distributed.checkpoint.planner:SavePlan",
    "torch.distributed.checkpoint.planner:WriteItem",
    "torch.distributed.checkpoint.planner:WriteItemType",
    "torch.distributed.checkpoint.planner:TensorWriteData",
    "torch.distributed.checkpoint.planner:BytesIOWriteData",
    "torch:Size",
    "torch.serialization:_get_layout",  # how torch pickles a layout (torch.strided)
    "collections:OrderedDict",
)

# Beyond megatron-core's SAFE_GLOBALS, what a megatron.training ``torch.save`` in a checkpoint
# names: none today. Add an entry here (and say why) rather than anywhere else.
EXTRA_TORCH_SAVE_GLOBALS: tuple[str, ...] = ()


class UnsafeCheckpoint(MegatronExtError, ValueError):
    """A checkpoint file whose pickle names a global outside the allowed ones, or that cannot
    be read as the pickle it should be (one line: file, global, the opt-in)."""


def _resolve(entry: str) -> Any:
    import importlib

    module, _, name = entry.partition(":")
    return getattr(importlib.import_module(module), name)


def allowed_globals() -> list[Any]:
    """What a ``torch.save`` archive or blob in a checkpoint may name beyond torch's own
    ``weights_only`` set: megatron-core's SAFE_GLOBALS and :data:`EXTRA_TORCH_SAVE_GLOBALS`."""
    from megatron.core.safe_globals import SAFE_GLOBALS

    return [*SAFE_GLOBALS, *(_resolve(e) for e in EXTRA_TORCH_SAVE_GLOBALS)]


def _torch_value(name: str) -> Any:
    """``torch.<name>`` when it is a dtype, layout or memory format (how torch pickles them:
    as the global ``torch.float32``, ``torch.strided``, ``torch.contiguous_format``)."""
    import torch

    value = getattr(torch, name, None)
    if isinstance(value, torch.dtype | torch.layout | torch.memory_format):
        return value
    return None


class RestrictedUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only :data:`TORCH_DIST_METADATA_GLOBALS` and torch's
    dtypes, layouts and memory formats; any other global is refused before it is imported."""

    def __init__(self, stream: Any):
        super().__init__(stream)
        self._allowed = {tuple(entry.split(":")): entry for entry in TORCH_DIST_METADATA_GLOBALS}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._allowed:
            return _resolve(self._allowed[(module, name)])
        if module == "torch" and (value := _torch_value(name)) is not None:
            return value
        raise _Refused(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused(f"a persistent id {str(pid)[:40]!r}")


class _Refused(pickle.UnpicklingError):
    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


def _refusal(path: str, name: str) -> UnsafeCheckpoint:
    return UnsafeCheckpoint(
        f"{path} holds {name}, which loading could use to run code; nothing was loaded. If "
        f"you made this checkpoint or trust its source, rerun with {TRUST_FLAG}"
    )


def _unreadable(path: str, why: str) -> UnsafeCheckpoint:
    return UnsafeCheckpoint(f"{path} cannot be checked: {why}; it was not loaded")


def load_metadata(path: str | os.PathLike) -> Any:
    """A torch DCP ``.metadata`` file, through :class:`RestrictedUnpickler`."""
    path = str(path)
    try:
        with files.open_regular(path, "rb") as stream:
            metadata = RestrictedUnpickler(stream).load()
    except _Refused as exc:
        raise _refusal(path, exc.name) from None
    except files.NotRegularFile as exc:
        raise UnsafeCheckpoint(f"{exc.strerror}; it was not loaded") from None
    except OSError as exc:
        raise _unreadable(path, exc.strerror or str(exc)) from None
    except Exception as exc:  # truncated or junk pickles raise many types
        raise _unreadable(path, f"not a pickle ({type(exc).__name__})") from None
    if type(metadata).__name__ != "Metadata" or not hasattr(metadata, "state_dict_metadata"):
        raise _unreadable(path, f"holds a {type(metadata).__name__}, not torch DCP's Metadata")
    return metadata


_GLOBAL_IN_TORCH_MESSAGE = re.compile(r"GLOBAL ([\w.]+)")


def _global_in(exc: Exception) -> str:
    """The global torch's weights-only unpickler refused, out of its multi-line message."""
    found = _GLOBAL_IN_TORCH_MESSAGE.search(str(exc))
    return found[1] if found else "an object that is not a tensor or a plain container"


def load_torch_save(source: str | os.PathLike | io.BytesIO, where: str | None = None) -> Any:
    """A ``torch.save`` archive (a path, or a blob as ``BytesIO``) with ``weights_only=True``
    plus :func:`allowed_globals`. ``where`` names the source in a refusal."""
    import torch

    where = where or str(source)
    kwargs: dict[str, Any] = {"map_location": "cpu", "weights_only": True}
    try:
        with torch.serialization.safe_globals(allowed_globals()):
            return torch.load(source, **kwargs)
    except pickle.UnpicklingError as exc:
        if "Weights only load failed" in str(exc):
            raise _refusal(where, _global_in(exc)) from None
        raise _unreadable(where, "not a torch.save file") from None
    except OSError as exc:
        raise _unreadable(where, exc.strerror or str(exc)) from None
    except Exception as exc:  # RuntimeError, EOFError... on junk
        raise _unreadable(where, f"not a torch.save file ({type(exc).__name__})") from None


def check_torch_save(source: str | os.PathLike | io.BytesIO, where: str | None = None) -> None:
    """:func:`load_torch_save`, result dropped (tensors of a large file are memory-mapped)."""
    import torch

    if not isinstance(source, io.BytesIO) and _is_zip(source):
        where = where or str(source)
        try:
            with torch.serialization.safe_globals(allowed_globals()):
                torch.load(source, map_location="cpu", weights_only=True, mmap=True)
            return
        except pickle.UnpicklingError as exc:
            if "Weights only load failed" in str(exc):
                raise _refusal(where, _global_in(exc)) from None
            raise _unreadable(where, "not a torch.save file") from None
        except Exception as exc:
            raise _unreadable(where, f"not a torch.save file ({type(exc).__name__})") from None
    load_torch_save(source, where)


def _is_zip(path: str | os.PathLike) -> bool:
    try:
        with files.open_regular(path, "rb") as stream:
            return stream.read(4) == b"PK\x03\x04"
    except files.NotRegularFile as exc:
        raise UnsafeCheckpoint(f"{exc.strerror}; it was not loaded") from None
    except OSError:
        return False


def _only_files_and_directories(directory: Path) -> None:
    """Refuse an iteration directory holding a FIFO, socket or device (links followed): the
    ranks would block on a FIFO or read a device without end."""
    import stat

    for path in sorted(directory.rglob("*")):
        try:
            mode = path.stat().st_mode
        except OSError:
            continue  # a dangling link: nothing to read there
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise UnsafeCheckpoint(
                f"{files.not_regular(path, mode).strerror} (in a checkpoint); it was not loaded"
            )


def _byte_items(iteration_dir: Path, metadata: Any) -> Iterator[tuple[str, Path, int, int]]:
    """(fqn, file, offset, length) of every pickled (byte) item the .metadata locates."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    kinds = metadata.state_dict_metadata
    for index, info in (metadata.storage_data or {}).items():
        fqn = str(getattr(index, "fqn", ""))
        if not isinstance(kinds.get(fqn), BytesStorageMetadata):
            continue
        relative = str(getattr(info, "relative_path", ""))
        if not relative or os.path.isabs(relative) or ".." in Path(relative).parts:
            raise _unreadable(
                str(iteration_dir / METADATA_FILE),
                f"item {fqn!r} points outside the checkpoint ({relative[:80]!r})",
            )
        if getattr(info, "transform_descriptors", None):
            raise _unreadable(
                str(iteration_dir / relative),
                f"item {fqn!r} is stored transformed ({info.transform_descriptors}), which "
                "this check cannot read",
            )
        yield fqn, iteration_dir / relative, int(info.offset), int(info.length)


def check_iteration_dir(iteration_dir: str | os.PathLike) -> int:
    """Check every pickle of one saved iteration (torch_dist or torch format); returns how many
    pickles were checked. Raises :class:`UnsafeCheckpoint`."""
    directory = Path(iteration_dir)
    _only_files_and_directories(directory)
    checked = 0
    if os.path.lexists(directory / METADATA_FILE):
        metadata = load_metadata(directory / METADATA_FILE)
        checked += 1
        for fqn, path, offset, length in _byte_items(directory, metadata):
            try:
                with files.open_regular(path, "rb") as stream:
                    stream.seek(offset)
                    blob = stream.read(length)
            except OSError as exc:
                raise _unreadable(str(path), exc.strerror or str(exc)) from None
            if len(blob) != length:
                raise _unreadable(str(path), f"item {fqn!r} is cut short")
            check_torch_save(io.BytesIO(blob), f"{path} (item {fqn!r})")
            checked += 1
    for path in sorted(directory.rglob("*.pt")):
        if not path.is_dir():
            check_torch_save(path)
            checked += 1
    return checked


def iteration_to_load(root: str | os.PathLike, step: int | None = None) -> Path | None:
    """The saved iteration Megatron's ``--load``/``--pretrained-checkpoint`` ROOT would open:
    ROOT itself when it is one (holds ``.metadata`` or ``*.pt``), ``iter_<step>`` for
    ``--ckpt-step``, else the tracker's iteration (or ``release``); None when none."""
    root = Path(root)
    if (root / METADATA_FILE).is_file() or (root / "common.pt").is_file():
        return root
    if step is not None:
        return root / f"iter_{step:07d}"
    try:
        text = files.read_bounded(root / TRACKER, 4096, "tracker").decode(errors="replace")
    except files.NotRegularFile as exc:
        raise UnsafeCheckpoint(f"{exc.strerror}; nothing was loaded") from None
    except OSError:
        return None
    text = text.strip()
    if text == "release":
        return root / "release"
    if text.isascii() and text.isdigit():
        return root / f"iter_{int(text):07d}"
    return None


def check_checkpoint(root: str | os.PathLike, step: int | None = None) -> int:
    """Check what loading ROOT would unpickle (see :func:`iteration_to_load`); a ROOT with no
    tracker is checked in every ``iter_*`` directory it holds. Returns the pickles checked."""
    root = Path(root)
    target = iteration_to_load(root, step)
    if target is not None:
        return check_iteration_dir(target) if target.is_dir() else 0
    if not root.is_dir():
        return 0
    return sum(
        check_iteration_dir(d)
        for d in sorted(root.iterdir())
        if d.is_dir() and (ITERATION_DIR.match(d.name) or d.name == "release")
    )
