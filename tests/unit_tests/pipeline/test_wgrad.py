"""Deferred weight gradients (megatron_ext.pipeline.wgrad), single rank: a deferrable linear
alone and a small mHC GPT built from the local spec give, after capture + run, the gradients
of an eager backward through megatron's own linears; DDP's hooks fire once per parameter per
micro-batch; an optimizer step with work pending is refused."""

from __future__ import annotations

import contextlib

import pytest
import torch
from mhc_moe_mla_cases import mla_plan, moe_plan

from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from megatron_ext.guards import PipelineScheduleError, UnsupportedCombinationError
from megatron_ext.pipeline import wgrad
from megatron_ext.testing.configs import small_config
from megatron_ext.testing.distributed import model_parallel
from megatron_ext.testing.equivalence import TrainPlan, make_microbatches, transformer_config

IN, OUT, SEQ, BATCH = 12, 20, 6, 3

pytestmark = pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC")


@pytest.fixture(autouse=True)
def _nothing_left_pending():
    wgrad.discard_pending()
    yield
    left = wgrad.pending()
    wgrad.discard_pending()
    assert not left, f"a test left work pending: {left}"


def _config(schedule: str, **fields):
    return small_config(
        num_layers=1,
        hidden_size=IN,
        num_attention_heads=2,
        pipeline_schedule=schedule,
        **fields,
    )


def _init(weight: torch.Tensor) -> None:
    torch.nn.init.normal_(weight, std=0.5)


def _build(kind: str, cls_source, schedule: str, bias: bool = True, seed: int = 7):
    """A column (IN -> OUT) or row (OUT -> IN) linear of ``cls_source`` (megatron's
    tensor_parallel or our wgrad module), with the same weights for the same seed."""
    config = _config(schedule)
    torch.manual_seed(seed)
    if kind == "column":
        layer = cls_source.ColumnParallelLinear(
            IN, OUT, config=config, init_method=_init, bias=bias, gather_output=False
        )
    else:
        layer = cls_source.RowParallelLinear(
            OUT,
            IN,
            config=config,
            init_method=_init,
            bias=bias,
            input_is_parallel=True,
            skip_bias_add=False,
        )
    if bias:
        with torch.no_grad():  # megatron zeroes biases; a zero bias gradient hides nothing
            layer.bias.normal_()
    return layer


def _inputs(kind: str, count: int, seed: int = 11):
    generator = torch.Generator().manual_seed(seed)
    width, out = (IN, OUT) if kind == "column" else (OUT, IN)
    xs = [torch.randn(SEQ, BATCH, width, generator=generator) for _ in range(count)]
    gs = [torch.randn(SEQ, BATCH, out, generator=generator) for _ in range(count)]
    return xs, gs


def _backward(layer, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    x = x.clone().requires_grad_()
    output, _ = layer(x)
    output.backward(g)
    return x.grad


def _grads(layer) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in layer.named_parameters()}


def _assert_equal(ours: dict, theirs: dict) -> None:
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name


@pytest.mark.parametrize("kind", ["column", "row"])
def test_captured_then_run_equals_eager_megatron(kind):
    with model_parallel():
        ref = _build(kind, tensor_parallel, "1f1b")
        ours = _build(kind, wgrad, "zb-h1")
        _assert_equal(dict(ours.named_parameters()), dict(ref.named_parameters()))
        xs, gs = _inputs(kind, 2)
        ref_dx = [_backward(ref, x, g) for x, g in zip(xs, gs, strict=True)]
        dx = []
        for key, (x, g) in enumerate(zip(xs, gs, strict=True)):
            with wgrad.capture(key):
                dx.append(_backward(ours, x, g))
            assert ours.weight.grad is None  # W not run yet
            assert wgrad.pending() == list(range(key + 1))
        if kind == "column":  # the bias is inside the deferred matmul
            assert ours.bias.grad is None
        wgrad.run(0)
        assert wgrad.pending() == [1]
        wgrad.run(1)
        assert wgrad.pending() == []
        for ours_dx, ref_dx_i in zip(dx, ref_dx, strict=True):
            assert torch.equal(ours_dx, ref_dx_i)
        # Two micro-batches accumulate like two eager backwards.
        _assert_equal(_grads(ours), _grads(ref))


