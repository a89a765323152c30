"""Building a multi-module pipeline in one call.

:func:`build` does, in the order that keeps every rank's collectives aligned, the steps
megatron-core 0.19.2 leaves to the user (``notes/multimodule.md`` §1 lists ten):

1. validate the plan and the pipeline config (no process group exists yet);
2. create every module's ``HyperCommGrid`` groups and embedding groups on every rank, members
   or not, in the plan's order (they are collective over the whole world);
3. fill a ``ProcessGroupCollection`` for each module on this rank;
4. build this rank's module stages with their factories, each wrapped in megatron-core's DDP
   with its own groups; build failures, each module's output ndim and the width each module
   takes from its bridges (declared, or derived from the built module: :func:`input_width_of`)
   are then agreed on by all ranks, so a failure raises the same error everywhere;
5. create the communicator (bridges use the grids' backend) and the
   ``MultiModuleProcessGroupCollection``;
6. wrap the stages in a :class:`MultiModuleModel` and point the pipeline config's
   ``no_sync_func`` and ``finalize_model_grads_func`` at it.

The result, a :class:`MultiModulePipeline`, holds what ``get_forward_backward_func`` and the
schedule it returns need (:meth:`MultiModulePipeline.schedule_kwargs`).
"""

from __future__ import annotations

import copy
import dataclasses
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megatron_ext import registry
from megatron_ext.errors import ConfigError, Problem
from megatron_ext.multimodule.communicator import MultiModuleCommunicator
from megatron_ext.multimodule.errors import MultiModuleBuildError, MultiModulePlanError
from megatron_ext.multimodule.grads import finalize_multimodule_grads
from megatron_ext.multimodule.model import (
    MultiModuleModel,
    StageContext,
    StageForward,
    core_module,
    default_forward,
)
from megatron_ext.multimodule.plan import MultiModulePlan

GRID_DIMS = ["tp", "cp", "pp", "dp", "ep"]  # ep: size 1, megatron's DDP asks for its group


@dataclass
class ModuleImpl:
    """How to build and run one module.

    ``factory(stage)`` returns the module stage for a :class:`StageContext` (its groups,
    pre/post-process, config); ``forward(module, batch, inputs, stage)`` runs it (default:
    ``module(batch, inputs)``). ``config``, when given, is the module's TransformerConfig:
    the builder fills in its parallel sizes from the plan and the pipeline's dtype and loss
    normalisation, and hands it to the factory as ``stage.config``.
    """

    factory: Callable[[StageContext], torch.nn.Module]
    forward: StageForward | None = None
    config: Any = None
    input_width: int | None = None
    """The last dim its first stage takes from its bridges (None: derived from the built
    module, see :func:`input_width_of`; a module that receives and shows no width fails the
    build). A sender whose output has another width raises BridgeShapeError before sending,
    instead of the receiver failing (or hanging, or silently reshaping) inside its forward."""


@dataclass
class MultiModulePipeline:
    """A built multi-module pipeline on this rank."""

    plan: MultiModulePlan
    config: Any
    grids: dict[str, Any]
    module_pg_collections: dict[str, Any]
    pg_collection: Any  # megatron-core's MultiModuleProcessGroupCollection
    communicator: MultiModuleCommunicator
    model: MultiModuleModel
    _groups: list = field(default_factory=list, repr=False)
    _pg_cache: dict = field(default_factory=dict, repr=False)
    _owns_memory_buffer: bool = field(default=False, repr=False)

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def local_module_names(self) -> list[str]:
        return list(self.model.local_modules)

    @property
    def reports_loss(self) -> bool:
        """This rank returns the per-micro-batch loss reports (language model last stage,
        TP rank 0): one report per micro-batch and language-model DP replica."""
        return self.model.reports_loss

    def stage(self, name: str) -> StageContext:
        return self.model.stages[name]

    def forward_backward_func(self) -> Callable:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        return get_forward_backward_func(schedule_pg_collection=self.pg_collection)

    def schedule_kwargs(self) -> dict:
        """The arguments that make megatron-core's schedule multi-module."""
        return dict(
            model=[self.model], p2p_communicator=self.communicator, pg_collection=self.pg_collection
        )

    def forward_backward(
        self,
        forward_step_func: Callable,
        data_iterator: Any,
        num_microbatches: int,
        forward_only: bool = False,
    ) -> list:
        """One step of megatron-core's schedule (shapes are exchanged, so the fixed
        ``seq_length``/``micro_batch_size`` arguments are unused)."""
        return self.forward_backward_func()(
            forward_step_func=forward_step_func,
            data_iterator=data_iterator,
            num_microbatches=num_microbatches,
            seq_length=0,
            micro_batch_size=0,
            forward_only=forward_only,
            **self.schedule_kwargs(),
        )

    def zero_grad_buffer(self) -> None:
        self.model.zero_grad_buffer()

    def destroy(self) -> None:
        """Release every process group this pipeline created (collective: call on all ranks)."""
        dist.barrier()
        for grid in self.grids.values():
            grid.destroy()
        destroyed = set()
        for group in list(self._pg_cache.values()) + self._groups:
            if group is None or id(group) in destroyed:
                continue
            destroyed.add(id(group))
            if _is_member(group):
                dist.destroy_process_group(group)
        self._pg_cache.clear()
        self._groups.clear()
        if self._owns_memory_buffer:
            # Leave parallel_state as found: initialize_model_parallel asserts it is unset.
            from megatron.core import parallel_state

            parallel_state.destroy_global_memory_buffer()
            self._owns_memory_buffer = False


