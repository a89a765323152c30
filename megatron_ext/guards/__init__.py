"""Validation guards: combinations megatron-ext does not support, each rejected with the
setting to change, as early as the information exists.

This package holds the config rules (the mHC fields, and how mHC meets the rest of Megatron:
recompute, pipeline parallelism, MTP, CUDA graphs, offloading and inference), which read only a
config, so :class:`~megatron_ext.config.MHCTransformerConfig`, the launchers and
``megatron-ext validate`` run them without starting anything. :data:`GUARDS` is the one list
of every guard in megatron-ext, these and the ones that need a spec, a built model, a
checkpoint or a recipe and so live beside that code; each rule is checked in one place.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from megatron_ext.errors import ConfigError, MegatronExtError, UnsupportedCombinationError
from megatron_ext.schedules.schedule import SCHEDULES

__all__ = [
    "GUARDS",
    "PIPELINE_SCHEDULES",
    "Guard",
    "PipelineScheduleError",
    "UnsupportedCombinationError",
    "by_stage",
]


@dataclass(frozen=True)
class Guard:
    """One rule: the function (``module:qualname``) that enforces it, when it runs, and what
    it rejects."""

    check: str
    stage: str  # config | recipe | spec | build | forward | load | inference
    rejects: str


class PipelineScheduleError(MegatronExtError, ValueError):
    """An unknown ``pipeline_schedule``."""


# config.pipeline_schedule's values: megatron's 1F1B, or the zero-bubble ZB-H1 (deferred W);
# the one list the schedule tools, recipes and the runtime share.
PIPELINE_SCHEDULES = SCHEDULES


def _mhc_pipeline(config: Any) -> bool:
    return bool(getattr(config, "enable_mhc_connections", False)) and (
        config.pipeline_model_parallel_size > 1
    )


# ---- the mHC fields ------------------------------------------------------------------------------
def check_mhc_recompute(config: Any) -> None:
    """The "mhc" selective recompute: its layer count, and what it cannot be combined with."""
    layer_num = config.mhc_recompute_layer_num
    if layer_num is not None and (
        isinstance(layer_num, bool) or not isinstance(layer_num, int) or layer_num < 1
    ):
        raise ConfigError(
            f"mhc_recompute_layer_num must be a positive integer or None, got {layer_num!r}"
        )
    if not config.mhc_recompute_enabled:
        if config.enable_mhc_connections:
            # No stacklevel: the caller is MHCTransformerConfig.__post_init__, deep in a dataclass
            # constructor; the guard's own line names the rule.
            warnings.warn(  # noqa: B028
                "enable_mhc_connections=True without mHC recompute: each layer keeps its "
                "n-stream activations. Consider recompute_granularity='selective' with "
                "'mhc' in recompute_modules."
            )
        return
    if not config.enable_mhc_connections:
        raise ConfigError(
            "'mhc' in recompute_modules requires enable_mhc_connections=True; "
            "set enable_mhc_connections=True or remove 'mhc' from recompute_modules"
        )
    if "mlp" in config.recompute_modules:
        raise ConfigError(
            "'mhc' and 'mlp' in recompute_modules cannot be used together: they checkpoint "
            "the same MLP path with different mechanisms; remove one of them from "
            f"recompute_modules (got {config.recompute_modules})"
        )
    if config.fine_grained_activation_offloading:
        raise NotImplementedError(
            "'mhc' in recompute_modules does not work with "
            "fine_grained_activation_offloading=True (the recompute hook runs before the "
            "offload backward chunk exists); disable one of them"
        )


def check_fused_mhc(config: Any) -> None:
    """``use_fused_mhc``: needs mHC, at most the streams the kernels hold in registers, and
    triton with CUDA tensors (or CPU under TRITON_INTERPRET=1)."""
    if not getattr(config, "use_fused_mhc", False):
        return
    if not config.enable_mhc_connections:
        raise ConfigError(
            "use_fused_mhc=True requires enable_mhc_connections=True; set "
            "enable_mhc_connections=True or use_fused_mhc=False"
        )
    from megatron_ext.mhc.fused import check_fused_available

    check_fused_available(config.mhc_num_residual_streams)


def check_mhc_values(config: Any) -> None:
    """The mHC fields' own ranges."""
    streams = config.mhc_num_residual_streams
    if isinstance(streams, bool) or not isinstance(streams, int) or streams < 1:
        raise ConfigError(f"mhc_num_residual_streams must be an integer >= 1, got {streams!r}")
    if config.mhc_sinkhorn_iterations < 1:
        raise ConfigError(
            "mhc_sinkhorn_iterations must be >= 1 (the Sinkhorn-Knopp backward relies on "
            f"at least one row normalisation), got {config.mhc_sinkhorn_iterations}"
        )
    if config.mhc_init_gating_factor < 0:
        raise ConfigError(
            f"mhc_init_gating_factor must be non-negative, got {config.mhc_init_gating_factor}"
        )


