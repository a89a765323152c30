"""Shared helpers of the recipe unit tests."""

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
RECIPES = sorted((REPO_ROOT / "recipes").glob("*.yaml"))


@pytest.fixture
def write_recipe(tmp_path):
    """Write a recipe file from YAML text; returns its path."""

    def write(text: str, name: str = "r.yaml") -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    return write


MINIMAL = """
version: 1
model: {type: gpt, num_layers: 4, hidden_size: 64, num_attention_heads: 4, seq_length: 32}
parallelism: {tp: 2, pp: 2}
training: {iterations: 8, micro_batch_size: 2, global_batch_size: 8}
platforms:
  big:
    model: {num_layers: 12}
    parallelism: {dp: 2}
    launch: {device: gpu}
"""


def shared_build_dir() -> Path:
    """Where a test puts a multi-node job's run directory: the repository's build/ unless the
    clone itself sits in a node-local place (CI may clone into /tmp), which submit refuses for a
    job over several nodes; then a directory under the home directory."""
    from megatron_ext.runs.submit import _shared_run_dir_problems

    build = REPO_ROOT / "build"
    if not _shared_run_dir_problems(build, 2):
        return build
    return Path.home() / ".cache" / "megatron-ext-tests"
