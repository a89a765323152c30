"""The multi-module plan: each module's parallel sizes and ranks, and the module graph.

One :class:`MultiModulePlan` owns everything that decides whether a multi-module pipeline can
run. :meth:`MultiModulePlan.validate` checks it without creating a process group and reports
every problem at once, each with the values involved and what to change. Derived facts (the
stage a rank sits at, how many micro-batches it runs ahead in the warm-up, each module's
micro-batch size under fan-in/fan-out) are read-only methods with the reason in their
docstring.

The schedule these plans run in is megatron-core's non-interleaved 1F1B
(``forward_backward_pipelining_without_interleaving``) with one warm-up count per rank.
Between two adjacent stages, 1F1B pairs each of the upstream stage's combined
send-forward/receive-backward exchanges with one of the downstream stage's
send-backward/receive-forward exchanges only if the upstream stage runs exactly one more
warm-up micro-batch than the downstream one. A rank's warm-up therefore has to be the number
of pipeline stages downstream of it. That is well defined for every graph in which all paths
from a module to the language model have the same number of stages after that module: fan-in
of encoders with different pipeline depths is fine (each encoder counts only what follows
it), but a module whose successors lead to the language model through different numbers of
stages would need two warm-up counts at once, which one 1F1B rank cannot have.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from megatron.core.model_parallel_config import ModelParallelConfig

from megatron_ext.errors import Problem
from megatron_ext.multimodule.errors import MultiModulePlanError
from megatron_ext.parallel_plan import ParallelPlan, ParallelPlanError


@dataclass(frozen=True)
class ModulePlan:
    """One module's parallel sizes and where its ranks start.

    The module occupies the contiguous ranks ``first_rank .. first_rank + size - 1``, laid out
    like megatron-core's ``HyperCommGrid(["tp", "cp", "pp", "dp"])``: TP varies fastest, DP
    slowest. ``output_ndim`` is the ndim of what the module's last stage hands to its
    successors (3 for Megatron's ``[s, b, h]``, 2 for ``[N, h]``); ``None`` takes it from the
    built module's ``output_ndim`` attribute, else 3.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    first_rank: int = 0
    output_ndim: int | None = None

    @property
    def parallel(self) -> ParallelPlan:
        """This module's grid as a parallel plan."""
        return ParallelPlan(tp=self.tp, pp=self.pp, cp=self.cp, dp_size=self.dp)

    @property
    def size(self) -> int:
        return self.parallel.world_size

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.size)

    def coordinates(self, rank: int) -> dict[str, int]:
        """The (tp, cp, pp, dp) coordinates of ``rank`` in this module's grid."""
        if rank not in self.ranks:
            raise ParallelPlanError(
                f"rank {rank} is not in ranks {self.ranks.start}..{self.ranks.stop - 1}"
            )
        local = rank - self.first_rank
        coords = {}
        for name, size in (("tp", self.tp), ("cp", self.cp), ("pp", self.pp), ("dp", self.dp)):
            coords[name] = local % size
            local //= size
        return coords


