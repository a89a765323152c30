"""Shared helpers of the tests that write recipes and upstream test cases (importable from every
folder of tests/unit_tests: pyproject.toml puts this folder on pytest's pythonpath)."""

from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO_ROOT / "recipes").glob("*.yaml"))


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


BASE_ARGS = {
    "--num-layers": 4,
    "--hidden-size": 64,
    "--num-attention-heads": 4,
    "--seq-length": 32,
    "--max-position-embeddings": 32,
    "--micro-batch-size": 2,
    "--global-batch-size": 8,
    "--train-iters": 8,
    "--tensor-model-parallel-size": 2,
    "--pipeline-model-parallel-size": 2,
    "--mock-data": True,
    "--tokenizer-type": "NullTokenizer",
    "--vocab-size": 128,
}


def write_case(
    tmp_path: Path, model_args: dict | None = None, name: str = "gpt3_case", **top
) -> Path:
    """A Megatron-LM test case in upstream's layout (gpt/NAME/model_config.yaml) under
    ``tmp_path``: a small TP2 x PP2 model on mock data, ``model_args`` and ``top`` on top."""
    case = tmp_path / "gpt" / name
    case.mkdir(parents=True, exist_ok=True)
    doc = {
        "ENV_VARS": {"CUDA_DEVICE_MAX_CONNECTIONS": 1},
        "MODEL_ARGS": {**BASE_ARGS, **(model_args or {})},
        "TEST_TYPE": "regular",
        **top,
    }
    path = case / "model_config.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path
