"""MHCTransformerConfig: upstream's mHC fields and defaults, "mhc" accepted as a recompute
module, and every mHC guard failing with a message that names the field."""

import dataclasses
import warnings
from operator import attrgetter

import pytest
import torch

from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_ext import native_mhc as native
from megatron_ext.config import MHCTransformerConfig

BASE = dict(num_layers=2, hidden_size=8, num_attention_heads=2)
MHC_RECOMPUTE = dict(recompute_granularity="selective", recompute_modules=["core_attn", "mhc"])


def _config(**fields):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return MHCTransformerConfig(**BASE, **fields)


def test_defaults_match_upstream():
    config = _config()
    assert config.enable_mhc_connections is False
    assert config.mhc_num_residual_streams == 4
    assert config.mhc_sinkhorn_iterations == 20
    assert config.mhc_h_res_method == "sinkhorn"
    assert config.mhc_init_gating_factor == 0.01
    assert config.mhc_recompute_layer_num is None
    assert config.recompute_modules == ["core_attn"]
    assert not config.mhc_recompute_enabled


# The recipe schema's model.mhc field -> the MHCTransformerConfig field it fills.
RECIPE_TO_CONFIG = {
    "enabled": "enable_mhc_connections",
    "num_residual_streams": "mhc_num_residual_streams",
    "sinkhorn_iterations": "mhc_sinkhorn_iterations",
    "init_gating_factor": "mhc_init_gating_factor",
    "recompute_layer_num": "mhc_recompute_layer_num",
    "fused": "use_fused_mhc",
}


def test_recipe_schema_mhc_defaults_are_the_configs():
    from megatron_ext.recipes.schema import MHC

    config = _config()
    recipe = MHC()
    for recipe_field, config_field in RECIPE_TO_CONFIG.items():
        assert getattr(recipe, recipe_field) == getattr(config, config_field), recipe_field


def test_every_mhc_flag_spelling_comes_from_one_alias_table():
    from megatron_ext import checkout, training_steps
    from megatron_ext.mhc_flags import MHC_ALIASES
    from megatron_ext.recipes import loader
    from megatron_ext.upstream_cases import model_config as upstream

    main = {a.main_flag: a for a in MHC_ALIASES}
    assert set(main) == {"--enable-mhc-connections", "--mhc-num-residual-streams"}
    assert training_steps.FLAG_ALIASES == {
        "--enable-mhc-connections": ("--enable-hyper-connections",),
        "--mhc-num-residual-streams": ("--num-residual-streams",),
    }
    assert upstream.MHC_FLAGS == {
        "--enable-hyper-connections": "enabled",
        "--enable-mhc-connections": "enabled",
        "--num-residual-streams": "num_residual_streams",
        "--mhc-num-residual-streams": "num_residual_streams",
    }
    assert loader.MHC_EXTRA_ARG_ALIASES == {
        "enabled": (
            "--enable-mhc-connections",
            "--enable-hyper-connections",
            "enable_mhc_connections",
            "enable_hyper_connections",
        ),
        "num_residual_streams": (
            "--mhc-num-residual-streams",
            "--num-residual-streams",
            "mhc_num_residual_streams",
            "num_residual_streams",
        ),
    }
    assert checkout.UPSTREAM_MHC_FIELDS == {
        "enable_mhc_connections": "--enable-mhc-connections",
        "enable_hyper_connections": "--enable-hyper-connections",
    }
    assert all(
        f in MHCTransformerConfig.__dataclass_fields__
        for f in map(attrgetter("main_field"), MHC_ALIASES)
    )


def test_disabled_mhc_is_exactly_transformer_config():
    ours = dataclasses.asdict(_config())
    core = dataclasses.asdict(TransformerConfig(**BASE))
    ext_fields = {name for name in ours if name not in core}
    assert ours["pipeline_schedule"] == "1f1b"  # megatron's schedule (issue 21's field)
    assert ours["pipeline_schedule_file"] is None  # the built order (issue 43's field)
    mhc_fields = ext_fields - {"pipeline_schedule", "pipeline_schedule_file"}
    ours_only = {
        "mhc_h_res_method",
        "mhc_learned_output_contract",
        "mhc_single_pass",
        "use_fused_mhc",
        "mhc_variant",
    }
    # megatron-core 0.20 declares the five native ones itself (same names and defaults).
    native_fields = set() if native.config_declares_mhc() else set(native.NATIVE_MHC_FIELDS)
    assert mhc_fields == ours_only | native_fields
    # repr: the init-method partials are fresh objects per config and compare by identity.
    assert {k: repr(v) for k, v in ours.items() if k not in ext_fields} == {
        k: repr(v) for k, v in core.items()
    }


def test_megatron_core_itself_rejects_mhc_as_a_recompute_module():
    """Why MHCTransformerConfig hides "mhc" from the base validation: 0.19.2 does not know the
    module, 0.20 (native mHC) knows it and refuses it without its own mHC enabled."""
    error = ValueError if native.config_declares_mhc() else AssertionError
    with pytest.raises(error, match="recompute_modules"):
        TransformerConfig(**BASE, recompute_granularity="selective", recompute_modules=["mhc"])


@pytest.mark.parametrize("modules", [["mhc"], ["core_attn", "mhc"], ["mhc", "layernorm"]])
def test_mhc_is_accepted_in_selective_recompute_modules(modules):
    requested = list(modules)
    config = _config(
        enable_mhc_connections=True,
        recompute_granularity="selective",
        recompute_modules=requested,
        mhc_recompute_layer_num=2,
    )
    assert sorted(config.recompute_modules) == sorted(modules)
    assert config.mhc_recompute_enabled
    assert requested == modules  # the caller's list is left alone


