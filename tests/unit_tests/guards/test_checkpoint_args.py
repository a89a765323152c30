"""Loading a checkpoint whose mHC settings or padded vocabulary differ from the model's is
refused (megatron's own check_checkpoint_args lets both through), naming the fix."""

from __future__ import annotations

import argparse

import pytest

import megatron_ext
from megatron_ext import registry
from megatron_ext.guards.checkpoint_args import ALLOW_ENV, CheckpointMismatchError

TARGET = "megatron.training.checkpointing:check_checkpoint_args"


def _args(**fields):
    base = dict(
        num_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        add_position_embedding=True,
        vocab_file=None,
        data_parallel_random_init=False,
        phase_transition_iterations=None,
        enable_mhc_connections=False,
        mhc_num_residual_streams=4,
        vocab_size=128,
        make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=2,
        padded_vocab_size=256,
        use_dist_ckpt=True,
        pipeline_model_parallel_size=1,
    )
    base.update(fields)
    return argparse.Namespace(**base)


@pytest.fixture
def current_args(monkeypatch):
    from megatron.training import checkpointing, global_vars

    megatron_ext.install()
    monkeypatch.setattr(checkpointing, "get_checkpoint_version", lambda: 3.0)
    monkeypatch.delenv(ALLOW_ENV, raising=False)

    def use(**fields):
        monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", _args(**fields))

    return use


def _check(checkpoint_args):
    from megatron.training import checkpointing

    checkpointing.check_checkpoint_args(checkpoint_args)


def test_same_settings_load(current_args):
    current_args(enable_mhc_connections=True)
    _check(_args(enable_mhc_connections=True))
    current_args()
    _check(_args(mhc_num_residual_streams=2))  # mHC off in both: the stream count means nothing


@pytest.mark.parametrize(
    "saved, now, field",
    [
        (
            dict(enable_mhc_connections=True),
            dict(),
            "enable_mhc_connections: checkpoint True, now False",
        ),
        (
            dict(),
            dict(enable_mhc_connections=True),
            "enable_mhc_connections: checkpoint False, now True",
        ),
        (
            dict(enable_mhc_connections=True, mhc_num_residual_streams=4),
            dict(enable_mhc_connections=True, mhc_num_residual_streams=2),
            "mhc_num_residual_streams: checkpoint 4, now 2",
        ),
        (
            dict(enable_mhc_connections=True),  # written before mhc_h_res_method existed
            dict(enable_mhc_connections=True, mhc_h_res_method="birkhoff"),
            "mhc_h_res_method: checkpoint 'sinkhorn', now 'birkhoff'.*--mhc-h-res-method",
        ),
        (
            dict(enable_mhc_connections=True),  # written before mhc_variant existed
            dict(enable_mhc_connections=True, mhc_variant="deepseek-v4"),
            "mhc_variant: checkpoint 'megatron', now 'deepseek-v4'.*--mhc-variant",
        ),
    ],
)
def test_mhc_mismatch_is_refused(current_args, saved, now, field):
    current_args(**now)
    with pytest.raises(CheckpointMismatchError, match=field):
        _check(_args(**saved))


def test_tp_change_that_repads_the_vocabulary_is_refused_with_the_flag_to_pin_it(current_args):
    current_args(tensor_model_parallel_size=1, padded_vocab_size=128)
    with pytest.raises(
        CheckpointMismatchError,
        match=r"256 in the checkpoint \(TP 2\), 128 now \(TP 1\).*"
        r"--make-vocab-size-divisible-by 256",
    ):
        _check(_args())
    current_args(
        tensor_model_parallel_size=1, padded_vocab_size=256, make_vocab_size_divisible_by=256
    )
    _check(_args())  # pinned: same padding, loads


def test_explicit_opt_in_loads_with_a_warning(current_args, monkeypatch):
    current_args()
    monkeypatch.setenv(ALLOW_ENV, "1")
    with pytest.warns(UserWarning, match="mHC settings differ"):
        _check(_args(enable_mhc_connections=True))


def test_megatron_alone_lets_both_through(current_args):
    """Why the registry wraps check_checkpoint_args."""
    current_args(tensor_model_parallel_size=1, padded_vocab_size=128)
    with registry.suspended(TARGET):
        _check(_args(enable_mhc_connections=True))


def test_torch_dist_load_is_refused_before_any_tensor_is_read(current_args):
    """load_checkpoint hands a torch_dist checkpoint's args to _maybe_setup_gpt_to_hybrid_load
    before reading tensors; there a different H_res method is refused with the flag, instead of
    dist checkpointing's bare shape mismatch (checked end to end by hand: a sinkhorn
    gpt_mhc_tp2_pp2_sp checkpoint resumed with --mhc-h-res-method birkhoff)."""
    import types

    from megatron.training import checkpointing

    saved = _args(enable_mhc_connections=True)
    now = _args(enable_mhc_connections=True, mhc_h_res_method="birkhoff")
    with pytest.raises(CheckpointMismatchError, match="--mhc-h-res-method"):
        checkpointing._maybe_setup_gpt_to_hybrid_load(now, saved, [])
    # No saved args (an old or foreign checkpoint): nothing to compare, megatron decides.
    checkpointing._maybe_setup_gpt_to_hybrid_load(now, types.SimpleNamespace(), [])
