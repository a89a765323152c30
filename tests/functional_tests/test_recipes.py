"""Every shipped recipe trains on CPU through `megatron-ext run` and matches its golden values.

The standalone embedding/loss recipe trains in tests/functional_tests/test_slurm.py instead
(`submit --slurm`, the same golden values and resume check). The plain TP2 x PP2 GPT runs from a
Megatron-LM-format test case instead of its recipe:
tests/functional_tests/test_cases/gpt/gpt3_mcore_tp2_pp2_cpu/model_config.yaml (written at GPU
size in upstream's format; the cpu overlay shrinks it to recipes/gpt_tp2_pp2.yaml's model, as a
unit test checks) against its golden_values_dev_cpu.json. Every run also checks that the
metrics read from TensorBoard (as Megatron-LM's CI reads them) equal Megatron's log lines.

Each recipe runs as a user runs it (`megatron-ext run recipes/NAME.yaml`): validation, the
ranks on gloo with the CPU runtime, the run directory, and the comparison with the recipe's
committed CPU golden values (lm loss within rtol 1e-4 on every step, num-zeros within 5 % + 4;
see megatron_ext/recipes/compare.py). ckpt-resume recipes also train twice and the resumed
half must equal the uninterrupted run exactly. A recipe without golden values fails: the
golden values are what makes a change of numerics visible.

Regenerate golden values after an intended change of numerics (and review the diff):
    megatron-ext run recipes/NAME.yaml --write-golden
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_ext.recipes import metrics as met

REPO_ROOT = Path(__file__).resolve().parents[2]
UPSTREAM_FORMAT_CASE = (
    REPO_ROOT / "tests/functional_tests/test_cases/gpt/gpt3_mcore_tp2_pp2_cpu/model_config.yaml"
)
# Recipes whose CPU run, golden values and resume check happen elsewhere, so CI trains them once:
# gpt_tp2_pp2's model from the upstream-format case below, and
# gpt_mhc_pp2_standalone_embedding_loss through `submit --slurm` on a real one-node Slurm
# (tests/functional_tests/test_slurm.py: the same golden values and ckpt-resume comparison).
TRAINED_ELSEWHERE = {"gpt_tp2_pp2", "gpt_mhc_pp2_standalone_embedding_loss"}
RECIPES = [
    r for r in sorted((REPO_ROOT / "recipes").glob("*.yaml")) if r.stem not in TRAINED_ELSEWHERE
]
RECIPES.append(UPSTREAM_FORMAT_CASE)
TIMEOUT_S = 600


def megatron_ext(*args, timeout=TIMEOUT_S) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        [sys.executable, "-m", "megatron_ext.cli", *map(str, args)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _case_id(path: Path) -> str:
    return path.parent.name if path.name == "model_config.yaml" else path.stem


def assert_tensorboard_equals_log_lines(tensorboard_dir: Path, log_dir: Path) -> None:
    """Megatron's TensorBoard scalars and its printed iteration lines agree step by step; the
    log's second line of a process is the mean of its first two iterations (a Megatron quirk)."""
    tb, logged = met.read_tensorboard(tensorboard_dir), met.parse_run_logs(log_dir)
    steps = sorted(logged["lm loss"])
    assert steps and sorted(tb["lm loss"]) == steps
    for step in steps:
        expected = tb["lm loss"][step]
        if step == steps[1]:
            expected = (tb["lm loss"][steps[0]] + tb["lm loss"][step]) / 2
        assert logged["lm loss"][step] == pytest.approx(expected, rel=2e-6), step
    if "num-zeros" in logged:
        assert logged["num-zeros"] == tb["num-zeros"]


