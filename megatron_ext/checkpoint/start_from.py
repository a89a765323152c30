"""Starting a run from a checkpoint: the recipe's ``checkpoint.load`` / ``finetune`` /
``load_optim``, and a resume under another parallel layout.

``checkpoint.load: DIR`` accepts a run directory (its ``checkpoints/``), a checkpoint root (a
``latest_checkpointed_iteration.txt`` beside ``iter_*``) or one saved iteration
(``.../iter_0000040``: loaded through ``--ckpt-step``). Before any rank starts, the
checkpoint's own Megatron args are read (from its ``common_state`` byte item, ``common.pt`` or a
torch-format file, all through :mod:`megatron_ext.checkpoint.safe_pickle`) and compared with
the recipe: another model shape, mHC stream count or H_res method, or another vocabulary is
refused, one line per field naming both values.

The Megatron flags (:func:`megatron_args`):

- ``--load ROOT`` (and ``--ckpt-step N`` for one iteration);
- ``--finetune`` with ``checkpoint.finetune`` (megatron: model weights only, iteration 0, a
  fresh optimizer and scheduler);
- ``--no-load-optim`` without ``checkpoint.load_optim``;
- ``--override-opt_param-scheduler`` when the iteration and optimizer continue: the
  scheduler's hyper-parameters come from this recipe (its ``training.iterations`` may differ),
  its step count from the checkpoint (megatron otherwise asserts they match);
- ``--make-vocab-size-divisible-by P/TP`` when this run's TP differs from the checkpoint's:
  megatron pads the vocabulary to a multiple of ``divisible_by x TP``, so the checkpoint's
  padded size P is kept (the embedding and output layer load at their saved shape).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_ext.checkpoint import safe_pickle
from megatron_ext.errors import MegatronExtError

COMMON_STATE = "common_state/"


class StartFromError(MegatronExtError, ValueError):
    """``checkpoint.load`` names no usable checkpoint (one line)."""


@dataclass(frozen=True)
class Source:
    root: Path
    step: int | None  # None: the tracker's iteration

    @property
    def iteration_dir(self) -> Path:
        target = safe_pickle.iteration_to_load(self.root, self.step)
        assert target is not None
        return target


def resolve(text: str | Path) -> Source:
    """The checkpoint root and step ``checkpoint.load`` names (see the module docstring)."""
    path = Path(text).expanduser().resolve()
    if not path.exists():
        raise StartFromError(f"{text} does not exist")
    if (path / "checkpoints").is_dir() and not (path / safe_pickle.TRACKER).exists():
        path = path / "checkpoints"
    if (path / safe_pickle.TRACKER).is_file():
        target = safe_pickle.iteration_to_load(path)
        if target is None or not target.is_dir():
            raise StartFromError(
                f"{path / safe_pickle.TRACKER} names no saved iteration in {path}; write the "
                "iteration of an iter_NNNNNNN directory there"
            )
        return Source(path, None)
    if re.fullmatch(r"iter_\d{7}", path.name) and (
        (path / safe_pickle.METADATA_FILE).is_file() or (path / "common.pt").is_file()
    ):
        return Source(path.parent, int(path.name[len("iter_") :]))
    raise StartFromError(
        f"{text} is not a checkpoint: give a run directory, its checkpoints/ (with "
        f"{safe_pickle.TRACKER}) or one iter_NNNNNNN directory"
    )


def checkpoint_state(source: Source) -> dict[str, Any]:
    """Megatron's common state of the checkpoint (``args``, ``iteration``, ...), read safely."""
    directory = source.iteration_dir
    if (directory / "common.pt").is_file():
        return dict(safe_pickle.load_torch_save(directory / "common.pt"))
    if (directory / safe_pickle.METADATA_FILE).is_file():
        return _common_state_item(directory)
    for path in sorted(directory.glob("mp_rank_*/model_optim_rng.pt")):
        return dict(safe_pickle.load_torch_save(path))
    raise StartFromError(f"{directory} holds no Megatron checkpoint (.metadata or common.pt)")


