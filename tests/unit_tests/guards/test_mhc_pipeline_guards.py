"""Each mHC + pipeline guard: its exception type, and a message naming the setting."""

import types

import pytest
import torch

from megatron_ext import guards
from megatron_ext.config import MHCTransformerConfig


def _config(**overrides):
    fields = dict(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=4,
        pipeline_dtype=torch.float32,
        enable_mhc_connections=True,
        pipeline_model_parallel_size=2,
    )
    fields.update(overrides)
    return MHCTransformerConfig(**fields)


def test_plain_mhc_pipeline_config_is_accepted():
    assert _config().pipeline_model_parallel_size == 2


@pytest.mark.parametrize(
    "overrides, setting",
    [
        (
            dict(
                overlap_moe_expert_parallel_comm=True,
                num_moe_experts=4,
                expert_model_parallel_size=1,
            ),
            "overlap_moe_expert_parallel_comm",
        ),
        (dict(cpu_offloading=True, cpu_offloading_num_layers=1), "cpu_offloading"),
        (
            dict(fine_grained_activation_offloading=True, offload_modules=["attn_norm"]),
            "fine_grained_activation_offloading",
        ),
    ],
)
def test_unqualified_combinations_with_mhc_pipeline_are_rejected(overrides, setting):
    # The same settings are accepted without mHC (or would fail in megatron-core for its own
    # reasons, which the match below would not accept).
    with pytest.raises(guards.UnsupportedCombinationError, match=setting):
        guards.check_mhc_pipeline(types.SimpleNamespace(**{**vars(_config()), **overrides}))


def test_config_construction_runs_the_pipeline_guards():
    with pytest.raises(NotImplementedError, match="cuda_graph_impl"):
        _config(cuda_graph_impl="local")


def test_same_settings_without_pipeline_are_not_our_business():
    guards.check_mhc_pipeline(
        types.SimpleNamespace(
            **{**vars(_config()), "pipeline_model_parallel_size": 1, "cuda_graph_impl": "local"}
        )
    )


def test_gpt_rejects_mhc_pipeline_with_mtp():
    config = types.SimpleNamespace(**{**vars(_config()), "mtp_num_layers": 1})
    with pytest.raises(guards.UnsupportedCombinationError, match="mtp_num_layers=1.*HybridModel"):
        guards.check_gpt_mhc_mtp(config)
    guards.check_gpt_mhc_mtp(
        types.SimpleNamespace(**{**vars(config), "enable_mhc_connections": False})
    )


def test_hybrid_rejects_a_standalone_mhc_mtp_stage():
    config = types.SimpleNamespace(
        **{**vars(_config()), "mtp_num_layers": 1, "mtp_standalone": True}
    )
    with pytest.raises(guards.UnsupportedCombinationError, match="mtp_standalone"):
        guards.check_hybrid_mhc_mtp(config)
    guards.check_hybrid_mhc_mtp(types.SimpleNamespace(**{**vars(config), "mtp_standalone": False}))


def test_inference_wrapper_rejects_mhc_on_an_inference_pipeline_group():
    class FakeWrapper:
        def __init__(self, config, pp_size):
            self.config = config
            self.pp_group = types.SimpleNamespace(size=lambda: pp_size)

    FakeWrapper.__init__ = guards.inference_wrapper_rejecting_mhc_pipeline(FakeWrapper.__init__)
    # Independent of the training PP setting: a PP=1 training config, inference group of 2.
    training_config = _config(pipeline_model_parallel_size=1)
    with pytest.raises(guards.UnsupportedCombinationError, match="inference pipeline group"):
        FakeWrapper(training_config, pp_size=2)
    FakeWrapper(training_config, pp_size=1)


def test_inference_guard_is_installed_on_megatron_core():
    from megatron.core.inference.model_inference_wrappers.abstract_model_inference_wrapper import (
        AbstractModelInferenceWrapper,
    )

    import megatron_ext

    megatron_ext.install()
    assert AbstractModelInferenceWrapper.__init__.__wrapped__ is not None
