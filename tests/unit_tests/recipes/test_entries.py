"""Recipes are data: `validate` never imports a module that only the recipe names (its code
would run), and accepts modules registered in the `megatron_ext.entries` entry-point group."""

from __future__ import annotations

import sys

import pytest

from megatron_ext.recipes import entries, load
from megatron_ext.recipes.validate import validate

MULTIMODULE = """
version: 1
model: {{type: multimodule, entry: {entry}, modules: {{encoder: {{tp: 1}}, llm: {{pp: 2}}}},
        topology: {{encoder: [llm]}}}}
launch: {{nproc: 3}}
training: {{iterations: 4}}
"""


@pytest.fixture
def hostile_modules(tmp_path, monkeypatch):
    """A module and a package whose import writes a canary, importable from the cwd."""
    canary = tmp_path / "canary"
    (tmp_path / "evilmod.py").write_text(f"open({str(canary)!r}, 'w').write('ran')\n")
    (tmp_path / "evilpkg").mkdir()
    (tmp_path / "evilpkg" / "__init__.py").write_text(f"open({str(canary)!r}, 'w').write('ran')\n")
    (tmp_path / "evilpkg" / "train.py").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield canary
    for name in ("evilmod", "evilpkg", "evilpkg.train"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize("entry", ["evilmod", "evilpkg.train"])
@pytest.mark.parametrize("model_type", ["gpt", "multimodule"])
def test_validate_never_imports_an_entry_named_only_by_the_recipe(
    tmp_path, hostile_modules, entry, model_type
):
    recipe = tmp_path / "r.yaml"
    if model_type == "gpt":
        recipe.write_text(
            "version: 1\nmodel: {type: gpt, num_layers: 2, hidden_size: 16, "
            f"num_attention_heads: 2, entry: {entry}}}\n"
        )
    else:
        recipe.write_text(MULTIMODULE.format(entry=entry))
    problems = [str(p) for p in validate(load(recipe)).problems]
    assert any(
        p.startswith(f"model.entry: '{entry}' is not a known training entry") for p in problems
    ), problems
    assert not hostile_modules.exists(), "the recipe's module ran"


def test_an_entry_registered_through_the_entry_point_group_is_accepted(tmp_path, monkeypatch):
    site = tmp_path / "site"
    info = site / "mytrainer-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mytrainer\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        f"[{entries.ENTRY_POINT_GROUP}]\nvlm = mytrainer.train\n"
    )
    (site / "mytrainer").mkdir()
    (site / "mytrainer" / "__init__.py").write_text("")
    (site / "mytrainer" / "train.py").write_text("")
    monkeypatch.syspath_prepend(str(site))
    assert entries.known_entries()["mytrainer.train"].startswith("entry point 'vlm' of mytrainer")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(MULTIMODULE.format(entry="mytrainer.train"))
    result = validate(load(recipe))
    assert not any(p.where == "model.entry" for p in result.problems), result.problems
    assert set(entries.OUR_ENTRIES) <= set(entries.known_entries())
