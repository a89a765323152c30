"""mHC stability statistics (``--log-mhc-stats``, recipe ``model.mhc.log_stats``).

What is measured, on a fixed sample of tokens: the first :data:`SAMPLE_TOKENS` positions of
the whole sequence (global positions, however SP and CP split it) of the first sequence of a
logged step's first micro-batch, as each hyper connection sees them:

* per sub-layer (``mhc/layerNN.<sublayer>/...``): the H_res residual of double stochasticity,
  ``h_res_row_err`` = max |row sum − 1| and ``h_res_col_err`` = max |column sum − 1| (Sinkhorn
  leaves some; birkhoff is exact to rounding), H_res's largest Frobenius distance from the
  identity and from uniform mixing (``h_res_identity_dist``, ``h_res_uniform_dist``: what the
  learned mixing moves, when the gains stay at 1 up to rounding), the ranges
  ``h_pre_min/max``, ``h_post_min/max``, the largest amplitudes ``h_pre_sum_max`` (Σ_i H_pre_i:
  how much of the streams the sub-layer reads) and ``h_post_sum_max`` (Σ_i H_post_i: how much of
  its output it writes back), and the residual streams' size as the sub-layer receives them,
  ``stream_rms_min/max`` (the RMS over h of each stream, extremes over streams and tokens): what
  moves when the maps stay doubly stochastic but the streams grow or drift apart;
* over the model (``mhc/forward_gain``, ``mhc/backward_gain``): the paper's "Amax Gain
  Magnitude" of the composite residual mixing of the decoder. A sub-layer maps the streams by
  ``x ↦ H_resᵀ x`` (our orientation, see :mod:`megatron_ext.mhc.hyper_connection`), so the
  composite is ``M = H_Lᵀ ⋯ H_1ᵀ`` in layer order; the forward gain is the largest absolute row
  sum of M, the backward gain its largest absolute column sum (max over the sample tokens).

Multi-token prediction. The paper's gain is the main residual path (decoder layers, main
loss); MTP layers (Hybrid MTP depths carry the n streams on from the decoder's last layer) are
not in it. Their sub-layers report under ``mhc/mtpD.layerNN.<sublayer>/...`` (D the depth,
NN the layer inside it) and ``mhc/mtp_forward_gain`` / ``mhc/mtp_backward_gain`` are the gains
of the path of the deepest MTP loss: the decoder's layers, then every depth's in order
(``h_proj`` acts on each stream alike, so it mixes none). GPT's MTP layers are plain layers
on the contracted output and have no hyper connections (nothing to report). A repeated MTP
layer (``mtp_use_repeated_layer``) is recorded at its first call (depth 1) only.

Cost: on a logged step each hyper connection computes its maps once more for its sample
tokens (no gradient), and at the log the maps (a few KiB) are gathered; other steps only test
one flag per sub-layer.

Parallelism. Each rank records the sample tokens it holds, with their global positions (its
slice under SP, its two load-balanced chunks under CP), from its first data-parallel replica
(the one holding the single-rank run's micro-batch) and, without SP, from its first TP rank
only (the others hold copies). Every rank's records are gathered; tokens are merged by
position and the sub-layers ordered globally by (MTP depth, layer number, order inside the
layer), so pipeline stages and VPP chunks compose in global layer order and the figures equal
a single rank's. The process groups are each connection's own (the layer's
``pg_collection``: the language model's groups in a multi-module pipeline), else megatron's
``parallel_state``. The last rank writes the figures to TensorBoard through megatron's writer;
the recipe runner reads them into metrics.json and plots them in ``mhc.png``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from megatron_ext.parallel_plan import cp_token_positions

# Global sequence positions sampled per hyper connection.
SAMPLE_TOKENS = 8

FORWARD_GAIN = "mhc/forward_gain"
BACKWARD_GAIN = "mhc/backward_gain"
GAIN_NAMES = (FORWARD_GAIN, BACKWARD_GAIN)
MTP_FORWARD_GAIN = "mhc/mtp_forward_gain"
MTP_BACKWARD_GAIN = "mhc/mtp_backward_gain"
MTP_GAIN_NAMES = (MTP_FORWARD_GAIN, MTP_BACKWARD_GAIN)

_creation_counter = itertools.count()


def next_creation_index() -> int:
    """Order of construction of hyper connections in this process (attention before MLP)."""
    return next(_creation_counter)


class Sample(NamedTuple):
    """One hyper connection's maps of the sample tokens this rank holds."""

    positions: torch.Tensor  # [T] global sequence positions, ascending
    h_pre: torch.Tensor  # [T, n]
    h_post: torch.Tensor  # [T, n]
    h_res: torch.Tensor  # [T, n, n] float64
    holder: bool  # whether this rank's copy counts (first DP replica; first TP rank w/o SP)
    stream_rms: torch.Tensor  # [T, n] float64: each stream's RMS over h