@dataclass
class MultiModulePlan:
    """Modules, the edges between them and which module is the language model.

    ``topology`` maps a module to the modules it feeds (``{"vision_encoder": ["llm"]}``);
    modules that feed nothing may be left out. ``world_size`` defaults to the launcher's
    ``WORLD_SIZE``.
    """

    modules: dict[str, ModulePlan]
    topology: dict[str, list[str]]
    language_model: str
    world_size: int | None = None
    backend: str | None = None  # of every grid and bridge group; None: the default group's

    def __post_init__(self) -> None:
        if self.world_size is None:
            self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.topology = {name: list(self.topology.get(name, [])) for name in self.modules} | {
            name: list(dests) for name, dests in self.topology.items() if name not in self.modules
        }

    # ------------------------------------------------------------------ graph facts
    def successors(self, name: str) -> list[str]:
        return list(self.topology.get(name, []))

    def predecessors(self, name: str) -> list[str]:
        """Modules feeding ``name``, in the order of ``modules`` (the order bridges are built,
        hence the order a module's first stage receives them)."""
        return [src for src in self.modules if name in self.topology.get(src, [])]

    @property
    def edges(self) -> list[tuple[str, str]]:
        return [(src, dst) for src in self.modules for dst in self.topology.get(src, [])]

    @property
    def sources(self) -> list[str]:
        return [name for name in self.modules if not self.predecessors(name)]

    @property
    def sinks(self) -> list[str]:
        return [name for name in self.modules if not self.successors(name)]

    @cached_property
    def topological_order(self) -> list[str]:
        """Modules with every predecessor before its successors (raises on a cycle)."""
        order: list[str] = []
        state: dict[str, str] = {}  # module -> "active" (on the path) | "done"

        def visit(name: str, path: tuple[str, ...]) -> None:
            if state.get(name) == "done":
                return
            if state.get(name) == "active":
                cycle = " -> ".join(path[path.index(name) :] + (name,))
                raise MultiModulePlanError(
                    [Problem("", f"the topology has a cycle: {cycle}; it must be a DAG")]
                )
            state[name] = "active"
            for src in self.predecessors(name):
                visit(src, path + (name,))
            state[name] = "done"
            order.append(name)

        for name in self.modules:
            visit(name, ())
        return order

    def reachable(self, src: str, dst: str) -> bool:
        """Whether activations of ``src`` flow (directly or not) into ``dst``."""
        todo, seen = list(self.successors(src)), set()
        while todo:
            name = todo.pop()
            if name == dst:
                return True
            if name not in seen:
                seen.add(name)
                todo.extend(self.successors(name))
        return False

    def stages_after(self, name: str) -> int:
        """Pipeline stages downstream of ``name``'s last stage, along its longest path to
        the language model (0 for the language model itself)."""
        successors = self.successors(name)
        if not successors:
            return 0
        return max(self.modules[s].pp + self.stages_after(s) for s in successors)

    def stages_before(self, name: str) -> int:
        """Pipeline stages upstream of ``name``'s first stage along its longest path."""
        preds = self.predecessors(name)
        if not preds:
            return 0
        return max(self.modules[p].pp + self.stages_before(p) for p in preds)

    @property
    def total_stages(self) -> int:
        """Stages along the longest path through the graph (megatron-core's definition)."""
        return max(self.stages_before(n) + self.modules[n].pp for n in self.modules)

    # ------------------------------------------------------------------ rank facts
    def modules_on(self, rank: int) -> list[str]:
        """The modules with a stage on ``rank``, in ``modules`` order."""
        return [name for name, m in self.modules.items() if rank in m.ranks]

    def warmup_on(self, rank: int) -> int:
        """Micro-batches ``rank`` runs forward before its first backward: the number of
        pipeline stages downstream of it (module-local stages after it plus
        :meth:`stages_after` its module). See the module docstring for why."""
        counts = {self._warmup_of(name, rank) for name in self.modules_on(rank)}
        if len(counts) != 1:
            raise ParallelPlanError(
                f"rank {rank} holds stages with different warm-up counts {counts}"
            )
        return counts.pop()

    def _warmup_of(self, name: str, rank: int) -> int:
        module = self.modules[name]
        pp_rank = module.coordinates(rank)["pp"]
        return module.pp - 1 - pp_rank + self.stages_after(name)

    def micro_batch_size(self, name: str, language_model_micro_batch_size: int) -> int:
        """Samples per micro-batch on one DP replica of ``name``: a global micro-batch holds
        ``mbs * dp`` samples of the language model, and every module splits the same samples
        over its own DP replicas (bridges concatenate or split along the batch dim)."""
        total = language_model_micro_batch_size * self.modules[self.language_model].dp
        dp = self.modules[name].dp
        if total % dp:
            raise ParallelPlanError(
                f"module {name!r}: the global micro-batch of {total} samples "
                f"(language model micro_batch_size {language_model_micro_batch_size} x dp "
                f"{self.modules[self.language_model].dp}) does not split over its dp={dp}"
            )
        return total // dp

    def sample_range(self, name: str, dp_rank: int, language_model_micro_batch_size: int) -> range:
        """Which samples of a global micro-batch DP replica ``dp_rank`` of ``name`` holds."""
        mbs = self.micro_batch_size(name, language_model_micro_batch_size)
        return range(dp_rank * mbs, (dp_rank + 1) * mbs)

    # ------------------------------------------------------------------ validation
    def problems(self, config: Any = None) -> list[Problem]:
        """Every reason this plan cannot run, one line each (empty when it can)."""
        problems: list[Problem] = []
        problems += self._module_problems()
        if problems:
            return problems
        problems += self._graph_problems()
        if problems:
            return problems
        problems += self._rank_problems()
        problems += self._bridge_problems()
        problems += self._schedule_problems()
        if config is not None:
            problems += pipeline_config_problems(config)
        return problems

    def validate(self, config: Any = None) -> MultiModulePlan:
        """Raise :class:`MultiModulePlanError` listing every problem; returns the plan."""
        problems = self.problems(config)
        if problems:
            raise MultiModulePlanError(problems)
        return self

    def _module_problems(self) -> list[Problem]:
        problems: list[Problem] = []
        if not self.modules:
            problems.append(Problem("", "the plan has no modules"))
        for name, m in self.modules.items():
            for bad in m.parallel.size_problems():
                value = getattr(m, bad.where)
                problems.append(
                    Problem(f"module {name!r}", f"{bad.where}={value!r} must be a positive integer")
                )
            if not isinstance(m.first_rank, int) or m.first_rank < 0:
                problems.append(
                    Problem(f"module {name!r}", f"first_rank={m.first_rank!r} must be >= 0")
                )
            if m.output_ndim not in (None, 2, 3):
                problems.append(
                    Problem(
                        f"module {name!r}",
                        f"output_ndim={m.output_ndim!r}; bridges carry 3-D "
                        "[s, b, h] or 2-D [N, h] tensors (2, 3, or None to infer)",
                    )
                )
        if self.language_model not in self.modules:
            problems.append(
                Problem(
                    "",
                    f"language_model={self.language_model!r} is not one of the modules "
                    f"{sorted(self.modules)}",
                )
            )
        return problems

    def _graph_problems(self) -> list[Problem]:
        problems: list[Problem] = []
        for src, dests in self.topology.items():
            if src not in self.modules:
                problems.append(
                    Problem(
                        "",
                        f"topology names {src!r}, which is not a module ({sorted(self.modules)})",
                    )
                )
            for dst in dests:
                if dst not in self.modules:
                    problems.append(
                        Problem(f"topology edge {src} -> {dst}", f"{dst!r} is not a module")
                    )
                elif dst == src:
                    problems.append(
                        Problem("", f"topology edge {src} -> {dst} feeds a module into itself")
                    )
            if len(set(dests)) != len(dests):
                problems.append(
                    Problem("", f"topology lists a successor of {src!r} twice: {dests}")
                )
        if problems:
            return problems
        try:
            self.topological_order  # noqa: B018 (evaluated for the cycle check it raises)
        except MultiModulePlanError as error:
            return error.problems
        if self.successors(self.language_model):
            problems.append(
                Problem(
                    "",
                    f"the language model {self.language_model!r} feeds "
                    f"{self.successors(self.language_model)}; it computes the loss, so it must be "
                    "the last module of the pipeline",
                )
            )
        for sink in self.sinks:
            if sink != self.language_model:
                problems.append(
                    Problem(
                        "",
                        f"module {sink!r} feeds no other module, but only the language model "
                        f"({self.language_model!r}) may end the pipeline (the loss is computed "
                        f"there); add an edge {sink} -> ... or set language_model={sink!r}",
                    )
                )
        return problems

    def _rank_problems(self) -> list[Problem]:
        problems: list[Problem] = []
        world = self.world_size
        assert world is not None  # __post_init__ fills it
        for name, m in self.modules.items():
            if m.ranks.stop > world:
                problems.append(
                    Problem(
                        "",
                        f"module {name!r} needs ranks {m.first_rank}..{m.ranks.stop - 1} "
                        f"(tp {m.tp} x cp {m.cp} x pp {m.pp} x dp {m.dp} = {m.size} ranks from "
                        f"first_rank {m.first_rank}), but the world has {world} ranks",
                    )
                )
        idle = [r for r in range(world) if not self.modules_on(r)]
        if idle and not problems:
            problems.append(
                Problem(
                    "",
                    f"ranks {idle} belong to no module; every rank must run a stage "
                    "(shrink the world or give a module those ranks)",
                )
            )
        names = list(self.modules)
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                shared = sorted(set(self.modules[a].ranks) & set(self.modules[b].ranks))
                if not shared:
                    continue
                span = (
                    f"ranks {shared[0]}..{shared[-1]}" if len(shared) > 1 else f"rank {shared[0]}"
                )
                if self.reachable(a, b) or self.reachable(b, a):
                    first, second = (a, b) if self.reachable(a, b) else (b, a)
                    problems.append(
                        Problem(
                            "",
                            f"modules {a!r} and {b!r} overlap on {span}, but {first!r} feeds "
                            f"{second!r}: pipelined modules must have disjoint rank ranges (a "
                            "rank cannot bridge to itself, and 1F1B would need its output before "
                            "it has run); move one module's first_rank",
                        )
                    )
                    continue
                for rank in shared:
                    wa, wb = self._warmup_of(a, rank), self._warmup_of(b, rank)
                    if wa != wb:
                        problems.append(
                            Problem(
                                "",
                                f"modules {a!r} and {b!r} share rank {rank}, where {a!r} runs "
                                f"{wa} warm-up micro-batch(es) and {b!r} {wb}; one rank runs one "
                                "1F1B schedule, so co-located modules must sit at the same depth "
                                "(give them the same pp and successors, or separate ranks)",
                            )
                        )
                        break
        return problems

    def _bridge_problems(self) -> list[Problem]:
        problems: list[Problem] = []
        for src, dst in self.edges:
            a, b = self.modules[src], self.modules[dst]
            if a.cp > 1 or b.cp > 1:
                problems.append(
                    Problem(
                        f"bridge {src} -> {dst}",
                        f"context parallelism across a bridge is not "
                        f"supported by megatron-core's BridgeCommunicator ({src} cp={a.cp}, "
                        f"{dst} cp={b.cp}); set cp=1 on both",
                    )
                )
            if a.dp % b.dp and b.dp % a.dp:
                problems.append(
                    Problem(
                        f"bridge {src} -> {dst}",
                        f"dp sizes {a.dp} and {b.dp} neither divide nor are "
                        "divided by each other, so the batch cannot be gathered (fan-in) or split "
                        "(fan-out) evenly; make one a multiple of the other",
                    )
                )
        return problems

    def _schedule_problems(self) -> list[Problem]:
        problems: list[Problem] = []
        for name in self.modules:
            successors = self.successors(name)
            depths = {s: self.modules[s].pp + self.stages_after(s) for s in successors}
            if len(set(depths.values())) > 1:
                described = ", ".join(f"{s} ({d} stage(s))" for s, d in depths.items())
                problems.append(
                    Problem(
                        "",
                        f"module {name!r} feeds modules that lead to the language model through "
                        f"different numbers of pipeline stages: {described}. Its last stage would "
                        "need a different 1F1B warm-up for each successor, and one rank has one "
                        "warm-up count, so this graph deadlocks in megatron-core's non-interleaved "
                        "schedule; give the paths the same number of stages (pp sizes), or feed "
                        "only successors at the same depth",
                    )
                )
        return problems