def assert_mhc_stats_recorded(run_dir: Path, metrics: dict, stdout: str) -> None:
    """model.mhc.log_stats: the mhc/... scalars in TensorBoard at every logged step, the gains
    in metrics.json, mhc.png and the console summary."""
    tb = met.read_tensorboard(run_dir / "tensorboard")
    steps = sorted(tb["lm loss"])
    for name in (
        "mhc/forward_gain",
        "mhc/backward_gain",
        "mhc/layer01.self_attention/h_res_row_err",
    ):
        assert sorted(tb[name]) == steps, name
        assert name.endswith("_err") or 0.5 < tb[name][steps[-1]] < 2.0, (name, tb[name])
    assert {"mhc/forward_gain", "mhc/backward_gain"} <= set(metrics)
    assert (run_dir / "mhc.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "mhc/forward_gain " in stdout


@pytest.mark.parametrize("recipe", RECIPES, ids=_case_id)
def test_recipe_trains_on_cpu_and_matches_its_golden_values(recipe, tmp_path):
    run_dir = tmp_path / "run"
    result = megatron_ext("run", recipe.relative_to(REPO_ROOT), "--run-dir", run_dir)
    out = result.stdout + result.stderr
    assert result.returncode == 0, f"megatron-ext run exited {result.returncode}:\n{out[-8000:]}"

    summary = _summary(run_dir)
    assert summary["status"] == "passed", out[-4000:]
    titles = [r["title"] for r in summary["reports"]]
    assert any(t.startswith("golden values") for t in titles), (
        f"{_case_id(recipe)} has no golden values for cpu; generate, review and commit them:\n"
        f"  megatron-ext run {recipe.relative_to(REPO_ROOT)} --write-golden\n{out[-2000:]}"
    )
    if summary["phases"][-1]["phase"] == "resume":
        assert any(t.startswith("ckpt-resume") for t in titles)

    # What a user finds in the run directory.
    for name in ("recipe.yaml", "command.sh", "metrics.json", "loss.png", "comparison.txt"):
        assert (run_dir / name).is_file(), name
    last_rank_log = (run_dir / "logs" / f"rank-{summary['world_size'] - 1}.log").read_text()
    eval_interval = (yaml.safe_load((run_dir / "recipe.yaml").read_text())["training"]).get(
        "eval_interval"
    )
    if eval_interval:  # evaluation ran through the (forward-only) pipeline schedule
        assert f"validation loss at iteration {eval_interval} " in last_rank_log
    metrics = json.loads((run_dir / "metrics.json").read_text())
    expected = {"lm loss"}
    if "multimodule" not in recipe.stem:
        # megatron.training reports zeros in the gradient; the multi-module entry steps its own
        # optimizer across grids and does not.
        expected.add("num-zeros")
    assert expected <= set(metrics)
    assert metrics["lm loss"]["start_step"] == 1 and metrics["lm loss"]["step_interval"] == 1
    if (yaml.safe_load((run_dir / "recipe.yaml").read_text())["model"].get("mhc") or {}).get(
        "log_stats"
    ):
        assert_mhc_stats_recorded(run_dir, metrics, result.stdout)
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Metrics as upstream reads them; throughput, memory, versions and the plan recorded.
    assert summary["metrics_source"] == "tensorboard"
    if "multimodule" not in recipe.stem:  # its entry prints no Megatron lines to compare with
        assert_tensorboard_equals_log_lines(run_dir / "tensorboard", run_dir / "logs")
    performance = summary["performance"]
    assert performance["tokens_per_s"] > 0 and performance["iteration_time_s"] > 0
    assert len(performance["peak_rss_mib_per_rank"]) == summary["world_size"]
    assert summary["versions"]["megatron-core"] == "0.19.2"
    assert summary["plan"]["world_size"] == summary["world_size"]
    # ... and the progress it saw on the way.
    assert "  iteration    1/" in result.stdout and f"PASSED: {summary['name']}" in result.stdout


def test_a_change_of_numerics_fails_the_run(tmp_path):
    """Another seed changes every loss: forced against the golden values, the run exits 1."""
    run_dir = tmp_path / "run"
    result = megatron_ext(
        "run",
        "recipes/gpt_mhc_pp2_standalone_embedding_loss.yaml",
        "test.type=regular",
        "training.seed=4321",
        "--compare",
        "--run-dir",
        run_dir,
    )
    assert result.returncode == 1, result.stdout[-4000:] + result.stderr[-2000:]
    assert "lm loss         approximate rtol=0.0001" in result.stdout and "FAILED" in result.stdout
    assert _summary(run_dir)["status"] == "mismatch"
