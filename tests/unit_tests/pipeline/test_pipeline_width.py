"""The one pipeline-width calculation, as both schedules' shapes pass through it."""

import types

import pytest

from megatron.core.pipeline_parallel.schedules import get_tensor_shapes

from megatron_ext.pipeline.shapes import pipeline_hidden_size, pipeline_tensor_shape


def _config(mhc=True, streams=4, sp=False, variable=False):
    return types.SimpleNamespace(
        enable_mhc_connections=mhc,
        mhc_num_residual_streams=streams,
        hidden_size=32,
        sequence_parallel=sp,
        variable_seq_lengths=variable,
    )


class _Group:
    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size


def test_width_is_n_streams_only_with_mhc_and_pipeline():
    assert pipeline_hidden_size(_config(), 2) == 128
    assert pipeline_hidden_size(_config(), 1) == 32
    assert pipeline_hidden_size(_config(mhc=False), 4) == 32
    assert (
        pipeline_hidden_size(types.SimpleNamespace(hidden_size=32), 4) == 32
    )  # plain TransformerConfig


@pytest.mark.parametrize(
    "tp, cp, sp", [(1, 1, False), (2, 1, True), (1, 2, False), (2, 2, True), (2, 1, False)]
)
def test_1f1b_shapes_keep_megatron_sequence_split_and_widen(tp, cp, sp):
    """megatron's get_tensor_shapes divides s by CP (and TP under SP); we change only h."""
    config = _config(sp=sp)
    shapes = get_tensor_shapes(
        seq_length=64,
        micro_batch_size=2,
        decoder_seq_length=None,
        config=config,
        tp_group=_Group(tp),
        cp_group=_Group(cp),
    )
    seq = 64 // cp // (tp if sp else 1)
    assert [list(pipeline_tensor_shape(config, s, 2)) for s in shapes] == [[seq, 2, 128]]


def test_interleaved_inline_shape_is_widened():
    # forward_backward_pipelining_with_interleaving builds [s, b, hidden_size] inline.
    assert pipeline_tensor_shape(_config(), [16, 2, 32], 2) == [16, 2, 128]


def test_variable_sequence_lengths_and_unknown_shapes_are_left_to_megatron():
    assert pipeline_tensor_shape(_config(variable=True), (), 2) == ()
    assert pipeline_tensor_shape(_config(), None, 2) is None
    assert pipeline_tensor_shape(_config(), [16, 2, 128], 2) == [16, 2, 128]


@pytest.mark.parametrize("schedules_size_streams", [False, True])
def test_a_megatron_that_sizes_n_streams_itself_is_not_widened_twice(
    monkeypatch, schedules_size_streams
):
    """Issue 39: megatron-core with native mHC under PP (Megatron-LM #4946) already gives its
    buffers n * hidden_size; that width, like hidden_size, becomes the payload's wire width
    (single-pass mHC: the streams and the fp32 coefficients), never n * (n * hidden_size)."""
    from megatron_ext import native_mhc as native

    monkeypatch.setattr(native, "schedules_size_streams", lambda: schedules_size_streams)
    single_pass = types.SimpleNamespace(**vars(_config()), mhc_single_pass=True)
    wire = pipeline_hidden_size(single_pass, 2)
    assert wire == 4 * 32 + 4  # the streams and one coefficient per stream
    assert pipeline_tensor_shape(single_pass, [16, 2, 32], 2) == [16, 2, wire]
    as_megatron_sized = pipeline_tensor_shape(single_pass, [16, 2, 128], 2)
    assert as_megatron_sized == ([16, 2, wire] if schedules_size_streams else [16, 2, 128])
    assert pipeline_tensor_shape(_config(), [16, 2, 128], 2) == [16, 2, 128]


def test_the_installed_schedules_are_recognised_for_what_they_size():
    """native.schedules_size_streams() reads the installed code: True exactly where
    megatron's own get_tensor_shapes gives a middle stage n * hidden_size with mHC."""
    from megatron_ext import native_mhc as native

    config = _config()
    shapes = get_tensor_shapes(
        seq_length=16,
        micro_batch_size=2,
        decoder_seq_length=None,
        config=config,
        tp_group=_Group(1),
        cp_group=_Group(1),
        **({"pp_group": _Rank(1, 2), "is_recv": True} if _takes_pp_group() else {}),
    )
    assert native.schedules_size_streams() == (list(shapes[0])[-1] == 128)


class _Rank(_Group):
    def __init__(self, rank, size):
        super().__init__(size)
        self._rank = rank

    def rank(self):
        return self._rank


def _takes_pp_group() -> bool:
    import inspect

    return "pp_group" in inspect.signature(get_tensor_shapes).parameters
