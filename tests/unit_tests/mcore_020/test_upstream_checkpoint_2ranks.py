"""Issue 39 item 6: a checkpoint saved by upstream megatron-core 0.20's own mHC model continues
in megatron-ext under pipeline parallelism with the loss upstream would have had.

Upstream's GPT is built from upstream's classes only (its GPTModel, its local layer spec with its
HyperConnectionTransformerLayer and HyperConnectionModule; 0.20 has no helper for this), its mHC
maps made far from their symmetric start (bias ~ N(0, 1), every gate 0.5), and trained at PP 1
(the single-rank reference: Adam, three steps). Its initial weights -- megatron's global keys
and shapes, stacked layers, what its torch_dist checkpoint holds -- are saved with torch.save,
converted with ``megatron-ext convert-checkpoint --model gpt --to megatron-ext --source main``
(H_res transposed: main mixes with H_res, megatron-ext with H_resᵀ), loaded into megatron-ext's
GPT at PP2 1F1B, PP2 x VPP2 and PP2 under ZB-H1, and trained on the same batches: every step's
loss equals upstream's PP 1 loss and the first step's gradients equal upstream's (transposed
likewise). Without the transposition the first loss already differs (checked too).
Run: torchrun --nproc_per_node 2 -m pytest tests/unit_tests/mcore_020/test_upstream_checkpoint_2ranks.py"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from megatron_ext import cli
from megatron_ext.checkpoint import convert
from megatron_ext.config import MHCTransformerConfig
from megatron_ext.testing.continuation import shared_directory
from megatron_ext.testing.equivalence import (
    TrainPlan,
    compare_pieces,
    gpt_forward_step,
    gpt_model_factory,
    run_reference,
    run_sharded,
)

pytestmark = [pytest.mark.world_size(2), pytest.mark.filterwarnings("ignore::UserWarning")]

PLAN = TrainPlan(
    num_layers=4,
    global_batch_size=8,
    steps=3,
    config_overrides=dict(
        enable_mhc_connections=True, mhc_num_residual_streams=4, mhc_sinkhorn_iterations=20
    ),
)
LAYOUTS = {
    "pp2": dict(pp=2),
    "pp2_vpp2": dict(pp=2, vpp=2),
    "pp2_zb_h1": dict(pp=2, schedule="zb-h1"),
}
# Sinkhorn normalises rows first in upstream, columns first in megatron-ext: the two H_res of
# the transposed logits agree to convergence after 20 iterations, not bit for bit.
LOSS_RTOL, GRAD_ATOL = 2e-6, 1e-6


def upstream_gpt_factory(plan: TrainPlan):
    """Upstream 0.20's own mHC GPT (nothing of megatron-ext's in the model)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.hyper_connection import HyperConnectionModule
    from megatron.core.transformer.transformer_layer import HyperConnectionTransformerLayer

    def build(config, pre_process, post_process, vp_stage):
        spec = get_gpt_layer_local_spec()
        submodules = dataclasses.replace(
            spec.submodules,
            self_attention_hyper_connection=HyperConnectionModule,
            mlp_hyper_connection=HyperConnectionModule,
        )
        spec = dataclasses.replace(
            spec, module=HyperConnectionTransformerLayer, submodules=submodules
        )
        model = GPTModel(
            config,
            spec,
            vocab_size=plan.vocab_size,
            max_sequence_length=plan.seq_length,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=True,
            position_embedding_type="learned_absolute",
            vp_stage=vp_stage,
        )
        assert type(model.decoder.layers[0]) is HyperConnectionTransformerLayer
        _far_from_the_start(model)
        return model

    return build


def _far_from_the_start(model: torch.nn.Module) -> None:
    """Non-trivial maps: at init H_res's logits are equal and the transpose changes nothing."""
    generator = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "_hyper_connection." not in name:
                continue
            if name.endswith(".bias"):
                parameter.copy_(torch.randn(parameter.shape, generator=generator))
            elif name.rsplit(".", 1)[-1].startswith("alpha_"):
                parameter.fill_(0.5)


@pytest.fixture(scope="module")
def upstream():
    """Upstream's PP 1 run and its initial weights converted by the CLI (every rank)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    # Upstream's mHC methods are torch.compile'd: the same maths eagerly (a minute less).
    # torch's own config patch: a monkeypatch of the config module would hide the key from
    # every later compile of the session ("torch._dynamo.config.disable does not exist").
    with torch._dynamo.config.patch(disable=True):
        reference = run_reference(
            PLAN, upstream_gpt_factory(PLAN), gpt_forward_step, config_class=TransformerConfig
        )
    with shared_directory("upstream-mhc-") as directory:
        saved, converted = directory / "upstream.pt", directory / "megatron-ext.pt"
        if dist.get_rank() == 0:
            torch.save(reference.initial_weights, saved)
            argv = ["convert-checkpoint", str(saved), str(converted), "--model", "gpt"]
            assert cli.main([*argv, "--to", "megatron-ext", "--source", "main"]) == 0
        dist.barrier()
        weights = torch.load(converted, weights_only=True)
    return reference, weights


def _continue(plan: TrainPlan, weights: dict[str, torch.Tensor]):
    """megatron-ext's GPT from ``weights`` at ``plan``'s layout: (losses per step, the first
    step's gradient pieces of every rank)."""
    records, _ = run_sharded(
        plan, gpt_model_factory(plan), gpt_forward_step, weights, MHCTransformerConfig
    )
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [(r.losses, r.grads) for r in records])
    losses = [
        sum(loss for rank in gathered for loss in rank[step][0])
        / sum(len(rank[step][0]) for rank in gathered)
        for step in range(plan.steps)
    ]
    return losses, [rank[0][1] for rank in gathered]


@pytest.mark.every_case  # issue 39 item 6: PP2, PP2 x VPP2 and ZB-H1, in make test's 0.20 lane
@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_upstream_mhc_checkpoint_continues_at_its_pp1_loss(upstream, layout):
    reference, weights = upstream
    plan = dataclasses.replace(PLAN, **LAYOUTS[layout])
    losses, first_grads = _continue(plan, weights)
    torch.testing.assert_close(
        torch.tensor(losses, dtype=torch.float64),
        torch.tensor(reference.losses, dtype=torch.float64),
        rtol=LOSS_RTOL,
        atol=0,
        msg=lambda m: f"{layout}: megatron-ext {losses} vs upstream PP1 {reference.losses}\n{m}",
    )
    expected_grads = convert.transpose_main_res(reference.grads[0])
    problems = compare_pieces("first-step gradient", first_grads, expected_grads, GRAD_ATOL)
    assert not problems, "\n".join(problems[:10])


def test_without_the_transposition_loss_and_gradients_differ(upstream):
    """The conversion is what makes them equal: the weights by name alone give another
    function (so the test above can fail on either check)."""
    reference, weights = upstream
    by_name = convert.transpose_main_res(weights)  # undoes the conversion (an involution)
    plan = dataclasses.replace(PLAN, pp=2, steps=1)
    losses, first_grads = _continue(plan, by_name)
    assert abs(losses[0] - reference.losses[0]) > 5 * LOSS_RTOL * abs(reference.losses[0])
    expected_grads = convert.transpose_main_res(reference.grads[0])
    assert compare_pieces("first-step gradient", first_grads, expected_grads, 100 * GRAD_ATOL)
