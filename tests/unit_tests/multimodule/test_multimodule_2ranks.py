"""Multi-module pipelines on 2 ranks (gloo): an encoder rank and a language-model rank
against the single-process reference (every micro-batch loss, every gradient of both steps,
the weights after them), 2-D encoder outputs, two encoders on one rank, a [s, b, 1] tensor
across a bridge, and the errors every rank must raise together.

Run: torchrun --nproc_per_node 2 -m pytest tests/unit_tests/multimodule
"""

from __future__ import annotations

import pytest
import torch.distributed as dist
from multimodule_cases import (
    PATCH,
    encoder,
    equivalence,
    flattened,
    language_model,
    pipeline_only,
    raises_everywhere,
)

from megatron_ext.multimodule import (
    BridgeShapeError,
    ModuleImpl,
    ModulePlan as M,
    MultiModuleBuildError,
    OutputNdimError,
    vlm,
)
from megatron_ext.multimodule.vlm import as_sbh

pytestmark = pytest.mark.world_size(2)

ENC_LLM = {"enc": ["llm"]}


def test_encoder_to_language_model_matches_reference():
    # 2 steps, 4 micro-batches, image lengths 4/6/8, loss scale 4.
    equivalence(
        {"enc": M(), "llm": M(first_rank=1)}, ENC_LLM, {"enc": encoder(), "llm": language_model()}
    )


def test_deallocated_pipeline_outputs_match_reference():
    equivalence(
        {"enc": M(), "llm": M(first_rank=1)},
        ENC_LLM,
        {"enc": encoder(), "llm": language_model()},
        deallocate_pipeline_outputs=True,
    )


def test_2d_encoder_output_is_inferred_and_matches_reference():
    """The encoder flattens to [b*s, h] and says so (output_ndim = 2); the plan leaves it
    unset, so the bridge is built for 2-D tensors from the module itself."""
    equivalence(
        {"enc": M(), "llm": M(first_rank=1)},
        ENC_LLM,
        {"enc": encoder(flatten_output=True), "llm": language_model()},
    )


def test_two_encoders_on_one_rank_match_reference():
    equivalence(
        {"a": M(), "b": M(), "llm": M(first_rank=1)},
        {"a": ["llm"], "b": ["llm"]},
        {"a": encoder(), "b": encoder(flatten_output=True), "llm": language_model()},
    )


def test_a_3d_tensor_with_a_singleton_last_dim_crosses_a_bridge_intact():
    """Bridges carry the declared ndim, so [s, b, 1] is not mistaken for a 2-D tensor there
    (the ambiguity exists only on intra-module P2P links; see the 4-rank guard test)."""

    def narrow(forward):
        return lambda module, batch, inputs, stage: forward(module, batch, inputs, stage)[..., :1]

    def widen(forward):
        def wrapped(module, batch, inputs, stage):
            if inputs is not None:
                assert inputs["enc"].shape[-1] == 1 and inputs["enc"].ndim == 3
                inputs = {"enc": inputs["enc"].expand(-1, -1, 32)}
            return forward(module, batch, inputs, stage)

        return wrapped

    llm = language_model(forward=widen)
    llm.input_width = 1  # its forward widens what it receives
    equivalence(
        {"enc": M(), "llm": M(first_rank=1)}, ENC_LLM, {"enc": encoder(forward=narrow), "llm": llm}
    )


def test_as_sbh_restores_sample_major_2d_outputs():
    import torch

    x = torch.arange(2 * 3 * 4, dtype=torch.float32).view(3, 2, 4)  # [s, b, h]
    flat = x.transpose(0, 1).reshape(6, 4)
    assert torch.equal(as_sbh(flat, 2), x)


def test_wrong_output_ndim_is_raised_on_every_rank_before_the_first_send():
    messages = raises_everywhere(
        OutputNdimError,
        lambda: pipeline_only(
            {"enc": M(), "llm": M(first_rank=1)},
            ENC_LLM,
            {"enc": encoder(forward=flattened), "llm": language_model()},
        ),
    )
    assert "returned a 2-D tensor" in messages[0] and "set output_ndim=2 for 'enc'" in messages[0]
    assert "received an abort marker from 'enc'" in messages[1]


@pytest.mark.parametrize("width", ["declared", "shown by the built module"])
def test_an_encoder_wider_than_the_language_model_is_raised_on_every_rank(width):
    """Encoder h=64 -> language model h=32: named at the bridge, on both ranks, before the
    first send (the receiver's concatenation used to fail alone and leave the encoder
    waiting for a gradient). The receiver's width is its ModuleImpl's, or, not declared,
    the one its built module shows (a megatron language model: its hidden size)."""
    wide = vlm.encoder_impl(vlm.transformer_config(2, 64, 4), PATCH)
    llm = language_model()
    if width != "declared":
        llm.input_width = None
    messages = raises_everywhere(
        BridgeShapeError,
        lambda: pipeline_only(
            {"enc": M(), "llm": M(first_rank=1)}, ENC_LLM, {"enc": wide, "llm": llm}
        ),
    )
    assert (
        "bridge enc -> llm: rank 0 (module 'enc', pipeline stage 0 of 1) sends [4, 2, 64]"
        in messages[0]
    )
    assert "but 'llm' takes width 32" in messages[0]
    assert (
        "received an abort marker from 'enc'" in messages[1] and "BridgeShapeError" in messages[1]
    )


def test_a_plan_contradicting_the_module_output_ndim_fails_the_build_everywhere():
    messages = raises_everywhere(
        MultiModuleBuildError,
        lambda: pipeline_only(
            {"enc": M(output_ndim=3), "llm": M(first_rank=1)},
            ENC_LLM,
            {"enc": encoder(flatten_output=True), "llm": language_model()},
        ),
    )
    assert all("the plan says output_ndim=3, the built module says [2]" in m for m in messages)


def test_a_factory_failing_on_one_rank_fails_the_build_everywhere():
    """The encoder's factory fails on its rank; the language model's rank, which built its
    stage fine, raises the same error. (A factory that fails while its module's other ranks
    are inside a collective of their own constructors, e.g. the tied-embedding all-reduce of
    a GPTModel with PP > 1, cannot be rescued this way.)"""
    good = encoder()

    def factory(stage):
        if dist.get_rank() == 0:
            raise RuntimeError("no weights for this stage")
        return good.factory(stage)

    messages = raises_everywhere(
        MultiModuleBuildError,
        lambda: pipeline_only(
            {"enc": M(), "llm": M(first_rank=1)},
            ENC_LLM,
            {"enc": ModuleImpl(factory, good.forward, good.config), "llm": language_model()},
        ),
    )
    assert all("rank 0: RuntimeError: no weights for this stage" in m for m in messages)


def test_a_single_module_pipeline_runs():
    """One module (the language model, PP=2) is a multi-module pipeline too."""
    equivalence({"llm": M(pp=2)}, {}, {"llm": language_model()})