def _group_rank_size(group) -> tuple[int, int]:
    # The group's own rank()/size(): no lookup in torch's registry of live groups.
    if group is None:
        return 0, 1
    return group.rank(), group.size()


def _groups(connection) -> dict[str, tuple[int, int]]:
    """(rank, size) in the connection's TP, CP and DP groups: its own process groups
    (``stats_groups``, the layer's pg_collection) or megatron's parallel_state."""
    own = getattr(connection, "stats_groups", None)
    if own is not None:
        return {name: _group_rank_size(getattr(own, name, None)) for name in ("tp", "cp", "dp")}
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return {name: (0, 1) for name in ("tp", "cp", "dp")}
    return {
        "tp": (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()),
        "cp": (ps.get_context_parallel_rank(), ps.get_context_parallel_world_size()),
        "dp": (ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()),
    }


def global_positions(local_length: int, groups: dict, sequence_parallel: bool) -> torch.Tensor:
    """Global sequence position of each of this rank's ``local_length`` tokens: SP gives a TP
    rank one slice of its CP rank's sequence; CP gives a rank two load-balanced chunks."""
    tp_rank, tp_size = groups["tp"]
    cp_rank, cp_size = groups["cp"]
    local = torch.arange(local_length)
    cp_length = local_length
    if sequence_parallel and tp_size > 1:
        local, cp_length = local + tp_rank * local_length, local_length * tp_size
    if cp_size > 1:
        positions = torch.tensor(cp_token_positions(cp_length, cp_size, cp_rank))
        return positions[local]
    return local


