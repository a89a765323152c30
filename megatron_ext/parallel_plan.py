"""The parallel plan: one small frozen object for the sizes of a run and what follows from them.

Every place that checks parallel sizes (recipes' schema and plan checks, the equivalence
harness, each module of a multi-module pipeline) builds a :class:`ParallelPlan` and asks it:
derived sizes are properties (``dp``, ``world_size``, ``model_chunks``, ``seq_len_divisor``)
and :meth:`ParallelPlan.problems` returns every inconsistency at once, each a
:class:`~megatron_ext.errors.Problem` whose ``where`` is the field (``tp``, ``world_size``, ...)
and whose ``what`` names the values involved and the fix, before any process group exists.
Nothing here imports torch or megatron (only :mod:`megatron_ext.errors`), so recipes are
checked without them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_ext.errors import MegatronExtError, Problem

SIZES = ("tp", "pp", "cp", "ep", "dp")


class ParallelPlanError(MegatronExtError, ValueError):
    """Parallel sizes that do not fit together (a world size, a batch or a sequence that does
    not split over the grid); the message names the sizes and the fix."""


@dataclass(frozen=True)
class ParallelPlan:
    """Sizes of one model's parallel grid, in megatron-core's order (TP fastest, then CP, PP,
    DP). Give ``dp`` or ``world_size`` (or both, then they must agree); neither means dp=1."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None  # virtual stages per pipeline rank; None or 1: none
    cp: int = 1
    ep: int = 1
    sp: bool = False
    dp_size: int | None = None
    world: int | None = None
    etp: int | None = None  # expert tensor parallelism; None: megatron's default, tp

    # ---- derived ---------------------------------------------------------------------------
    @property
    def expert_tp(self) -> int:
        """Expert tensor-parallel size: given, else tp (megatron's default in validate_args
        and initialize_model_parallel)."""
        return self.etp if self.etp is not None else self.tp

    @property
    def expert_grid(self) -> int:
        """Ranks of one expert replica: etp * ep * pp; the world must be a multiple of it
        (megatron-core's initialize_model_parallel builds the expert grid beside the dense one)."""
        return self.expert_tp * self.ep * self.pp

    @property
    def smallest_expert_dp(self) -> int:
        """The smallest dp whose world both grids divide: tp * cp * dp a multiple of etp * ep."""
        expert = self.expert_tp * self.ep
        return expert // math.gcd(self.tp * self.cp, expert)

    @property
    def model_parallel_size(self) -> int:
        """Ranks one model replica spans: tp * pp * cp (EP folds into DP in megatron-core)."""
        return self.tp * self.pp * self.cp

    @property
    def dp(self) -> int:
        """Data-parallel replicas: the given one, else world // (tp * pp * cp)."""
        if self.dp_size is not None:
            return self.dp_size
        if self.world is not None:
            return self.world // self.model_parallel_size
        return 1

    @property
    def world_size(self) -> int:
        """Ranks the plan occupies: the given world, else tp * pp * cp * dp."""
        return self.world if self.world is not None else self.model_parallel_size * self.dp

    @property
    def virtual_stages(self) -> int:
        return self.vpp or 1

    @property
    def model_chunks(self) -> int:
        """Pieces the layers are split into: pp * vpp."""
        return self.pp * self.virtual_stages

    @property
    def seq_len_divisor(self) -> int:
        """What the sequence length must be a multiple of: sequence parallelism splits it over
        tp, load-balanced context parallelism into 2 * cp chunks (each split again over tp
        under SP; megatron's get_batch_on_this_cp_rank)."""
        divisor = self.tp if self.sp else 1
        return divisor * (2 * self.cp if self.cp > 1 else 1)

    # ---- checks ----------------------------------------------------------------------------
    def size_problems(self) -> list[Problem]:
        """Sizes that are not positive integers (every later check assumes they are)."""
        problems = []
        for name in SIZES:
            value = self.dp_size if name == "dp" else getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                problems.append(Problem(name, f"must be >= 1, got {value}"))
        if self.etp is not None and (not isinstance(self.etp, int) or self.etp < 1):
            problems.append(Problem("etp", f"must be >= 1 or null, got {self.etp}"))
        if self.vpp is not None and (not isinstance(self.vpp, int) or self.vpp < 1):
            problems.append(Problem("vpp", f"must be >= 1 or null, got {self.vpp}"))
        return problems

    def problems(self) -> list[Problem]:
        """Every problem of the plan at once (sizes first; nothing else when they are bad)."""
        problems = self.size_problems()
        if problems:
            return problems
        if (
            self.world is not None
            and self.dp_size is None
            and self.world % self.model_parallel_size
        ):
            problems.append(
                Problem(
                    "world_size",
                    f"world size {self.world} is not divisible by tp({self.tp})*pp({self.pp})*"
                    f"cp({self.cp})={self.model_parallel_size}",
                )
            )
        if (
            self.world is not None
            and self.dp_size is not None
            and self.world != self.world_from_sizes
        ):
            problems.append(
                Problem(
                    "world_size",
                    f"{self.world} ranks, but tp({self.tp}) * pp({self.pp}) * cp({self.cp}) * "
                    f"dp({self.dp_size}) = {self.world_from_sizes}; leave nproc null or change dp",
                )
            )
        if self.sp and self.tp == 1:
            problems.append(
                Problem(
                    "sp",
                    "sequence parallelism needs tp > 1 (megatron silently turns it off at tp=1)",
                )
            )
        if (self.ep > 1 or self.etp is not None) and self.world_size % self.expert_grid:
            problems.append(Problem("ep", self.expert_grid_problem()))
        return problems

    def expert_grid_problem(self) -> str:
        etp = "etp" if self.etp is not None else "etp=tp"
        return (
            f"world size {self.world_size} is not divisible by the expert grid {etp}"
            f"({self.expert_tp}) * ep({self.ep}) * pp({self.pp}) = {self.expert_grid} "
            "(megatron's expert tensor parallelism defaults to tp); set parallelism.dp to a "
            f"multiple of {self.smallest_expert_dp} (world size "
            f"{self.model_parallel_size * self.smallest_expert_dp}), or change ep"
        )

    @property
    def world_from_sizes(self) -> int:
        return self.model_parallel_size * self.dp

    def optimizer_instances_problem(self, instances: int) -> str | None:
        """Why ``instances`` distributed-optimizer instances cannot split this plan's dp * cp
        (None when they can; megatron-core asserts it when the ranks start)."""
        if (self.dp * self.cp) % instances == 0:
            return None
        return (
            f"dp({self.dp}) * cp({self.cp}) = {self.dp * self.cp} is not divisible by "
            f"{OPTIMIZER_INSTANCES_FLAG} ({instances}); set parallelism.dp to a multiple of "
            f"{smallest_instances_dp(instances, self.cp)}, or lower the instances"
        )

    def seq_length_problem(self, seq_length: int) -> str | None:
        """Why ``seq_length`` does not split as this plan needs (None when it does)."""
        if seq_length % self.seq_len_divisor == 0:
            return None
        if self.cp > 1 and self.sp:
            return (
                f"{seq_length} is not divisible by 2 * cp * tp = {self.seq_len_divisor} "
                "(context parallelism's load-balanced split, each chunk split again over tp "
                "by sequence parallelism)"
            )
        if self.cp > 1:
            return (
                f"{seq_length} is not divisible by 2 * cp = {self.seq_len_divisor} "
                "(context parallelism's load-balanced split)"
            )
        return (
            f"{seq_length} is not divisible by tp={self.tp}, which sequence parallelism "
            "splits it over"
        )

    def layers_problem(self, num_layers: int) -> str | None:
        """Why ``num_layers`` does not split evenly over the model chunks (None when it does)."""
        if num_layers % self.model_chunks == 0:
            return None
        return (
            f"{num_layers} layers do not split over pp({self.pp}) * vpp({self.virtual_stages}) "
            f"= {self.model_chunks} model chunks"
        )

    def batch_problem(self, global_batch_size: int, micro_batch_size: int) -> str | None:
        """Why the global batch does not split into micro-batches over the DP replicas."""
        if global_batch_size % (micro_batch_size * self.dp) == 0:
            return None
        return (
            f"{global_batch_size} is not a multiple of micro_batch_size({micro_batch_size}) "
            f"* dp({self.dp})"
        )

    def check(self) -> ParallelPlan:
        """Raise :class:`ParallelPlanError` listing every problem; returns the plan."""
        problems = self.problems()
        if problems:
            raise ParallelPlanError("; ".join(map(str, problems)))
        return self


