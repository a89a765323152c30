"""The error family (megatron_ext/errors.py): every bad input a user can meet is raised as a
named MegatronExtError kind that still is the built-in it used to be.

The source scan fails when a new bare ``raise ValueError`` appears in megatron_ext outside
:data:`BARE_VALUE_ERRORS`, and when an entry of that list no longer raises one (the list stays
the truth). A new user-facing refusal raises a kind: one of errors.py's (ConfigError, SpecError,
DataError, EnvVariableError), or its package's own (RecipeError, ScheduleTextError, ...).
"""

from __future__ import annotations

import ast
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

import megatron_ext
from megatron_ext.errors import (
    ConfigError,
    DataError,
    EnvVariableError,
    MegatronExtError,
    SpecError,
)

PACKAGE = Path(megatron_ext.__file__).parent

# (file under megatron_ext/, enclosing function) -> why a bare ValueError is right there.
BARE_VALUE_ERRORS = {
    ("recipe_flags.py", "layer_list.value"): "control flow: layer_list catches it and returns None",
    ("upstream_cases/model_config.py", "_integer"): (
        "control flow: caught two lines below and turned into a Problem naming the flag"
    ),
    ("data/checks.py", "sentencepiece_problem"): (
        "control flow: caught by the same function and reported as a problem line"
    ),
    ("cli/compare.py", "_tolerance"): (
        "argparse's type= contract: argparse turns a ValueError into its one-line usage error"
    ),
    ("files.py", "open_regular"): "programming error: a caller asked a read-only opener to write",
    ("launch/training.py", "_with_parser_defaults.provide"): (
        "programming error: an entry's own table of parser defaults names a flag it lacks"
    ),
    ("mhc/birkhoff.py", "birkhoff_mix"): (
        "internal assert: the layer sizes the logits n! from the same config; no user input"
    ),
}


def _is_value_error(node: ast.expr | None) -> bool:
    target = node.func if isinstance(node, ast.Call) else node
    return isinstance(target, ast.Name) and target.id == "ValueError"


def _bare_value_errors(source: str) -> list[tuple[str, int]]:
    """(enclosing function's dotted name, line) of every ``raise ValueError`` in ``source``."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, scope: tuple[str, ...]) -> None:
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = (*scope, child.name)
            if isinstance(child, ast.Raise) and _is_value_error(child.exc):
                found.append((".".join(scope) or "<module>", child.lineno))
            visit(child, inner)

    visit(ast.parse(source), ())
    return found


def _scan() -> dict[tuple[str, str], list[int]]:
    raised: dict[tuple[str, str], list[int]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        for function, line in _bare_value_errors(path.read_text(encoding="utf-8")):
            raised.setdefault((relative, function), []).append(line)
    return raised


def test_the_scan_sees_each_spelling_of_a_bare_value_error():
    source = (
        "def f():\n    raise ValueError('x')\n"
        "class C:\n    def g(self):\n        raise ValueError\n"
        "def h():\n    raise ConfigError('x')\n"
    )
    assert _bare_value_errors(source) == [("f", 2), ("C.g", 5)]


def test_no_bare_value_error_reaches_a_user():
    raised = _scan()
    new = {
        f"megatron_ext/{path}:{lines[0]} ({function})"
        for (path, function), lines in raised.items()
        if (path, function) not in BARE_VALUE_ERRORS
    }
    assert not new, (
        f"bare `raise ValueError` in {sorted(new)}: raise a named MegatronExtError kind that "
        "also subclasses ValueError (megatron_ext/errors.py), or, for an error no user can "
        "meet, add it to BARE_VALUE_ERRORS with the reason"
    )
    stale = sorted(set(BARE_VALUE_ERRORS) - set(raised))
    assert not stale, f"BARE_VALUE_ERRORS lists places that raise no ValueError now: {stale}"


@pytest.mark.parametrize("kind", [ConfigError, SpecError, DataError, EnvVariableError])
def test_every_kind_is_still_a_value_error(kind):
    assert issubclass(kind, MegatronExtError) and issubclass(kind, ValueError)
    with pytest.raises(ValueError, match="the field"):  # old `except ValueError` still holds
        raise kind("the field: the fix")


# ---- representative user paths -----------------------------------------------------------
def test_a_config_value_out_of_range_is_a_config_error():
    from megatron_ext.guards import check_mhc_values

    config = SimpleNamespace(
        mhc_num_residual_streams=4, mhc_sinkhorn_iterations=0, mhc_init_gating_factor=0.01
    )
    with pytest.raises(ConfigError, match=r"^mhc_sinkhorn_iterations must be >= 1"):
        check_mhc_values(config)


def test_mhc_config_refusal_is_a_config_error_megatron_still_sees_as_value_error():
    from megatron_ext.config import MHCTransformerConfig

    with warnings.catch_warnings():  # the "no mHC recompute" advice is not what is tested
        warnings.simplefilter("ignore")
        config_error = pytest.raises(ConfigError, match="mhc_num_residual_streams")
        with config_error as caught:
            MHCTransformerConfig(
                num_layers=2,
                hidden_size=16,
                num_attention_heads=2,
                enable_mhc_connections=True,
                mhc_num_residual_streams=0,
            )
    assert isinstance(caught.value, ValueError) and "\n" not in str(caught.value)


def test_a_split_string_megatron_cannot_read_is_a_data_error():
    from megatron_ext.data.splits import split_shares

    with pytest.raises(DataError, match="98,1,1"):
        split_shares("0,0")


def test_a_bad_environment_variable_is_an_env_variable_error(monkeypatch):
    from megatron_ext.launch import faults, stop_signals

    # fault_from_env reads the variable once per process (an earlier test may have read it):
    # read afresh here
    monkeypatch.setenv(faults.FAULT_ENV, "rank=x,step=2")
    monkeypatch.setattr(faults, "_fault_read", False)
    with pytest.raises(EnvVariableError, match=faults.FAULT_ENV):
        faults.fault_from_env()
    with pytest.raises(EnvVariableError, match="unknown signal 'NOPE'"):
        stop_signals.parse_signals("TERM,NOPE")


def test_parallel_sizes_that_do_not_fit_are_a_parallel_plan_error():
    from megatron_ext.parallel_plan import ParallelPlan, ParallelPlanError

    with pytest.raises(ParallelPlanError, match="world_size"):
        ParallelPlan(tp=3, world=4).check()


def test_an_unknown_layout_symbol_is_a_recipe_field_error():
    from megatron_ext.recipes.schema import RecipeFieldError, layout_stages

    with pytest.raises(RecipeFieldError, match="unknown symbol"):
        layout_stages("E|tX|L")


def test_an_unknown_shipped_recipe_is_a_shipped_recipe_error(tmp_path):
    from megatron_ext.recipes.shipped import ShippedRecipeError, copy_out

    with pytest.raises(ShippedRecipeError, match="no shipped recipe 'no-such-recipe'"):
        copy_out("no-such-recipe", tmp_path)


def test_golden_values_out_of_megatron_layout_are_a_metrics_format_error():
    from megatron_ext.runs.metrics import MetricsFormatError, from_golden

    with pytest.raises(MetricsFormatError, match="metric 'lm loss'"):
        from_golden({"lm loss": [3.0, 2.9]})


def test_a_patch_declared_twice_is_a_declaration_error():
    from megatron_ext import registry

    declared = registry.patches(every=True)[0]
    with pytest.raises(registry.DeclarationError, match="registered twice"):
        registry.register(declared)
