"""Multi-module pipelines on 4 ranks (gloo) against the single-process reference: every
micro-batch loss, every gradient of 2 steps with 4 accumulated micro-batches and loss scale 4,
and the weights after them, with megatron-core's DDP on every module and image lengths that
change per micro-batch. Plus the errors every rank must raise together.

Run: torchrun --nproc_per_node 4 -m pytest tests/unit_tests/multimodule
"""

from __future__ import annotations

import pytest
from multimodule_cases import (
    HIDDEN,
    encoder,
    equivalence,
    flattened,
    language_model,
    last_dim_one,
    pipeline_only,
    projector,
    raises_everywhere,
    record_shapes,
)

from megatron_ext.mhc.stats import GAIN_NAMES
from megatron_ext.multimodule import AmbiguousShapeError, ModulePlan as M, OutputNdimError
from megatron_ext.testing.mhc_stats import StatsCheck
from megatron_ext.testing.multimodule import PipelineEquivalenceError

pytestmark = pytest.mark.world_size(4)

ENC_LLM = {"enc": ["llm"]}


def test_encoder_pp1_to_language_model_pp3():
    equivalence(
        {"enc": M(), "llm": M(pp=3, first_rank=1)},
        ENC_LLM,
        {"enc": encoder(), "llm": language_model(layers=3)},
    )


def test_encoder_pp2_to_language_model_pp2_with_deallocated_outputs():
    equivalence(
        {"enc": M(pp=2), "llm": M(pp=2, first_rank=2)},
        ENC_LLM,
        {"enc": encoder(), "llm": language_model()},
        deallocate_pipeline_outputs=True,
    )


def test_encoder_tp2_to_language_model_tp2():
    equivalence(
        {"enc": M(tp=2), "llm": M(tp=2, first_rank=2)},
        ENC_LLM,
        {"enc": encoder(), "llm": language_model()},
    )


@pytest.mark.parametrize(
    "modules",
    [
        {"enc": M(tp=2), "llm": M(tp=2, first_rank=2)},  # TP shards and TP replicas
        {"enc": M(dp=2), "llm": M(pp=2, first_rank=2)},
    ],  # DP replicas, tied embedding copy
    ids=["tp2_tp2", "dp2_pp2"],
)
def test_global_grad_norm_counts_every_element_once(modules):
    import torch

    from megatron_ext.multimodule.grads import global_grad_norm

    norms = []
    reference = equivalence(
        modules,
        ENC_LLM,
        {"enc": encoder(), "llm": language_model()},
        on_gradients=lambda step, pipeline: norms.append(global_grad_norm(pipeline)),
    )
    for step, norm in enumerate(norms):
        expected = 4.0 * torch.sqrt(
            sum(g.double().pow(2).sum() for g in reference.grads[step].values())
        )
        assert abs(norm - float(expected)) <= 1e-5 * float(expected), (step, norm, float(expected))


# ------------------------------------------------------------------ fan-in and fan-out
FAN_IN = {"enc": M(dp=2), "llm": M(pp=2, first_rank=2)}
FAN_OUT = {"enc": M(tp=2), "llm": M(dp=2, first_rank=2)}


@pytest.mark.parametrize("overlap_grad_reduce", [False, True])
def test_fan_in_encoder_dp2_to_language_model_dp1(overlap_grad_reduce):
    equivalence(
        FAN_IN,
        ENC_LLM,
        {"enc": encoder(), "llm": language_model()},
        ddp_overrides=dict(overlap_grad_reduce=overlap_grad_reduce, bucket_size=2000),
    )


def test_fan_in_with_2d_encoder_outputs():
    equivalence(FAN_IN, ENC_LLM, {"enc": encoder(flatten_output=True), "llm": language_model()})


def test_fan_out_encoder_dp1_to_language_model_dp2():
    equivalence(FAN_OUT, ENC_LLM, {"enc": encoder(), "llm": language_model()})


@pytest.mark.parametrize("modules", [FAN_IN, FAN_OUT], ids=["fan_in", "fan_out"])
def test_per_token_loss_across_grids(modules):
    equivalence(
        modules, ENC_LLM, {"enc": encoder(), "llm": language_model()}, calculate_per_token_loss=True
    )


