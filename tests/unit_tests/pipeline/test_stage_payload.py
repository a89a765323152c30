"""The typed stage payload (megatron_ext.pipeline.payload, payload_wire) and single-pass mHC's
maths (megatron_ext.mhc.single_pass), on one process: packing is bit-exact both ways, today's
models' payload is the one tensor they exchanged before (same width, same bytes in the
schedule report of every shipped recipe), single-pass payloads add the fp32 coefficients,
and a chain of single-pass sites computes the published order of operations."""

import types
import warnings
from pathlib import Path

import pytest
import torch

from megatron_ext import cli, guards
from megatron_ext.config import MHCTransformerConfig
from megatron_ext.mhc.hyper_connection import HyperConnectionModule
from megatron_ext.mhc.reference import reference_mappings
from megatron_ext.mhc.single_pass import (
    SinglePassState,
    contract_with_pre_mix,
    initial_pre_mix,
    single_pass_site,
)
from megatron_ext.pipeline.payload import PRE_MIX, stage_payload
from megatron_ext.pipeline.payload_wire import pack, unpack
from megatron_ext.schedules.schedule import message_bytes

RECIPES = Path(__file__).parents[3] / "recipes"
S, B, N, H = 5, 2, 4, 8


def _settings(**fields):
    base = dict(hidden_size=H, enable_mhc_connections=True, mhc_num_residual_streams=N)
    base.update(fields)
    return types.SimpleNamespace(**base)


def _single_pass_payload(dtype):
    return stage_payload(_settings(mhc_single_pass=True, pipeline_dtype=dtype), 2)


# ----------------------------------------------------------------------------- the wire
@pytest.mark.parametrize("wire", [torch.float32, torch.bfloat16])
def test_pack_and_unpack_move_every_bit_both_ways(wire):
    """Values and gradients cross bit for bit, also bit patterns that arithmetic would alter
    (a NaN payload, subnormals, -0.0), for an fp32 field inside a bf16 wire too."""
    payload = _single_pass_payload(wire)
    streams = torch.randn(S, B, N * H).to(wire).requires_grad_()
    odd = torch.tensor([float("nan"), 1e-40, -0.0, 3.0]).view(torch.int32)
    odd[0] = 0x7FC00123  # a NaN with a payload
    coefficients = odd.view(torch.float32).expand(S, B, N).clone().requires_grad_()
    wire_tensor = pack(payload, {"hidden_states": streams, PRE_MIX: coefficients})
    assert wire_tensor.dtype == wire and wire_tensor.shape == (S, B, payload.wire_width)
    received = wire_tensor.detach().requires_grad_()
    fields = unpack(payload, received)
    assert torch.equal(fields["hidden_states"].view(torch.uint8), streams.view(torch.uint8))
    assert torch.equal(fields[PRE_MIX].view(torch.int32), coefficients.view(torch.int32))

    grad_streams = torch.randn_like(streams)
    grad_coefficients = coefficients.detach().clone()  # the odd patterns as a gradient
    torch.autograd.backward(
        [fields["hidden_states"], fields[PRE_MIX]], [grad_streams, grad_coefficients]
    )
    wire_tensor.backward(received.grad)  # what the sender's backward_step does
    assert torch.equal(streams.grad.view(torch.uint8), grad_streams.view(torch.uint8))
    assert torch.equal(coefficients.grad.view(torch.int32), grad_coefficients.view(torch.int32))


def test_a_plain_payload_is_the_tensor_itself():
    payload = stage_payload(_settings(), 2)
    assert payload.is_plain and payload.names == ("hidden_states",)
    x = torch.randn(S, B, N * H, requires_grad=True)
    assert pack(payload, {"hidden_states": x}) is x
    assert unpack(payload, x)["hidden_states"] is x


def test_pack_refuses_a_field_of_the_wrong_width_or_dtype():
    payload = _single_pass_payload(torch.float32)
    streams = torch.zeros(S, B, N * H)
    with pytest.raises(ValueError, match="payload field pre_mix"):
        pack(payload, {"hidden_states": streams, PRE_MIX: torch.zeros(S, B, N).double()})
    with pytest.raises(ValueError, match="has the fields"):
        pack(payload, {"hidden_states": streams})


