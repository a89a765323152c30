"""Key conversion of mHC checkpoints between upstream Megatron-LM's layouts and ours.

GPT. Upstream main (Split 1/N of PR #3430), PR #6401 and ``dev`` name a GPT layer's mHC
modules ``decoder.layers.i.self_attention_hyper_connection.*`` and
``decoder.layers.i.mlp_hyper_connection.*``, as we do, so a GPT checkpoint loads by key.
Two things differ by source and are not in the keys:

- main mixes the residual streams with H_res, PR #6401/dev (and we) with H_resᵀ: with
  ``--source main`` the res rows ``2n + i*n + j`` and ``2n + j*n + i`` of every
  ``*_hyper_connection.mapping_proj.weight`` and ``bias`` (and their optimizer state) swap
  (:func:`transpose_main_res`), so the converted model computes main's function
  (:data:`H_RES_NOTE`);
- ``dev``'s GPT contracts the streams with a learned contraction (``decoder.hc_head_fn``,
  ``hc_head_base``, ``hc_head_scale``); build the model with
  ``mhc_learned_output_contract=True`` to load those keys (ours defaults to main's mean).

Hybrid. PR #6401 and ``dev`` wrap every Hybrid layer in ``HyperConnectionHybridLayer``: one
``layers.i.hyper_connection.*`` and the layer itself under ``layers.i.inner_layer.*``. Our
Hybrid layers carry the hyper connection beside their own parameters, named by the sub-block
it wraps: ``layers.i.self_attention_hyper_connection.*`` (attention layers),
``layers.i.mlp_hyper_connection.*`` (MLP and MoE layers), ``layers.i.mixer_hyper_connection.*``
(Mamba layers), and the layer's parameters at ``layers.i.*``. Shapes are the same, so
conversion is renaming (:func:`hybrid_to_upstream`, :func:`hybrid_from_upstream`); which
hyper connection a layer has follows from its inner parameters.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from megatron_ext.checkpoint.safe_pickle import TRUST_FLAG
from megatron_ext.errors import MegatronExtError

# Where each source's checkpoints come from (the CLI's --source).
SOURCES = ("main", "pr6401", "dev", "megatron-ext")

H_RES_NOTE = (
    "upstream main mixes the residual streams with H_res (mixed_i = sum_j H_res[i, j] x_j); "
    "PR #6401, dev and megatron-ext use H_res transposed (DeepSeek-V4's orientation). The res "
    "rows i*n+j and j*n+i of every hyper connection's mapping_proj.weight and bias (and their "
    "optimizer state) were swapped, so the model computes main's function (up to Sinkhorn "
    "convergence: main normalises rows first, megatron-ext columns)."
)
LEARNED_CONTRACTION_NOTE = (
    "dev's GPT contracts the streams with a learned contraction (decoder.hc_head_fn/base/scale): "
    "build megatron-ext's GPT with mhc_learned_output_contract=True to load those keys."
)

# The sub-block a hyper connection wraps, named by the inner parameters that identify it.
HYPER_CONNECTION_BY_INNER = (
    ("mixer.", "mixer_hyper_connection"),
    ("self_attention.", "self_attention_hyper_connection"),
    ("mlp.", "mlp_hyper_connection"),
)
OUR_HYPER_CONNECTIONS = tuple(name for _, name in HYPER_CONNECTION_BY_INNER)
UPSTREAM_HYPER_CONNECTION = "hyper_connection"
UPSTREAM_INNER = "inner_layer"

_LAYER_KEY = re.compile(r"^(?P<head>(?:.*\.)?decoder\.layers\.(?P<index>\d+)\.)(?P<rest>.+)$")


class ConversionError(MegatronExtError, ValueError):
    """The state dict is not in the layout the conversion reads."""


def _by_layer(state_dict: Mapping[str, Any]) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """{layer prefix: {key within the layer: value}}, and every key outside decoder layers."""
    layers: dict[str, dict[str, Any]] = {}
    other: dict[str, Any] = {}
    for key, value in state_dict.items():
        match = _LAYER_KEY.match(key)
        if match:
            layers.setdefault(match["head"], {})[match["rest"]] = value
        else:
            other[key] = value
    return layers, other


def _has_upstream_names(rest: str) -> bool:
    """A key within a layer that PR #6401/dev's ``HyperConnectionHybridLayer`` names."""
    return rest.startswith((UPSTREAM_HYPER_CONNECTION + ".", UPSTREAM_INNER + "."))


