"""``--pipeline-schedule``: the flag of our entries, its refusals (parsed arguments, a config,
Megatron's own checks as ``megatron-ext validate`` runs them) and the choice inside
megatron.training (the declared get_forward_backward_func patch). CPU only, no process."""

import argparse
import pathlib
import types

import pytest

from megatron_ext import guards, registry
from megatron_ext.launch import training as launch
from megatron_ext.pipeline import selection

CHOOSER = "megatron.training.training:get_forward_backward_func"


def _settings(**overrides):
    """Parsed arguments / config fields (megatron's names) of a plain PP=2 zb-h1 run."""
    fields = dict(
        pipeline_schedule="zb-h1",
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=None,
        overlap_p2p_comm=False,
        overlap_moe_expert_parallel_comm=False,
        cuda_graph_impl="none",
        enable_cuda_graph=False,
        external_cuda_graph=False,
        moe_paged_stash=False,
        fine_grained_activation_offloading=False,
    )
    return types.SimpleNamespace(**{**fields, **overrides})


def test_the_entries_declare_the_flag_with_1f1b_by_default():
    from megatron_ext.training_steps import add_megatron_ext_args

    parser = add_megatron_ext_args(argparse.ArgumentParser())
    assert parser.parse_args([]).pipeline_schedule == "1f1b"
    assert parser.parse_args(["--pipeline-schedule", "zb-h1"]).pipeline_schedule == "zb-h1"
    with pytest.raises(SystemExit):
        parser.parse_args(["--pipeline-schedule", "zb-v"])


def test_a_plain_pipeline_is_accepted():
    assert selection.schedule_problems(_settings()) == []
    launch.refuse_unsupported_schedule(_settings())
    guards.check_schedule_supported(_settings())


def test_1f1b_is_not_checked_here():
    """megatron checks its own schedules; every refusal below is zb-h1's."""
    settings = _settings(pipeline_schedule="1f1b", pipeline_model_parallel_size=1)
    assert selection.schedule_problems(settings) == []
    assert selection.schedule_problems(types.SimpleNamespace()) == [], "no field: 1f1b"


REFUSED = [
    ({"pipeline_model_parallel_size": 1}, "pipeline_model_parallel_size=1"),
    ({"virtual_pipeline_model_parallel_size": 2}, "virtual_pipeline_model_parallel_size=2"),
    ({"overlap_p2p_comm": True}, "overlap_p2p_comm=True"),
    ({"overlap_moe_expert_parallel_comm": True}, "overlap_moe_expert_parallel_comm=True"),
    ({"cuda_graph_impl": "local"}, "cuda_graph_impl='local'"),
    ({"enable_cuda_graph": True}, "CUDA graphs"),
    ({"moe_paged_stash": True}, "moe_paged_stash=True"),
    ({"fine_grained_activation_offloading": True}, "fine_grained_activation_offloading=True"),
]


@pytest.mark.parametrize("overrides, where", REFUSED, ids=[w for _, w in REFUSED])
def test_arguments_zb_h1_does_not_run_with_stop_the_entry_in_one_line(overrides, where):
    with pytest.raises(SystemExit) as stop:
        launch.refuse_unsupported_schedule(_settings(**overrides))
    (line,) = str(stop.value.code).splitlines()
    assert line.startswith(f"error: --pipeline-schedule zb-h1: {where}: "), line
    assert "1f1b" in line, "the fix names the other schedule"


@pytest.mark.parametrize("overrides, where", REFUSED, ids=[w for _, w in REFUSED])
def test_a_config_zb_h1_does_not_run_with_is_refused(overrides, where):
    with pytest.raises(guards.UnsupportedCombinationError, match=f"^{where}: "):
        guards.check_schedule_supported(_settings(**overrides))


def test_every_refusal_is_its_own_line():
    settings = _settings(pipeline_model_parallel_size=1, cuda_graph_impl="local")
    with pytest.raises(SystemExit) as stop:
        launch.refuse_unsupported_schedule(settings)
    assert len(str(stop.value.code).splitlines()) == 2