def ensure_global_memory_buffer() -> bool:
    """Local attention takes its scratch space from megatron's global memory buffer, which
    ``initialize_model_parallel`` creates; multi-module pipelines never call that. Returns
    whether it was created here."""
    from megatron.core import parallel_state

    try:
        parallel_state.get_global_memory_buffer()
        return False
    except AssertionError:
        registry.private("megatron.core.parallel_state:_set_global_memory_buffer")()
        return True


def _is_member(group: Any) -> bool:
    non_member = getattr(dist.GroupMember, "NON_GROUP_MEMBER", None)
    return group is not None and group is not non_member


def input_width_of(module: torch.nn.Module) -> int | None:
    """The last dim ``module`` (a first stage, before DDP) takes from its bridges, as the
    module shows it: its ``input_width`` attribute; for a megatron language model its
    hidden_size (its first stage takes the bridged ``decoder_input`` [s, b, h]); else the input
    features of its first linear layer in registration order (torch's Linear, megatron's
    Column/RowParallelLinear: ``input_size``, Transformer Engine's: ``in_features``; all full
    widths, as a bridge delivers). None when it shows none of these."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    declared = getattr(module, "input_width", None)
    if declared:
        return int(declared)
    if isinstance(module, LanguageModule):
        return int(module.config.hidden_size)
    for sub in module.modules():
        if "Linear" not in type(sub).__name__:
            continue
        width = getattr(sub, "in_features", None) or getattr(sub, "input_size", None)
        if isinstance(width, int) and width > 0:
            return width
    return None


def resolve_input_widths(
    plan: MultiModulePlan, impls: dict[str, ModuleImpl], shown: list[dict[str, int | None]]
) -> tuple[dict[str, int], list[Problem]]:
    """Every bridge receiver's width: its ``ModuleImpl.input_width``, else what its first-stage
    ranks derived (``shown``: one {module: width} per rank). Returns (widths, problems): a
    receiver that shows no width, or different ones on different ranks, is a problem."""
    widths, problems = {}, []
    for name in plan.modules:
        if declared := impls[name].input_width:
            widths[name] = int(declared)
            continue
        if not plan.predecessors(name):
            continue
        found = {rank_widths[name] for rank_widths in shown if name in rank_widths}
        if found == {None} or not found:
            problems.append(
                Problem(
                    "",
                    f"module {name!r} receives from {plan.predecessors(name)} but shows no input "
                    "width (no input_width attribute, not a megatron language model, no linear "
                    "layer), so what crosses its bridges cannot be checked; give "
                    f"ModuleImpl(input_width=...) for {name!r} or its module an input_width "
                    "attribute",
                )
            )
        elif len(found) > 1:
            problems.append(
                Problem(
                    f"module {name!r}",
                    f"its first-stage ranks show different input widths {sorted(found, key=str)}",
                )
            )
        else:
            (width,) = found
            assert width is not None  # {None} is refused above
            widths[name] = width
    return widths, problems


def _agree(problem: str | None, what: str) -> None:
    """Raise the same error on every rank if any rank has a problem."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problem)
    problems = [f"rank {r}: {p}" for r, p in enumerate(everyone) if p]
    if problems:
        raise MultiModuleBuildError(
            f"{what} failed on {len(problems)} rank(s):\n" + "\n".join(problems)
        )


def _create_grids(plan: MultiModulePlan) -> tuple[dict, list]:
    """Every module's grid and groups, and its embedding groups, on every rank in one order."""
    from megatron.core.hyper_comm_grid import HyperCommGrid

    grids, embedding_groups = {}, []
    for name, m in plan.modules.items():
        grid = HyperCommGrid(
            [m.tp, m.cp, m.pp, m.dp, 1],
            list(GRID_DIMS),
            rank_offset=m.first_rank,
            backend=plan.backend,
        )
        # With cp = 1 the tp-cp and dp-cp groups have the tp and dp groups' members.
        combined = [["tp", "cp"], ["dp", "cp"]] if m.cp > 1 else []
        for dims in ["tp", "cp", "pp", "dp", "ep", ["tp", "pp"], *combined]:
            grid.create_pg(dims)
        grids[name] = grid
    for name, m in plan.modules.items():
        if m.pp == 1:
            continue
        # megatron's default embedding ranks: first and last stage of each pipeline.
        for pipeline in grids[name].get_rank_enum("pp"):
            ranks = sorted({pipeline[0], pipeline[-1]})
            embedding_groups.append((name, ranks, dist.new_group(ranks, backend=plan.backend)))
    return grids, embedding_groups


