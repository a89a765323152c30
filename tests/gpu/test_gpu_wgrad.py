"""Deferred weight gradients (megatron_ext.pipeline.wgrad, ZB-H1's W) on one CUDA device
(marked ``gpu``, skipped without CUDA). tests/unit_tests/pipeline/test_wgrad.py checks
the same behaviour on CPU; on CUDA autograd runs the backward on its own device thread (the
reason wgrad's store is process-global) and ``torch.amp.custom_fwd/custom_bwd`` ("cuda")
bring autocast into the backward, neither of which a CPU run reaches.

Checked: a deferrable ColumnParallelLinear and RowParallelLinear (TP=1), and a tiny GPT+mHC
from our local spec with ``pipeline_schedule="zb-h1"``, give after ``wgrad.capture(k)`` +
backward, then the W step, the gradients of the eager (``"1f1b"``) model; fp32 params, bf16
params, and fp32 params under bf16 autocast (linears). A torch optimizer step (plain and fused)
with work pending raises. megatron's DDP (main_grad) is not exercised here: the other gpu tests
do not set it up, and the CPU tests cover its hooks.

Tolerances: the two paths run the same GEMMs on the same operands, so they are expected to be
bit-identical; each bound (:data:`REL_TOL`) allows a different cuBLAS kernel choice (another
reduction order) and is far below what a lost, doubled or misattributed micro-batch gives
(an O(1) relative error)."""

from __future__ import annotations

import contextlib

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC recompute"),
]

DEVICE = torch.device("cuda", 0)
IN, OUT, SEQ, BATCH = 64, 96, 16, 4

# Largest |ours - eager| allowed, relative to the eager tensor's largest |entry|.
# fp32: a reordered fp32 reduction over SEQ*BATCH = 64 terms moves a sum by a few ulps
# (2^-23 each), well under 1e-5. bf16 (params, or autocast GEMMs): results are rounded to
# bf16 (2^-8 = 3.9e-3 relative); one differing rounding plus the accumulation of two
# micro-batches' gradients in bf16 stays under 1e-2.
REL_TOL = {"fp32": 1e-5, "bf16": 1e-2, "autocast": 1e-2}
PRECISIONS = list(REL_TOL)


@pytest.fixture
def one_gpu_model_parallel():
    import megatron_ext
    from megatron_ext.testing.distributed import model_parallel

    megatron_ext.install()
    if DEVICE.type == "cuda":
        torch.cuda.set_device(DEVICE)
    with model_parallel():
        yield


@pytest.fixture(autouse=True)
def _nothing_left_pending():
    from megatron_ext.pipeline import wgrad

    wgrad.discard_pending()
    yield
    left = wgrad.pending()
    wgrad.discard_pending()
    assert not left, f"a test left work pending: {left}"


def _params_dtype(precision: str) -> torch.dtype:
    return torch.bfloat16 if precision == "bf16" else torch.float32


def _autocast(precision: str):
    if precision == "autocast":
        return torch.autocast(DEVICE.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, precision: str, what: str):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    assert actual.device == expected.device, what
    error = (actual.float() - expected.float()).abs().max().item()
    scale = expected.float().abs().max().item()
    # A zero eager tensor (an mHC gate whose gradient vanishes at init) must stay exactly zero.
    assert error <= REL_TOL[precision] * scale, f"{what}: max error {error:.3e}, scale {scale:.3e}"
    return scale


# ----------------------------------------------------------------------------- the linears
def _linear(kind: str, source, schedule: str, precision: str, seed: int = 7):
    """A column (IN -> OUT) or row (OUT -> IN) linear of ``source`` (megatron's
    tensor_parallel or our wgrad module) on the device; same weights for the same seed."""
    from megatron_ext.testing.configs import small_config

    config = small_config(
        num_layers=1,
        hidden_size=IN,
        num_attention_heads=2,
        pipeline_schedule=schedule,
        params_dtype=_params_dtype(precision),
    )

    def init(weight):
        torch.nn.init.normal_(weight, std=0.5)

    torch.manual_seed(seed)
    if kind == "column":
        layer = source.ColumnParallelLinear(
            IN, OUT, config=config, init_method=init, bias=True, gather_output=False
        )
    else:
        layer = source.RowParallelLinear(
            OUT, IN, config=config, init_method=init, bias=True, input_is_parallel=True,
            skip_bias_add=False,
        )  # fmt: skip
    with torch.no_grad():  # megatron zeroes biases; a zero bias gradient hides nothing
        layer.bias.normal_()
    return layer.to(DEVICE)