# ----------------------------------------------------------------------------- sizes
@pytest.mark.parametrize("mhc", [False, True])
@pytest.mark.parametrize("streams", [2, 4])
@pytest.mark.parametrize("pp", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, None])
def test_todays_models_exchange_one_field_as_wide_as_before(mhc, streams, pp, dtype):
    """The width megatron-ext sized P2P buffers with before the payload: n*h with mHC and
    more than one stage, else h."""
    settings = _settings(
        enable_mhc_connections=mhc, mhc_num_residual_streams=streams, pipeline_dtype=dtype
    )
    payload = stage_payload(settings, pp)
    assert payload.is_plain
    assert payload.wire_width == (H * streams if mhc and pp > 1 else H)


def _shipped_single_model_recipes():
    from megatron_ext.recipes.schedule import plan_from_recipe

    for path in sorted(RECIPES.glob("*.yaml")):
        plan, size = plan_from_recipe(str(path), [])
        if size is not None:
            yield path.stem, plan, size


def test_schedule_message_sizes_of_the_shipped_recipes_are_unchanged():
    """`megatron-ext schedule --recipe` sizes each message from the payload; for every
    shipped recipe that is message_bytes, the formula it used before, and one field (the
    single-pass recipe adds exactly its fp32 coefficients)."""
    seen = 0
    for name, _plan, size in _shipped_single_model_recipes():
        if size.single_pass:
            coefficients = size.local_seq * size.micro_batch_size * size.mhc_streams * 4
            assert (
                size.bytes
                == message_bytes(
                    size.hidden, size.seq, size.micro_batch_size, size.mhc_streams, size.dtype_bytes
                )
                + coefficients
            )
            continue
        before = message_bytes(
            size.hidden,
            size.seq,
            size.micro_batch_size,
            size.mhc_streams,
            size.dtype_bytes,
            size.tp,
            size.cp,
            size.sequence_parallel,
        )
        assert size.bytes == before, name
        assert size.payload.is_plain, name
        seen += 1
    assert seen >= 8


def test_single_pass_payload_adds_fp32_coefficients():
    fp32, bf16 = _single_pass_payload(torch.float32), _single_pass_payload(torch.bfloat16)
    assert fp32.names == bf16.names == ("hidden_states", PRE_MIX)
    assert fp32.wire_width == N * H + N  # n fp32 values in fp32 slots
    assert bf16.wire_width == N * H + 2 * N  # each fp32 value takes two bf16 slots
    assert bf16.field_bytes(S, B) == {"hidden_states": S * B * N * H * 2, PRE_MIX: S * B * N * 4}
    assert all(f.requires_grad for f in bf16.fields)
    # One stage: nothing travels, the payload stays the plain residual.
    assert stage_payload(_settings(mhc_single_pass=True), 1).is_plain


