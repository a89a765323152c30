"""megatron-ext's HybridModel on one process: without mHC it is megatron-core's; with mHC its
parameters, learned contraction, training, MTP and 'mhc' recompute."""

import dataclasses
import math

import pytest
import torch

from megatron.core.models.hybrid import hybrid_block
from megatron.core.models.hybrid.hybrid_model import HybridModel as CoreHybridModel
from megatron.core.pipeline_parallel.schedules import custom_backward, deallocate_output_tensor
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_ext.mhc import recompute as mhc_recompute
from megatron_ext.models.hybrid import (
    HybridHyperConnectionLayer,
    HybridModel,
    HybridStack,
    get_hybrid_stack_local_spec,
)
from megatron_ext.models.norms import LocalNorm
from megatron_ext.testing.configs import small_config
from megatron_ext.testing.distributed import model_parallel
from megatron_ext.testing.equivalence import TrainPlan, make_microbatches

pytestmark = pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC recompute")

PLAN = TrainPlan()


@pytest.fixture(autouse=True)
def _fresh_mtp_loss_tracker():
    """megatron's MTP loss tracker is global and sized by the first model's MTP depth."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker.clear()
    yield
    MTPLossLoggingHelper.tracker.clear()


def _config(pattern: str, mhc: bool, streams: int = 2, **fields):
    main, _, mtp = pattern.partition("/")
    moe = (
        dict(
            num_moe_experts=4,
            moe_router_topk=2,
            moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="alltoall",
            add_bias_linear=False,
        )
        if "E" in pattern
        else {}
    )
    settings = dict(
        num_layers=len(main.replace("|", "")),
        hidden_size=PLAN.hidden_size,
        num_attention_heads=PLAN.num_attention_heads,
        enable_mhc_connections=mhc,
        mhc_num_residual_streams=streams,
        mtp_num_layers=len(pattern.split("/")) - 1 if mtp else None,
        **moe,
    )
    settings.update(fields)
    return small_config(**settings)


def _build(model_class, config, spec, pattern, seed=3, **kwargs):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    return model_class(
        config,
        spec,
        vocab_size=PLAN.vocab_size,
        max_sequence_length=PLAN.seq_length,
        hybrid_layer_pattern=pattern,
        position_embedding_type="rope",
        **kwargs,
    )


def _loss(model, step=0, index=0):
    batch = make_microbatches(PLAN, step)[index]
    losses = model(
        batch["tokens"],
        batch["position_ids"],
        batch["attention_mask"],
        labels=batch["labels"],
        loss_mask=batch["loss_mask"],
    )
    return (losses * batch["loss_mask"]).sum() / batch["loss_mask"].sum()


# ------------------------------------------------------------------------- without mHC


def _core_stack_spec(spec):
    """The same layer specs, built by megatron-core's own HybridStack."""
    fields = dataclasses.fields(hybrid_block.HybridStackSubmodules)
    submodules = hybrid_block.HybridStackSubmodules(
        **{f.name: getattr(spec.submodules, f.name) for f in fields}
    )
    return ModuleSpec(module=hybrid_block.HybridStack, submodules=submodules)


@pytest.mark.parametrize("pattern", ["*-E*-", "*-*-/*-"])
def test_without_mhc_same_parameters_and_outputs_as_megatron_core(monkeypatch, pattern):
    # megatron-core's HybridStack hard-codes TENorm as its final norm; give it the local one.
    monkeypatch.setattr(hybrid_block, "TENorm", LocalNorm)
    with model_parallel():
        config = _config(pattern, mhc=False)
        ours = _build(HybridModel, config, get_hybrid_stack_local_spec(), pattern)
        core = _build(
            CoreHybridModel, config, _core_stack_spec(get_hybrid_stack_local_spec()), pattern
        )
        assert (
            isinstance(ours.decoder, HybridStack) and type(core.decoder) is hybrid_block.HybridStack
        )
        ours_params, core_params = dict(ours.named_parameters()), dict(core.named_parameters())
        assert list(ours_params) == list(core_params)
        for name, param in ours_params.items():
            assert torch.equal(param, core_params[name]), name
        ours_loss, core_loss = _loss(ours), _loss(core)
        assert torch.equal(ours_loss, core_loss)
        ours_loss.backward()
        core_loss.backward()
        for name, param in ours_params.items():
            assert torch.equal(param.grad, core_params[name].grad), name
        batch = make_microbatches(PLAN, 0)[0]
        logits = [
            m(batch["tokens"], batch["position_ids"], batch["attention_mask"]) for m in (ours, core)
        ]
        assert torch.equal(*logits)


def test_local_spec_layers_follow_the_pattern_symbols():
    with model_parallel():
        model = _build(HybridModel, _config("*-E", mhc=False), get_hybrid_stack_local_spec(), "*-E")
        attention, mlp, moe = model.decoder.layers
        assert type(attention.self_attention).__name__ == "SelfAttention"
        assert type(attention.mlp).__name__ == "IdentityOp"
        assert type(mlp.self_attention).__name__ == "IdentityOp"
        assert type(mlp.mlp).__name__ == "MLP" and type(moe.mlp).__name__ == "MoELayer"
        assert isinstance(model.decoder.final_norm, torch.nn.LayerNorm)