def _pg_collection(name: str, grid: Any, embedding_groups: list) -> Any:
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgc = ProcessGroupCollection()
    pgc.tp = grid.get_pg("tp")
    pgc.cp = grid.get_pg("cp")
    pgc.pp = grid.get_pg("pp")
    pgc.dp = grid.get_pg("dp")
    pgc.ep = grid.get_pg("ep")
    combined = grid.shape[grid.dim_names.index("cp")] > 1
    pgc.tp_cp = grid.get_pg(["tp", "cp"]) if combined else pgc.tp
    pgc.dp_cp = grid.get_pg(["dp", "cp"]) if combined else pgc.dp
    pgc.mp = grid.get_pg(["tp", "pp"])
    pgc.expt_dp = pgc.dp  # ep = 1 and expert TP = TP: the expert DP group is the DP group
    pgc.expt_tp = pgc.tp
    pgc.embd = None
    pgc.pos_embd = None  # megatron's position-embedding group is the first stage alone
    rank = dist.get_rank()
    for owner, ranks, group in embedding_groups:
        if owner == name and rank in ranks:
            pgc.embd = group
    return pgc


def _module_config(impl: ModuleImpl, plan: MultiModulePlan, name: str, config: Any) -> Any:
    if impl.config is None:
        return None
    m = plan.modules[name]
    return dataclasses.replace(
        impl.config,
        tensor_model_parallel_size=m.tp,
        pipeline_model_parallel_size=m.pp,
        context_parallel_size=m.cp,
        pipeline_dtype=config.pipeline_dtype,
        calculate_per_token_loss=bool(getattr(config, "calculate_per_token_loss", False)),
    )


def build(
    plan: MultiModulePlan,
    impls: dict[str, ModuleImpl],
    config: Any,
    ddp_config: Any = None,
    seed: int = 1234,
) -> MultiModulePipeline:
    """Build the pipeline described by ``plan`` (see the module docstring for the steps).

    ``config`` is the schedule's config (a TransformerConfig or
    :class:`~megatron_ext.multimodule.MultiModulePipelineConfig`); its ``no_sync_func`` and
    ``finalize_model_grads_func`` are set here. ``ddp_config`` is megatron-core's
    ``DistributedDataParallelConfig`` used for every module (default: synchronous
    reduction, no distributed optimizer). Must be called on every rank.
    """
    problems = plan.problems(config)
    if set(impls) != set(plan.modules):
        problems.append(
            Problem(
                "", f"impls name {sorted(impls)} but the plan's modules are {sorted(plan.modules)}"
            )
        )
    if not hasattr(config, "calculate_per_token_loss"):
        problems.append(
            Problem(
                "",
                f"the pipeline config ({type(config).__name__}) has no calculate_per_token_loss, "
                "which the schedule reads; use megatron_ext.multimodule.MultiModulePipelineConfig "
                "or a TransformerConfig",
            )
        )
    if not dist.is_initialized():
        problems.append(
            Problem("", "torch.distributed is not initialised; call init_process_group first")
        )
    elif dist.get_world_size() != plan.world_size:
        problems.append(
            Problem(
                "",
                f"the plan is for {plan.world_size} ranks but the world has {dist.get_world_size()}",
            )
        )
    if problems:
        raise MultiModulePlanError(problems)

    grids, embedding_groups = _create_grids(plan)
    owns_memory_buffer = ensure_global_memory_buffer()
    try:
        pipeline = _build_on_groups(plan, impls, config, ddp_config, seed, grids, embedding_groups)
    except MultiModuleBuildError:
        # Raised on every rank at the same point, so releasing the groups stays collective.
        for grid in grids.values():
            grid.destroy()
        for _, _, group in embedding_groups:
            if _is_member(group):
                dist.destroy_process_group(group)
        if owns_memory_buffer:
            from megatron.core import parallel_state

            parallel_state.destroy_global_memory_buffer()
        raise
    pipeline._owns_memory_buffer = owns_memory_buffer
    return pipeline