def test_a_config_class_without_the_field_is_refused_before_the_model_is_built():
    """A config that cannot carry pipeline_schedule would build layers that never defer."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.training_steps import _check_config_schedule

    config = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2)
    with pytest.raises(SystemExit, match=r"--pipeline-schedule zb-h1: .*MHCTransformerConfig"):
        _check_config_schedule(argparse.Namespace(pipeline_schedule="zb-h1"), config)
    _check_config_schedule(argparse.Namespace(pipeline_schedule="1f1b"), config)


def test_a_schedule_file_needs_zb_h1_in_the_arguments_and_the_config():
    """--pipeline-schedule-file hands ZB-H1 an order; megatron's 1F1B would ignore it."""
    from megatron_ext.config import MHCTransformerConfig
    from megatron_ext.training_steps import add_megatron_ext_args

    parser = add_megatron_ext_args(argparse.ArgumentParser())
    assert parser.parse_args([]).pipeline_schedule_file is None
    args = parser.parse_args(["--pipeline-schedule-file", "order.txt"])
    (problem,) = selection.schedule_problems(args)
    assert str(problem).startswith("--pipeline-schedule-file: only ZB-H1 executes an order")
    with pytest.raises(SystemExit, match="only ZB-H1"):
        launch.refuse_unsupported_schedule(args)
    assert selection.schedule_problems(_settings(pipeline_schedule_file="order.txt")) == []
    with pytest.raises(guards.PipelineScheduleError, match="pipeline_schedule_file is set"):
        MHCTransformerConfig(
            num_layers=2, hidden_size=8, num_attention_heads=2, pipeline_schedule_file="x.txt"
        )


def test_megatron_ext_validate_refuses_through_megatrons_own_checks():
    """A recipe's command line through the entry's parser and validate_args, as `validate`
    runs it (layer 3, past the recipe checks): --pipeline-schedule zb-h1 with one stage is one
    problem, and with two stages there is none."""
    from megatron_ext.recipes import load
    from megatron_ext.recipes.validate import megatron_problems

    recipe = pathlib.Path(__file__).resolve().parents[3] / "recipes/gpt_mhc_tp2_pp2_sp.yaml"
    zb_h1 = "parallelism.schedule=zb-h1"
    one_stage = load(recipe, "cpu", [zb_h1, "parallelism.pp=1"])
    (problem,) = megatron_problems(one_stage, "megatron_ext.pretrain_gpt")
    assert problem.where == "megatron arguments"
    assert problem.what.startswith("--pipeline-schedule zb-h1: pipeline_model_parallel_size=1: ")
    assert megatron_problems(load(recipe, "cpu", [zb_h1]), "megatron_ext.pretrain_gpt") == []


# ---- the choice inside megatron.training ---------------------------------------------------------
@pytest.fixture
def chooser(monkeypatch):
    """megatron.training.training.get_forward_backward_func with the patch applied and the
    run's arguments set by the test."""
    import megatron.training.training as training

    run_args = types.SimpleNamespace(pipeline_schedule="1f1b")
    monkeypatch.setattr(selection, "_run_arguments", lambda: run_args)
    with registry.applied(CHOOSER):
        yield run_args, training.get_forward_backward_func


def test_1f1b_runs_megatrons_exact_functions(chooser):
    from megatron.core.pipeline_parallel import schedules

    _, get = chooser
    assert (
        get(pp_size=2, vp_size=None) is schedules.forward_backward_pipelining_without_interleaving
    )
    assert get(pp_size=2, vp_size=2) is schedules.forward_backward_pipelining_with_interleaving
    assert get(pp_size=1, vp_size=None) is schedules.forward_backward_no_pipelining


def test_zb_h1_replaces_megatrons_1f1b(chooser):
    from megatron_ext.pipeline import zero_bubble

    run_args, get = chooser
    run_args.pipeline_schedule = "zb-h1"
    assert get(pp_size=2, vp_size=None) is zero_bubble.forward_backward_pipelining_zero_bubble_h1


@pytest.mark.parametrize("pp_size, vp_size", [(1, None), (2, 2)])
def test_zb_h1_never_silently_runs_another_schedule(chooser, pp_size, vp_size):
    run_args, get = chooser
    run_args.pipeline_schedule = "zb-h1"
    with pytest.raises(selection.ScheduleChoiceError, match="--pipeline-schedule 1f1b"):
        get(pp_size=pp_size, vp_size=vp_size)


def test_install_applies_the_choice():
    import megatron_ext

    megatron_ext.install()
    assert registry.is_applied(CHOOSER)