# ------------------------------------------------------------------------- mHC: structure


def test_mhc_parameters_are_named_and_initialised_as_upstream():
    n = 2
    with model_parallel():
        spec = get_hybrid_stack_local_spec(enable_mhc_connections=True)
        model = _build(HybridModel, _config("*-E", mhc=True, streams=n), spec, "*-E")
        params = dict(model.named_parameters())
        h = PLAN.hidden_size
        assert params["decoder.hc_head_fn"].shape == (n, n * h)
        assert torch.equal(params["decoder.hc_head_base"], torch.zeros(n))
        assert torch.equal(params["decoder.hc_head_scale"], torch.ones(1))
        bound = math.sqrt(6.0 / (n + n * h))  # xavier uniform
        assert (
            params["decoder.hc_head_fn"].abs().max() <= bound
            and params["decoder.hc_head_fn"].std() > 0
        )
        attention, mlp, moe = model.decoder.layers
        assert all(isinstance(layer, HybridHyperConnectionLayer) for layer in (attention, mlp, moe))
        assert "decoder.layers.0.self_attention_hyper_connection.mapping_proj.weight" in params
        assert not any(k.startswith("decoder.layers.0.mlp_hyper_connection") for k in params)
        assert "decoder.layers.1.mlp_hyper_connection.alpha_res" in params
        assert "decoder.layers.2.mlp_hyper_connection.bias" in params and moe.is_moe_layer
        assert not any(
            k.startswith("decoder.layers.1.self_attention_hyper_connection") for k in params
        )
        keys = set(model.sharded_state_dict().keys())
        assert {"decoder.hc_head_fn", "decoder.hc_head_base", "decoder.hc_head_scale"} <= keys
        for name in ("hc_head_fn", "hc_head_base", "hc_head_scale"):
            assert getattr(model.decoder, name).sequence_parallel is False  # config has SP off


def test_only_the_post_process_stack_has_the_learned_contraction():
    with model_parallel():
        config = _config("*-", mhc=True)
        spec = get_hybrid_stack_local_spec(enable_mhc_connections=True)
        first = _build(HybridModel, config, spec, "*-", post_process=False)
        last = _build(HybridModel, config, spec, "*-", pre_process=False)
        assert not hasattr(first.decoder, "hc_head_fn") and hasattr(last.decoder, "hc_head_fn")
        assert first.decoder.contracts_streams is False and last.decoder.contracts_streams


def _hand_contraction(x, head_fn, n, eps):
    """DeepSeek-V4's learned contraction for one token, term by term, in float64."""
    x, head_fn = x.double().tolist(), head_fn.double().tolist()
    h = len(x) // n
    rho = 1.0 / math.sqrt(sum(v * v for v in x) / len(x) + eps)
    weights = []
    for i in range(n):
        logit = rho * sum(head_fn[i][k] * x[k] for k in range(len(x)))
        weights.append(1.0 / (1.0 + math.exp(-(logit * 1.0 + 0.0))) + eps)  # scale 1, base 0
    return [sum(weights[i] * x[i * h + j] for i in range(n)) for j in range(h)]


def test_learned_contraction_at_initialisation_equals_the_hand_computation():
    n, h = 2, 4
    with model_parallel():
        config = _config(
            "-", mhc=True, streams=n, hidden_size=h, num_attention_heads=1, layernorm_epsilon=1e-5
        )
        model = _build(
            HybridModel, config, get_hybrid_stack_local_spec(enable_mhc_connections=True), "-"
        )
        stack = model.decoder
        x = torch.tensor(
            [
                [[0.5, -1.0, 2.0, 0.25, 1.5, 0.0, -0.75, 3.0]],
                [[1.0, 1.0, -2.0, 0.5, 0.1, -0.2, 0.3, 0.4]],
            ]
        )  # [s=2, b=1, n*h=8]
        head_fn = stack.hc_head_fn.detach()
        expected = torch.tensor(
            [[_hand_contraction(token[0], head_fn, n, 1e-5)] for token in x], dtype=torch.float32
        )
        contracted = stack.contract_streams(x)
        torch.testing.assert_close(contracted, expected, rtol=1e-6, atol=1e-6)
        # The final norm sees the contraction (its pre-hook contracts the n streams).
        with torch.no_grad():
            torch.testing.assert_close(
                stack.final_norm(x), torch.nn.functional.layer_norm(expected, (h,), eps=1e-5)
            )
            # With a zero head the weights are exactly sigmoid(0) + eps: (0.5 + eps) * (x_1 + x_2).
            stack.hc_head_fn.zero_()
        by_hand = (0.5 + 1e-5) * (x[..., :h] + x[..., h:])
        torch.testing.assert_close(stack.contract_streams(x), by_hand, rtol=0, atol=1e-7)


