"""mHC stability statistics (``--log-mhc-stats``, recipe ``model.mhc.log_stats``).

What is measured, on a fixed sample of tokens (the first :data:`SAMPLE_TOKENS` sequence
positions of the first sequence of a logged step's first micro-batch, as each hyper
connection sees them):

* per sub-layer (``mhc/layerNN.<sublayer>/...``): the H_res residual of double stochasticity,
  ``h_res_row_err`` = max |row sum − 1| and ``h_res_col_err`` = max |column sum − 1| (Sinkhorn
  leaves some; birkhoff is exact to rounding), and the ranges ``h_pre_min/max``,
  ``h_post_min/max``;
* over the model (``mhc/forward_gain``, ``mhc/backward_gain``): the paper's "Amax Gain
  Magnitude" of the composite residual mixing. A sub-layer maps the streams by
  ``x ↦ H_resᵀ x`` (our orientation, see :mod:`megatron_ext.mhc.hyper_connection`), so the
  composite is ``M = H_Lᵀ ⋯ H_1ᵀ`` in layer order; the forward gain is the largest absolute row
  sum of M, the backward gain its largest absolute column sum (max over the sample tokens).

Cost: on a logged step each hyper connection computes its maps once more for its sample
tokens (no gradient), and at the log the figures and n×n products are formed and gathered;
other steps only test one flag per sub-layer.

Pipeline parallelism: every rank composes the products of its own consecutive layers (one per
stage or virtual chunk); the products and per-layer figures are gathered and the chunks'
products multiplied in global layer order, from the ranks of the first tensor-, context- and
data-parallel coordinate (those that hold the sample positions a single rank would). The last
rank writes them to TensorBoard through megatron's writer; the recipe runner reads them into
metrics.json and plots them in ``mhc.png``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

# Sequence positions sampled per hyper connection (of the local sequence under SP/CP).
SAMPLE_TOKENS = 8

FORWARD_GAIN = "mhc/forward_gain"
BACKWARD_GAIN = "mhc/backward_gain"
GAIN_NAMES = (FORWARD_GAIN, BACKWARD_GAIN)

_creation_counter = itertools.count()


def next_creation_index() -> int:
    """Order of construction of hyper connections in this process (attention before MLP)."""
    return next(_creation_counter)


@dataclass
class Recorder:
    """Holds each hyper connection's maps of its sample tokens in the armed step."""

    armed: bool = True
    # id(connection) -> (connection, (h_pre [T, n], h_post [T, n], h_res [T, n, n]))
    samples: dict[int, tuple[Any, Any]] = field(default_factory=dict)

    def capture(self, connection, x: torch.Tensor) -> None:
        """The maps of the first training call per connection (recompute calls again),
        computed now, from the weights this forward uses."""
        key = id(connection)
        if not self.armed or not connection.training or key in self.samples:
            return
        self.samples[key] = (connection, None)  # compute_mappings below records again
        sample = x[:SAMPLE_TOKENS, :1].detach()
        n = connection.n
        with torch.no_grad():
            h_pre, h_post, h_res = connection.compute_mappings(sample)
        maps = (h_pre.reshape(-1, n), h_post.reshape(-1, n), h_res.reshape(-1, n, n).double())
        self.samples[key] = (connection, maps)


_recorder: Recorder | None = None


def enable() -> Recorder:
    """Start recording (the hyper connections check :func:`recorder`)."""
    global _recorder
    _recorder = Recorder()
    return _recorder


def disable() -> None:
    global _recorder
    _recorder = None


def recorder() -> Recorder | None:
    return _recorder


# ---- the figures -------------------------------------------------------------------------------
def sublayer_figures(h_pre: torch.Tensor, h_post: torch.Tensor, h_res: torch.Tensor) -> dict:
    """Per-sub-layer figures from maps ``[T, n]``, ``[T, n]``, ``[T, n, n]``."""
    return {
        "h_res_row_err": (h_res.sum(-1) - 1).abs().max().item(),
        "h_res_col_err": (h_res.sum(-2) - 1).abs().max().item(),
        "h_pre_min": h_pre.min().item(),
        "h_pre_max": h_pre.max().item(),
        "h_post_min": h_post.min().item(),
        "h_post_max": h_post.max().item(),
    }