@pytest.mark.parametrize("kind", ["column", "row"])
def test_outside_capture_is_eager(kind):
    with model_parallel():
        ref = _build(kind, tensor_parallel, "1f1b")
        ours = _build(kind, wgrad, "zb-h1")
        (x,), (g,) = _inputs(kind, 1)
        assert torch.equal(_backward(ours, x, g), _backward(ref, x, g))
        assert wgrad.pending() == []
        _assert_equal(_grads(ours), _grads(ref))


@pytest.mark.parametrize("kind", ["column", "row"])
def test_deferral_disabled_is_megatron_bit_for_bit(kind):
    with model_parallel():
        ref = _build(kind, tensor_parallel, "1f1b")
        ours = _build(kind, wgrad, "1f1b")
        xs, gs = _inputs(kind, 2)
        for x, g in zip(xs, gs, strict=True):
            x_ref = x.clone().requires_grad_()
            x_ours = x.clone().requires_grad_()
            out_ref, _ = ref(x_ref)
            with wgrad.capture(0):  # nothing is deferred: the config does not ask for it
                out_ours, _ = ours(x_ours)
                out_ours.backward(g)
            out_ref.backward(g)
            assert torch.equal(out_ours, out_ref)
            # megatron's own autograd function, not ours
            assert type(out_ours.grad_fn).__name__ == type(out_ref.grad_fn).__name__
            assert torch.equal(x_ours.grad, x_ref.grad)
        assert wgrad.pending() == []
        _assert_equal(_grads(ours), _grads(ref))


def test_backward_dw_computes_the_modules_own_work():
    with model_parallel():
        column = _build("column", wgrad, "zb-h1", seed=1)
        row = _build("row", wgrad, "zb-h1", seed=2)
        ref_column = _build("column", tensor_parallel, "1f1b", seed=1)
        ref_row = _build("row", tensor_parallel, "1f1b", seed=2)
        (x,), (g,) = _inputs("column", 1)
        x.requires_grad_()  # (an input without a gradient keeps megatron's path)
        for key in ("a", "b"):
            with wgrad.capture(key):
                out, _ = row(column(x)[0].relu())
                out.backward(g[..., :IN])
            out, _ = ref_row(ref_column(x)[0].relu())
            out.backward(g[..., :IN])
        row.backward_dw()
        assert row.weight.grad is not None and column.weight.grad is None
        assert wgrad.pending() == ["a", "b"]  # the column's work is left
        column.backward_dw()
        assert wgrad.pending() == []
        _assert_equal(_grads(row), _grads(ref_row))
        _assert_equal(_grads(column), _grads(ref_column))


def test_a_linear_used_twice_accumulates_once_per_micro_batch():
    """Shared use (as a repeated MTP layer would): the two contributions are summed first, as
    autograd's input buffer does, and the accumulator (DDP's hook) runs once per micro-batch."""
    with model_parallel():
        ours = _build("column", wgrad, "zb-h1")
        ref = _build("column", tensor_parallel, "1f1b")
        nodes, calls = [], []
        for layer in (ours, ref):
            node = layer.weight.expand_as(layer.weight).grad_fn.next_functions[0][0]
            nodes.append(node)  # keeps the node (and its hook) alive
            calls.append([0])
            node.register_hook(lambda *_, c=calls[-1]: c.__setitem__(0, c[0] + 1))
        xs, gs = _inputs("column", 4)
        for key in range(2):
            for layer in (ours, ref):
                a = xs[2 * key].clone().requires_grad_()
                b = xs[2 * key + 1].clone().requires_grad_()
                out = layer(a)[0] * gs[2 * key] + layer(b)[0] * gs[2 * key + 1]
                with wgrad.capture(key) if layer is ours else contextlib.nullcontext():
                    out.sum().backward()
        assert calls[0] == [0] and calls[1] == [2]
        wgrad.run(0)
        assert calls[0] == [1]
        wgrad.run(1)
        assert calls[0] == [2]
        _assert_equal(_grads(ours), _grads(ref))


