"""Property-based fuzzing of recipe documents and KEY=VALUE overrides: the only outcomes of
loading and validating are success or megatron-ext's own RecipeError / problems, one line
each; never a traceback. CI runs a few dozen examples; a soak run raises the count:

    MEGATRON_EXT_FUZZ_EXAMPLES=5000 python -m pytest tests/unit_tests/recipes/test_fuzz_recipes.py
"""

from __future__ import annotations

import os

import pytest
import yaml

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from megatron_ext.recipes import RecipeError, load  # noqa: E402
from megatron_ext.recipes.schema import documented_fields  # noqa: E402
from megatron_ext.recipes.validate import validate  # noqa: E402

from recipe_texts import MINIMAL  # noqa: E402

EXAMPLES = int(os.environ.get("MEGATRON_EXT_FUZZ_EXAMPLES", "40"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not os.environ.get("MEGATRON_EXT_FUZZ_EXAMPLES"),
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

LEAVES = [path for path, *_ in documented_fields()]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["", " ", "abc", "1e-3", "-1", "0", "{foo}", "\x00", "é", "[1, 2", "a: b"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)
keys = st.one_of(
    st.sampled_from(LEAVES),
    st.sampled_from(["model", "training", "platforms", "nope", "model.nope"]),
    st.text(max_size=10),
)


def _outcome(path, overrides=()):
    try:
        loaded = load(path, overrides=list(overrides))
    except RecipeError as error:
        assert error.problems and all("\n" not in str(p) for p in error.problems), error.problems
        return
    result = validate(loaded, megatron_checks=False)
    assert all("\n" not in str(p) for p in result.problems), result.problems


@FUZZ
@given(st.lists(st.tuples(keys, values), min_size=1, max_size=4))
def test_overrides(tmp_path_factory, pairs):
    path = tmp_path_factory.mktemp("fuzz") / "r.yaml"
    path.write_text(MINIMAL)
    overrides = [
        f"{k}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}"
        for k, v in pairs
    ]
    _outcome(path, overrides)


@FUZZ
@given(st.lists(st.tuples(keys, values), min_size=1, max_size=4), st.booleans())
def test_documents(tmp_path_factory, pairs, break_syntax):
    base = yaml.safe_load(MINIMAL)
    for key, value in pairs:
        node = base
        *parents, leaf = key.split(".") or [key]
        for part in parents:
            child = node.get(part) if isinstance(node, dict) else None
            if not isinstance(child, dict):
                child = {}
                node[part] = child
            node = child
        node[leaf] = value
    text = yaml.safe_dump(base)
    if break_syntax:
        text = text.replace(":", "", 1)
    path = tmp_path_factory.mktemp("fuzz") / "r.yaml"
    path.write_text(text)
    _outcome(path)
