"""Tied embeddings + MTP under PP=2: the MTP stage holds no dead ``output_layer.weight``,
saves a torch_dist checkpoint, and trains like the single-rank reference; with
megatron-core's own constructor (registry patch suspended) the save fails. Run:
torchrun --nproc_per_node 2 -m pytest tests/unit_tests/models/test_mtp_tied_output_2ranks.py"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import megatron_ext
from megatron_ext import registry
from megatron_ext.config import MHCTransformerConfig
from megatron_ext.testing.distributed import model_parallel
from megatron_ext.testing.equivalence import (
    TrainPlan,
    build_model_chunks,
    check_equivalence,
    transformer_config,
)
from megatron_ext.testing.hybrid import hybrid_forward_step, hybrid_model_factory, hybrid_plan

pytestmark = [
    pytest.mark.world_size(2),
    pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC recompute"),
]

GPT_INIT = "megatron.core.models.gpt.gpt_model:GPTModel.__init__"
HYBRID_INIT = "megatron.core.models.hybrid.hybrid_model:HybridModel.__init__"
HYBRID_PATTERN = "*-|*-/*-"


@pytest.fixture(autouse=True)
def _installed_and_fresh_mtp_tracker():
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    megatron_ext.install()
    MTPLossLoggingHelper.tracker.clear()
    yield
    MTPLossLoggingHelper.tracker.clear()


def gpt_mtp_factory(plan: TrainPlan):
    """megatron-ext's GPTModel, local spec, tied embeddings, MTP on the last stage."""
    from megatron.core.models.gpt import gpt_layer_specs as core_specs

    from megatron_ext.models.gpt import GPTModel, get_gpt_layer_local_spec

    def build(config, pre_process, post_process, vp_stage):
        spec = get_gpt_layer_local_spec()
        return GPTModel(
            config,
            spec,
            vocab_size=plan.vocab_size,
            max_sequence_length=plan.seq_length,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=True,
            position_embedding_type="rope",
            mtp_block_spec=core_specs.get_gpt_mtp_block_spec(
                config, spec, use_transformer_engine=False, vp_stage=vp_stage
            ),
            vp_stage=vp_stage,
        )

    return build


def _cases():
    gpt_plan = TrainPlan(pp=2, num_layers=2, steps=1, config_overrides=dict(mtp_num_layers=1))
    hybrid = hybrid_plan(HYBRID_PATTERN, pp=2, steps=1)
    return {
        "gpt": (gpt_plan, gpt_mtp_factory(gpt_plan), None),
        "hybrid": (hybrid, hybrid_model_factory(hybrid, HYBRID_PATTERN), None),
    }


def _shared_dir(tmp_path_factory) -> str:
    path = [str(tmp_path_factory.mktemp("ckpt")) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]


def _try_sharded_state_dict(chunks):
    try:
        for chunk in chunks:
            chunk.sharded_state_dict()
        return None
    except AssertionError as error:
        # megatron-core asserts that the tied key is absent and prints every key it has.
        return (
            "refused output_layer.weight"
            if "'output_layer.weight'" in str(error)
            else str(error)[:300]
        )


@pytest.mark.parametrize("kind", ["gpt", "hybrid"])
def test_mtp_stage_holds_no_dead_weight_and_saves(kind, tmp_path_factory):
    from megatron.core import dist_checkpointing

    plan, factory, _ = _cases()[kind]
    with model_parallel(pp=2, seed=plan.seed):
        config = transformer_config(plan, parallel=True)
        chunks = build_model_chunks(plan, config, factory)
        last = chunks[-1]
        if dist.get_rank() == 1:
            assert last.mtp_process and not last.pre_process
            assert last.output_layer.weight is None
            assert "output_layer.weight" not in dict(last.named_parameters())
        sharded = {}
        for chunk in chunks:
            sharded.update(chunk.sharded_state_dict())
        directory = _shared_dir(tmp_path_factory)
        dist_checkpointing.save(sharded, directory)
        # Load it back into the same layout: the tied copy on the MTP stage comes back.
        before = {n: p.detach().clone() for n, p in last.named_parameters()}
        for p in last.parameters():
            p.data.zero_()
        loaded = dist_checkpointing.load(last.sharded_state_dict(), directory)
        last.load_state_dict(loaded, strict=False)
        for name, param in last.named_parameters():
            torch.testing.assert_close(param, before[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("kind", ["gpt", "hybrid"])
def test_upstream_allocation_cannot_save(kind):
    """Why the registry wraps the constructors: megatron-core's own GPTModel/HybridModel
    give the MTP stage an output_layer.weight that its tied state dict then refuses."""
    plan, factory, _ = _cases()[kind]
    with registry.suspended(GPT_INIT), registry.suspended(HYBRID_INIT):
        with model_parallel(pp=2, seed=plan.seed):
            config = transformer_config(plan, parallel=True)
            chunks = build_model_chunks(plan, config, factory)
            error = _try_sharded_state_dict(chunks)
            outcomes = [None, None]
            dist.all_gather_object(outcomes, error)
    assert outcomes[0] is None, outcomes
    assert outcomes[1] == "refused output_layer.weight", outcomes


def test_hybrid_mhc_pp2_tied_mtp_matches_reference():
    """With the dead weight gone a tied MTP stage trains like the single-rank model."""
    plan = hybrid_plan(
        HYBRID_PATTERN,
        pp=2,
        lr=1e-4,
        steps=2,
        config_overrides=dict(enable_mhc_connections=True, mhc_num_residual_streams=2),
    )
    check_equivalence(
        plan,
        factory=hybrid_model_factory(plan, HYBRID_PATTERN),
        forward_step=hybrid_forward_step,
        config_class=MHCTransformerConfig,
    )
