"""Mamba layers ('M') with mHC residual streams. megatron's MambaMixer needs mamba_ssm (absent
here), so the layer is exercised with a small causal stand-in mixer: the hyper connection
around it, the layer in a HybridModel, and 'mhc' recompute with Mamba layers in between."""

import dataclasses

import pytest
import torch

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_ext.mhc.hyper_connection import aggregate, expand_output, mix_residual
from megatron_ext.models.hybrid import HybridModel, get_hybrid_stack_local_spec
from megatron_ext.models.hybrid.mamba_layer import (
    HyperConnectionMambaLayer,
    HyperConnectionMambaLayerSubmodules,
)
from megatron_ext.models.norms import LocalNorm
from megatron_ext.testing.configs import small_config
from megatron_ext.testing.distributed import model_parallel
from megatron_ext.testing.equivalence import TrainPlan, make_microbatches

pytestmark = pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC recompute")

PLAN = TrainPlan()


class CausalStandInMixer(torch.nn.Module):
    """Mixes along the sequence causally (running mean), then projects; returns (out, bias)
    as megatron's MambaMixer does. Built with MambaMixer's constructor arguments."""

    def __init__(
        self, config, d_model, layer_number=1, pg_collection=None, pp_layer_offset=0, name=None
    ):
        super().__init__()
        self.proj = torch.nn.Linear(d_model, d_model)

    def forward(self, hidden_states, inference_context=None, packed_seq_params=None):
        steps = torch.arange(1, hidden_states.shape[0] + 1, dtype=hidden_states.dtype)
        running_mean = hidden_states.cumsum(0) / steps.view(-1, 1, 1)
        return self.proj(torch.tanh(running_mean)), None


def _mamba_spec():
    return ModuleSpec(
        module=HyperConnectionMambaLayer,
        submodules=HyperConnectionMambaLayerSubmodules(
            norm=LocalNorm, mixer=CausalStandInMixer, mamba_bda=get_bias_dropout_add
        ),
    )


def _config(**fields):
    settings = dict(
        num_layers=4,
        hidden_size=PLAN.hidden_size,
        num_attention_heads=PLAN.num_attention_heads,
        enable_mhc_connections=True,
        mhc_num_residual_streams=4,
    )
    settings.update(fields)
    return small_config(**settings)


def _pg_collection():
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection.use_mpu_process_groups()


def test_mamba_layer_applies_the_hyper_connection_around_its_mixer():
    with model_parallel():
        config = _config(mhc_init_gating_factor=0.5)
        layer = HyperConnectionMambaLayer(
            config, _mamba_spec().submodules, layer_number=1, pg_collection=_pg_collection()
        )
        with torch.no_grad():
            layer.mixer_hyper_connection.bias.normal_()  # make every map non-trivial
        x = torch.randn(PLAN.seq_length, 2, 4 * PLAN.hidden_size, requires_grad=True)
        output = layer(x)
        h_pre, h_post, h_res = layer.mixer_hyper_connection.compute_mappings(x)
        mixed, _ = layer.mixer(layer.norm(aggregate(x, h_pre)))
        expected = mix_residual(x, h_res) + expand_output(mixed, h_post)
        torch.testing.assert_close(output, expected)
        assert output._base is None
        output.sum().backward()
        names = {n for n, p in layer.named_parameters() if p.grad is not None}
        assert {
            "mixer_hyper_connection.mapping_proj.weight",
            "mixer_hyper_connection.alpha_res",
            "mixer.proj.weight",
            "norm.weight",
        } <= names


def test_mamba_layer_needs_mhc_in_the_config():
    with model_parallel(), pytest.raises(ValueError, match="enable_mhc_connections=True"):
        HyperConnectionMambaLayer(
            _config(enable_mhc_connections=False),
            _mamba_spec().submodules,
            pg_collection=_pg_collection(),
        )


def _model(pattern, **fields):
    spec = get_hybrid_stack_local_spec(enable_mhc_connections=True)
    spec = dataclasses.replace(
        spec, submodules=dataclasses.replace(spec.submodules, mamba_layer=_mamba_spec())
    )
    torch.manual_seed(5)
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(5)
    return HybridModel(
        _config(num_layers=len(pattern), **fields),
        spec,
        vocab_size=PLAN.vocab_size,
        max_sequence_length=PLAN.seq_length,
        hybrid_layer_pattern=pattern,
    )


def _loss(model):
    batch = make_microbatches(PLAN, 0)[0]
    losses = model(
        batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
    )
    return (losses * batch["loss_mask"]).sum() / batch["loss_mask"].sum()