def test_without_the_cross_grid_scale_the_fan_in_encoder_gradient_is_half(monkeypatch):
    """What megatron-core gives when each module is finalised on its own (measured 0.5x)."""
    from megatron_ext.multimodule import grads

    monkeypatch.setattr(grads, "module_gradient_factor", lambda plan, name: 1.0)
    with pytest.raises(PipelineEquivalenceError, match=r"step 0 gradient: enc/"):
        equivalence(FAN_IN, ENC_LLM, {"enc": encoder(), "llm": language_model()}, steps=1)


# ------------------------------------------------------------------ graphs
def test_two_encoders_to_one_language_model():
    equivalence(
        {"a": M(), "b": M(first_rank=1), "llm": M(pp=2, first_rank=2)},
        {"a": ["llm"], "b": ["llm"]},
        {"a": encoder(), "b": encoder(flatten_output=True), "llm": language_model()},
    )


def test_encoders_of_different_pipeline_depths_feed_one_language_model():
    """encoder a (PP1) and encoder b (PP2) into the language model: megatron-core's global
    warm-up deadlocks here; one warm-up per rank runs and matches the reference."""
    equivalence(
        {"a": M(), "b": M(pp=2, first_rank=1), "llm": M(first_rank=3)},
        {"a": ["llm"], "b": ["llm"]},
        {"a": encoder(layers=1), "b": encoder(), "llm": language_model()},
    )


def test_forward_only_gives_the_training_forward_losses():
    """Evaluation (forward_only) with per-rank warm-ups of different lengths: the same loss
    reports as the forward half of a training step on the same batches."""
    import torch
    import torch.distributed as dist
    from multimodule_cases import make_plan

    from megatron_ext.multimodule import MultiModulePipelineConfig, build, vlm

    plan = make_plan(
        {"a": M(), "b": M(pp=2, first_rank=1), "llm": M(first_rank=3)}, {"a": ["llm"], "b": ["llm"]}
    )
    pipeline = build(
        plan,
        {"a": encoder(), "b": encoder(), "llm": language_model()},
        MultiModulePipelineConfig(pipeline_dtype=torch.float32),
    )
    try:
        data = vlm.VLMData("llm", {"a": 12, "b": 12}, image_lengths=(4, 6, 8))
        step = vlm.make_forward_step("llm")
        batches = vlm.local_batches(pipeline, data, 0, 4, 2)
        evaluated = pipeline.forward_backward(step, iter(batches), 4, forward_only=True)
        trained = pipeline.forward_backward(step, iter(batches), 4)
        assert [r["lm loss"] for r in evaluated] == [r["lm loss"] for r in trained]
        assert len(trained) == (4 if dist.get_rank() == 3 else 0)
    finally:
        pipeline.destroy()


DIAMOND = (
    {"enc": M(), "pa": M(first_rank=1), "pb": M(first_rank=2), "llm": M(first_rank=3)},
    {"enc": ["pa", "pb"], "pa": ["llm"], "pb": ["llm"]},
)


def test_a_module_feeding_two_modules_gets_the_sum_of_their_gradients():
    equivalence(
        *DIAMOND, {"enc": encoder(), "pa": projector(), "pb": projector(), "llm": language_model()}
    )


def test_keeping_only_the_last_successors_gradient_is_caught(monkeypatch):
    """megatron-core's communicator overwrites the gradient of all but the last successor."""
    from megatron_ext.multimodule import communicator

    monkeypatch.setattr(
        communicator, "_accumulate", lambda grads, key, grad: grads.__setitem__(key, grad)
    )
    with pytest.raises(PipelineEquivalenceError, match=r"step 0 gradient: enc/"):
        equivalence(
            *DIAMOND,
            {"enc": encoder(), "pa": projector(), "pb": projector(), "llm": language_model()},
            steps=1,
        )


@pytest.mark.parametrize("method", ["sinkhorn", "birkhoff"])
def test_encoder_to_mhc_language_model_pp2(method):
    """The bridge carries the encoder's [s, b, h]; the mHC language model expands to n
    streams on its first stage, and its own P2P carries [s, b, n*h]. With either H_res method
    it matches the reference, and so do the mHC statistics: recorded by the language model's
    ranks with its own groups (the encoder's ranks hold no hyper connection), its two stages'
    layers composed in order; birkhoff's gains are 1."""
    shapes: list = []
    check = StatsCheck(steps=2, reference_rank=0)
    try:
        equivalence(
            FAN_IN,
            ENC_LLM,
            {
                "enc": encoder(),
                "llm": language_model(
                    forward=record_shapes(shapes),
                    enable_mhc_connections=True,
                    mhc_num_residual_streams=2,
                    mhc_h_res_method=method,
                ),
            },
            on_gradients=lambda step, pipeline: check.on_gradients(step, [pipeline.model]),
        )
    finally:
        check.close()
    assert not check.problems(), check.problems()
    assert len([name for name in check.first if name.endswith("/h_res_row_err")]) == 4
    if method == "birkhoff":
        for name in GAIN_NAMES:
            assert abs(check.first[name] - 1) <= 1e-5 and abs(check.last[name] - 1) <= 1e-5
    import torch.distributed as dist

    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, shapes)
    # The pipeline's first language-model stage (rank 2) sent n*h = 2*32 wide activations.
    sent = {
        shape
        for rank_shapes in everyone
        for pp_rank, pp_size, shape in rank_shapes
        if pp_size == 2 and pp_rank == 0
    }
    assert sent and {shape[-1] for shape in sent} == {2 * HIDDEN}, sent