def _common_state_item(directory: Path) -> dict[str, Any]:
    import io

    metadata = safe_pickle.load_metadata(directory / safe_pickle.METADATA_FILE)
    for index, info in (metadata.storage_data or {}).items():
        if str(getattr(index, "fqn", "")).startswith(COMMON_STATE):
            with open(directory / info.relative_path, "rb") as stream:
                stream.seek(info.offset)
                blob = io.BytesIO(stream.read(info.length))
            value = safe_pickle.load_torch_save(blob, f"{directory} ({index.fqn})")
            return dict(value[0] if isinstance(value, list) else value)
    raise StartFromError(
        f"{directory} has no common state (a torch_dist save by megatron.training)"
    )


def _expected(recipe: Any) -> dict[str, Any]:
    """The checkpoint args this recipe's model must match, by Megatron argument name."""
    m = recipe.model
    fields: dict[str, tuple[str, Any]] = {
        "hidden_size": ("model.hidden_size", m.hidden_size),
        "num_attention_heads": ("model.num_attention_heads", m.num_attention_heads),
        "enable_mhc_connections": ("model.mhc.enabled", bool(m.mhc.enabled)),
        "vocab_size": ("data.tokenizer.vocab_size", recipe.data.tokenizer.vocab_size),
        "tokenizer_type": ("data.tokenizer.type", recipe.data.tokenizer.type),
    }
    if m.type == "gpt":
        fields["num_layers"] = ("model.num_layers", m.num_layers)
    else:
        fields["hybrid_layer_pattern"] = ("model.hybrid_layer_pattern", m.hybrid_layer_pattern)
    if m.ffn_hidden_size:
        fields["ffn_hidden_size"] = ("model.ffn_hidden_size", m.ffn_hidden_size)
    if m.mhc.enabled:
        fields["mhc_num_residual_streams"] = (
            "model.mhc.num_residual_streams",
            m.mhc.num_residual_streams,
        )
        fields["mhc_h_res_method"] = ("model.mhc.h_res_method", m.mhc.h_res_method)
    return fields


def mismatches(recipe: Any, args: Any, where: str) -> list[str]:
    """One line per field in which the recipe's model differs from the checkpoint's args."""
    problems = []
    for name, (field_name, ours) in _expected(recipe).items():
        if not hasattr(args, name) or ours is None:
            continue
        theirs = getattr(args, name)
        if name == "mhc_h_res_method" and theirs is None:
            theirs = "sinkhorn"  # saved before the method existed
        if name == "hybrid_layer_pattern":  # '|' only splits the layers over PP stages
            theirs = theirs or getattr(args, "hybrid_override_pattern", None)
            if str(theirs).replace("|", "") == str(ours).replace("|", ""):
                continue
        if theirs != ours and not (theirs is None and name.startswith("mhc_")):
            problems.append(
                f"{where}: {field_name} is {ours!r} here but {theirs!r} in the checkpoint "
                f"(--{name.replace('_', '-')}); a checkpoint loads only into the model it was "
                f"saved from: set {field_name}: {theirs!r} or load another checkpoint"
            )
    return problems


def problems(recipe: Any) -> list[str]:
    """Why ``checkpoint.load`` cannot start this run (empty: it can), before any rank."""
    c = recipe.checkpoint
    if c.load and (recipe.test.type == "ckpt-resume" or recipe.model.type == "multimodule"):
        return [
            "checkpoint.load: applies to runs that save and resume (a gpt or hybrid recipe with "
            "test.type regular); set test.type: regular or remove checkpoint.load"
        ]
    if not c.load:
        if c.finetune or not c.load_optim:
            field_name = "checkpoint.finetune" if c.finetune else "checkpoint.load_optim"
            return [f"{field_name}: applies to checkpoint.load, which is not set; set it"]
        return []
    try:
        source = resolve(c.load)
        state = checkpoint_state(source)
    except (StartFromError, safe_pickle.UnsafeCheckpoint) as exc:
        return [f"checkpoint.load: {exc}"]
    args = state.get("args")
    if args is None:
        return [f"checkpoint.load: {c.load} holds no Megatron args; cannot check it"]
    found = mismatches(recipe, args, "checkpoint.load")
    if (why := optimizer_layout_problem(recipe, args, source)) is not None:
        found.append(f"checkpoint.load: {why}")
    return found


