"""``mhc_variant`` in whole models on one rank: GPT (dense, MoE + MLA) and Hybrid (with MTP)
build the variant's head (deepseek-v4: learned ``hc_head_*``; glm5: the mean, no parameters),
the lean path equals the reference path (loss and every gradient), the maps' parameters stay
fp32 under a bf16 cast, selective 'mhc' recompute is bit-identical, and the mHC statistics
match a direct computation from the variant's reference maps."""

import os

import pytest
import torch

from megatron_ext.config import MHCMLATransformerConfig, MHCTransformerConfig
from megatron_ext.mhc import HyperConnectionModule
from megatron_ext.models.gpt import GPTModel, get_gpt_decoder_block_spec
from megatron_ext.testing.configs import small_config
from megatron_ext.testing.distributed import model_parallel
from megatron_ext.testing.equivalence import TrainPlan, make_microbatches

pytestmark = pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC recompute")

VOCAB, SEQ = 64, 16
MLA = dict(q_lora_rank=16, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8)
MOE = dict(
    num_moe_experts=4,
    moe_router_topk=2,
    moe_layer_freq=[0, 1],
    moe_shared_expert_intermediate_size=32,
    moe_aux_loss_coeff=0.01,
    moe_token_dispatcher_type="alltoall",
    add_bias_linear=False,
)
HEAD = {"decoder.hc_head_fn", "decoder.hc_head_base", "decoder.hc_head_scale"}


@pytest.fixture(autouse=True)
def _fresh_mtp_loss_tracker():
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker.clear()
    yield
    MTPLossLoggingHelper.tracker.clear()


def _gpt(variant, moe_mla=False, **fields):
    config_class = MHCMLATransformerConfig if moe_mla else MHCTransformerConfig
    extra = dict(MOE, **MLA) if moe_mla else {}
    config = small_config(
        config_class,
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        enable_mhc_connections=True,
        mhc_num_residual_streams=4,
        mhc_variant=variant,
        hidden_dropout=0.1,
        **extra,
        **fields,
    )
    torch.manual_seed(4)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    model = GPTModel(
        config, spec, vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope"
    )
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # away from init, so every map and the head matter
        for name, param in model.named_parameters():
            if "hyper_connection" in name or "hc_head" in name:
                param.add_(torch.randn(param.shape, generator=generator) * 0.5)
    return model


def _loss_and_grads(model, reference_path=False):
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(0))
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    positions = torch.arange(SEQ).expand(2, SEQ)
    model.zero_grad()
    model.train()
    HyperConnectionModule.use_reference_path = reference_path
    try:
        torch.manual_seed(9)  # the same dropout masks on both paths
        loss = model(tokens[:, :-1], positions, mask, labels=tokens[:, 1:]).float().mean()
        loss.backward()
    finally:
        HyperConnectionModule.use_reference_path = False
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


SOAK = pytest.mark.skipif(
    os.environ.get("MEGATRON_EXT_SOAK") != "1",
    reason="soak only (~20 s): CI runs deepseek-v4 + MoE + MLA against the reference at PP2",
)


@pytest.mark.parametrize(
    "variant, moe_mla",
    [("deepseek-v4", False), ("glm5", False), pytest.param("deepseek-v4", True, marks=SOAK)],
)
def test_gpt_variant_head_and_lean_path_equal_the_reference(variant, moe_mla):
    with model_parallel(seed=2):
        model = _gpt(variant, moe_mla)
        names = {name for name, _ in model.named_parameters()}
        assert (HEAD <= names) == (variant == "deepseek-v4"), "the variant's head"
        assert not (HEAD & names) or variant == "deepseek-v4"
        lean_loss, lean = _loss_and_grads(model)
        reference_loss, reference = _loss_and_grads(model, reference_path=True)
    assert lean_loss == pytest.approx(reference_loss, rel=1e-6)
    for name, grad in reference.items():
        scale = grad.abs().max().clamp_min(1e-3)
        assert (lean[name] - grad).abs().max() <= 1e-5 * scale, name
    connection = model.decoder.layers[1].mlp_hyper_connection
    assert connection.mapping_proj.weight.grad.abs().sum() > 0


def test_variant_parameters_stay_fp32_under_bf16():
    with model_parallel(seed=2):
        model = _gpt("deepseek-v4").bfloat16()
    for name, param in model.named_parameters():
        keeps_fp32 = "hyper_connection" in name or "hc_head" in name
        assert (param.dtype == torch.float32) == keeps_fp32, name


def test_mhc_recompute_is_bit_identical_for_the_variant(variant="deepseek-v4"):
    """(glm5's sub-layers are deepseek-v4's; only the head differs.)"""
    recompute = dict(recompute_granularity="selective", recompute_modules=["mhc"])
    results = []
    for fields in ({}, dict(recompute, mhc_recompute_layer_num=1)):
        with model_parallel(seed=2):
            results.append(_loss_and_grads(_gpt(variant, **fields)))
    (loss, grads), (recomputed_loss, recomputed) = results
    assert loss == recomputed_loss
    for name, grad in grads.items():
        assert torch.equal(grad, recomputed[name]), name


@pytest.mark.parametrize("variant", ["deepseek-v4", "glm5"])
def test_hybrid_with_mtp_builds_the_variant_head_and_trains(variant):
    from megatron_ext.models.hybrid import HybridModel, get_hybrid_stack_local_spec

    plan = TrainPlan()
    pattern = "*-E*-/*-"
    config = small_config(
        num_layers=4,
        hidden_size=plan.hidden_size,
        num_attention_heads=plan.num_attention_heads,
        enable_mhc_connections=True,
        mhc_num_residual_streams=4,
        mhc_variant=variant,
        mtp_num_layers=1,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_token_dispatcher_type="alltoall",
        add_bias_linear=False,
    )
    with model_parallel(seed=2):
        torch.manual_seed(3)
        model = HybridModel(
            config,
            get_hybrid_stack_local_spec(enable_mhc_connections=True),
            vocab_size=plan.vocab_size,
            max_sequence_length=plan.seq_length,
            hybrid_layer_pattern=pattern,
            position_embedding_type="rope",
        )
        heads = [name for name, _ in model.named_parameters() if "hc_head" in name]
        # the decoder's head and the MTP depth's (the release's MTP layers carry their own)
        assert len(heads) == (6 if variant == "deepseek-v4" else 0), heads
        batch = make_microbatches(plan, 0)[0]
        losses = model(
            batch["tokens"],
            batch["position_ids"],
            batch["attention_mask"],
            labels=batch["labels"],
            loss_mask=batch["loss_mask"],
        )
        loss = (losses * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
        loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for name, p in model.named_parameters() if "hyper_connection" in name]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)
