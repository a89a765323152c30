"""validate refuses what no real run has, in one bounded line, before anything is built:
sizes and learning rates past any model's, non-finite flag values, Slurm times the launcher
cannot watch, 100 KB values, megabyte recipes (issue 25 items 10, 12, 17)."""

from __future__ import annotations

import time

import pytest

from megatron_ext.launch import slurm
from megatron_ext.recipes import RecipeError, load
from megatron_ext.recipes.prepare import prepare
from megatron_ext.recipes.validate import validate
from megatron_ext.runs.submit import SlurmOptions, build_job

from recipe_texts import MINIMAL


def _problems(path, overrides):
    """Refused at load (the schema) or by validation: the same one-line problems."""
    try:
        loaded = load(path, overrides=overrides)
    except RecipeError as exc:
        return [str(p) for p in exc.problems]
    return [str(p) for p in validate(loaded, megatron_checks=False).problems]


@pytest.mark.parametrize(
    "override, where",
    [
        ("model.hidden_size=1000000000000000000", "model.hidden_size"),
        ("data.tokenizer.vocab_size=1000000000000000000", "data.tokenizer.vocab_size"),
        ("training.lr=1e18", "training.lr"),
        ("training.lr=.nan", "training.lr"),
        ("extra_args.--attention-softmax-in-fp32=.nan", "extra_args.--attention-softmax-in-fp32"),
        ("extra_args.--clip-grad=.inf", "extra_args.--clip-grad"),
        ("launch.slurm.time=ab:cd", "launch.slurm.time"),
        ("launch.slurm.time=UNLIMITED", "launch.slurm.time"),
    ],
)
def test_values_no_real_run_has_are_refused(write_recipe, override, where):
    problems = _problems(write_recipe(MINIMAL), [override])
    assert any(p.startswith(where + ":") for p in problems), problems


@pytest.mark.parametrize("text", ["UNLIMITED", "ab:cd", "1:2:3:4", "-5", "0", "999-0"])
def test_submit_refuses_a_time_it_cannot_watch_before_sbatch(write_recipe, tmp_path, text):
    job, problems = build_job(
        prepare(load(write_recipe(MINIMAL)), megatron_checks=False, check_pickles=False),
        tmp_path / "run",
        SlurmOptions(partition="p", time=text),
    )
    assert job is None and problems and problems[0].startswith("--time: "), problems
    for good in ("30", "00:30:00", "1-12", "2-00:00:00"):
        assert slurm.time_problem(good) is None, good


def test_a_huge_value_is_not_echoed_in_full(write_recipe):
    problems = _problems(write_recipe(MINIMAL), ["model.type=" + "x" * 100_000])
    assert problems and max(len(p) for p in problems) <= 400, [len(p) for p in problems]


def test_a_megabyte_recipe_is_refused_without_parsing_it(write_recipe):
    path = write_recipe(MINIMAL + "# " + "x" * (30 << 20) + "\n")
    start = time.monotonic()
    with pytest.raises(RecipeError, match="more than a recipe's limit"):
        load(path)
    assert time.monotonic() - start < 10