def optimizer_layout_problem(recipe: Any, args: Any, source: Source) -> str | None:
    """The layout changes ``run --resume`` refuses because Megatron cannot load the optimizer
    state across them (:func:`ep_change_problem`), refused the
    same way when the optimizer state comes through ``checkpoint.load`` (issue 40, item 8)."""
    c = recipe.checkpoint
    if c.finetune or not c.load_optim or not has_optimizer_state(source):
        return None
    return ep_change_problem(
        getattr(args, "expert_model_parallel_size", 1),
        recipe.parallelism.ep,
        "set checkpoint.load_optim: false (a fresh optimizer)",
    )


def ep_change_problem(old: int | None, new: int | None, other_way: str) -> str | None:
    """Why an optimizer state saved under expert parallelism ``old`` cannot be loaded under
    ``new`` (None: it can); the one rule for ``run --resume`` and ``checkpoint.load``.
    ``other_way``: the caller's alternative to keeping the EP side."""
    old, new = old or 1, new or 1
    if (old > 1) == (new > 1):
        return None
    return (
        f"parallelism.ep {old} -> {new}: Megatron keeps the experts' optimizer state apart "
        f"only when ep > 1 and cannot load it across that change; keep ep "
        f"{'> 1' if old > 1 else '= 1'}, or {other_way}"
    )


def has_optimizer_state(source: Source) -> bool:
    """Whether the saved iteration holds optimizer state (a torch_dist save's ``optimizer.*``
    items; a torch-format save is assumed to)."""
    directory = source.iteration_dir
    if not (directory / safe_pickle.METADATA_FILE).is_file():
        return True
    metadata = safe_pickle.load_metadata(directory / safe_pickle.METADATA_FILE)
    return any(str(key).startswith("optimizer.") for key in metadata.state_dict_metadata)


def saved_args(root: str | Path) -> Any | None:
    """The args of the checkpoint a resume of ROOT (a checkpoints/ directory) loads."""
    try:
        state = checkpoint_state(Source(Path(root), None))
    except (StartFromError, safe_pickle.UnsafeCheckpoint, OSError):
        return None
    return state.get("args")


def vocab_args(args: Any, tp: int) -> list[str]:
    """``--make-vocab-size-divisible-by`` keeping the checkpoint's padded vocabulary under
    tensor-parallel size ``tp`` (none when the saved TP is the same or nothing is needed)."""
    padded = getattr(args, "padded_vocab_size", None)
    saved_tp = getattr(args, "tensor_model_parallel_size", tp)
    if not padded or saved_tp == tp or padded % tp:
        return []
    return ["--make-vocab-size-divisible-by", str(padded // tp)]


def megatron_args(recipe: Any) -> list[str]:
    """The flags of a first start from ``checkpoint.load`` (see the module docstring)."""
    c = recipe.checkpoint
    try:
        source = resolve(c.load)
    except StartFromError:  # validation names it; a dry run still shows the flag
        return ["--load", str(c.load)]
    args = ["--load", str(source.root)]
    if source.step is not None:
        args += ["--ckpt-step", str(source.step)]
    if c.finetune:
        args.append("--finetune")
    else:
        args.append("--override-opt_param-scheduler")
    if not c.load_optim:
        args.append("--no-load-optim")
    saved = None
    try:
        saved = checkpoint_state(source).get("args")
    except (StartFromError, safe_pickle.UnsafeCheckpoint):
        pass
    if saved is not None and "--make-vocab-size-divisible-by" not in recipe.extra_args:
        args += vocab_args(saved, recipe.parallelism.tp)
    return args