def test_schedule_reports_each_field(capsys):
    code = cli.main(
        ["schedule", "--pp", "2", "--microbatches", "4", "--hidden", "64", "--seq", "32"]
        + ["--micro-batch-size", "2", "--mhc-streams", "4", "--mhc-single-pass"]
        + ["--dtype-bytes", "2"]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "each message [32, 2, 264] x 2 B = 33.0 KiB, its fields:" in out
    assert "hidden_states [32, 2, 4*64] bf16 (with its gradient) = 32.0 KiB" in out
    assert "pre_mix [32, 2, 4] fp32 (with its gradient) = 1.0 KiB" in out


# ----------------------------------------------------------------------------- single-pass maths
def _config(**overrides):
    fields = dict(
        num_layers=2,
        hidden_size=H,
        num_attention_heads=2,
        enable_mhc_connections=True,
        mhc_num_residual_streams=N,
        mhc_single_pass=True,
    )
    fields.update(overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return MHCTransformerConfig(**fields)


def _sites(count, reference_path):
    sites = []
    for index in range(count):
        torch.manual_seed(index)
        site = HyperConnectionModule(_config(), layer_number=index + 1)
        with torch.no_grad():  # away from init, so every term matters
            for param in site.parameters():
                param.copy_(torch.randn(param.shape) * 0.3)
        site.use_reference_path = reference_path
        sites.append(site)
    return sites


def _sublayer(index):
    return lambda u: torch.tanh(u * (0.5 + 0.1 * index))


def _by_the_formulas(sites, x):
    """The published order, spelled out: site k aggregates with pre_{k-1} (e_0 first), mixes
    with its own res and post, hands its pre on; the last pre contracts."""
    previous = torch.zeros(S, B, N)
    previous[..., 0] = 1
    for index, site in enumerate(sites):
        pre, post, res = reference_mappings(site, x)
        streams = x.view(S, B, N, H)
        u = (previous.unsqueeze(-1) * streams).sum(-2)
        y = _sublayer(index)(u)
        mixed = torch.einsum("sbji,sbjh->sbih", res, streams)  # H_resᵀ
        x = (mixed + post.unsqueeze(-1) * y.unsqueeze(-2)).reshape(S, B, N * H)
        previous = pre
    return (previous.unsqueeze(-1) * x.view(S, B, N, H)).sum(-2)


def _by_the_module(sites, x):
    state = SinglePassState(initial_pre_mix(x, N))
    for index, site in enumerate(sites):
        u, post, res = single_pass_site(site, x, state)
        x = site.merge_fn(res, x, post, _sublayer(index)(u), None)
    return contract_with_pre_mix(x, state)


@pytest.mark.parametrize("reference_path", [False, True])
def test_single_pass_chain_follows_the_published_order(reference_path):
    """Output and every gradient (input and all parameters) of 3 sites equal the formulas,
    for the lean and the reference path."""
    x = torch.randn(S, B, N * H, dtype=torch.float64)
    sites = [s.double() for s in _sites(3, reference_path)]
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, want = _by_the_module(sites, x1), _by_the_formulas(sites, x2)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    probe = torch.randn_like(got)
    params = [p for s in sites for p in s.parameters()]
    got_grads = torch.autograd.grad((got * probe).sum(), [x1, *params])
    want_grads = torch.autograd.grad((want * probe).sum(), [x2, *params])
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_single_pass_differs_from_two_pass():
    """Not the two-pass form in disguise: the first site reads stream 0 only."""
    site = _sites(1, False)[0]
    x = torch.randn(S, B, N * H)
    state = SinglePassState(initial_pre_mix(x, N))
    u, _, _ = single_pass_site(site, x, state)
    assert torch.equal(u, x[..., :H])
    two_pass, _, _ = site(x)
    assert not torch.allclose(u, two_pass)


# ----------------------------------------------------------------------------- guards
@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (dict(use_fused_mhc=True), "use_fused_mhc"),
        (
            dict(recompute_granularity="selective", recompute_modules=["mhc"]),
            "'mhc' in recompute_modules",
        ),
        (dict(mhc_learned_output_contract=True), "mhc_learned_output_contract"),
    ],
)
def test_single_pass_refuses_what_it_cannot_do_yet(overrides, named, monkeypatch):
    monkeypatch.setattr(guards, "check_fused_mhc", lambda config: None)  # no triton needed
    with pytest.raises(guards.UnsupportedCombinationError, match=f"mhc_single_pass=True .*{named}"):
        _config(**overrides)


@pytest.mark.parametrize("variant", ["deepseek-v4", "glm5"])
def test_single_pass_takes_deepseek_maps(variant):
    """Upstream's single pass is on DeepSeek's maps (issue 42): no longer refused."""
    config = _config(mhc_variant=variant)
    assert config.mhc_single_pass and config.mhc_variant == variant


def test_single_pass_needs_mhc():
    with pytest.raises(ValueError, match="needs enable_mhc_connections"):
        guards.check_mhc_single_pass(types.SimpleNamespace(mhc_single_pass=True))


def test_stages_disagreeing_on_single_pass_are_named():
    """pipeline.consistency names the field before the shape it changes."""
    from megatron_ext.pipeline import consistency

    records = []
    for rank, single_pass in enumerate((False, True)):
        config = _settings(mhc_single_pass=single_pass, pipeline_dtype=torch.float32)
        width = stage_payload(config, 2).wire_width
        records.append({**consistency.stage_fields(config, [S, B, width]), "rank": rank})
    assert consistency.first_difference(records).startswith(
        "pipeline stages disagree on mhc_single_pass"
    )