# ----------------------------------------------------------------------------- the CP split
def load_balanced_chunks(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two of the ``2 * cp_size`` sequence chunks that CP rank ``cp_rank`` holds, in the
    order they sit in its local sequence (megatron's load-balanced split for causal attention:
    an early chunk and its mirror, so every rank gets the same share of the mask)."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def cp_token_positions(local_seq_length: int, cp_size: int, cp_rank: int) -> list[int]:
    """Global sequence index of each of CP rank ``cp_rank``'s ``local_seq_length`` tokens."""
    if local_seq_length % 2:
        raise ParallelPlanError(
            f"a CP rank holds two equal chunks, but its local sequence has {local_seq_length} "
            f"tokens; the sequence length must be divisible by 2 * context_parallel_size"
        )
    chunk = local_seq_length // 2
    return [
        position
        for index in load_balanced_chunks(cp_size, cp_rank)
        for position in range(index * chunk, (index + 1) * chunk)
    ]


OPTIMIZER_INSTANCES_FLAG = "--num-distributed-optimizer-instances"


def smallest_instances_dp(instances: int, cp: int) -> int:
    """The smallest dp whose dp * cp the distributed optimizer instances divide (megatron-core
    0.19.2's initialize_model_parallel asserts it when the ranks start)."""
    return instances // math.gcd(cp, instances)