def _inputs(kind: str, precision: str, count: int = 2):
    generator = torch.Generator().manual_seed(11)
    width, out = (IN, OUT) if kind == "column" else (OUT, IN)
    dtype = _params_dtype(precision)
    xs = [torch.randn(SEQ, BATCH, width, generator=generator) for _ in range(count)]
    gs = [torch.randn(SEQ, BATCH, out, generator=generator) for _ in range(count)]
    return [x.to(DEVICE, dtype) for x in xs], [g.to(DEVICE, dtype) for g in gs]


def _backward(layer, x: torch.Tensor, g: torch.Tensor, precision: str) -> torch.Tensor:
    """Forward (under autocast for "autocast"), then backward outside it, as torch's AMP
    recipe does: custom_bwd puts the backward under the forward's autocast state."""
    x = x.clone().requires_grad_()
    with _autocast(precision):
        output, _ = layer(x)
    output.backward(g.to(output.dtype))
    return x.grad


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("kind", ["column", "row"])
def test_deferrable_linear_capture_then_run_equals_eager(one_gpu_model_parallel, kind, precision):
    from megatron.core import tensor_parallel

    from megatron_ext.pipeline import wgrad

    eager = _linear(kind, tensor_parallel, "1f1b", precision)
    ours = _linear(kind, wgrad, "zb-h1", precision)
    for (name, p), q in zip(ours.named_parameters(), eager.parameters(), strict=True):
        assert p.device.type == DEVICE.type and torch.equal(p, q), name
    xs, gs = _inputs(kind, precision)
    eager_dx = [_backward(eager, x, g, precision) for x, g in zip(xs, gs, strict=True)]
    dx = []
    for key, (x, g) in enumerate(zip(xs, gs, strict=True)):
        with wgrad.capture(key):
            dx.append(_backward(ours, x, g, precision))
        # Stored, not computed: the device thread that ran the backward saw the capture.
        assert ours.weight.grad is None, "the weight gradient was computed in B"
        assert wgrad.pending() == list(range(key + 1))
    if kind == "column":  # its bias is inside the deferred matmul
        assert ours.bias.grad is None
    wgrad.run(0)
    assert wgrad.pending() == [1]
    wgrad.run(1)
    assert wgrad.pending() == []
    for i, (mine, theirs) in enumerate(zip(dx, eager_dx, strict=True)):
        _assert_close(mine, theirs, precision, f"input gradient {i}")
    for (name, p), q in zip(ours.named_parameters(), eager.parameters(), strict=True):
        _assert_close(p.grad, q.grad, precision, f"{name}.grad")


@pytest.mark.parametrize("precision", PRECISIONS)
def test_deferrable_linear_outside_capture_is_eager(one_gpu_model_parallel, precision):
    from megatron.core import tensor_parallel

    from megatron_ext.pipeline import wgrad

    eager = _linear("column", tensor_parallel, "1f1b", precision)
    ours = _linear("column", wgrad, "zb-h1", precision)
    (x,), (g,) = _inputs("column", precision, count=1)
    dx = _backward(ours, x, g, precision)
    assert wgrad.pending() == []
    _assert_close(dx, _backward(eager, x, g, precision), precision, "input gradient")
    for (name, p), q in zip(ours.named_parameters(), eager.parameters(), strict=True):
        _assert_close(p.grad, q.grad, precision, f"{name}.grad")


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused_adam"])
def test_optimizer_step_with_work_pending_raises(one_gpu_model_parallel, fused):
    from megatron_ext.pipeline import wgrad

    layer = _linear("column", wgrad, "zb-h1", "fp32")
    if fused:  # a CUDA-only optimizer path: the step pre-hook must guard it too
        optimizer = torch.optim.Adam(layer.parameters(), lr=0.1, fused=True)
    else:
        optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    (x,), (g,) = _inputs("column", "fp32", count=1)
    with wgrad.capture("mb"):
        _backward(layer, x, g, "fp32")
    before = layer.weight.detach().clone()
    with pytest.raises(wgrad.PendingWeightGradientError, match=r"1 micro-batch.*run\(key\)"):
        optimizer.step()
    assert torch.equal(layer.weight, before)
    wgrad.run("mb")
    optimizer.step()
    assert not torch.equal(layer.weight, before)


