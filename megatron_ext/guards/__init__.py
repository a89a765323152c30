"""Validation guards: combinations megatron-ext does not support, rejected before any process
group or model is built, each with the setting to change.

The mHC field guards live with the fields (``megatron_ext.config.MHCTransformerConfig``); this
package holds the ones about how mHC meets the rest of Megatron: pipeline parallelism, MTP,
CUDA graphs, offloading and inference. Every check reads only a config, so the launchers and
``megatron-ext validate`` can run them without starting anything.
"""

from __future__ import annotations

from typing import Any


class UnsupportedCombinationError(NotImplementedError):
    """A combination of settings that megatron-ext rejects (a NotImplementedError)."""


def _mhc_pipeline(config: Any) -> bool:
    return bool(getattr(config, "enable_mhc_connections", False)) and (
        config.pipeline_model_parallel_size > 1
    )


def check_mhc_pipeline(config: Any) -> None:
    """mHC with pipeline parallelism: what the pipeline support does not qualify."""
    if not _mhc_pipeline(config):
        return
    pp = config.pipeline_model_parallel_size
    if config.overlap_moe_expert_parallel_comm:
        raise UnsupportedCombinationError(
            f"overlap_moe_expert_parallel_comm=True is not supported with enable_mhc_connections "
            f"and pipeline_model_parallel_size={pp}: its overlapped schedule does not carry the "
            "n-stream residual; set overlap_moe_expert_parallel_comm=False"
        )
    if config.cuda_graph_impl != "none" or config.enable_cuda_graph or config.external_cuda_graph:
        raise UnsupportedCombinationError(
            f"CUDA graphs (cuda_graph_impl={config.cuda_graph_impl!r}) are not qualified with "
            f"enable_mhc_connections and pipeline_model_parallel_size={pp}; set "
            "cuda_graph_impl='none' (and enable_cuda_graph/external_cuda_graph=False)"
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


def check_hybrid_mhc_mtp(config: Any) -> None:
    """Hybrid MTP with mHC must run on the final post-process chunk."""
    if getattr(config, "enable_mhc_connections", False) and config.mtp_num_layers and (
        config.mtp_standalone
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
