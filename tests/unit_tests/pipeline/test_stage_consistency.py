"""Pipeline stages built differently are an error naming the field, stages, ranks and values,
not a silently reshaped tensor: two stages whose exchanged tensors have the same byte count
(mHC n=4 h=32 next to plain h=128, or mHC n=4 h=32 next to mHC n=2 h=64) run megatron-core's
own 1F1B schedule. With tied embeddings the stages must agree before they are built (megatron
all-reduces the embedding inside the constructor): what megatron-ext's model providers do
through training_steps.stage_config. Run: torchrun --nproc_per_node 2 -m pytest <this file>."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

from megatron_ext import training_steps
from megatron_ext.config import MHCTransformerConfig
from megatron_ext.pipeline import consistency
from megatron_ext.testing.distributed import init_distributed, model_parallel
from megatron_ext.testing.equivalence import (
    TrainPlan,
    build_model_chunks,
    gpt_forward_step,
    make_microbatches,
    transformer_config,
)

MHC_N4_H32 = dict(
    hidden_size=32, config_overrides=dict(enable_mhc_connections=True, mhc_num_residual_streams=4)
)
PLAIN_H128 = dict(hidden_size=128, config_overrides={})
MHC_N2_H64 = dict(
    hidden_size=64, config_overrides=dict(enable_mhc_connections=True, mhc_num_residual_streams=2)
)


PLAIN_H64 = dict(hidden_size=64, config_overrides={})


def _gpt_factory(plan: TrainPlan, tied: bool = False):
    """megatron-ext's GPTModel. With tied embeddings megatron's own embedding all-reduce at
    build time fails (inside gloo, naming no stage) when the stages' widths differ, unless
    they agreed first."""
    from megatron_ext.models.gpt import GPTModel, get_gpt_layer_local_spec

    def build(config, pre_process, post_process, vp_stage):
        return GPTModel(
            config,
            get_gpt_layer_local_spec(enable_mhc_connections=config.enable_mhc_connections),
            vocab_size=plan.vocab_size,
            max_sequence_length=plan.seq_length,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=tied,
            vp_stage=vp_stage,
        )

    return build


def _forward_backward(
    stage_plans: list[dict], tied: bool = False, agree_first: bool = False, iterations: int = 1
) -> None:
    """Each rank builds its stage from its own plan (``agree_first``: after agreeing on it as
    megatron-ext's model providers do), then 1F1B iterations run."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    init_distributed()
    plan = TrainPlan(pp=2, steps=1, **stage_plans[dist.get_rank()])
    with model_parallel(pp=2, seed=plan.seed):
        config = transformer_config(plan, parallel=True, config_class=MHCTransformerConfig)
        if agree_first:
            flags = types.SimpleNamespace(
                untie_embeddings_and_output_weights=not tied,
                padded_vocab_size=plan.vocab_size,
                seq_length=plan.seq_length,
                micro_batch_size=plan.micro_batch_size,
            )
            config = training_steps.stage_config(flags, config, MHCTransformerConfig)
        chunks = build_model_chunks(plan, config, _gpt_factory(plan, tied))
        for _ in range(iterations):
            get_forward_backward_func()(
                forward_step_func=gpt_forward_step,
                data_iterator=iter(make_microbatches(plan, 0)[:2]),
                model=chunks,
                num_microbatches=2,
                seq_length=plan.seq_length,
                micro_batch_size=plan.micro_batch_size,
                forward_only=False,
            )


@pytest.mark.world_size(2)
@pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC recompute")
@pytest.mark.parametrize(
    "stages, message",
    [
        (
            (MHC_N4_H32, PLAIN_H128),
            "pipeline stages disagree on hidden_size: stage 0 (rank 0) 32, stage 1 (rank 1) 128.",
        ),
        (
            (MHC_N4_H32, MHC_N2_H64),
            "pipeline stages disagree on hidden_size: stage 0 (rank 0) 32, stage 1 (rank 1) 64.",
        ),
        (
            (MHC_N4_H32, dict(MHC_N4_H32, seq_length=8)),
            "pipeline stages disagree on exchanged tensor shape: stage 0 (rank 0) [16, 2, 128], stage 1 (rank 1) [8, 2, 128].",
        ),
    ],
)
def test_stages_built_differently_fail_on_every_rank_naming_the_field(stages, message):
    with pytest.raises(consistency.PipelineConsistencyError) as raised:
        _forward_backward(list(stages))
    assert str(raised.value).startswith(message), str(raised.value)


@pytest.mark.world_size(2)
@pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC recompute")
def test_the_same_stage_configuration_passes():
    _forward_backward([MHC_N4_H32, MHC_N4_H32])


@pytest.mark.world_size(2)
@pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC recompute")
def test_without_the_check_the_same_byte_count_trains_silently(monkeypatch):
    """Why the check exists: [16, 2, 4*32] and [16, 2, 128] have the same size, so megatron's
    exchange reads one stage's n streams as the other's hidden vector and nothing fails."""
    monkeypatch.setattr(consistency, "check_once", lambda *args: None)
    _forward_backward([MHC_N4_H32, PLAIN_H128])


@pytest.mark.world_size(2)
@pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC recompute")
@pytest.mark.parametrize(
    "stages, message",
    [
        (
            (MHC_N4_H32, PLAIN_H128),  # without the agreement: a gloo size error at build
            "pipeline stages disagree on hidden_size: stage 0 (rank 0) 32, stage 1 (rank 1) 128.",
        ),
        (
            (MHC_N2_H64, PLAIN_H64),  # the same embedding: would build, then misread n streams
            "pipeline stages disagree on enable_mhc_connections: stage 0 (rank 0) True, "
            "stage 1 (rank 1) False.",
        ),
    ],
)
def test_tied_stages_built_differently_fail_before_the_embedding_all_reduce(stages, message):
    with pytest.raises(consistency.PipelineConsistencyError) as raised:
        _forward_backward(list(stages), tied=True, agree_first=True)
    assert str(raised.value).startswith(message), str(raised.value)
    # before any model was built (not at the first send, which would be too late for gloo)
    assert any(entry.name == "stage_config" for entry in raised.traceback)


@pytest.mark.world_size(2)
@pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC recompute")
def test_stages_agreed_before_build_agree_on_the_exchanged_shape_once(monkeypatch):
    """Fields agreed at build are not gathered again per schedule call: two iterations cost
    one agreement at build and one on the exchanged shape, not one per communicator."""
    agreed = []
    agree = consistency._agree
    monkeypatch.setattr(
        consistency,
        "_agree",
        lambda group, fields: agreed.append(list(fields)) or agree(group, fields),
    )
    _forward_backward([MHC_N4_H32, MHC_N4_H32], tied=True, agree_first=True, iterations=2)
    assert agreed[0][0] == "hidden_size" and "padded_vocab_size" in agreed[0], agreed
    assert agreed[1:] == [["exchanged tensor shape"]], agreed


# ---- single process: the field comparison and the per-send shape check -----------------------
def test_first_difference_names_the_first_field_in_order():
    base = {
        "rank": 0,
        **consistency.stage_fields(types.SimpleNamespace(hidden_size=32), [16, 2, 32]),
    }
    other = {**base, "rank": 3, "batch_p2p_comm": True, "exchanged tensor shape": [16, 2, 64]}
    assert consistency.first_difference([base, base]) is None
    assert consistency.first_difference([base, other]).startswith(
        "pipeline stages disagree on batch_p2p_comm: stage 0 (rank 0) False, stage 1 (rank 3) True."
    )
    unknown = {**base, "exchanged tensor shape": None}  # a stage that had not exchanged yet
    assert consistency.first_difference([base, unknown]) is None


def test_the_fields_agreed_before_build_add_what_the_constructor_and_schedule_share():
    config = types.SimpleNamespace(hidden_size=32, num_layers=4, mtp_num_layers=None)
    fields = consistency.build_fields(config, padded_vocab_size=64, seq_length=16)
    assert "exchanged tensor shape" not in fields  # not known before the first exchange
    assert list(fields)[0] == "hidden_size" and list(fields)[-2:] == [
        "padded_vocab_size",
        "seq_length",
    ]
    assert fields["mtp_num_layers"] == 0 and fields["num_layers"] == 4
    deeper = {**fields, "rank": 1, "num_layers": 8}
    assert consistency.first_difference([{**fields, "rank": 0}, deeper]).startswith(
        "pipeline stages disagree on num_layers: stage 0 (rank 0) 4, stage 1 (rank 1) 8."
    )


class _Group:
    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


class _Communicator:
    """Stands in for megatron's P2PCommunicator (hashable, as the agreed shapes are keyed by it)."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


def test_a_send_of_another_shape_names_both_stages_and_both_shapes():
    communicator = _Communicator(
        config=types.SimpleNamespace(hidden_size=32),
        pp_group=_Group(1, 4),
        next_rank=2,
        prev_rank=0,
    )
    consistency._agreed_shapes[communicator] = [16, 2, 128]  # as check_once leaves it
    consistency.check_sends(communicator, torch.empty(16, 2, 128), None)
    with pytest.raises(
        consistency.PipelineConsistencyError,
        match=r"stage 1 -> stage 2: stage 1 \(rank .*\) sends a tensor of shape \[16, 2, 32\] "
        r"to the next stage 2 \(rank 2\), which receives \[16, 2, 128\]",
    ):
        consistency.check_sends(communicator, torch.empty(16, 2, 32), None)
