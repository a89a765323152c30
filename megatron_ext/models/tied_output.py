"""No dead output weight on a pipeline stage that borrows the shared embedding.

With tied embeddings (``share_embeddings_and_output_weights``) and multi-token prediction
under pipeline parallelism, the last stage runs MTP and therefore holds its own copy of the
word embeddings (``mtp_process`` is True, ``pre_process`` False). megatron-core 0.19.2
decides whether the output layer allocates a weight from ``pre_process`` alone, so that
stage gets an ``output_layer.weight`` as well. Every forward passes the embedding copy to
the output layer instead, so the extra weight is never read and never receives a gradient
(the constant ``num-zeros`` of such runs), and ``LanguageModule``'s tied state dict asserts
that the key is absent, so a ``torch_dist`` save fails at the first checkpoint.

Upstream's open fix (Megatron-LM PR #7577) changes the allocation condition. We cannot edit
the constructor, so we release the weight right after construction, before any wrapper
(DDP buffers, optimizer, checkpoint) sees the module. Construction itself is untouched,
so the random-number streams, and therefore a seed's model and losses, stay exactly those
of megatron-core.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


def borrows_shared_output_weight(model: Any) -> bool:
    """True on a stage whose output layer is fed the MTP stage's embedding copy."""
    return bool(
        getattr(model, "post_process", False)
        and not getattr(model, "pre_process", True)
        and getattr(model, "share_embeddings_and_output_weights", False)
        and getattr(model, "mtp_process", False)
        and getattr(getattr(model, "output_layer", None), "weight", None) is not None
    )


def release_borrowed_output_weight(model: Any) -> None:
    """Drop the output layer's own weight where the shared embedding copy is used instead.

    Afterwards the layer behaves as if built with ``skip_weight_param_allocation=True``:
    its forward requires (and always gets) the ``weight`` argument.
    """
    if borrows_shared_output_weight(model):
        # nn.Module.__setattr__ turns this into register_parameter("weight", None): the
        # parameter leaves parameters(), state_dict() and the sharded state dict.
        model.output_layer.weight = None
        logger.debug("released the unused output_layer.weight of an MTP stage")


def init_without_dead_output_weight(original_init: Callable[..., None]) -> Callable[..., None]:
    """Wrap a GPTModel/HybridModel ``__init__`` so the dead weight is released after it."""

    @functools.wraps(original_init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        release_borrowed_output_weight(self)

    return __init__
