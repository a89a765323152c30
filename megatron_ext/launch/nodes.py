"""Where a job's ranks sit on its nodes: the node layout of a Slurm job, its checks, and each
rank's own placement report.

Slurm's default task distribution with ``--ntasks-per-node`` is block: node k of the
allocation (in ``scontrol show hostnames`` order) holds ranks ``k*T .. k*T+T-1`` (srun(1),
``--distribution=block``). Megatron numbers a model's ranks with TP fastest
(``parallel_state.initialize_model_parallel(order="tp-cp-ep-dp-pp")``; a multi-module
recipe's ``HyperCommGrid(["tp", "cp", "pp", "dp"])``), so a TP group is ``tp`` consecutive
ranks and stays inside one node whenever ``tp`` divides the ranks per node.

:func:`layout` builds the :class:`NodeLayout` of a recipe's grids, handed in by the run request
(this module knows no recipe; ``submit --dry-run`` prints the layout, :func:`layout_problems`
refuses what cannot work across nodes); :func:`report_placement` is
called by a rank once it trains and prints the line tests read back (hostname, rank, coords).
Nothing here imports torch or megatron at module level.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

PLACEMENT_PREFIX = "[megatron-ext] placement:"
LAYOUT_PREFIX = "[megatron-ext] node layout:"

# Megatron's orders, fastest-varying first.
GPT_ORDER = ("tp", "cp", "dp", "pp")  # parallel_state's tp-cp-ep-dp-pp (EP folds into DP)
MODULE_ORDER = ("tp", "cp", "pp", "dp")  # HyperCommGrid(["tp", "cp", "pp", "dp"])


@dataclass(frozen=True)
class Grid:
    """One model's ranks ``first_rank ..`` with its sizes in megatron's order, fastest first."""

    name: str
    first_rank: int
    sizes: tuple[tuple[str, int], ...]

    @property
    def size(self) -> int:
        total = 1
        for _, n in self.sizes:
            total *= n
        return total

    @property
    def tp(self) -> int:
        return dict(self.sizes).get("tp", 1)

    def holds(self, rank: int) -> bool:
        return self.first_rank <= rank < self.first_rank + self.size

    def coordinates(self, rank: int) -> dict[str, int]:
        local, coords = rank - self.first_rank, {}
        for name, n in self.sizes:
            coords[name] = local % n
            local //= n
        return coords


@dataclass(frozen=True)
class NodeLayout:
    nodes: int
    tasks_per_node: int
    grids: tuple[Grid, ...] = field(default_factory=tuple)

    def node_of(self, rank: int) -> int:
        return rank // self.tasks_per_node

    def ranks_on(self, node: int) -> range:
        return range(node * self.tasks_per_node, (node + 1) * self.tasks_per_node)

    def grid_of(self, rank: int) -> Grid | None:
        return next((g for g in self.grids if g.holds(rank)), None)

    def tp_groups_across_nodes(self) -> list[tuple[str, list[int]]]:
        """TP groups whose ranks sit on more than one node (grid name, ranks)."""
        crossing = []
        for grid in self.grids:
            for start in range(grid.first_rank, grid.first_rank + grid.size, grid.tp):
                group = list(range(start, start + grid.tp))
                if len({self.node_of(r) for r in group}) > 1:
                    crossing.append((grid.name, group))
        return crossing

    def describe_rank(self, rank: int) -> str:
        grid = self.grid_of(rank)
        if grid is None:
            return f"rank {rank} (idle)"
        coords = " ".join(f"{k} {v}" for k, v in grid.coordinates(rank).items())
        named = f"{grid.name} " if len(self.grids) > 1 else ""
        return f"rank {rank}: {named}{coords}"

    def lines(self) -> list[str]:
        """What ``submit --dry-run`` shows: every node's ranks and their coordinates."""
        out = [
            f"{LAYOUT_PREFIX} {self.nodes} node(s) x {self.tasks_per_node} rank(s), block "
            "distribution (node k of the allocation holds the k-th block of ranks)"
        ]
        for node in range(self.nodes):
            ranks = self.ranks_on(node)
            out.append(f"  node {node} (ranks {ranks.start}-{ranks.stop - 1}):")
            out += [f"    {self.describe_rank(r)}" for r in ranks]
        for name, group in self.tp_groups_across_nodes():
            out.append(f"  note: {name} TP group {group} spans nodes (TP traffic between nodes)")
        return out


def layout(grids: Sequence[Grid], nodes: int, tasks_per_node: int) -> NodeLayout:
    """The node layout of a job whose models sit on ``grids`` (a recipe's: the run request's
    ``launch.grids``, built by :func:`megatron_ext.recipes.prepare.prepare`)."""
    return NodeLayout(nodes, tasks_per_node, tuple(grids))


