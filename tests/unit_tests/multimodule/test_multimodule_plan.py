"""Multi-module plans: every validation error before any process group exists, the per-rank
warm-up that makes encoders of different depths work, fan-in/fan-out batch sizes, and the
abort markers that carry a first-micro-batch error downstream (single process)."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.multimodule import (
    ModulePlan as M,
    MultiModulePipelineConfig,
    MultiModulePlan as P,
    MultiModulePlanError,
    pipeline_config_problems,
)
from megatron_ext.multimodule.communicator import abort_marker, aborted_with
from megatron_ext.multimodule.errors import AmbiguousShapeError, OutputNdimError


def plan(modules, topology, lm="llm", world=None):
    world = world or max(m.ranks.stop for m in modules.values())
    return P(modules, topology, lm, world_size=world)


def problems_of(p, config=None) -> str:
    with pytest.raises(MultiModulePlanError) as error:
        p.validate(config)
    return str(error.value)


ENC_LLM = dict(topology={"enc": ["llm"]})


def test_a_valid_plan_passes():
    p = plan({"enc": M(dp=2), "llm": M(pp=2, first_rank=2)}, **ENC_LLM)
    assert p.validate(MultiModulePipelineConfig(pipeline_dtype=torch.float32)) is p


def test_context_parallel_across_a_bridge_is_rejected():
    text = problems_of(plan({"enc": M(cp=2), "llm": M(first_rank=2)}, **ENC_LLM))
    assert "bridge enc -> llm: context parallelism" in text and "enc cp=2" in text


def test_dp_sizes_that_neither_divide_are_rejected():
    text = problems_of(plan({"enc": M(dp=2), "llm": M(dp=3, first_rank=2)}, **ENC_LLM))
    assert "dp sizes 2 and 3 neither divide" in text


def test_a_sink_that_is_not_the_language_model_is_rejected():
    p = plan({"enc": M(), "aux": M(first_rank=1), "llm": M(first_rank=2)}, {"enc": ["llm"]})
    text = problems_of(p)
    assert "module 'aux' feeds no other module, but only the language model ('llm')" in text


def test_the_language_model_must_be_last():
    p = plan(
        {"enc": M(), "llm": M(first_rank=1), "gen": M(first_rank=2)},
        {"enc": ["llm"], "llm": ["gen"]},
    )
    text = problems_of(p)
    assert "the language model 'llm' feeds ['gen']" in text


def test_overlapping_rank_ranges_of_pipelined_modules_are_rejected():
    text = problems_of(plan({"enc": M(dp=2), "llm": M(pp=2)}, **ENC_LLM))
    assert "modules 'enc' and 'llm' overlap on ranks 0..1, but 'enc' feeds 'llm'" in text


def test_colocated_independent_modules_at_one_depth_are_allowed():
    # Two encoders on the same rank, both one stage before the language model.
    p = plan({"a": M(), "b": M(), "llm": M(first_rank=1)}, {"a": ["llm"], "b": ["llm"]})
    p.validate()
    assert p.warmup_on(0) == 1


def test_colocated_modules_at_different_depths_are_rejected():
    p = plan({"a": M(pp=2), "b": M(), "llm": M(first_rank=2)}, {"a": ["llm"], "b": ["llm"]})
    text = problems_of(p)
    assert "modules 'a' and 'b' share rank 0, where 'a' runs 2 warm-up" in text


def test_missing_variable_seq_lengths_is_rejected():
    from megatron.core.model_parallel_config import ModelParallelConfig

    config = ModelParallelConfig(pipeline_dtype=torch.float32)  # variable_seq_lengths=False
    text = problems_of(plan({"enc": M(), "llm": M(first_rank=1)}, **ENC_LLM), config)
    assert "config.variable_seq_lengths is False" in text
    assert pipeline_config_problems(MultiModulePipelineConfig(pipeline_dtype=torch.float32)) == []


def test_pipeline_config_problems_name_every_setting():
    config = MultiModulePipelineConfig(
        pipeline_dtype=None, variable_seq_lengths=False, virtual_pipeline_model_parallel_size=None
    )
    found = pipeline_config_problems(config)
    assert len(found) == 2 and "pipeline_dtype is None" in str(found[1])


def test_successors_at_different_depths_are_rejected_with_the_reason():
    p = plan(
        {"enc": M(), "proj": M(first_rank=1), "llm": M(first_rank=2)},
        {"enc": ["llm", "proj"], "proj": ["llm"]},
    )
    text = problems_of(p)
    assert "module 'enc' feeds modules that lead to the language model through different" in text
    assert "llm (1 stage(s)), proj (2 stage(s))" in text and "one rank has one" in text


def test_a_cycle_is_rejected():
    p = plan(
        {"a": M(), "b": M(first_rank=1), "llm": M(first_rank=2)}, {"a": ["b"], "b": ["a", "llm"]}
    )
    assert "the topology has a cycle" in problems_of(p)


def test_unknown_modules_in_the_topology_are_rejected():
    text = problems_of(plan({"enc": M(), "llm": M(first_rank=1)}, {"enc": ["lm"]}))
    assert "topology edge enc -> lm: 'lm' is not a module" in text


def test_ranks_outside_the_world_and_idle_ranks_are_rejected():
    text = problems_of(plan({"enc": M(dp=2), "llm": M(pp=2, first_rank=2)}, **ENC_LLM, world=3))
    assert "module 'llm' needs ranks 2..3" in text and "the world has 3 ranks" in text
    text = problems_of(plan({"enc": M(), "llm": M(first_rank=1)}, **ENC_LLM, world=3))
    assert "ranks [2] belong to no module" in text


def test_every_problem_is_reported_at_once():
    from megatron.core.model_parallel_config import ModelParallelConfig

    p = plan({"enc": M(dp=2, cp=2), "llm": M(dp=3, first_rank=4)}, **ENC_LLM)
    with pytest.raises(MultiModulePlanError) as error:
        p.validate(ModelParallelConfig(pipeline_dtype=torch.float32))
    assert len(error.value.problems) == 3  # cp across the bridge, dp 2 vs 3, variable_seq_lengths


def test_build_rejects_a_bad_plan_before_any_process_group():
    import torch.distributed as dist

    from megatron_ext.multimodule import ModuleImpl, build

    groups_before = len(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else 0
    p = plan({"enc": M(cp=2), "llm": M(first_rank=2)}, **ENC_LLM)
    impls = {"enc": ModuleImpl(factory=None), "llm": ModuleImpl(factory=None)}
    with pytest.raises(MultiModulePlanError, match="context parallelism"):
        build(p, impls, MultiModulePipelineConfig(pipeline_dtype=torch.float32))
    groups_after = len(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else 0
    assert groups_after == groups_before


def test_per_rank_warmup_is_the_number_of_stages_downstream(monkeypatch):
    """Encoders of different pipeline depths feeding one language model: megatron-core counts
    every rank's warm-up from the global longest path, which gives the one-stage encoder two
    warm-up micro-batches where its language-model peer pairs its second activation with the
    first gradient (the measured deadlock); the plan gives it one."""
    from megatron.core.hyper_comm_grid import HyperCommGrid
    from megatron.core.pipeline_parallel.multimodule_communicator import (
        MultiModulePipelineCommunicator as Upstream,
    )

    p = plan(
        {"a": M(), "b": M(pp=2, first_rank=1), "llm": M(first_rank=3)}, {"a": ["llm"], "b": ["llm"]}
    )
    p.validate()
    assert p.total_stages == 3
    assert [p.warmup_on(r) for r in range(4)] == [1, 2, 1, 0]

    monkeypatch.setenv("WORLD_SIZE", "4")
    grids = {
        n: HyperCommGrid([1, 1, m.pp, 1], ["tp", "cp", "pp", "dp"], rank_offset=m.first_rank)
        for n, m in p.modules.items()
    }
    topology = {n: p.successors(n) for n in p.modules}
    total = Upstream.compute_total_pipeline_stages(topology, grids)

    def upstream_warmup(rank):
        name = p.modules_on(rank)[0]
        stage = (
            Upstream.compute_total_pipeline_stages(topology, grids, rank=rank, module_name=name) - 1
        )
        return total - stage - 1

    assert [upstream_warmup(r) for r in range(4)] == [2, 2, 1, 0]


def test_micro_batch_sizes_under_fan_in_and_fan_out():
    p = plan({"enc": M(dp=4), "llm": M(dp=2, first_rank=4)}, **ENC_LLM)
    assert p.micro_batch_size("enc", 2) == 1 and p.micro_batch_size("llm", 2) == 2
    assert list(p.sample_range("enc", 3, 2)) == [3]
    p = plan({"enc": M(), "llm": M(dp=2, first_rank=1)}, **ENC_LLM)
    assert p.micro_batch_size("enc", 2) == 4
    with pytest.raises(ValueError, match="does not split over its dp=4"):
        plan({"enc": M(dp=4), "llm": M(first_rank=4)}, **ENC_LLM).micro_batch_size("enc", 2)


@pytest.mark.parametrize("ndim", [2, 3])
@pytest.mark.parametrize("error", [OutputNdimError, AmbiguousShapeError])
def test_abort_markers_survive_fan_in_and_fan_out(ndim, error):
    marker = abort_marker(error, ndim, batch_dim=1, dtype=torch.float32)
    assert marker.numel() == 0 and aborted_with(marker) is error
    batch_dim = 1 if ndim == 3 else 0
    gathered = torch.cat([marker, marker.clone()], dim=batch_dim)
    assert aborted_with(gathered) is error
    assert all(aborted_with(t) is error for t in torch.tensor_split(gathered, 2, dim=batch_dim))
    assert aborted_with([marker]) is error


def test_ordinary_empty_tensors_are_not_abort_markers():
    assert aborted_with(torch.empty(0, 32)) is None
    assert aborted_with(torch.empty(4, 0, 32)) is None
    assert aborted_with(torch.zeros(3, 2, 1)) is None


def test_a_receiver_without_a_declared_width_is_checked_at_the_width_it_shows():
    """A custom projector or encoder built without ModuleImpl.input_width is still held to
    a width at its bridges: the one its built module shows, or the build fails naming it."""
    from megatron_ext.multimodule import ModuleImpl
    from megatron_ext.multimodule.builder import input_width_of, resolve_input_widths

    class Declares(torch.nn.Module):
        input_width = 48

    projector = torch.nn.Sequential(
        torch.nn.LayerNorm(24), torch.nn.Linear(24, 16), torch.nn.Linear(16, 8)
    )
    assert input_width_of(Declares()) == 48
    assert input_width_of(projector) == 24
    assert input_width_of(torch.nn.Sequential(torch.nn.GELU())) is None

    p = plan({"enc": M(), "proj": M(), "llm": M(first_rank=1)}, {"enc": ["proj"], "proj": ["llm"]})
    impls = {
        "enc": ModuleImpl(factory=None),
        "proj": ModuleImpl(factory=None),
        "llm": ModuleImpl(factory=None, input_width=32),
    }
    # one {module: width shown} per rank; only the receivers' first-stage ranks report
    assert resolve_input_widths(p, impls, [{"proj": 24}, {}]) == ({"proj": 24, "llm": 32}, [])
    _, (problem,) = resolve_input_widths(p, impls, [{"proj": None}, {}])
    assert str(problem).startswith("module 'proj' receives from ['enc'] but shows no input width")
    assert "give ModuleImpl(input_width=...) for 'proj'" in str(problem)
    _, (problem,) = resolve_input_widths(p, impls, [{"proj": 24}, {"proj": 16}])
    assert "first-stage ranks show different input widths [16, 24]" in str(problem)
