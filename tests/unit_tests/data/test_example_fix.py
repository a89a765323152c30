"""The shipped real-data recipes before `prepare-data --example` has run: every missing-file
problem names the one command that makes the files (issue 33, item 11)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from megatron_ext.recipes import load
from megatron_ext.recipes.checks import plan_problems

REPO_ROOT = Path(__file__).resolve().parents[3]
COMMAND = "run `megatron-ext prepare-data --example example_data`"


@pytest.mark.parametrize("name", ["gpt_mhc_pp2_real_data", "hybrid_mhc_tp2_pp2_real_data"])
def test_missing_example_data_names_the_command(tmp_path, monkeypatch, name):
    (tmp_path / "recipes").mkdir()
    shutil.copy(REPO_ROOT / "recipes" / f"{name}.yaml", tmp_path / "recipes")
    monkeypatch.delenv("MEGATRON_EXT_EXAMPLE_DATA", raising=False)
    monkeypatch.chdir(tmp_path)  # the command is given relative to where validate runs
    problems = [str(p) for p in plan_problems(load(Path("recipes") / f"{name}.yaml"))]
    missing = [p for p in problems if "not found" in p or "does not exist" in p]
    assert len(missing) == 3, problems  # the tokenizer and the blend's two prefixes
    assert all(COMMAND in p for p in missing), missing


def test_other_missing_paths_keep_the_general_advice(tmp_path):
    from megatron_ext.data.checks import example_fix

    assert example_fix(str(tmp_path / "corpus" / "mine_text_document")) is None
    assert example_fix(str(tmp_path / "ex" / "tokenizers" / "huggingface")).endswith(
        f"--example {tmp_path / 'ex'}` (or set MEGATRON_EXT_EXAMPLE_DATA to where it is)"
    )