@dataclass
class Recorder:
    """Holds each hyper connection's maps of its sample tokens in the armed step."""

    armed: bool = True
    # id(connection) -> (connection, Sample or None while being taken)
    samples: dict[int, tuple[Any, Any]] = field(default_factory=dict)

    def capture(self, connection, x: torch.Tensor) -> None:
        """The maps of the first training call per connection (recompute calls again),
        computed now, from the weights this forward uses."""
        key = id(connection)
        if not self.armed or not connection.training or key in self.samples:
            return
        self.samples[key] = (connection, None)  # compute_mappings below records again
        groups = _groups(connection)
        sequence_parallel = bool(getattr(connection.config, "sequence_parallel", False))
        positions = global_positions(x.shape[0], groups, sequence_parallel)
        taken = torch.nonzero(positions < SAMPLE_TOKENS).flatten()
        holder = groups["dp"][0] == 0 and (sequence_parallel or groups["tp"][0] == 0)
        n = connection.n
        if taken.numel() == 0:  # this rank holds none of the sample positions
            empty = torch.zeros(0, n, dtype=torch.float64)
            self.samples[key] = (
                connection,
                Sample(taken, empty, empty, empty.view(0, n, n), False, empty),
            )
            return
        with torch.no_grad():
            tokens = x.index_select(0, taken.to(x.device))[:, :1].detach()
            h_pre, h_post, h_res = connection.compute_mappings(tokens)
            streams = tokens.double().reshape(-1, n, tokens.shape[-1] // n)
            stream_rms = streams.square().mean(dim=-1).sqrt()
        maps = (h_pre.reshape(-1, n), h_post.reshape(-1, n), h_res.reshape(-1, n, n).double())
        self.samples[key] = (connection, Sample(positions[taken], *maps, holder, stream_rms))


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
def sublayer_figures(
    h_pre: torch.Tensor,
    h_post: torch.Tensor,
    h_res: torch.Tensor,
    stream_rms: torch.Tensor | None = None,
) -> dict:
    """Per-sub-layer figures from maps ``[T, n]``, ``[T, n]``, ``[T, n, n]`` and the streams'
    RMS ``[T, n]`` (when given).

    Where H_res sits between the two ends of the Birkhoff polytope: its largest Frobenius
    distance (over the sample tokens) from the identity (no mixing, the plain residual) and
    from uniform mixing ``J / n`` (every stream the mean); a doubly stochastic n x n matrix
    is within ``sqrt(n - 1)`` of either (both are doubly stochastic and
    ``||I - J/n||_F = sqrt(n - 1)``)."""
    n = h_res.shape[-1]
    identity = torch.eye(n, dtype=h_res.dtype, device=h_res.device)
    figures = {
        "h_res_row_err": (h_res.sum(-1) - 1).abs().max().item(),
        "h_res_col_err": (h_res.sum(-2) - 1).abs().max().item(),
        "h_res_identity_dist": torch.linalg.matrix_norm(h_res - identity).max().item(),
        "h_res_uniform_dist": torch.linalg.matrix_norm(h_res - 1.0 / n).max().item(),
        "h_pre_min": h_pre.min().item(),
        "h_pre_max": h_pre.max().item(),
        "h_post_min": h_post.min().item(),
        "h_post_max": h_post.max().item(),
        "h_pre_sum_max": h_pre.sum(-1).max().item(),
        "h_post_sum_max": h_post.sum(-1).max().item(),
    }
    if stream_rms is not None:
        figures["stream_rms_min"] = stream_rms.min().item()
        figures["stream_rms_max"] = stream_rms.max().item()
    return figures


def compose(operators: list[torch.Tensor]) -> torch.Tensor:
    """``A_k ⋯ A_1`` per token for ``[T, n, n]`` operators in application order."""
    product = operators[0]
    for operator in operators[1:]:
        product = torch.bmm(operator, product)
    return product


def gains(composite: torch.Tensor, names: tuple[str, str] = GAIN_NAMES) -> dict[str, float]:
    """Forward (max abs row sum) and backward (max abs column sum) gain of ``[T, n, n]``."""
    magnitude = composite.abs()
    return {
        names[0]: magnitude.sum(-1).max().item(),
        names[1]: magnitude.sum(-2).max().item(),
    }


def mtp_depth(connection) -> int:
    """0 for the decoder's hyper connections, D for those of MTP depth D."""
    return int(getattr(connection, "stats_mtp_depth", 0))


def sublayer_name(connection) -> str:
    """``mhc/layerNN.<sublayer>`` (decoder) or ``mhc/mtpD.layerNN.<sublayer>`` (MTP depth D)."""
    depth = mtp_depth(connection)
    scope = f"mtp{depth}." if depth else ""
    return f"mhc/{scope}layer{connection.layer_number:02d}.{connection.stats_sublayer}"


class Entry(NamedTuple):
    """One sub-layer's sample as it is gathered: name, global order, tokens and maps."""

    name: str
    order: tuple[int, int, int]  # (MTP depth, layer number, index inside the layer)
    positions: torch.Tensor
    h_pre: torch.Tensor
    h_post: torch.Tensor
    h_res: torch.Tensor
    stream_rms: torch.Tensor


def contribution(samples: dict, holders_only: bool = True) -> list[Entry]:
    """This rank's entries: the samples it holds for the model's figures (see the module doc;
    ``holders_only=False`` takes every sample, for a model built on one rank of a larger
    world), each ordered by its place in the layer (creation order: attention before MLP)."""
    recorded = [(c, s) for c, s in samples.values() if s is not None]
    by_layer: dict[tuple[int, int], list] = {}
    for connection, sample in recorded:
        by_layer.setdefault((mtp_depth(connection), connection.layer_number), []).append(
            (connection.stats_order, connection, sample)
        )
    entries = []
    for (depth, layer), members in by_layer.items():
        for index, (_, connection, sample) in enumerate(sorted(members, key=lambda m: m[0])):
            if (sample.holder or not holders_only) and sample.positions.numel():
                entries.append(
                    Entry(
                        sublayer_name(connection),
                        (depth, layer, index),
                        sample.positions.cpu(),
                        sample.h_pre.detach().double().cpu(),
                        sample.h_post.detach().double().cpu(),
                        sample.h_res.detach().double().cpu(),
                        sample.stream_rms.detach().double().cpu(),
                    )
                )
    return entries


def _merged(contributions: list) -> dict[str, Entry]:
    """Every sub-layer's sample tokens from every rank, one copy per position, by position."""
    parts: dict[str, list[Entry]] = {}
    for entries in contributions:
        for entry in entries or ():
            parts.setdefault(entry.name, []).append(entry)
    merged = {}
    for name, pieces in parts.items():
        positions = torch.cat([p.positions for p in pieces])
        order = torch.argsort(positions, stable=True)
        keep = order[
            torch.cat([torch.tensor([True]), positions[order][1:] != positions[order][:-1]])
        ]
        merged[name] = Entry(
            name,
            pieces[0].order,
            positions[keep],
            *(
                torch.cat([getattr(p, f) for p in pieces])[keep]
                for f in ("h_pre", "h_post", "h_res", "stream_rms")
            ),
        )
    return merged


def _composite_gains(entries: list[Entry], names: tuple[str, str]) -> dict[str, float]:
    """The gains of the entries' operators composed in order; none unless every sub-layer
    holds the same sample positions."""
    if not entries or any(not torch.equal(e.positions, entries[0].positions) for e in entries):
        return {}
    return gains(compose([e.h_res.transpose(-1, -2) for e in entries]), names)  # x -> H_resᵀ x


def combine(contributions: list) -> dict[str, float]:
    """Per-sub-layer figures and the gains from every rank's :func:`contribution`."""
    merged = sorted(_merged(contributions).values(), key=lambda entry: entry.order)
    figures: dict[str, float] = {}
    for entry in merged:
        maps = (entry.h_pre, entry.h_post, entry.h_res, entry.stream_rms)
        for name, value in sublayer_figures(*maps).items():
            figures[f"{entry.name}/{name}"] = value
    decoder = [entry for entry in merged if entry.order[0] == 0]
    figures.update(_composite_gains(decoder, GAIN_NAMES))
    if len(decoder) < len(merged):
        figures.update(_composite_gains(merged, MTP_GAIN_NAMES))
    return figures


def collect(recorder_: Recorder) -> dict[str, float]:
    """Every rank calls this at a logged step; all get the model's figures."""
    import torch.distributed as dist

    mine = contribution(recorder_.samples)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
    else:
        gathered = [mine]
    return combine(gathered)


__all__ = [
    "BACKWARD_GAIN",
    "Entry",
    "FORWARD_GAIN",
    "GAIN_NAMES",
    "MTP_BACKWARD_GAIN",
    "MTP_FORWARD_GAIN",
    "MTP_GAIN_NAMES",
    "Recorder",
    "SAMPLE_TOKENS",
    "Sample",
    "collect",
    "combine",
    "compose",
    "contribution",
    "disable",
    "enable",
    "gains",
    "global_positions",
    "recorder",
    "sublayer_figures",
    "sublayer_name",
]