def test_mamba_in_a_hybrid_mhc_model_is_named_and_trained():
    with model_parallel():
        model = _model("M*-M")
        assert isinstance(model.decoder.layers[0], HyperConnectionMambaLayer)
        keys = set(model.sharded_state_dict())
        assert "decoder.layers.3.mixer_hyper_connection.mapping_proj.weight" in keys
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
        losses = []
        for _ in range(10):
            optimizer.zero_grad()
            loss = _loss(model)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        assert losses[-1] < 0.85 * losses[0], losses


@pytest.mark.parametrize("layers_per_group", [None, 1])
def test_mhc_recompute_with_mamba_layers_in_between_gives_identical_gradients(layers_per_group):
    """Mamba layers keep their activations; the attention and MLP layers around them are
    recomputed (the group's last layer is the last non-Mamba one)."""
    results = []
    with model_parallel():
        for recompute in (False, True):
            extra = (
                dict(
                    recompute_granularity="selective",
                    recompute_modules=["mhc"],
                    mhc_recompute_layer_num=layers_per_group,
                )
                if recompute
                else {}
            )
            model = _model("*M-M*M", **extra)
            loss = _loss(model)
            loss.backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            results.append((loss.detach(), grads))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    for name, grad in grads_a.items():
        assert torch.equal(grad, grads_b[name]), name


def test_single_pass_mamba_layer_aggregates_with_the_previous_sites_coefficients():
    """Single pass (megatron_ext.mhc.single_pass): the mixer reads Σ_j pre_prev[j]·x_j, the
    merge uses this site's post and res, and this site's pre travels on with its gradient."""
    from megatron_ext.mhc.single_pass import SinglePassState

    with model_parallel():
        layer = HyperConnectionMambaLayer(
            _config(mhc_init_gating_factor=0.5, mhc_single_pass=True),
            _mamba_spec().submodules,
            layer_number=1,
            pg_collection=_pg_collection(),
        )
        with torch.no_grad():
            layer.mixer_hyper_connection.bias.normal_()
        x = torch.randn(PLAN.seq_length, 2, 4 * PLAN.hidden_size, requires_grad=True)
        previous = torch.rand(PLAN.seq_length, 2, 4, requires_grad=True)
        state = SinglePassState(previous)
        layer.single_pass_state = state
        output = layer(x)
        h_pre, h_post, h_res = layer.mixer_hyper_connection.compute_mappings(x)
        mixed, _ = layer.mixer(layer.norm(aggregate(x, previous)))
        torch.testing.assert_close(output, mix_residual(x, h_res) + expand_output(mixed, h_post))
        torch.testing.assert_close(state.pre_mix, h_pre)
        (output.sum() + state.pre_mix.sum()).backward()
    assert previous.grad is not None and previous.grad.abs().sum() > 0
    assert layer.mixer_hyper_connection.mapping_proj.weight.grad.abs().sum() > 0


def test_single_pass_hybrid_model_contracts_with_the_last_sites_pre_and_feeds_mtp():
    """A single-pass Hybrid stack has no hc_head (decoder or MTP depth); its final norm reads
    the streams contracted by the last site's pre; the MTP depth's sites chain on from the
    decoder's last pre, and every hyper connection (Mamba, attention, MLP, MTP) trains."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from megatron_ext.mhc.hyper_connection import aggregate as aggregate_streams

    MTPLossLoggingHelper.tracker.clear()
    seen = {}
    with model_parallel():
        model = _model("M*-M/*-", mhc_single_pass=True, mtp_num_layers=1)
        assert not [n for n, _ in model.named_parameters() if "hc_head" in n]
        last = model.decoder.layers[-1]
        last.register_forward_hook(
            lambda m, args, kwargs, out: seen.update(
                streams_in=kwargs["hidden_states"], streams_out=out
            ),
            with_kwargs=True,
        )
        # Registered after the stack's contraction hook, so it sees the contracted input.
        model.decoder.final_norm.register_forward_pre_hook(
            lambda m, args: seen.update(contracted=args[0])
        )
        loss = _loss(model)
        pre_last, _, _ = last.mixer_hyper_connection.compute_mappings(seen["streams_in"])
        expected = aggregate_streams(seen["streams_out"], pre_last)
        torch.testing.assert_close(seen["contracted"], expected)
        loss.backward()
    MTPLossLoggingHelper.tracker.clear()
    untrained = [
        name
        for name, param in model.named_parameters()
        if "hyper_connection.mapping_proj" in name and not param.grad.abs().sum() > 0
    ]
    assert not untrained, untrained
    assert any(
        n.startswith("mtp.") and "hyper_connection" in n for n, _ in model.named_parameters()
    )
