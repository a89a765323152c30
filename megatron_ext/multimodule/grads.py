"""Finalising gradients of a multi-module pipeline to one global scale.

megatron-core's ``finalize_model_grads`` takes one ``ProcessGroupCollection``; given the
schedule's ``MultiModuleProcessGroupCollection`` it fails its ``hasattr(pg_collection, 'tp')``
assertion. :func:`finalize_multimodule_grads` is the ``finalize_model_grads_func`` for
multi-module pipelines: it runs megatron-core's own finalisation once per module on this rank,
with that module's groups (DP reduction, sequence-parallel norms, tied embeddings across the
module's pipeline), then puts every module on the language model's scale.

The scale. The loss is the language model's, defined as megatron defines it for one model:

- default: the mean over the language model's DP replicas and micro-batches of each
  micro-batch's token-mean loss. The language model's DDP averages over its own DP replicas,
  which is exactly that. Every other module receives, on each of its replicas, the
  gradient of the *sum* of the language-model replicas' losses restricted to its samples, so
  the sum over its replicas is ``dp(language model)`` times the true gradient, while its DDP
  divides by its own ``dp``. Multiplying by ``dp(module) / dp(language model)`` corrects it
  (fan-in encoder DP2 -> LM DP1: x2; fan-out DP1 -> DP2: x1/2).
- ``calculate_per_token_loss``: every DDP sums; the global token count is summed over the
  language model's last-stage ranks (TP rank 0 of each replica) and shared with every rank,
  encoder-only ranks included, and every module is divided by it.

Both are linear in the gradients, so ``grad_scale_func`` (loss scaling) carries through.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron.core.distributed import finalize_model_grads

from megatron_ext.multimodule.model import MultiModuleModel


def finalize_multimodule_grads(
    model: list[torch.nn.Module],
    num_tokens: torch.Tensor | None = None,
    pg_collection: Any = None,
    force_all_reduce: bool | None = False,
) -> None:
    """``config.finalize_model_grads_func`` for a :class:`MultiModuleModel` (see module doc)."""
    (joint,) = model
    assert isinstance(joint, MultiModuleModel), f"one MultiModuleModel, got {type(joint)}"
    plan = joint.plan
    for name, chunk in joint.local_modules.items():
        finalize_model_grads(
            [chunk],
            None,
            pg_collection=joint.finalize_pg_collections[name],
            force_all_reduce=force_all_reduce,
        )
    if num_tokens is not None:
        counted = num_tokens if joint.reports_loss else torch.zeros_like(num_tokens)
        total = counted.clone()
        dist.all_reduce(total)  # every rank calls finalize once per step: WORLD is safe
        scale = 1.0 / max(int(total.item()), 1)
        for chunk in joint.local_modules.values():
            chunk.scale_gradients(scale)
        return
    for name, chunk in joint.local_modules.items():
        factor = module_gradient_factor(plan, name)
        if factor != 1.0:
            chunk.scale_gradients(factor)


def module_gradient_factor(plan, name: str) -> float:
    """What a module's DP-averaged gradient is multiplied by to be on the language model's
    scale (default loss normalisation): ``dp(module) / dp(language model)``, CP included."""
    module, lm = plan.modules[name], plan.modules[plan.language_model]
    return (module.dp * module.cp) / (lm.dp * lm.cp)


def global_grad_norm(pipeline: Any) -> float:
    """The L2 norm of every module's finalised gradient, each element counted once: DP
    replicas and TP-replicated parameters on one rank, the tied output-layer copy not at all."""
    local = torch.zeros(1, dtype=torch.float64)
    for name, module in pipeline.model.core_modules().items():
        stage = pipeline.stage(name)
        if stage.dp_rank != 0:
            continue
        for param in module.parameters():
            if not param.requires_grad or getattr(param, "shared", False):
                continue
            if stage.tp_rank != 0 and not getattr(param, "tensor_model_parallel", False):
                continue
            local += param.main_grad.double().pow(2).sum()
    dist.all_reduce(local)
    return float(local.sqrt().item())