def _build_on_groups(plan, impls, config, ddp_config, seed, grids, embedding_groups):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.process_groups_config import MultiModuleProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    rank = dist.get_rank()
    local_names = [n for n in plan.topological_order if rank in plan.modules[n].ranks]
    module_pgcs = {n: _pg_collection(n, grids[n], embedding_groups) for n in local_names}

    stages, modules, forwards, finalize_pgcs = {}, {}, {}, {}
    problem, ndims, shown_widths = None, {}, {}
    try:
        for name in local_names:
            m = plan.modules[name]
            coords = m.coordinates(rank)
            impl = impls[name]
            stage = StageContext(
                name=name,
                config=_module_config(impl, plan, name, config),
                pg_collection=module_pgcs[name],
                pp_rank=coords["pp"],
                pp_size=m.pp,
                tp_rank=coords["tp"],
                dp_rank=coords["dp"],
                dp_size=m.dp,
                predecessors=plan.predecessors(name),
                successors=plan.successors(name),
                is_language_model=name == plan.language_model,
            )
            torch.manual_seed(seed)
            model_parallel_cuda_manual_seed(seed, tp_rank=coords["tp"], ep_rank=0, etp_rank=0)
            module = impl.factory(stage)
            module_config = getattr(module, "config", None) or stage.config
            if module_config is None or not hasattr(module_config, "calculate_per_token_loss"):
                raise TypeError(
                    f"module {name!r} has no TransformerConfig: give ModuleImpl(config=...) "
                    "or a module with a .config (megatron's DDP needs one)"
                )
            if module_config.calculate_per_token_loss != bool(
                getattr(config, "calculate_per_token_loss", False)
            ):
                raise ConfigError(
                    f"module {name!r} has calculate_per_token_loss="
                    f"{module_config.calculate_per_token_loss}, the pipeline config "
                    f"{config.calculate_per_token_loss}; they decide together whether DDP "
                    "averages or sums, so they must agree"
                )
            ddp = DistributedDataParallel(
                module_config,
                dataclasses.replace(ddp_config)
                if ddp_config is not None
                else DistributedDataParallelConfig(),
                module,
                pg_collection=module_pgcs[name],
            )
            modules[name] = ddp
            stages[name] = stage
            forwards[name] = impl.forward or default_forward
            finalize_pgc = module_pgcs[name]
            if finalize_pgc.embd is not None and not hasattr(
                core_module(module), "shared_embedding_or_output_weight"
            ):
                # Only language modules tie embeddings across their pipeline.
                finalize_pgc = copy.copy(finalize_pgc)
                finalize_pgc.embd = None
            finalize_pgcs[name] = finalize_pgc
            if stage.post_process and stage.successors:
                ndims[name] = getattr(core_module(module), "output_ndim", None)
            if stage.pre_process and stage.predecessors and not impl.input_width:
                shown_widths[name] = input_width_of(core_module(module))
    except Exception as error:  # agreed on below, so every rank raises it
        problem = "".join(traceback.format_exception_only(type(error), error)).strip()
        problem += "\n" + "".join(traceback.format_tb(error.__traceback__)[-3:])
    _agree(problem, "building the module stages")

    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (ndims, shown_widths))
    gathered = [rank_ndims for rank_ndims, _ in everyone]
    output_ndim, ndim_problems = {}, []
    for name, m in plan.modules.items():
        inferred = {rank_ndims.get(name) for rank_ndims in gathered} - {None}
        declared = m.output_ndim
        if len(inferred) > 1:
            ndim_problems.append(
                Problem(
                    f"module {name!r}",
                    f"its last-stage ranks report different output_ndim {sorted(inferred)}",
                )
            )
        elif declared is not None and inferred and inferred != {declared}:
            ndim_problems.append(
                Problem(
                    f"module {name!r}",
                    f"the plan says output_ndim={declared}, the built module says "
                    f"{sorted(inferred)}; fix one of them",
                )
            )
        output_ndim[name] = declared or (min(inferred) if inferred else 3)
    _agree("; ".join(map(str, ndim_problems)) if ndim_problems else None, "checking output ndims")

    input_width, width_problems = resolve_input_widths(plan, impls, [w for _, w in everyone])
    _agree("; ".join(map(str, width_problems)) if width_problems else None, "checking input widths")

    pg_cache: dict = {}
    communicator = MultiModuleCommunicator(
        plan, grids, config, output_ndim, pg_cache, input_width=input_width
    )
    lm = plan.language_model
    mm_pgc = MultiModuleProcessGroupCollection(
        module_pgs=dict(module_pgcs), language_model_module_name=lm if lm in module_pgcs else None
    )
    reports_loss = lm in stages and stages[lm].post_process and stages[lm].tp_rank == 0
    model = MultiModuleModel(plan, modules, stages, forwards, config, finalize_pgcs, reports_loss)
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_multimodule_grads
    return MultiModulePipeline(
        plan=plan,
        config=config,
        grids=grids,
        module_pg_collections=module_pgcs,
        pg_collection=mm_pgc,
        communicator=communicator,
        model=model,
        _groups=[group for _, _, group in embedding_groups],
        _pg_cache=pg_cache,
    )