def test_mhc_recompute_survives_dataclasses_replace():
    config = _config(enable_mhc_connections=True, **MHC_RECOMPUTE)
    copy = dataclasses.replace(config, hidden_size=16)
    assert copy.recompute_modules.count("mhc") == 1 and copy.mhc_recompute_enabled


def test_pipeline_parallel_and_mtp_are_not_rejected_here():
    """megatron-ext supports mHC under PP; MTP rules live with the MTP wiring."""
    config = _config(
        enable_mhc_connections=True,
        pipeline_model_parallel_size=2,
        pipeline_dtype=torch.float32,
        mtp_num_layers=1,
        **MHC_RECOMPUTE,
    )
    assert config.pipeline_model_parallel_size == 2 and config.mtp_num_layers == 1


def test_enabling_without_mhc_recompute_warns():
    with pytest.warns(UserWarning, match="'mhc' in recompute_modules"):
        MHCTransformerConfig(**BASE, enable_mhc_connections=True)


def test_enabling_with_mhc_recompute_does_not_warn_about_it():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        MHCTransformerConfig(**BASE, enable_mhc_connections=True, **MHC_RECOMPUTE)
    assert not [w for w in caught if "mhc" in str(w.message)]


GUARDS = {
    "mhc recompute without mHC": (
        dict(**MHC_RECOMPUTE),
        ValueError,
        "enable_mhc_connections",
    ),
    "mhc with mlp recompute": (
        dict(
            enable_mhc_connections=True,
            recompute_granularity="selective",
            recompute_modules=["mlp", "mhc"],
        ),
        ValueError,
        "'mlp'",
    ),
    "layer_num zero": (
        dict(enable_mhc_connections=True, mhc_recompute_layer_num=0, **MHC_RECOMPUTE),
        ValueError,
        "mhc_recompute_layer_num",
    ),
    "layer_num bool": (
        dict(enable_mhc_connections=True, mhc_recompute_layer_num=True, **MHC_RECOMPUTE),
        ValueError,
        "mhc_recompute_layer_num",
    ),
    "layer_num float": (
        dict(enable_mhc_connections=True, mhc_recompute_layer_num=1.5, **MHC_RECOMPUTE),
        ValueError,
        "mhc_recompute_layer_num",
    ),
    "mhc recompute with fine-grained offloading": (
        dict(
            enable_mhc_connections=True,
            fine_grained_activation_offloading=True,
            offload_modules=["core_attn"],
            **MHC_RECOMPUTE,
        ),
        NotImplementedError,
        "fine_grained_activation_offloading",
    ),
    "full recompute": (
        dict(
            enable_mhc_connections=True,
            recompute_granularity="full",
            recompute_method="uniform",
            recompute_num_layers=1,
        ),
        NotImplementedError,
        "recompute_granularity",
    ),
    "fused inference TP communication": (
        dict(
            enable_mhc_connections=True,
            inference_fuse_tp_communication=True,
            transformer_impl="inference_optimized",
            normalization="RMSNorm",
            add_bias_linear=False,
        ),
        NotImplementedError,
        "inference_fuse_tp_communication",
    ),
    "fp32 residual": (
        dict(enable_mhc_connections=True, fp32_residual_connection=True),
        NotImplementedError,
        "fp32_residual_connection",
    ),
    "zero sinkhorn iterations": (
        dict(enable_mhc_connections=True, mhc_sinkhorn_iterations=0),
        ValueError,
        "mhc_sinkhorn_iterations",
    ),
    "negative gating factor": (
        dict(enable_mhc_connections=True, mhc_init_gating_factor=-0.1),
        ValueError,
        "mhc_init_gating_factor",
    ),
    "fused without mHC": (dict(use_fused_mhc=True), ValueError, "enable_mhc_connections"),
    "fused with too many streams": (
        dict(enable_mhc_connections=True, use_fused_mhc=True, mhc_num_residual_streams=9),
        ValueError,
        "use_fused_mhc",
    ),
    "shared experts with bias": (
        dict(num_moe_experts=4, moe_shared_expert_intermediate_size=32, add_bias_linear=True),
        NotImplementedError,
        "add_bias_linear=False",
    ),
    "zero streams": (
        dict(enable_mhc_connections=True, mhc_num_residual_streams=0),
        ValueError,
        "mhc_num_residual_streams",
    ),
}


@pytest.mark.parametrize("fields, error, field_named", GUARDS.values(), ids=GUARDS.keys())
def test_guard_raises_naming_the_field(fields, error, field_named):
    with pytest.raises(error, match=field_named):
        _config(**fields)


@pytest.mark.parametrize("fields, error, field_named", GUARDS.values(), ids=GUARDS.keys())
def test_guarded_settings_are_otherwise_valid_for_megatron_core(fields, error, field_named):
    """Each guard case differs from a valid config only in its mHC part, so it is our guard,
    not megatron-core's validation, that fires above."""
    core_fields = {
        k: v for k, v in fields.items() if not k.startswith(("enable_mhc", "mhc_", "use_fused_mhc"))
    }
    if "recompute_modules" in core_fields:
        core_fields["recompute_modules"] = [
            m for m in core_fields["recompute_modules"] if m != "mhc"
        ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        TransformerConfig(**BASE, **core_fields)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU guard")
def test_fused_mhc_without_a_gpu_or_the_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="use_fused_mhc=False"):
        _config(enable_mhc_connections=True, use_fused_mhc=True)
