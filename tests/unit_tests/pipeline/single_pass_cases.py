"""Shared pieces of the single-pass mHC pipeline tests: the plan, and the negative control's
cut of the coefficient field's gradient."""

from __future__ import annotations

import contextlib

import pytest
from mhc_pipeline_cases import check_mhc, mhc_plan

from megatron_ext.mhc import single_pass
from megatron_ext.pipeline.payload import PRE_MIX
from megatron_ext.testing.equivalence import EquivalenceError, TrainPlan


def single_pass_plan(**kwargs) -> TrainPlan:
    """mhc_pipeline_cases' mHC plan with ``mhc_single_pass=True`` (hidden 16, sequence 8: the
    maths under test is per token; the run time is the model's)."""
    overrides = dict(mhc_single_pass=True)
    overrides.update(kwargs.pop("config_overrides", {}))
    kwargs.setdefault("hidden_size", 16)
    kwargs.setdefault("num_attention_heads", 2)
    kwargs.setdefault("seq_length", 8)
    kwargs.setdefault("steps", 2)
    return mhc_plan(config_overrides=overrides, **kwargs)


DEEPSEEK_MAPS = ("deepseek-v4", "glm5")
"""The variants whose single pass is upstream's (Megatron-LM #7500, DeepSeek-V4.1)."""


def deepseek_single_pass_plan(variant: str = "deepseek-v4", **kwargs) -> TrainPlan:
    """:func:`single_pass_plan` on DeepSeek's maps, gates at 0.5 instead of 0.01 so the maps
    are far from uniform from the first step (the softmax Sinkhorn and the ε terms matter)."""
    overrides = dict(mhc_variant=variant, mhc_init_gating_factor=0.5)
    overrides.update(kwargs.pop("config_overrides", {}))
    return single_pass_plan(config_overrides=overrides, **kwargs)


@contextlib.contextmanager
def coefficient_gradient_cut(monkeypatch):
    """Every received payload's ``pre_mix`` field detached: its gradient never goes back."""
    unpack = single_pass.unpack

    def unpack_detached(payload, wire):
        fields = unpack(payload, wire)
        if PRE_MIX in fields:
            fields[PRE_MIX] = fields[PRE_MIX].detach()
        return fields

    monkeypatch.setattr(single_pass, "unpack", unpack_detached)
    yield


def assert_cut_differs_from_reference(plan: TrainPlan, monkeypatch) -> None:
    """The negative control: with the coefficients' gradient cut the run must differ from the
    single-rank reference, and only where the cut gradient goes: the MLP site that ends a
    stage, whose pre coefficients only the next stage's first site uses (at init the gates
    are 0.01, so the gradients differ below the 1e-5 tolerance and Adam's steps show it)."""
    with coefficient_gradient_cut(monkeypatch), pytest.raises(EquivalenceError) as raised:
        check_mhc(plan)
    differences = str(raised.value).splitlines()[1:]
    assert differences and all("mlp_hyper_connection" in d for d in differences), str(raised.value)[
        :3000
    ]
