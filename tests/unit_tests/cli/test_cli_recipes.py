"""`megatron-ext validate | compare | submit --dry-run` as a user runs them (no training)."""

import json
import subprocess
import sys

from megatron_ext.recipes.loader import parse_yaml
from megatron_ext.testing import timing

from recipe_texts import MINIMAL, REPO_ROOT


def _cli(*args, cwd=REPO_ROOT):
    return subprocess.run(
        [sys.executable, "-m", "megatron_ext.cli", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timing.bound(300),
    )


def test_validate_accepts_every_shipped_recipe_on_every_platform(example_data):
    recipes = sorted(p.relative_to(REPO_ROOT) for p in (REPO_ROOT / "recipes").glob("*.yaml"))
    result = _cli("validate", *recipes)
    assert result.returncode == 0, result.stdout + result.stderr
    ok = [line for line in result.stdout.splitlines() if ": OK (" in line]
    platforms = sum(
        1 + len(parse_yaml((REPO_ROOT / r).read_text()).get("platforms") or {}) for r in recipes
    )
    assert len(ok) == platforms, result.stdout


def test_validate_prints_one_line_per_problem_and_exits_2(write_recipe):
    path = write_recipe(MINIMAL)
    result = _cli(
        "validate",
        path,
        "--platform",
        "cpu",
        "parallelism.pp=3",
        "model.num_attention_heads=3",
        "parallelism.sp=true",
    )
    assert result.returncode == 2
    lines = result.stdout.splitlines()
    assert lines == [
        f"{path} [cpu]: model.hidden_size: 64 is not divisible by num_attention_heads (3)",
        f"{path} [cpu]: model.num_attention_heads: 3 heads do not split over tp=2",
        f"{path} [cpu]: model.num_layers: 4 layers do not split over pp(3) * vpp(1) = 3 model chunks",
    ], result.stdout
    typo = _cli("validate", path, "--platform", "cpu", "training.iteration=3")
    assert typo.returncode == 2
    assert typo.stdout.strip() == (
        f"{path} [cpu]: override 'training.iteration=3': unknown key "
        "'training.iteration' (did you mean 'iterations'?)"
    )


def _golden(values):
    return {
        "lm loss": {
            "start_step": 1,
            "end_step": len(values),
            "step_interval": 1,
            "values": {str(i + 1): v for i, v in enumerate(values)},
        }
    }


def test_compare_applies_megatrons_rules_and_reports_the_worst_step(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.json").write_text(json.dumps(_golden([4.0, 3.0, 2.0])))
    golden = tmp_path / "golden.json"
    golden.write_text(json.dumps(_golden([4.0, 3.0, 2.0])))
    assert _cli("compare", run, golden).returncode == 0
    golden.write_text(json.dumps(_golden([4.0, 3.0, 2.1])))
    result = _cli("compare", run, golden)
    assert result.returncode == 1
    assert (
        "lm loss         exact" in result.stdout and "first difference at step 3" in result.stdout
    )
    assert "worst step 3: 2 vs golden 2.1" in result.stdout
    relaxed = _cli("compare", run, golden, "--approximate-only", "--rtol", "0.1")
    assert relaxed.returncode == 0, relaxed.stdout


def test_submit_dry_run_prints_the_sbatch_script():
    result = _cli(
        "submit",
        "recipes/gpt_tp2_pp2.yaml",
        "--slurm",
        "--dry-run",
        "--partition",
        "batch",
        "--account",
        "proj",
        "--time",
        "00:20:00",
        "--container-image",
        "img:1",
        "--run-dir",
        "/shared/runs/x",
    )
    assert result.returncode == 0, result.stderr
    script = result.stdout
    assert script.startswith("#!/bin/bash\n#SBATCH --job-name=megatron-ext-gpt_tp2_pp2\n")
    assert "#SBATCH --gpus-per-node=8" in script, (
        "the gpu-cluster platform is the default for submit"
    )
    assert "#SBATCH --partition=batch" in script and "#SBATCH --time=00:20:00" in script
    assert (
        "--container-image=img:1" in script
        and "'--output=/shared/runs/x/logs/'\"${SEGMENT}\"'/rank-%t.log'" in script
    )
    cpu = _cli("submit", "recipes/gpt_tp2_pp2.yaml", "--slurm", "--dry-run", "--platform", "cpu")
    assert cpu.returncode == 0 and "#SBATCH --ntasks-per-node=4" in cpu.stdout


def test_submit_without_slurm_flag_is_refused():
    result = _cli("submit", "recipes/gpt_tp2_pp2.yaml", "--dry-run")
    assert result.returncode == 2 and "only --slurm is supported" in result.stderr


def test_run_refuses_an_invalid_recipe_before_starting_anything(write_recipe, tmp_path):
    result = _cli(
        "run", write_recipe(MINIMAL), "parallelism.pp=3", "--runs-root", tmp_path / "runs"
    )
    assert result.returncode == 2
    assert "model.num_layers: 4 layers do not split over pp(3)" in result.stdout
    assert not (tmp_path / "runs").exists(), "no run directory for a recipe that cannot run"
