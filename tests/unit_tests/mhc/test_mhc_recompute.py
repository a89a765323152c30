"""Selective recompute "mhc": groups never cross the block, gradients are bit-identical with
and without it (dropout included), and the activations kept for backward shrink."""

import dataclasses

import pytest
import torch

from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megatron_ext.mhc.recompute import MHCRecomputeGroup, plan_recompute_groups
from megatron_ext.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_ext.models.norms import LocalNorm
from megatron_ext.testing.configs import small_config
from megatron_ext.testing.distributed import model_parallel

pytestmark = pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC recompute")

VOCAB, SEQ, BATCH = 64, 32, 2


def _config(recompute=None, layer_num=None, **overrides):
    fields = dict(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=4,
        hidden_dropout=0.1,  # the merge's dropout must be replayed exactly
        enable_mhc_connections=True,
        mhc_num_residual_streams=4,
    )
    if recompute:
        fields.update(recompute_granularity="selective", recompute_modules=list(recompute))
        fields.update(mhc_recompute_layer_num=layer_num)
    return small_config(**{**fields, **overrides})


def _batch():
    generator = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    return tokens[:, :-1], positions, mask, tokens[:, 1:]


def _train_step(config, layer_spec=None, measure=False, dtype=None):
    """One forward/backward from fixed weights and RNG; returns (loss, grads, kept bytes)."""
    with model_parallel(seed=5):
        model = GPTModel(
            config,
            layer_spec or get_gpt_layer_local_spec(enable_mhc_connections=True),
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
        )
        if dtype is not None:
            model = model.to(dtype)  # what megatron's Float16Module does to every parameter
        model.train()
        inputs, positions, mask, labels = _batch()
        parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
        saved = []

        def pack(tensor):
            if measure:
                saved.append(tensor)
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = model(inputs, positions, mask, labels=labels).float().mean()
        kept = _activation_bytes(saved, parameters)
        saved.clear()
        loss.backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return loss.item(), grads, kept


def _activation_bytes(saved, parameters) -> int:
    """Bytes of the distinct non-parameter storages autograd holds for backward (a discarded
    tensor's storage has been resized to 0)."""
    storages = {}
    for tensor in saved:
        storage = tensor.untyped_storage()
        if storage.data_ptr() and storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _assert_bit_identical(reference, other):
    loss, grads, _ = reference
    other_loss, other_grads, _ = other
    assert loss == other_loss
    assert grads.keys() == other_grads.keys()
    for name in grads:
        assert torch.equal(grads[name], other_grads[name]), name


# ----------------------------------------------------------------------------- the plan


@pytest.mark.parametrize(
    "num_layers, layer_num, ends",
    [
        (4, None, [False, False, False, True]),
        (4, 2, [False, True, False, True]),
        (5, 2, [False, True, False, True, True]),
        (3, 1, [True, True, True]),
        (2, 8, [False, True]),
        (0, 2, []),
    ],
)
def test_groups_end_every_layer_num_layers_and_at_the_block_end(num_layers, layer_num, ends):
    assert plan_recompute_groups(num_layers, layer_num) == ends


# ----------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("layer_num", [None, 1, 3])
def test_mhc_recompute_gives_bit_identical_gradients(layer_num):
    reference = _train_step(_config())
    _assert_bit_identical(reference, _train_step(_config(["mhc"], layer_num)))


@pytest.mark.parametrize("recompute", [["layernorm"], ["mhc", "layernorm"], ["mhc", "core_attn"]])
def test_other_selective_recompute_modules_combine_bit_identically(recompute):
    _assert_bit_identical(_train_step(_config()), _train_step(_config(recompute, 2)))


def test_bf16_gradients_are_bit_identical_too():
    overrides = dict(params_dtype=torch.bfloat16, bf16=True)
    reference = _train_step(_config(**overrides), dtype=torch.bfloat16)
    _assert_bit_identical(
        reference, _train_step(_config(["mhc"], 2, **overrides), dtype=torch.bfloat16)
    )


@pytest.mark.parametrize("layer_num", [1, 3])
def test_attention_only_and_mlp_only_layers_recompute_bit_identically(layer_num):
    """Groups that end on an attention-only layer (Hybrid-style blocks) keep that output."""
    full = get_gpt_layer_local_spec(enable_mhc_connections=True)
    attention_only = dataclasses.replace(
        full,
        submodules=dataclasses.replace(
            full.submodules, pre_mlp_layernorm=IdentityOp, mlp=IdentityOp, mlp_bda=IdentityFuncOp
        ),
    )
    mlp_only = dataclasses.replace(
        full,
        submodules=dataclasses.replace(
            full.submodules,
            input_layernorm=IdentityOp,
            self_attention=IdentityOp,
            self_attn_bda=IdentityFuncOp,
        ),
    )
    block = TransformerBlockSubmodules(
        layer_specs=[attention_only, mlp_only, attention_only, mlp_only], layer_norm=LocalNorm
    )
    reference = _train_step(_config(), block)
    _assert_bit_identical(reference, _train_step(_config(["mhc"], layer_num), block))


# ----------------------------------------------------------------------------- memory


def test_recompute_keeps_fewer_activations_for_backward():
    """Measured figure (4 layers, h=32, n=4, s=32, b=2, fp32): about 0.6 of the bytes."""
    _, _, without = _train_step(_config(), measure=True)
    _, _, whole_block = _train_step(_config(["mhc"]), measure=True)
    _, _, pairs = _train_step(_config(["mhc"], 2), measure=True)
    assert whole_block < 0.7 * without, (whole_block, without)
    assert pairs < 0.8 * without, (pairs, without)


def test_without_backward_nothing_is_discarded():
    """Evaluation and no-grad forwards run the plain path: same output, no groups."""
    config = _config(["mhc"], 2, hidden_dropout=0.0)
    with model_parallel(seed=5):
        model = GPTModel(
            config,
            get_gpt_layer_local_spec(enable_mhc_connections=True),
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
        )
        inputs, positions, mask, labels = _batch()
        model.eval()
        evaluated = model(inputs, positions, mask, labels=labels)
        model.train()
        with torch.no_grad():
            no_grad = model(inputs, positions, mask, labels=labels)
        trained = model(inputs, positions, mask, labels=labels)
    assert torch.equal(evaluated, no_grad) and torch.equal(evaluated, trained.detach())
    assert all(layer.mhc_recompute is None for layer in model.decoder.layers)


def test_group_frees_outputs_and_refills_them_on_backward():
    x = torch.randn(6, 4, requires_grad=True)
    group = MHCRecomputeGroup()
    hidden = group.checkpoint(lambda t: t * 3, x)
    kept = torch.sin(hidden)  # saves `hidden` for its backward
    output = kept.sum(dim=1, keepdim=True) * 1.0
    group.discard_and_recompute_on_backward(output)
    assert hidden.untyped_storage().nbytes() == 0
    output.sum().backward()
    torch.testing.assert_close(x.grad, 3 * torch.cos(3 * x.detach()))
    assert hidden.untyped_storage().nbytes() == hidden.numel() * hidden.element_size()


def test_recompute_needs_backward_not_autograd_grad():
    x = torch.randn(3, requires_grad=True)
    group = MHCRecomputeGroup()
    hidden = group.checkpoint(lambda t: t * 2, x)
    output = torch.exp(hidden)
    group.discard_and_recompute_on_backward(output)
    with pytest.raises(RuntimeError, match="torch.autograd.backward"):
        torch.autograd.grad(output.sum(), x)