def compose(operators: list[torch.Tensor]) -> torch.Tensor:
    """``A_k ⋯ A_1`` per token for ``[T, n, n]`` operators in application order."""
    product = operators[0]
    for operator in operators[1:]:
        product = torch.bmm(operator, product)
    return product


def gains(composite: torch.Tensor) -> dict[str, float]:
    """Forward (max abs row sum) and backward (max abs column sum) gain of ``[T, n, n]``."""
    magnitude = composite.abs()
    return {
        FORWARD_GAIN: magnitude.sum(-1).max().item(),
        BACKWARD_GAIN: magnitude.sum(-2).max().item(),
    }


def _sublayer_name(connection) -> str:
    return f"mhc/layer{connection.layer_number:02d}.{connection.stats_sublayer}"


@torch.no_grad()
def local_figures(samples: dict) -> tuple[dict[str, float], list[tuple[tuple, torch.Tensor]]]:
    """This rank's per-sub-layer figures and one composed product per run of consecutive
    layers (a stage or a virtual chunk), keyed by its first sub-layer's global order."""
    ordered = sorted(samples.values(), key=lambda item: (item[0].layer_number, item[0].stats_order))
    figures: dict[str, float] = {}
    chunks: list[tuple[tuple, list[torch.Tensor]]] = []
    previous_layer = None
    for connection, (h_pre, h_post, h_res) in ordered:
        for name, value in sublayer_figures(h_pre, h_post, h_res).items():
            figures[f"{_sublayer_name(connection)}/{name}"] = value
        layer = connection.layer_number
        if previous_layer is None or layer not in (previous_layer, previous_layer + 1):
            chunks.append(((layer, connection.stats_order), []))
        chunks[-1][1].append(h_res.transpose(-1, -2))  # the operator x -> H_resᵀ x
        previous_layer = layer
    return figures, [(key, compose(ops)) for key, ops in chunks]


def _is_sample_holder() -> bool:
    """Whether this rank's sample is the single-rank run's (first TP, CP and DP coordinate)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return True
    return (
        ps.get_tensor_model_parallel_rank() == 0
        and ps.get_context_parallel_rank() == 0
        and ps.get_data_parallel_rank() == 0
    )


def combine(contributions: list) -> dict[str, float]:
    """Per-sub-layer figures and the model's gains from every rank's contribution."""
    figures: dict[str, float] = {}
    chunks = []
    for contribution in contributions:
        if contribution is None:
            continue
        rank_figures, rank_chunks = contribution
        figures.update(rank_figures)
        chunks.extend(rank_chunks)
    if chunks:
        chunks.sort(key=lambda chunk: chunk[0])
        lengths = {product.shape[0] for _, product in chunks}
        if len(lengths) == 1:  # every stage sampled the same number of tokens
            figures.update(gains(compose([product for _, product in chunks])))
    return figures


def collect(recorder_: Recorder) -> dict[str, float]:
    """Every rank calls this at a logged step; all get the model's figures."""
    import torch.distributed as dist

    contribution: tuple[dict[str, float], list[tuple[tuple[Any, ...], torch.Tensor]]] | None = None
    if recorder_.samples and _is_sample_holder():
        figures, chunks = local_figures(recorder_.samples)
        contribution = (figures, [(key, product.cpu()) for key, product in chunks])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, contribution)
    else:
        gathered = [contribution]
    return combine(gathered)


__all__ = [
    "BACKWARD_GAIN",
    "FORWARD_GAIN",
    "GAIN_NAMES",
    "Recorder",
    "SAMPLE_TOKENS",
    "collect",
    "combine",
    "compose",
    "disable",
    "enable",
    "gains",
    "local_figures",
    "recorder",
    "sublayer_figures",
]