def is_upstream_layer(entries: Mapping[str, Any]) -> bool:
    """Every key of the layer is already under ``hyper_connection.`` or ``inner_layer.``."""
    return bool(entries) and all(_has_upstream_names(rest) for rest in entries)


def is_our_layer(entries: Mapping[str, Any]) -> bool:
    """No key of the layer is under upstream's wrapper names: megatron-ext's layout already
    (a layer without mHC has the same names in both layouts)."""
    return not any(_has_upstream_names(rest) for rest in entries)


def hybrid_to_upstream(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """megatron-ext Hybrid keys -> PR #6401/dev ``hyper_connection`` + ``inner_layer`` keys.
    A layer already in upstream's layout is kept as it is."""
    layers, converted = _by_layer(state_dict)
    for head, entries in layers.items():
        if is_upstream_layer(entries):
            converted.update({f"{head}{rest}": value for rest, value in entries.items()})
            continue
        found = sorted({rest.split(".", 1)[0] for rest in entries} & set(OUR_HYPER_CONNECTIONS))
        if len(found) != 1:
            raise ConversionError(
                f"{head}: a megatron-ext Hybrid mHC layer has exactly one of "
                f"{', '.join(OUR_HYPER_CONNECTIONS)}, found {found or 'none'} (is this a GPT or a "
                "non-mHC checkpoint? GPT keys need no conversion)"
            )
        for rest, value in entries.items():
            module, _, name = rest.partition(".")
            if module == found[0]:
                converted[f"{head}{UPSTREAM_HYPER_CONNECTION}.{name}"] = value
            else:
                converted[f"{head}{UPSTREAM_INNER}.{rest}"] = value
    return converted


def hybrid_from_upstream(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """PR #6401/dev Hybrid keys -> megatron-ext's (the inverse of :func:`hybrid_to_upstream`).
    A layer already in megatron-ext's layout (e.g. megatron-ext's own checkpoint converted for
    its format only: issue 41, item 9) is kept as it is."""
    layers, converted = _by_layer(state_dict)
    for head, entries in layers.items():
        if is_our_layer(entries):
            converted.update({f"{head}{rest}": value for rest, value in entries.items()})
            continue
        inner = {
            rest[len(UPSTREAM_INNER) + 1 :]: v
            for rest, v in entries.items()
            if rest.startswith(UPSTREAM_INNER + ".")
        }
        connection = {
            rest[len(UPSTREAM_HYPER_CONNECTION) + 1 :]: v
            for rest, v in entries.items()
            if rest.startswith(UPSTREAM_HYPER_CONNECTION + ".")
        }
        stray = (
            set(entries)
            - {f"{UPSTREAM_INNER}.{k}" for k in inner}
            - {f"{UPSTREAM_HYPER_CONNECTION}.{k}" for k in connection}
        )
        if stray or not inner or not connection:
            raise ConversionError(
                f"{head}: an upstream Hybrid mHC layer holds only {UPSTREAM_HYPER_CONNECTION}.* and "
                f"{UPSTREAM_INNER}.* keys (found {sorted(stray) or 'one of them missing'})"
            )
        kinds = [
            name
            for marker, name in HYPER_CONNECTION_BY_INNER
            if any(k.startswith(marker) for k in inner)
        ]
        if len(kinds) != 1:
            raise ConversionError(
                f"{head}: cannot tell which sub-block the hyper connection wraps (inner layer has "
                f"{'both ' + ' and '.join(kinds) if kinds else 'no mixer, self_attention or mlp'} "
                "parameters); megatron-ext's Hybrid layers are Mamba, attention-only or MLP/MoE-only"
            )
        for rest, value in inner.items():
            converted[f"{head}{rest}"] = value
        for name, value in connection.items():
            converted[f"{head}{kinds[0]}.{name}"] = value
    return converted


# The parameters whose rows (weight) or entries (bias) hold the [pre | post | res] logits.
RES_ROW_PARAMETERS = (
    ("_hyper_connection.mapping_proj.weight", -2),
    ("_hyper_connection.bias", -1),
)


def res_transposition(width: int) -> list[int] | None:
    """The order of the ``width = 2n + n²`` logits with the n×n res block transposed (row
    ``2n + i*n + j`` takes ``2n + j*n + i``); None when ``width`` has no such n (Birkhoff's n!
    block is not upstream's and has no transpose here)."""
    n = round((width + 1) ** 0.5) - 1
    if n < 1 or n * n + 2 * n != width:
        return None
    res = [2 * n + j * n + i for i in range(n) for j in range(n)]
    return [*range(2 * n), *res]


def transpose_main_res(state_dict: Mapping[str, Any], name_of: Any = None) -> dict[str, Any]:
    """``state_dict`` with the res block of every hyper connection transposed (an
    involution: main's orientation <-> ours). ``name_of(key)`` gives a key's parameter name
    (torch_dist keys carry optimizer and shard parts); values that are not tensors pass."""
    import torch

    converted = dict(state_dict)
    for key, value in state_dict.items():
        name = name_of(key) if name_of else key
        dim = next((d for suffix, d in RES_ROW_PARAMETERS if name.endswith(suffix)), None)
        if dim is None or not isinstance(value, torch.Tensor) or value.dim() < -dim:
            continue
        order = res_transposition(value.shape[dim])
        if order is None:
            raise ConversionError(
                f"{key}: {value.shape[dim]} logits is not 2n + n² for any n (a Birkhoff "
                "checkpoint?); --source main checkpoints use Sinkhorn's n² res logits"
            )
        index = torch.tensor(order, device=value.device)
        converted[key] = value.index_select(value.dim() + dim, index)
    return converted


def notes_for(source: str, model: str, state_dict: Mapping[str, Any]) -> list[str]:
    """What a user loading a ``source`` checkpoint of ``model`` must know beyond the keys."""
    notes = []
    if source == "main":
        notes.append(H_RES_NOTE)
    if model == "gpt" and any(k.endswith("decoder.hc_head_fn") for k in state_dict):
        notes.append(LEARNED_CONTRACTION_NOTE)
    outside = sorted(k for k in state_dict if "hyper_connection" in k and not _LAYER_KEY.match(k))
    if model == "hybrid" and outside:
        notes.append(
            f"{len(outside)} hyper-connection keys outside decoder.layers (e.g. {outside[0]}; MTP "
            "layers) were left unchanged: MTP layouts differ between upstream and megatron-ext "
            "beyond renaming (upstream's e_proj/h_proj), and are not converted."
        )
    return notes


def already_named_note(state_dict: Mapping[str, Any], model: str, to: str) -> str | None:
    """A note when the input's decoder layers already carry ``to``'s names, so the keys are
    written unchanged (a format change only); None otherwise."""
    if model != "hybrid":
        return None
    layers, _ = _by_layer(state_dict)
    if not layers:
        return None
    done = is_upstream_layer if to == "upstream" else is_our_layer
    if not all(done(entries) for entries in layers.values()):
        return None
    names = "upstream Megatron-LM's" if to == "upstream" else "megatron-ext's"
    return f"the input already has {names} Hybrid names: keys written unchanged"


def convert_state_dict(state_dict: Mapping[str, Any], model: str, to: str) -> dict[str, Any]:
    """One model state dict to ``to`` ("upstream" or "megatron-ext"). GPT keys are the same in
    both layouts and come back unchanged."""
    if model == "gpt":
        return dict(state_dict)
    if model != "hybrid":
        raise ConversionError(f"model must be 'gpt' or 'hybrid', got {model!r}")
    if to == "upstream":
        return hybrid_to_upstream(state_dict)
    if to == "megatron-ext":
        return hybrid_from_upstream(state_dict)
    raise ConversionError(f"to must be 'upstream' or 'megatron-ext', got {to!r}")


def _model_entries(checkpoint: Mapping[str, Any]) -> list[str]:
    """The keys of a Megatron torch checkpoint that hold model state dicts ("model", or
    "model0", "model1", ... under virtual pipeline stages); none for a bare state dict."""
    return sorted(
        k
        for k in checkpoint
        if re.fullmatch(r"model\d*", str(k)) and isinstance(checkpoint[k], Mapping)
    )


def _unsafe_global(exc: Exception) -> str:
    """The global torch's weights-only unpickler refused, out of its multi-line message."""
    found = re.search(r"GLOBAL ([\w.]+)", str(exc))
    return found[1] if found else "an object that is not a tensor or a plain container"


def load_checkpoint(path: str, trust_pickle: bool = False) -> Any:
    """``torch.load`` with ``weights_only=True`` (tensors, containers and megatron-core's own
    safe types, :data:`megatron.core.safe_globals.SAFE_GLOBALS`): a pickle that names any other
    global is refused, since unpickling it could run code. ``trust_pickle`` (the CLI's
    ``--trust-pickle``) is the explicit opt-in for a legacy file the user trusts."""
    import pickle

    import torch

    from megatron_ext import files

    try:  # only a regular file: a FIFO would block torch.load forever (issue 40, item 6)
        stream = files.open_regular(path, "rb")
    except files.NotRegularFile as exc:
        raise ConversionError(str(exc.strerror)) from None
    except OSError as exc:
        raise ConversionError(f"{path} cannot be read: {files.failure_reason(exc)}") from None
    try:
        with stream:
            if trust_pickle:
                return torch.load(stream, map_location="cpu", weights_only=False)
            from megatron_ext.checkpoint.safe_pickle import allowed_globals

            with torch.serialization.safe_globals(allowed_globals()):
                return torch.load(stream, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "Weights only load failed" not in str(exc):
            raise ConversionError(f"{path} is not a torch.save file ({_first_line(exc)})") from None
        raise ConversionError(
            f"{path} holds {_unsafe_global(exc)}, which loading could use to run code; it was not "
            f"loaded. If you made this file or trust its source, rerun with {TRUST_FLAG}"
        ) from None
    except (IsADirectoryError, FileNotFoundError, PermissionError) as exc:
        raise ConversionError(f"{path} cannot be read: {exc.strerror}") from None
    except Exception as exc:  # torch raises RuntimeError, EOFError, ValueError... on junk
        raise ConversionError(
            f"{path} is not a torch.save file ({type(exc).__name__}: {_first_line(exc)})"
        ) from None


def _first_line(exc: Exception) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if isinstance(exc, EOFError):
        return "the file is empty or truncated"
    return lines[0][:200] if lines else type(exc).__name__


def _check_keys(state_dict: Mapping[Any, Any], where: str) -> None:
    bad = [k for k in state_dict if not isinstance(k, str)]
    if bad:
        raise ConversionError(
            f"{where} has {len(bad)} keys that are not strings (e.g. {bad[0]!r}); a model state "
            "dict maps parameter names to tensors"
        )


def _save_atomically(obj: Any, target_path: str) -> None:
    """Write beside the target and rename, so a failed write leaves no half file and never
    replaces the previous one."""
    import os
    import tempfile

    import torch

    from megatron_ext.files import output_problem

    directory = os.path.dirname(os.path.abspath(target_path))
    if (problem := output_problem(target_path)) is not None:  # never rename over a device
        raise ConversionError(problem)
    if not os.path.isdir(directory):
        raise ConversionError(f"output directory {directory} does not exist; create it first")
    try:
        handle, temporary = tempfile.mkstemp(dir=directory, prefix=".convert-", suffix=".pt")
    except OSError as exc:
        raise ConversionError(f"cannot write in {directory}: {exc.strerror}") from None
    try:
        with os.fdopen(handle, "wb") as stream:
            torch.save(obj, stream)
        os.replace(temporary, target_path)
    except (OSError, RuntimeError) as exc:
        os.unlink(temporary)
        raise ConversionError(f"cannot write {target_path}: {_first_line(exc)}") from None


def convert_file(
    source_path: str,
    target_path: str,
    model: str,
    to: str,
    source: str,
    trust_pickle: bool = False,
    convert: Any = None,
) -> list[str]:
    """Convert a ``torch.save`` file: a bare model state dict or Megatron's torch-format
    checkpoint (``model_optim_rng.pt``; the model entries only, everything else copied).
    Returns the notes a user should read (see :func:`notes_for`). The input is read with
    ``weights_only=True`` unless ``trust_pickle`` (see :func:`load_checkpoint`).
    ``convert(state_dict, model, to)`` replaces :func:`convert_state_dict` (the CLI's
    ``--mhc-names``: :func:`megatron_ext.checkpoint.hc_names.convert_mhc_names`)."""
    import os

    convert = convert or convert_state_dict

    if (
        os.path.exists(source_path)
        and os.path.exists(target_path)
        and os.path.samefile(source_path, target_path)
    ):
        raise ConversionError(f"output {target_path} is the input; give another file name")
    from megatron_ext.files import output_problem

    if (problem := output_problem(target_path)) is not None:  # before reading the input
        raise ConversionError(problem)
    checkpoint = load_checkpoint(source_path, trust_pickle)
    if not isinstance(checkpoint, Mapping):
        raise ConversionError(
            f"{source_path}: expected a state dict or a Megatron checkpoint, got {type(checkpoint).__name__}"
        )
    entries = _model_entries(checkpoint)
    notes: list[str] = []
    if entries:
        converted = dict(checkpoint)
        for entry in entries:
            _check_keys(checkpoint[entry], f"{source_path}'s {entry!r}")
            notes += notes_for(source, model, checkpoint[entry])
            if convert is convert_state_dict:
                notes += filter(None, [already_named_note(checkpoint[entry], model, to)])
            converted[entry] = convert(_in_our_orientation(checkpoint[entry], source), model, to)
    else:
        _check_keys(checkpoint, source_path)
        notes += notes_for(source, model, checkpoint)
        if convert is convert_state_dict:
            notes += filter(None, [already_named_note(checkpoint, model, to)])
        converted = convert(_in_our_orientation(checkpoint, source), model, to)
    _save_atomically(converted, target_path)
    return list(dict.fromkeys(notes))


FORMATS = ("torch_dist", "torch")


def convert_path(
    source_path: str,
    target_path: str,
    model: str,
    to: str,
    source: str,
    output_format: str | None = None,
    trust_pickle: bool = False,
    convert: Any = None,
) -> list[str]:
    """``convert-checkpoint``: a torch_dist checkpoint (an iteration directory, a checkpoint
    root with its tracker, or a run directory) or a ``torch.save`` file, renamed to ``to``
    and written as ``output_format`` (default: the input's). Returns the notes to show.
    ``convert``: as for :func:`convert_file` (the CLI's ``--mhc-names``)."""
    from megatron_ext.checkpoint import torch_dist

    if output_format not in (None, *FORMATS):
        raise ConversionError(
            f"--format must be one of {', '.join(FORMATS)}, got {output_format!r}"
        )
    if not torch_dist.is_torch_dist(source_path):
        if output_format == "torch_dist":
            raise ConversionError(
                f"{source_path} is a single-file torch checkpoint: writing torch_dist from it is "
                "not supported (it lacks megatron's common state and sharded objects); convert "
                "with --format torch, or start a run from it with checkpoint.finetune"
            )
        return convert_file(source_path, target_path, model, to, source, trust_pickle, convert)
    if convert is not None and (output_format or "torch_dist") == "torch_dist":
        # the names join three tensors into one (scale) and number every layer: a plain
        # state dict's spelling, not a torch_dist directory's (stacked layers, optimizer state)
        raise ConversionError(
            "--mhc-names writes a plain state dict (per-layer transformers / DeepSeek names): "
            "from a torch_dist input add --format torch"
        )
    convert = convert or convert_state_dict
    try:
        state, _ = _read_torch_dist(source_path, trust_pickle)
        state = _in_our_orientation(state, source, name_of=torch_dist.parameter_name)
        weights = torch_dist.model_weights(state)
        notes = notes_for(source, model, weights)
        if convert is convert_state_dict and (note := already_named_note(weights, model, to)):
            notes.append(note)
        if (output_format or "torch_dist") == "torch":
            _check_output_file(target_path)
            _save_atomically(convert(weights, model, to), target_path)
            return [*notes, _WEIGHTS_ONLY_NOTE]
        renamed = torch_dist.rename_keys(state, lambda sd: convert(sd, model, to))
        torch_dist.write(renamed, target_path, torch_dist.tracker_iteration(source_path))
    except torch_dist.TorchDistError as exc:
        raise ConversionError(str(exc)) from None
    return notes


def _in_our_orientation(state: Mapping[str, Any], source: str, name_of: Any = None) -> Any:
    """A ``source`` state with H_res in megatron-ext's orientation (only main's differs)."""
    return transpose_main_res(state, name_of) if source == "main" else state


_WEIGHTS_ONLY_NOTE = (
    "--format torch writes the model weights only (a plain state dict, stacked layers split "
    "per layer); the optimizer state, RNG state and args stay in the torch_dist checkpoint"
)


def _read_torch_dist(path: str, trust_pickle: bool) -> tuple[dict[str, Any], Any]:
    from megatron_ext.checkpoint import safe_pickle, torch_dist

    try:
        return torch_dist.read(path, trust_pickle)
    except safe_pickle.UnsafeCheckpoint as exc:
        raise ConversionError(str(exc)) from None


def _check_output_file(target_path: str) -> None:
    import os

    if os.path.exists(target_path) and not os.path.isfile(target_path):
        raise ConversionError(f"output {target_path} exists and is not a regular file")