@dataclass
class MultiModulePipelineConfig(ModelParallelConfig):
    """The schedule's config for a multi-module pipeline: megatron-core's
    ModelParallelConfig with ``variable_seq_lengths`` on and the one TransformerConfig field
    the schedule reads (``calculate_per_token_loss``). Each module keeps its own
    TransformerConfig."""

    variable_seq_lengths: bool = True
    calculate_per_token_loss: bool = False
    """Normalise by the global number of loss tokens instead of per micro-batch."""


def pipeline_config_problems(config: Any) -> list[Problem]:
    """What the schedule's config must say for a multi-module pipeline."""
    problems: list[Problem] = []
    if not getattr(config, "variable_seq_lengths", False):
        problems.append(
            Problem(
                "",
                "config.variable_seq_lengths is False: multi-module pipelines exchange every "
                "tensor's shape (encoder and language-model tensors differ, bridges gather and "
                "split batches), which megatron-core's schedule only does with "
                "variable_seq_lengths=True; set it in the pipeline config",
            )
        )
    if getattr(config, "pipeline_dtype", None) is None:
        problems.append(
            Problem(
                "",
                "config.pipeline_dtype is None: P2P and bridge buffers are allocated in it; set "
                "it (e.g. torch.float32 or torch.bfloat16)",
            )
        )
    if getattr(config, "virtual_pipeline_model_parallel_size", None) is not None:
        problems.append(
            Problem(
                "",
                "config.virtual_pipeline_model_parallel_size is set, but megatron-core has no "
                "interleaved multi-module schedule; leave it None",
            )
        )
    if getattr(config, "overlap_p2p_comm", False):
        problems.append(
            Problem(
                "",
                "config.overlap_p2p_comm=True: the non-interleaved schedule (the only one for "
                "multi-module pipelines) rejects it; set it False",
            )
        )
    return problems
