"""Multi-module pipelines: an encoder (or several) and a language model, each on its own
parallel grid, trained in megatron-core's 1F1B schedule.

megatron-core 0.19.2 has the machinery (``HyperCommGrid``, ``BridgeCommunicator``,
``MultiModulePipelineCommunicator``, ``MultiModuleProcessGroupCollection``, dict tensors in
the non-interleaved schedule). This package owns everything around it:

- the plan (:mod:`~megatron_ext.multimodule.plan`): modules with their TP/PP/DP/CP and rank
  ranges, the module graph and the language model, validated before any process group exists;
- the builder (:mod:`~megatron_ext.multimodule.builder`): grids, groups, per-module
  collections, module stages in megatron-core's DDP, the communicator and the joint wrapper,
  in one collective call that returns what ``get_forward_backward_func`` needs;
- communicator fixes (:mod:`~megatron_ext.multimodule.communicator`): bridges on the grids'
  backend (gloo works), one warm-up per rank (encoders of different depths), summed fan-out
  gradients, checked sends whose errors reach the waiting ranks;
- finalize-grads (:mod:`~megatron_ext.multimodule.grads`): megatron-core's finalisation per
  module and one global gradient scale across grids of different DP sizes;
- a small vision-language model for tests and the recipe (:mod:`~megatron_ext.multimodule.vlm`;
  its single-process reference harness is :mod:`megatron_ext.testing.multimodule`), and the
  training entry ``python -m megatron_ext.pretrain_multimodule RECIPE [KEY=VALUE ...]`` (its
  recipe's plan: :mod:`megatron_ext.recipes.multimodule`).

Typical use::

    plan = MultiModulePlan(
        modules={"vision_encoder": ModulePlan(tp=1, pp=1, dp=2, first_rank=0),
                 "llm": ModulePlan(tp=1, pp=2, dp=1, first_rank=2)},
        topology={"vision_encoder": ["llm"]},
        language_model="llm",
    )
    pipeline = build(plan, {"vision_encoder": ModuleImpl(...), "llm": ModuleImpl(...)},
                     MultiModulePipelineConfig(pipeline_dtype=torch.float32))
    losses = pipeline.forward_backward(forward_step, data_iterator, num_microbatches=4)
"""

from megatron_ext.multimodule.builder import ModuleImpl, MultiModulePipeline, build
from megatron_ext.multimodule.communicator import (
    GridBridgeCommunicator,
    MultiModuleCommunicator,
)
from megatron_ext.multimodule.errors import (
    AmbiguousShapeError,
    BridgeShapeError,
    MultiModuleBuildError,
    MultiModuleError,
    MultiModulePlanError,
    OutputNdimError,
)
from megatron_ext.multimodule.grads import finalize_multimodule_grads
from megatron_ext.multimodule.model import MultiModuleModel, StageContext
from megatron_ext.multimodule.plan import (
    ModulePlan,
    MultiModulePipelineConfig,
    MultiModulePlan,
    pipeline_config_problems,
)

__all__ = [
    "AmbiguousShapeError",
    "BridgeShapeError",
    "GridBridgeCommunicator",
    "ModuleImpl",
    "ModulePlan",
    "MultiModuleBuildError",
    "MultiModuleCommunicator",
    "MultiModuleError",
    "MultiModuleModel",
    "MultiModulePipeline",
    "MultiModulePipelineConfig",
    "MultiModulePlan",
    "MultiModulePlanError",
    "OutputNdimError",
    "StageContext",
    "build",
    "finalize_multimodule_grads",
    "pipeline_config_problems",
]