def test_optimizer_step_with_work_pending_is_an_error():
    with model_parallel():
        layer = _build("column", wgrad, "zb-h1")
        optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
        (x,), (g,) = _inputs("column", 1)
        with wgrad.capture(3):
            _backward(layer, x, g)
        before = layer.weight.detach().clone()
        with pytest.raises(wgrad.PendingWeightGradientError, match=r"1 micro-batch.*run\(key\)"):
            optimizer.step()
        assert torch.equal(layer.weight, before)
        wgrad.run(3)
        optimizer.step()
        assert not torch.equal(layer.weight, before)


def test_captures_do_not_nest():
    with wgrad.capture(0), pytest.raises(RuntimeError, match="do not nest"):
        with wgrad.capture(1):
            pass


def test_pipeline_schedule_field_is_validated():
    assert _config("1f1b").pipeline_schedule == "1f1b"
    assert wgrad.deferral_enabled(_config("zb-h1"))
    assert not wgrad.deferral_enabled(_config("1f1b"))
    with pytest.raises(PipelineScheduleError, match="pipeline_schedule must be one of"):
        _config("zb-h2")
    with pytest.raises(UnsupportedCombinationError, match="gradient_accumulation_fusion=False"):
        _config("zb-h1", gradient_accumulation_fusion=True)


# ----------------------------------------------------------------------------- a GPT model
def _gpt(schedule: str, plan: TrainPlan):
    from megatron_ext.config import MHCTransformerConfig
    from megatron_ext.models.gpt import GPTModel, get_gpt_layer_local_spec

    plan.config_overrides = dict(
        enable_mhc_connections=True,
        mhc_num_residual_streams=2,
        add_bias_linear=True,
        pipeline_schedule=schedule,
    )
    config = transformer_config(plan, parallel=False, config_class=MHCTransformerConfig)
    torch.manual_seed(plan.seed)
    model_parallel_cuda_manual_seed(plan.seed)
    return GPTModel(
        config,
        get_gpt_layer_local_spec(enable_mhc_connections=True),
        vocab_size=plan.vocab_size,
        max_sequence_length=plan.seq_length,
        share_embeddings_and_output_weights=True,
    )


def _loss(model, batch) -> torch.Tensor:
    losses = model(
        batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
    )
    return (losses * batch["loss_mask"]).sum()


def _gpt_grads(model) -> dict[str, torch.Tensor]:
    grads = {}
    for name, param in model.named_parameters():
        grad = param.main_grad if hasattr(param, "main_grad") else param.grad
        grads[name] = grad.clone()
    return grads


def test_gpt_mhc_model_grads_equal_1f1b():
    plan = TrainPlan(num_layers=2, micro_batch_size=2, global_batch_size=4)
    with model_parallel():
        batches = make_microbatches(plan, 0)
        ref = _gpt("1f1b", plan)
        ours = _gpt("zb-h1", plan)
        deferred = wgrad.deferrable_linears(ours)
        assert len(deferred) == 2 * 4  # qkv, proj, fc1, fc2 per layer
        for batch in batches:
            _loss(ref, batch).backward()
        for key, batch in enumerate(batches):
            with wgrad.capture(key):
                _loss(ours, batch).backward()
        assert wgrad.pending() == [0, 1]
        for key in range(len(batches)):
            wgrad.run(key)
        _assert_equal(_gpt_grads(ours), _gpt_grads(ref))


def _ddp(model, overlap_grad_reduce: bool, distributed_optimizer: bool = False):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=distributed_optimizer,
        bucket_size=None if not overlap_grad_reduce else 4000,
    )
    return DistributedDataParallel(model.config, ddp_config, model)


def _count_hook_calls(ddp) -> dict[str, list[int]]:
    """Per parameter, a counter bumped by a hook on the same AccumulateGrad node DDP hooked."""
    counts: dict[str, list[int]] = {}
    for name, param in ddp.module.named_parameters():
        counter = counts.setdefault(name, [0])
        node = param.expand_as(param).grad_fn.next_functions[0][0]
        assert any(node is acc for acc in ddp.grad_accs)
        node.register_hook(lambda *_, c=counter: c.__setitem__(0, c[0] + 1))
    return counts