def check_mhc_h_res_method(config: Any) -> None:
    """``mhc_h_res_method``: a known method; birkhoff only for small n and without the fused
    kernels (which implement Sinkhorn only)."""
    from megatron_ext.mhc.birkhoff import H_RES_METHODS, check_birkhoff_streams

    method = getattr(config, "mhc_h_res_method", "sinkhorn")
    if method not in H_RES_METHODS:
        raise ConfigError(
            f"mhc_h_res_method must be one of {', '.join(H_RES_METHODS)}, got {method!r}"
        )
    if method != "birkhoff":
        return
    check_birkhoff_streams(config.mhc_num_residual_streams)
    if getattr(config, "use_fused_mhc", False):
        raise ConfigError(
            "mhc_h_res_method='birkhoff' has no fused kernel yet (the Triton kernels implement "
            "Sinkhorn only); set use_fused_mhc=False or mhc_h_res_method='sinkhorn'"
        )


def check_mhc_variant(config: Any) -> None:
    """``mhc_variant``: a known variant; the fused kernels compute the megatron maps only; glm5's
    head is the mean, so it takes no learned contraction."""
    from megatron_ext.mhc.variants import VARIANTS

    variant = getattr(config, "mhc_variant", "megatron")
    if variant not in VARIANTS:
        raise ConfigError(f"mhc_variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    if variant == "megatron":
        return
    if getattr(config, "use_fused_mhc", False):
        raise ConfigError(
            f"mhc_variant={variant!r} has no fused kernel (the Triton kernels compute megatron's "
            "RMS factor, exp/clamp Sinkhorn and H_pre without eps); set use_fused_mhc=False or "
            "mhc_variant='megatron'"
        )
    if variant == "glm5" and getattr(config, "mhc_learned_output_contract", False):
        raise ConfigError(
            "mhc_variant='glm5' contracts the streams by their mean (GLM-5-Next has no hc_head); "
            "set mhc_learned_output_contract=False, or mhc_variant='deepseek-v4' for the "
            "learned head"
        )


def check_mhc_features(config: Any) -> None:
    """Megatron features that assume a single-stream residual."""
    if config.recompute_granularity == "full":
        raise NotImplementedError(
            "enable_mhc_connections does not support recompute_granularity='full' yet; use "
            "recompute_granularity='selective' with 'mhc' in recompute_modules, or no recompute"
        )
    if config.inference_fuse_tp_communication:
        raise NotImplementedError(
            "enable_mhc_connections does not support inference_fuse_tp_communication=True "
            "(the fused inference TP path assumes a single-stream residual); set it to False"
        )
    if config.fp32_residual_connection:
        raise NotImplementedError(
            "enable_mhc_connections does not support fp32_residual_connection=True (the "
            "n-stream residual feeds the H_res mixing and must share the activation dtype); "
            "set fp32_residual_connection=False"
        )


def check_mhc_layer_features(config: Any) -> None:
    """What the mHC layers do not implement, at any pipeline size: the layers' own check
    (:func:`megatron_ext.mhc.transformer_layer.check_mhc_layer_features`), asked here too."""
    from megatron_ext.mhc.transformer_layer import check_mhc_layer_features as layer_check

    layer_check(config)


# ---- MoE ---------------------------------------------------------------------------------------
def check_moe_bias(config: Any) -> None:
    """A linear bias in MoE layers: megatron-core 0.19.2's shared experts have none (its
    SharedExpertMLP asserts at build time, without the fix). Routed experts of megatron-ext's
    local specs take one at any EP size (megatron_ext.models.linears); megatron's own config
    check keeps expert TP at 1 for it."""
    if (
        config.num_moe_experts
        and config.add_bias_linear
        and config.moe_shared_expert_intermediate_size
    ):
        raise UnsupportedCombinationError(
            "megatron-core's shared experts have no bias (moe_shared_expert_intermediate_size="
            f"{config.moe_shared_expert_intermediate_size} with add_bias_linear=True); set "
            "add_bias_linear=False (--disable-bias-linear) or moe_shared_expert_intermediate_size=None"
        )


# ---- the pipeline schedule ----------------------------------------------------------------------
def check_pipeline_schedule(config: Any) -> None:
    """``pipeline_schedule``: a known schedule, and what ZB-H1's deferred weight gradients
    (megatron_ext.pipeline.wgrad) do not implement."""
    schedule = getattr(config, "pipeline_schedule", "1f1b")
    if schedule not in PIPELINE_SCHEDULES:
        raise PipelineScheduleError(
            f"pipeline_schedule must be one of {', '.join(PIPELINE_SCHEDULES)}, got {schedule!r}; "
            "set pipeline_schedule='1f1b' (megatron's) or 'zb-h1' (zero bubble)"
        )
    if getattr(config, "pipeline_schedule_file", None) and schedule != "zb-h1":
        raise PipelineScheduleError(
            f"pipeline_schedule_file is set but pipeline_schedule={schedule!r}: only ZB-H1 "
            "executes an order given as text (megatron's schedules run their own); set "
            "pipeline_schedule='zb-h1' or drop the file"
        )
    if schedule == "zb-h1" and config.gradient_accumulation_fusion:
        raise UnsupportedCombinationError(
            "pipeline_schedule='zb-h1' does not defer weight gradients fused into main_grad "
            "(gradient_accumulation_fusion=True); set gradient_accumulation_fusion=False "
            "(--no-gradient-accumulation-fusion)"
        )


def check_schedule_supported(config: Any) -> None:
    """The run's ``pipeline_schedule`` can run this config: for zb-h1, nothing that
    :func:`megatron_ext.pipeline.selection.schedule_problems` (the ZB-H1 runtime's rules) lists.
    Not part of the config's own checks (:func:`check_pipeline_schedule`): a single-stage zb-h1
    config is fine for the deferred-gradient layers alone; the entries and validate run it on
    the run's config before the model is built."""
    from megatron_ext.pipeline.selection import schedule_problems

    problems = schedule_problems(config)
    if problems:
        raise UnsupportedCombinationError("; ".join(str(p) for p in problems))


# ---- mHC and the rest of Megatron ----------------------------------------------------------------
def check_mhc_pipeline(config: Any) -> None:
    """mHC with pipeline parallelism: what the pipeline support does not qualify (CUDA graphs
    are refused at every pipeline size, by :func:`check_mhc_layer_features`)."""
    if not _mhc_pipeline(config):
        return
    pp = config.pipeline_model_parallel_size
    if config.overlap_moe_expert_parallel_comm:
        raise UnsupportedCombinationError(
            f"overlap_moe_expert_parallel_comm=True is not supported with enable_mhc_connections "
            f"and pipeline_model_parallel_size={pp}: its overlapped schedule does not carry the "
            "n-stream residual; set overlap_moe_expert_parallel_comm=False"
        )
    if config.fine_grained_activation_offloading or config.cpu_offloading:
        raise UnsupportedCombinationError(
            "activation offloading (fine_grained_activation_offloading / cpu_offloading) is not "
            f"qualified with enable_mhc_connections and pipeline_model_parallel_size={pp}; set "
            "both to False"
        )


def check_gpt_mhc_mtp(config: Any) -> None:
    """GPTModel contracts the residual at the end of its decoder, before the MTP block."""
    if _mhc_pipeline(config) and config.mtp_num_layers:
        raise UnsupportedCombinationError(
            f"GPTModel does not support mtp_num_layers={config.mtp_num_layers} with "
            "enable_mhc_connections and pipeline_model_parallel_size="
            f"{config.pipeline_model_parallel_size}: its decoder contracts the n-stream residual "
            "before the MTP block. Set mtp_num_layers=None, or use HybridModel (its MTP sits on "
            "the final chunk, where both the n-stream state and its contraction exist)"
        )


def check_mhc_single_pass(config: Any) -> None:
    """``mhc_single_pass`` (megatron_ext.mhc.single_pass): what the single-pass form does not
    do yet, each with its reason."""
    if not getattr(config, "mhc_single_pass", False):
        return
    if not getattr(config, "enable_mhc_connections", False):
        raise ConfigError(
            "mhc_single_pass=True needs enable_mhc_connections=True (--enable-mhc-connections)"
        )
    refusals = (
        (
            getattr(config, "use_fused_mhc", False),
            "use_fused_mhc=True: the fused kernels aggregate with the site's own coefficients; "
            "set use_fused_mhc=False",
        ),
        (
            getattr(config, "mhc_recompute_enabled", False),
            "'mhc' in recompute_modules: the recompute rebuilds a site from its streams alone, "
            "not from the previous site's coefficients; remove 'mhc' from recompute_modules",
        ),
        (
            getattr(config, "mhc_learned_output_contract", False),
            "mhc_learned_output_contract=True: single-pass mHC contracts with the last site's "
            "coefficients and has no hc_head; set mhc_learned_output_contract=False",
        ),
    )
    for refused, reason in refusals:
        if refused:
            raise UnsupportedCombinationError(f"mhc_single_pass=True does not support {reason}")


def check_hybrid_mhc_mtp(config: Any) -> None:
    """Hybrid MTP with mHC must run on the final post-process chunk."""
    if (
        getattr(config, "enable_mhc_connections", False)
        and config.mtp_num_layers
        and (config.mtp_standalone)
    ):
        raise UnsupportedCombinationError(
            "a standalone MTP stage (mtp_standalone=True) is not supported with "
            "enable_mhc_connections: MTP needs the n-stream decoder state and its learned "
            "contraction, which exist only on the final post-process chunk; put the MTP layers "
            "in the last pipeline segment of the hybrid pattern instead"
        )


def check_mhc_inference_pipeline(config: Any, inference_pp_size: int) -> None:
    """Inference wrappers size their receive buffers from hidden_size (single stream)."""
    if getattr(config, "enable_mhc_connections", False) and inference_pp_size > 1:
        raise UnsupportedCombinationError(
            "inference with enable_mhc_connections needs an inference pipeline group of size 1 "
            f"(got {inference_pp_size}): the inference wrappers' pipeline receive buffers are "
            "single-stream. Run inference with pipeline_model_parallel_size=1 (for the "
            "inference process groups)"
        )


def inference_wrapper_rejecting_mhc_pipeline(init):
    """Wraps ``AbstractModelInferenceWrapper.__init__``: after it resolves the inference
    pipeline group (the inference config's own, else the training one), refuse mHC on it."""
    import functools

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        check_mhc_inference_pipeline(self.config, self.pp_group.size())

    return __init__


# ---- the one list --------------------------------------------------------------------------------
# Every guard of megatron-ext, wherever it has to live (tests/unit_tests/guards/test_guard_list.py
# fails on a raising check that is missing here).
GUARDS: tuple[Guard, ...] = (
    # config: MHCTransformerConfig.__post_init__ runs these, and megatron-ext validate through it
    Guard(
        "megatron_ext.guards:check_mhc_recompute",
        "config",
        "a bad mhc_recompute_layer_num; 'mhc' recompute without mHC, with 'mlp', with offloading",
    ),
    Guard(
        "megatron_ext.guards:check_fused_mhc",
        "config",
        "use_fused_mhc without mHC, with n > 8 streams, or without triton/CUDA (or the interpreter)",
    ),
    Guard(
        "megatron_ext.guards:check_mhc_values",
        "config",
        "mhc_num_residual_streams < 1, mhc_sinkhorn_iterations < 1, mhc_init_gating_factor < 0",
    ),
    Guard(
        "megatron_ext.guards:check_mhc_h_res_method",
        "config",
        "an unknown mhc_h_res_method; birkhoff with n > 6 streams (n! logits) or fused kernels",
    ),
    Guard(
        "megatron_ext.guards:check_mhc_variant",
        "config",
        "an unknown mhc_variant; a DeepSeek variant with fused kernels; glm5 with a learned head",
    ),
    Guard(
        "megatron_ext.guards:check_mhc_features",
        "config",
        "mHC with full recompute, fused inference TP communication, fp32 residual connection",
    ),
    Guard(
        "megatron_ext.mhc.transformer_layer:check_mhc_layer_features",
        "config",
        "mHC with CUDA graphs, offloaded layer norms, or a chunked MLP (any pipeline size)",
    ),
    Guard(
        "megatron_ext.guards:check_mhc_pipeline",
        "config",
        "mHC under PP with the overlapped MoE schedule or activation offloading",
    ),
    Guard(
        "megatron_ext.guards:check_schedule_supported",
        "config",
        "pipeline_schedule='zb-h1' with what pipeline.zero_bubble.zero_bubble_problems "
        "lists: one stage, virtual stages, overlap_p2p_comm, the overlapped MoE schedule, "
        "CUDA graphs, paged stash, activation offloading (validate; the entries before the "
        "model is built)",
    ),
    Guard(
        "megatron_ext.guards:check_mhc_single_pass",
        "config",
        "mhc_single_pass without mHC, or with fused kernels, 'mhc' recompute, the learned "
        "contraction or a DeepSeek variant",
    ),
    Guard(
        "megatron_ext.guards:check_gpt_mhc_mtp",
        "config",
        "a GPT with mHC, PP and MTP (validate; GPTModel at construction)",
    ),
    Guard(
        "megatron_ext.guards:check_hybrid_mhc_mtp",
        "config",
        "a standalone MTP stage with mHC (validate; HybridModel at construction)",
    ),
    Guard(
        "megatron_ext.guards:check_moe_bias",
        "config",
        "MoE shared experts with add_bias_linear=True (megatron-core's have no bias)",
    ),
    Guard(
        "megatron_ext.guards:check_pipeline_schedule",
        "config",
        "an unknown pipeline_schedule; zb-h1 with gradient_accumulation_fusion",
    ),
    # recipe: megatron-ext validate, before any process starts
    Guard(
        "megatron_ext.recipes.checks:_check_context_parallel",
        "recipe",
        "local CP attention with a sequence not split into 2*cp chunks or a non-causal mask flag",
    ),
    Guard(
        "megatron_ext.recipes.checks:_check_schedule",
        "recipe",
        "parallelism.schedule: zb-h1 with pp=1, virtual stages, a multimodule recipe, the "
        "overlapped MoE schedule or CUDA graphs in extra_args",
    ),
    Guard(
        "megatron_ext.recipes.checks:plan_problems",
        "recipe",
        "recipe fields that contradict each other or the parallel plan (ParallelPlan.problems)",
    ),
    # spec: the layer specs, before any weight exists
    Guard(
        "megatron_ext.mhc.transformer_layer:_check_config",
        "spec",
        "an mHC layer in a config without enable_mhc_connections",
    ),
    Guard(
        "megatron_ext.mhc.transformer_layer:_check_submodules",
        "spec",
        "cross-attention (or its hyper connection) in an mHC layer",
    ),
    Guard(
        "megatron_ext.mhc.transformer_layer:HyperConnectionTransformerLayer.__init__",
        "spec",
        "an mHC layer as a GPT MTP layer, or with a MoE MLP outside HybridModel",
    ),
    Guard(
        "megatron_ext.mhc.transformer_block:check_layers_support_mhc",
        "spec",
        "layers without mHC residual streams in an mHC block",
    ),
    Guard(
        "megatron_ext.models.hybrid.hybrid_model:_check_mhc_spec",
        "spec",
        "a hybrid stack or MTP spec that cannot carry the n streams",
    ),
    Guard(
        "megatron_ext.models.hybrid.layer_specs:UnavailableHybridLayer.__new__",
        "spec",
        "a hybrid pattern symbol the spec cannot build (e.g. Mamba without mamba_ssm)",
    ),
    Guard(
        "megatron_ext.models.context_parallel:_check_supported",
        "spec",
        "local CP attention with a non-causal or sliding-window mask",
    ),
    # build: a model being constructed
    Guard(
        "megatron_ext.models.hybrid.hybrid_model:HybridModel.__init__",
        "build",
        "a chunk with mHC MTP layers but no post_process (layout placing MTP elsewhere)",
    ),
    # forward: only a forward call knows
    Guard(
        "megatron_ext.mhc.transformer_block:HyperConnectionTransformerBlock._assign_recompute_groups",
        "forward",
        "'mhc' recompute with extract_layer_indices while training",
    ),
    Guard(
        "megatron_ext.models.hybrid.mtp:HyperConnectionMTPLayer.forward_single_position",
        "forward",
        "speculative decoding with mHC MTP layers",
    ),
    Guard(
        "megatron_ext.models.hybrid.mtp:HyperConnectionMTPBlock.forward",
        "forward",
        "mHC MTP layers split across pipeline stages",
    ),
    Guard(
        "megatron_ext.models.context_parallel:ContextParallelDotProductAttention.forward",
        "forward",
        "packed sequences (THD) with local CP attention",
    ),
    # load and inference: registered patches wrap megatron's own functions
    Guard(
        "megatron_ext.guards.checkpoint_args:checking_model_settings",
        "load",
        "a checkpoint whose mHC settings or padded vocabulary differ from the model's",
    ),
    Guard(
        "megatron_ext.guards:check_mhc_inference_pipeline",
        "inference",
        "mHC inference on a pipeline group larger than one",
    ),
)


def by_stage(stage: str | None = None) -> list[Guard]:
    """The registered guards, optionally only those of one stage."""
    return [g for g in GUARDS if stage is None or g.stage == stage]