def layout_problems(
    world: int, nodes: int, tasks_per_node: int | None, grids, tp_within_node: bool
) -> list[str]:
    """What cannot work across nodes, one line each naming the field and the fix."""
    if nodes < 1:
        return [f"--nodes / launch.nodes: {nodes} node(s); give at least 1"]
    if world % nodes:
        return [
            f"--nodes / launch.nodes: {world} ranks do not split evenly over {nodes} node(s); "
            f"give a --nodes that divides {world}"
        ]
    if tasks_per_node is not None and nodes * tasks_per_node != world:
        return [
            f"--nodes / launch.nodes: {nodes} node(s) x {tasks_per_node} task(s) per node = "
            f"{nodes * tasks_per_node} tasks, but the recipe has {world} ranks; change --nodes "
            "or the tasks per node (--gpus-per-node / launch.slurm.gpus_per_node)"
        ]
    per_node = world // nodes
    if tp_within_node:
        for grid in grids:
            if grid.tp > per_node:
                return [
                    f"launch.slurm.tp_within_node: {grid.name} tp={grid.tp} is larger than a "
                    f"node's {per_node} rank(s); use fewer nodes (--nodes {world // grid.tp} or "
                    "less) or set launch.slurm.tp_within_node: false"
                ]
            layout_ = NodeLayout(nodes, per_node, (grid,))
            if layout_.tp_groups_across_nodes():
                return [
                    f"launch.slurm.tp_within_node: {grid.name} tp={grid.tp} does not divide a "
                    f"node's {per_node} ranks, so a TP group would span nodes; change --nodes "
                    "or set launch.slurm.tp_within_node: false"
                ]
    return []


def report_placement(coords: dict[str, int], module: str | None = None) -> None:
    """Print this rank's placement (under Slurm only): hostname, node, rank, coordinates.
    Tests read these lines back from the ranks' logs to check where each rank ran."""
    if "SLURM_STEP_ID" not in os.environ:
        return
    where = " ".join(f"{k} {v}" for k, v in coords.items())
    named = f" module {module}" if module else ""
    print(
        f"{PLACEMENT_PREFIX} rank {os.environ.get('RANK', '?')} host {socket.gethostname()} "
        f"node {os.environ.get('SLURM_NODEID', '?')} local_rank "
        f"{os.environ.get('LOCAL_RANK', '?')}{named} {where}",
        flush=True,
    )


def report_megatron_placement() -> None:
    """:func:`report_placement` with the coordinates from megatron's parallel state."""
    from megatron.core import parallel_state as ps

    report_placement(
        {
            "tp": ps.get_tensor_model_parallel_rank(),
            "cp": ps.get_context_parallel_rank(),
            "dp": ps.get_data_parallel_rank(),
            "pp": ps.get_pipeline_model_parallel_rank(),
            # a MoE run's expert-parallel coordinate (0 without experts; issue 41, item 10)
            "ep": ps.get_expert_model_parallel_rank(),
        }
    )


def parse_placements(text: str) -> list[dict[str, str]]:
    """The placement lines in a log, as dicts (``rank``, ``host``, ``node``, ``tp``, ...)."""
    found = []
    for line in text.splitlines():
        if PLACEMENT_PREFIX in line:
            words = line.split(PLACEMENT_PREFIX, 1)[1].split()
            found.append(dict(zip(words[::2], words[1::2], strict=False)))
    return found


_NODE_FAILURE = re.compile(r"[Nn]ode failure on (\S+)")
_JOB_NODE_FAILURE = re.compile(r"JOB \d+ ON (\S+) CANCELLED AT \S+ DUE TO NODE FAILURE")


def lost_nodes(slurm_out: Path) -> list[str]:
    """One line per node that Slurm declared failed during the job (from the job's output:
    srun's "Node failure on NODE"), naming the ranks it held (the batch script's layout line)."""
    try:
        text = slurm_out.read_text(errors="replace")
    except OSError:
        return []
    held: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith(LAYOUT_PREFIX):
            for word in line[len(LAYOUT_PREFIX) :].split("(")[0].split():
                node, _, ranks = word.partition("=")
                held[node] = ranks
    lost = list(dict.fromkeys(_NODE_FAILURE.findall(text)))
    if not lost and _JOB_NODE_FAILURE.search(text):
        lost = ["(unnamed)"]
    return [
        f"node {node} lost (ranks {held.get(node, '?')}): Slurm declared it failed "
        "(its slurmd stopped answering)"
        for node in lost
    ]