def _run_ddp(ddp, batches, deferred: bool, counts) -> None:
    ddp.zero_grad_buffer()
    last = len(batches) - 1
    for key, batch in enumerate(batches):
        sync = contextlib.nullcontext() if key == last else ddp.no_sync()
        with sync:
            if not deferred:
                _loss(ddp, batch).backward()
                continue
            with wgrad.capture(key):
                _loss(ddp, batch).backward()
    if deferred:  # W steps after every B, the last micro-batch's W last (it starts the sync)
        for key in range(len(batches)):
            sync = contextlib.nullcontext() if key == last else ddp.no_sync()
            before = {name: c[0] for name, c in counts.items()}
            with sync:
                wgrad.run(key)
            fired = {name for name, c in counts.items() if c[0] != before[name]}
            assert fired == {
                name for name, p in ddp.module.named_parameters() if _deferred_param(ddp, p)
            }
    ddp.finish_grad_sync()


def _deferred_param(ddp, param) -> bool:
    """A linear's weight, or a column-parallel bias added inside the matmul (a row-parallel
    bias is added after the reduce, a skip_bias_add bias by the caller: both in B)."""
    for module in ddp.module.modules():
        if not isinstance(module, wgrad._Deferrable):
            continue
        in_matmul = isinstance(module, wgrad.ColumnParallelLinear) and not module.skip_bias_add
        if param is module.weight or (in_matmul and param is module.bias):
            return True
    return False


@pytest.mark.parametrize("overlap_grad_reduce", [False, True])
def test_ddp_main_grad_and_hooks(overlap_grad_reduce):
    plan = TrainPlan(num_layers=2, micro_batch_size=2, global_batch_size=6)
    with model_parallel():
        batches = make_microbatches(plan, 0)
        ref = _ddp(_gpt("1f1b", plan), overlap_grad_reduce)
        ours = _ddp(_gpt("zb-h1", plan), overlap_grad_reduce)
        ref_counts, counts = _count_hook_calls(ref), _count_hook_calls(ours)
        _run_ddp(ref, batches, False, ref_counts)
        _run_ddp(ours, batches, True, counts)
        # Once per parameter per micro-batch, as in the eager backward.
        assert set(c[0] for c in counts.values()) == {len(batches)}
        assert {n: c[0] for n, c in counts.items()} == {n: c[0] for n, c in ref_counts.items()}
        assert all(p.grad is None for p in ours.module.parameters())
        _assert_equal(_gpt_grads(ours.module), _gpt_grads(ref.module))


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_megatron_optimizer_step_with_work_pending_is_an_error(distributed_optimizer):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    plan = TrainPlan(num_layers=1, micro_batch_size=2, global_batch_size=2)
    with model_parallel():
        ddp = _ddp(_gpt("zb-h1", plan), False, distributed_optimizer)
        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=1e-3, use_distributed_optimizer=distributed_optimizer
            ),
            [ddp],
            use_gloo_process_groups=False,  # the default group is gloo already
        )
        (batch,) = make_microbatches(plan, 0)
        ddp.zero_grad_buffer()
        with wgrad.capture(0):
            _loss(ddp, batch).backward()
        ddp.finish_grad_sync()
        with pytest.raises(wgrad.PendingWeightGradientError, match="1 micro-batch"):
            optimizer.step()
        wgrad.run(0)
        ddp.finish_grad_sync()
        update_successful, _, _ = optimizer.step()
        assert update_successful


def _factory_model(plan: TrainPlan, schedule: str):
    from megatron_ext.config import MHCMLATransformerConfig, MHCTransformerConfig
    from megatron_ext.testing.equivalence import gpt_model_factory

    plan.config_overrides["pipeline_schedule"] = schedule
    mla = "q_lora_rank" in plan.config_overrides
    config_class = MHCMLATransformerConfig if mla else MHCTransformerConfig
    config = transformer_config(plan, parallel=False, config_class=config_class)
    torch.manual_seed(plan.seed)
    model_parallel_cuda_manual_seed(plan.seed)
    return gpt_model_factory(plan)(config, True, True, None)