# ------------------------------------------------------------------------- mHC: training


def test_mhc_hybrid_loss_decreases_over_20_steps_on_a_fixed_batch():
    pattern = "*-E*-"
    with model_parallel():
        spec = get_hybrid_stack_local_spec(enable_mhc_connections=True)
        model = _build(HybridModel, _config(pattern, mhc=True, streams=4), spec, pattern)
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
        losses = []
        for step in range(20):
            optimizer.zero_grad()
            loss = _loss(model)
            loss.backward()
            if step == 0:
                for name, param in model.named_parameters():
                    if "hc_head" in name or "hyper_connection" in name:
                        assert param.grad is not None and param.grad.abs().sum() > 0, name
            optimizer.step()
            losses.append(loss.item())
        assert losses[-1] < 0.7 * losses[0], losses
        assert all(math.isfinite(v) for v in losses)


def test_mhc_hybrid_mtp_trains_every_depth():
    """MTP depths continue from the decoder's n streams: their projections, layers and own
    contraction all receive gradients, and the MTP loss reaches the decoder too."""
    pattern = "*-/*-/*-"
    with model_parallel():
        spec = get_hybrid_stack_local_spec(enable_mhc_connections=True)
        model = _build(HybridModel, _config(pattern, mhc=True), spec, pattern)
        names = dict(model.named_parameters())
        for depth in (0, 1):
            for name in (
                "e_proj.weight",
                "h_proj.weight",
                "hc_head_fn",
                "hc_head_base",
                "hc_head_scale",
            ):
                assert f"mtp.layers.{depth}.{name}" in names
            assert f"mtp.layers.{depth}.eh_proj.weight" not in names
        assert (
            "mtp.layers.0.mtp_model_layer.layers.0.self_attention_hyper_connection.alpha_pre"
            in names
        )
        _loss(model).backward()
        for name, param in names.items():
            if name.startswith("mtp.") and "output_layer" not in name:
                assert param.grad is not None and param.grad.abs().sum() > 0, name


def test_mtp_loss_changes_decoder_gradients():
    pattern = "*-/*-"
    with model_parallel():
        spec = get_hybrid_stack_local_spec(enable_mhc_connections=True)
        grads = []
        for scale in (0.0, 1.0):
            model = _build(
                HybridModel,
                _config(pattern, mhc=True, mtp_loss_scaling_factor=scale),
                spec,
                pattern,
            )
            from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

            MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
            _loss(model).backward()
            grads.append(
                model.decoder.layers[
                    0
                ].self_attention_hyper_connection.mapping_proj.weight.grad.clone()
            )
        assert not torch.allclose(grads[0], grads[1])


@pytest.mark.parametrize("layers_per_group", [None, 1, 2])
def test_mhc_recompute_gives_identical_gradients(monkeypatch, layers_per_group):
    pattern = "*-E*-"
    discarded = []
    original = mhc_recompute.MHCRecomputeGroup.discard_and_recompute_on_backward

    def counting(self, hook_tensor):
        discarded.append(len(self))
        return original(self, hook_tensor)

    monkeypatch.setattr(
        mhc_recompute.MHCRecomputeGroup, "discard_and_recompute_on_backward", counting
    )
    results = []
    with model_parallel():
        spec = get_hybrid_stack_local_spec(enable_mhc_connections=True)
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
            model = _build(
                HybridModel, _config(pattern, mhc=True, streams=4, **extra), spec, pattern
            )
            loss = _loss(model)
            loss.backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            results.append((loss.detach(), grads))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name
    expected_groups = {None: 1, 1: 5, 2: 3}[layers_per_group]
    assert len(discarded) == expected_groups and sum(discarded) > 0, discarded


# ------------------------------------------------------------------------- empty chunks


@pytest.mark.parametrize("mhc", [False, True])
def test_an_empty_intermediate_chunk_returns_a_graph_connected_copy(mhc):
    with model_parallel():
        config = _config("*-", mhc=mhc)
        stack = HybridStack(
            config,
            get_hybrid_stack_local_spec(enable_mhc_connections=mhc).submodules,
            pre_process=False,
            post_process=False,
            layer_type_list=[],
            pg_collection=_pg_collection(),
        )
        width = config.hidden_size * (2 if mhc else 1)
        received = torch.randn(PLAN.seq_length, 2, width, requires_grad=True)
        stack.set_input_tensor(received)
        output = stack(None, None)
        assert output is not received and output.data_ptr() != received.data_ptr()
        assert output._base is None  # viewless: the schedule may free its data after sending
        torch.testing.assert_close(output, received)
        # What the schedule does after sending it: free its data, then run backward from it
        # through the C++ engine (which does not check the freed output's shape).
        deallocate_output_tensor(output, deallocate_pipeline_outputs=True)
        assert received.shape == (PLAN.seq_length, 2, width)
        custom_backward(output, torch.full((PLAN.seq_length, 2, width), 2.0))
        assert torch.equal(received.grad, torch.full_like(received, 2.0))


def _pg_collection():
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection.use_mpu_process_groups()