# ------------------------------------------------------------------ errors
def test_wrong_output_ndim_reaches_every_rank():
    """The TP2 encoder's last stage returns 2-D where its bridge carries 3-D: both encoder
    ranks raise before sending; the receiving leader, its TP member and the language model's
    second stage receive the abort marker and raise the same error."""
    messages = raises_everywhere(
        OutputNdimError,
        lambda: pipeline_only(
            {"enc": M(tp=2), "llm": M(pp=2, first_rank=2)},
            ENC_LLM,
            {"enc": encoder(forward=flattened), "llm": language_model()},
        ),
    )
    assert all("returned a 2-D tensor" in m for m in messages[:2])
    assert all("received an abort marker" in m for m in messages[2:])


def test_ambiguous_shape_guard_on_an_intra_module_link():
    """The encoder's first stage hands [s, b, 1] to its second stage over P2P, which would
    arrive squeezed to 2-D: the guard raises there and every downstream rank raises too."""
    messages = raises_everywhere(
        AmbiguousShapeError,
        lambda: pipeline_only(
            {"enc": M(pp=2), "llm": M(pp=2, first_rank=2)},
            ENC_LLM,
            {"enc": encoder(forward=last_dim_one), "llm": language_model()},
        ),
    )
    assert "singleton last dim" in messages[0]


# ------------------------------------------------------------------ the training entry
@pytest.mark.parametrize("method", ["sinkhorn", "birkhoff"])
def test_training_entry_logs_the_language_models_mhc_stats(tmp_path, method):
    """pretrain_multimodule with model.modules.llm.mhc.log_stats: every iteration the last
    rank writes the language model's mhc/... scalars (its 4 layers over 2 stages) and prints
    the gains; birkhoff's are 1. (Near init Sinkhorn's are 1 too: H_res is near uniform. The
    figures' values against the single rank's are test_encoder_to_mhc_language_model_pp2's.)"""
    from pathlib import Path

    import torch.distributed as dist

    from megatron_ext import pretrain_multimodule as entry
    from megatron_ext.recipes import multimodule as recipe_plan
    from megatron_ext.runs import metrics
    from megatron_ext.testing.distributed import init_distributed

    init_distributed()
    recipe_path = Path(__file__).resolve().parents[3] / "recipes"
    recipe = entry.load_recipe(
        str(recipe_path / "multimodule_encoder_llm_mhc_pp2.yaml"),
        [
            "training.iterations=2",
            "model.modules.llm.mhc.log_stats=true",
            f"model.modules.llm.mhc.h_res_method={method}",
        ],
    )
    plan = recipe_plan.plan_of(recipe, dist.get_world_size())
    lines: list[str] = []
    board = tmp_path / "tensorboard"
    entry.train(recipe, plan, log=lines.append, tensorboard_dir=str(board))
    problems = []
    if dist.get_rank() == dist.get_world_size() - 1:
        scalars = metrics.read_tensorboard(board)
        for layer in range(1, 5):
            for sublayer in ("self_attention", "mlp"):
                name = f"mhc/layer{layer:02d}.{sublayer}/h_res_row_err"
                if sorted(scalars.get(name, {})) != [1, 2]:
                    problems.append(f"{name}: {scalars.get(name)}")
        for name in GAIN_NAMES:
            values = list(scalars.get(name, {}).values())
            if len(values) != 2 or method == "birkhoff" and any(abs(v - 1) > 1e-5 for v in values):
                problems.append(f"{name}: {values}")
        if sum(line.startswith(" mHC [iteration") for line in lines) != 2:
            problems.append(f"console: {lines}")
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problems)
    assert not any(everyone), everyone