@pytest.mark.parametrize("case", ["moe", "mla"])
def test_moe_and_mla_grads_equal_1f1b(case):
    """MoE: the routed (SequentialMLP) and shared experts' linears defer; MLA: every linear
    but the down projections (megatron checks their class by identity)."""
    plan_of = {"moe": moe_plan, "mla": mla_plan}[case]
    with model_parallel():
        ref = _factory_model(plan_of(micro_batch_size=2, global_batch_size=4), "1f1b")
        ours = _factory_model(plan_of(micro_batch_size=2, global_batch_size=4), "zb-h1")
        batches = make_microbatches(plan_of(micro_batch_size=2, global_batch_size=4), 0)
        names = {n for n, m in ours.named_modules() if isinstance(m, wgrad._Deferrable)}
        if case == "moe":
            assert any(".experts.local_experts.3.linear_fc2" in n for n in names)
            assert any(".shared_experts.linear_fc1" in n for n in names)
        else:
            assert any(n.endswith("linear_q_up_proj") for n in names)
            assert not any(n.endswith("linear_kv_down_proj") for n in names)
        for batch in batches:
            _loss(ref, batch).backward()
        for key, batch in enumerate(batches):
            with wgrad.capture(key):
                _loss(ours, batch).backward()
        assert wgrad.pending() == [0, 1]
        for key in range(len(batches)):
            wgrad.run(key)
        _assert_equal(_gpt_grads(ours), _gpt_grads(ref))


def test_hybrid_mhc_stack_grads_equal_1f1b():
    """The Hybrid local stack (attention, MLP and MoE layers) with mHC defers the same way."""
    from megatron_ext.config import MHCTransformerConfig
    from megatron_ext.testing.hybrid import hybrid_model_factory, hybrid_plan

    pattern = "*-E"

    def build(schedule: str):
        plan = hybrid_plan(
            pattern,
            micro_batch_size=2,
            global_batch_size=4,
            config_overrides=dict(
                enable_mhc_connections=True,
                mhc_num_residual_streams=2,
                pipeline_schedule=schedule,
            ),
        )
        config = transformer_config(plan, parallel=False, config_class=MHCTransformerConfig)
        torch.manual_seed(plan.seed)
        model_parallel_cuda_manual_seed(plan.seed)
        return plan, hybrid_model_factory(plan, pattern)(config, True, True, None)

    with model_parallel():
        plan, ref = build("1f1b")
        _, ours = build("zb-h1")
        names = {n for n, m in ours.named_modules() if isinstance(m, wgrad._Deferrable)}
        assert any("experts.local_experts.0.linear_fc1" in n for n in names)
        assert any(n.endswith("mlp.linear_fc2") and "experts" not in n for n in names)
        batches = make_microbatches(plan, 0)
        for batch in batches:
            _loss(ref, batch).backward()
        for key, batch in enumerate(batches):
            with wgrad.capture(key):
                _loss(ours, batch).backward()
        assert wgrad.pending() == [0, 1]
        for key in range(len(batches)):
            wgrad.run(key)
        _assert_equal(_gpt_grads(ours), _gpt_grads(ref))


def test_weight_gradient_runs_under_the_autocast_state_its_backward_had():
    # On CUDA, megatron's custom_bwd re-enters the forward's autocast in the backward, where the
    # work is stored; W runs later, outside it, and must compute as that backward would (bf16
    # output gradient with the fp32 saved input: a dtype mismatch outside autocast). The GPU
    # check runs the real case (tests/gpu/test_gpu_wgrad.py, "autocast"); here the mechanism.
    generator = torch.Generator().manual_seed(3)
    weight = torch.zeros(OUT, IN, requires_grad=True)
    x = torch.randn(SEQ * BATCH, IN, generator=generator)
    g = torch.randn(SEQ * BATCH, OUT, generator=generator).to(torch.bfloat16)

    def work(autocast):
        return wgrad._Work(None, x, g, weight, None, False, None, autocast)

    with pytest.raises(RuntimeError):
        work(("cpu", False, torch.bfloat16)).gradients()
    grad_weight, _ = work(("cpu", True, torch.bfloat16)).gradients()
    assert grad_weight.dtype == torch.bfloat16
    assert torch.equal(grad_weight, g.t().matmul(x.to(torch.bfloat16)))
