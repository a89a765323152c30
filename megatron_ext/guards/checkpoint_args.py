"""Checkpoint compatibility beyond megatron-core's own ``check_checkpoint_args``.

Two loads that megatron 0.19.2 lets through silently and that give a different model:

- an mHC checkpoint into an mHC-off model (or a different stream count): a ``torch_dist``
  load reads only the keys the model asks for, so the hyper-connection weights are dropped;
- a resume whose tensor-parallel size changes the padded vocabulary (upstream compares
  ``padded_vocab_size`` only without a distributed checkpoint and with a vocab file): the
  embedding is read with ``allow_shape_mismatch`` and the loss changes.

Both are refused with the settings involved and the fix. ``MEGATRON_EXT_ALLOW_CKPT_MISMATCH=1``
loads anyway (with a warning), for a deliberate conversion.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from typing import Any

from megatron_ext.errors import MegatronExtError

ALLOW_ENV = "MEGATRON_EXT_ALLOW_CKPT_MISMATCH"
MHC_FIELDS = (
    "enable_mhc_connections",
    "mhc_num_residual_streams",
    "mhc_h_res_method",
    "mhc_variant",
)


class CheckpointMismatchError(MegatronExtError, AssertionError):
    """The checkpoint was written for a model this run would build differently."""


def _padded(vocab: int, divisible_by: int, tp: int) -> int:
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def _mhc_settings(ns: Any) -> dict[str, Any]:
    """mHC on/off and, when on, its stream count and H_res method (off: they mean nothing;
    a checkpoint from before mhc_h_res_method existed is sinkhorn)."""
    on = bool(getattr(ns, "enable_mhc_connections", False))
    return {
        "enable_mhc_connections": on,
        "mhc_num_residual_streams": getattr(ns, "mhc_num_residual_streams", None) if on else None,
        "mhc_h_res_method": getattr(ns, "mhc_h_res_method", "sinkhorn") if on else None,
        "mhc_variant": getattr(ns, "mhc_variant", "megatron") if on else None,
    }


def mhc_mismatch(checkpoint_args: Any, args: Any) -> str | None:
    saved, now = _mhc_settings(checkpoint_args), _mhc_settings(args)
    diffs = [
        f"{name}: checkpoint {saved[name]!r}, now {now[name]!r}"
        for name in MHC_FIELDS
        if saved[name] != now[name]
    ]
    if not diffs:
        return None
    return (
        "the checkpoint's mHC settings differ from this model's (" + "; ".join(diffs) + "); the "
        "hyper-connection weights would be dropped or misread. Use the checkpoint's mHC flags "
        f"(--enable-mhc-connections, --mhc-num-residual-streams, --mhc-h-res-method, --mhc-variant), or set {ALLOW_ENV}=1 to load anyway"
    )


def vocab_mismatch(checkpoint_args: Any, args: Any) -> str | None:
    saved = getattr(checkpoint_args, "padded_vocab_size", None)
    now = getattr(args, "padded_vocab_size", None)
    if saved is None or now is None or saved == now:
        return None
    saved_tp = getattr(checkpoint_args, "tensor_model_parallel_size", None)
    tp = getattr(args, "tensor_model_parallel_size", 1)
    fix = ""
    divisible = getattr(checkpoint_args, "make_vocab_size_divisible_by", None)
    vocab = getattr(args, "vocab_size", None) or getattr(checkpoint_args, "vocab_size", None)
    if divisible and saved_tp and vocab:
        candidate = divisible * saved_tp // tp if (divisible * saved_tp) % tp == 0 else None
        if candidate and _padded(vocab, candidate, tp) == saved:
            fix = (
                f"pass --make-vocab-size-divisible-by {candidate} to keep the checkpoint's padding"
            )
    fix = (
        fix or "pin --make-vocab-size-divisible-by so the padded vocabulary stays the checkpoint's"
    )
    return (
        f"the padded vocabulary changes on resume: {saved} in the checkpoint (TP {saved_tp}), {now} "
        f"now (TP {tp}); the embedding and output rows would be re-cut and the loss would change. "
        f"{fix[0].upper()}{fix[1:]} (or set {ALLOW_ENV}=1 to load anyway)"
    )


def checking_model_settings(original: Callable[..., None]) -> Callable[..., None]:
    """Wrap megatron's ``check_checkpoint_args`` with the two checks above."""

    @functools.wraps(original)
    def check_checkpoint_args(checkpoint_args, *a: Any, **kw: Any) -> None:
        original(checkpoint_args, *a, **kw)
        from megatron.training import get_args

        args = get_args()
        problems = [
            p
            for p in (mhc_mismatch(checkpoint_args, args), vocab_mismatch(checkpoint_args, args))
            if p
        ]
        if not problems:
            return
        if os.environ.get(ALLOW_ENV) == "1":
            for problem in problems:
                warnings.warn(problem, stacklevel=2)
            return
        raise CheckpointMismatchError(" | ".join(problems))

    return check_checkpoint_args


def refusing_mhc_mismatch_before_loading(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap megatron's ``_maybe_setup_gpt_to_hybrid_load(args, ckpt_args, model)``, which
    ``load_checkpoint`` calls with a ``torch_dist`` checkpoint's args *before* it reads any
    tensor: a different mHC shape (stream count, H_res method) would otherwise fail there first
    with dist-checkpointing's bare "Global shape mismatch"."""

    @functools.wraps(original)
    def maybe_setup_gpt_to_hybrid_load(args, ckpt_args, *a: Any, **kw: Any):
        if getattr(ckpt_args, "num_layers", None) is not None:  # args were saved
            problem = mhc_mismatch(ckpt_args, args)
            if problem and os.environ.get(ALLOW_ENV) != "1":
                raise CheckpointMismatchError(problem)
        return original(args, ckpt_args, *a, **kw)

    return maybe_setup_gpt_to_hybrid_load