# ----------------------------------------------------------------------------- a GPT + mHC
def _gpt(schedule: str, precision: str):
    """A 2-layer GPT with mHC (n=2) from our local spec; bf16 as megatron trains it (bf16
    params behind Float16Module)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    from megatron_ext.config import MHCTransformerConfig
    from megatron_ext.models.gpt import GPTModel, get_gpt_layer_local_spec
    from megatron_ext.testing.equivalence import TrainPlan, transformer_config

    dtype = _params_dtype(precision)
    plan = TrainPlan(num_layers=2, hidden_size=64, micro_batch_size=2, global_batch_size=4)
    plan.config_overrides = dict(
        enable_mhc_connections=True,
        mhc_num_residual_streams=2,
        add_bias_linear=True,
        pipeline_schedule=schedule,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=precision == "bf16",
    )
    config = transformer_config(plan, parallel=False, config_class=MHCTransformerConfig)
    torch.manual_seed(plan.seed)
    model_parallel_cuda_manual_seed(plan.seed)
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(enable_mhc_connections=True),
        vocab_size=plan.vocab_size,
        max_sequence_length=plan.seq_length,
        share_embeddings_and_output_weights=True,
    ).to(DEVICE)
    wrapped = Float16Module(config, model) if precision == "bf16" else model
    return plan, model, wrapped


def _gpt_loss(model, batch) -> torch.Tensor:
    batch = {k: v.to(DEVICE) for k, v in batch.items()}
    losses = model(
        batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
    )
    return (losses.float() * batch["loss_mask"]).sum()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gpt_mhc_zb_h1_grads_equal_1f1b(one_gpu_model_parallel, precision):
    from megatron_ext.pipeline import wgrad
    from megatron_ext.pipeline.zero_bubble import weight_gradient_step
    from megatron_ext.testing.equivalence import make_microbatches

    plan, eager_model, eager = _gpt("1f1b", precision)
    _, our_model, ours = _gpt("zb-h1", precision)
    assert len(wgrad.deferrable_linears(our_model)) == 2 * 4  # qkv, proj, fc1, fc2 per layer
    for (name, p), q in zip(our_model.named_parameters(), eager_model.parameters(), strict=True):
        assert p.device.type == DEVICE.type and torch.equal(p, q), name
    for deferred in wgrad.deferrable_linears(our_model):  # (mHC keeps its own params fp32)
        assert deferred.weight.dtype == _params_dtype(precision)
    batches = make_microbatches(plan, 0)
    eager_losses = [_gpt_loss(eager, batch) for batch in batches]
    for loss in eager_losses:
        loss.backward()
    losses = []
    for key, batch in enumerate(batches):
        loss = _gpt_loss(ours, batch)
        with wgrad.capture(key):
            loss.backward()
        losses.append(loss.detach())
    assert wgrad.pending() == [0, 1]
    for deferred in wgrad.deferrable_linears(our_model):
        assert deferred.weight.grad is None, "a weight gradient was computed in B"
    for key in range(len(batches)):  # the schedule's W step, single-stage
        weight_gradient_step(our_model, key, our_model.config)
    assert wgrad.pending() == []
    for i, (mine, theirs) in enumerate(zip(losses, eager_losses, strict=True)):
        _assert_close(mine, theirs.detach(), precision, f"loss {i}")
    nonzero = []
    for (name, p), q in zip(our_model.named_parameters(), eager_model.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        if _assert_close(p.grad, q.grad, precision, f"{name}.grad") > 0:
            nonzero.append(name)
    # The comparison proves something: every deferred weight and mHC projection has a gradient.
    deferred_ids = {id(m) for m in wgrad.deferrable_linears(our_model)}
    weights = [f"{n}.weight" for n, m in our_model.named_modules() if id(m) in deferred_ids]
    assert len(weights) == 8 and not [w for w in weights if w not in nonzero], nonzero
    assert any("hyper_connection.mapping_proj" in n for n in nonzero), nonzero
