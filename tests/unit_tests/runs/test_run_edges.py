"""CLI edges without training: compare's exit codes, secrets, run --dry-run, Hydra-style map
overrides, logging packages, TensorBoard metrics, and the typed multimodule section."""

from __future__ import annotations

import json

import pytest

from megatron_ext import cli
from megatron_ext.launch import slurm
from megatron_ext.recipes import load
from megatron_ext.recipes.loader import dump
from megatron_ext.recipes.prepare import prepare
from megatron_ext.recipes.validate import validate
from megatron_ext.runs import metrics as met, runner, verdict

from recipe_texts import MINIMAL, REPO_ROOT

GOLDEN = {
    "lm loss": {"start_step": 1, "end_step": 2, "step_interval": 1, "values": {"1": 5.0, "2": 4.0}}
}


# ---- compare: 0 passed, 1 failed comparison, 2 bad input, never a traceback ----------------------
@pytest.mark.parametrize(
    "case, code, message",
    [
        ("passes", 0, None),
        ("differs", 1, None),
        ("golden missing", 2, "golden values {tmp}/none.json does not exist"),
        ("golden not json", 2, "golden values {tmp}/bad.json is not JSON"),
        ("golden wrong shape", 2, "golden values {tmp}/shape.json is not golden-value JSON"),
        ("golden is a directory", 2, "golden values {tmp} is a directory"),
        ("run missing", 2, "{tmp}/no-run does not exist"),
        ("run without metrics", 2, "no metrics in {tmp}/empty-run"),
    ],
)
def test_compare_exit_codes(tmp_path, capsys, case, code, message):
    (tmp_path / "golden.json").write_text(json.dumps(GOLDEN))
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "shape.json").write_text(json.dumps({"lm loss": [1, 2]}))
    actual = json.loads(json.dumps(GOLDEN))
    if case == "differs":
        actual["lm loss"]["values"]["2"] = 4.5
    (tmp_path / "run.json").write_text(json.dumps(actual))
    (tmp_path / "empty-run").mkdir()
    run, golden = (
        {"run missing": "no-run", "run without metrics": "empty-run"}.get(case, "run.json"),
        {
            "golden missing": "none.json",
            "golden not json": "bad.json",
            "golden wrong shape": "shape.json",
            "golden is a directory": ".",
        }.get(case, "golden.json"),
    )
    got = cli.main(["compare", str(tmp_path / run), str(tmp_path / golden), "--device", "cpu"])
    err = capsys.readouterr().err
    assert got == code
    assert "Traceback" not in err
    if message:
        assert err.strip().startswith("megatron-ext compare: " + message.format(tmp=tmp_path)), err
        assert len(err.strip().splitlines()) == 1


# ---- secrets -------------------------------------------------------------------------------------
SECRETS = {
    "WANDB_API_KEY": "k-123",
    "HF_TOKEN": "t-456",
    "MY_SECRET": "s-789",
    "DB_PASSWORD": "p-000",
}


def test_secrets_are_not_written_but_reach_the_ranks(write_recipe, tmp_path):
    env = ", ".join(f"{k}: {v}" for k, v in SECRETS.items())
    loaded = load(
        write_recipe(MINIMAL + f"launch: {{env: {{{env}, PLAIN: visible}}}}\n"),
        overrides=["launch.env.HF_TOKEN=t-456"],
    )
    script = runner.command_script(
        prepare(loaded, megatron_checks=False, check_pickles=False), tmp_path / "run"
    )
    written = script + dump(loaded)
    job, _ = _slurm_job(loaded, tmp_path)
    written += slurm.sbatch_script(job)
    for value in SECRETS.values():
        assert value not in written
    assert "PLAIN=visible" in script
    assert ': "${WANDB_API_KEY:?is a secret and not written here; export WANDB_API_KEY' in script
    assert "launch.env.HF_TOKEN=<redacted>" in script
    from megatron_ext.recipes import command

    assert {
        k: command.run_environment(loaded)[k] for k in SECRETS
    } == SECRETS  # the launcher passes them


def _slurm_job(loaded, tmp_path):
    from megatron_ext.runs.submit import SlurmOptions, build_job

    return build_job(
        prepare(loaded, megatron_checks=False, check_pickles=False),
        tmp_path / "slurm-run",
        SlurmOptions(partition="p", time="00:10:00"),
    )


# ---- run --dry-run ---------------------------------------------------------------------------------
def test_dry_run_prints_the_plan_and_command_and_starts_nothing(write_recipe, tmp_path, capsys):
    runs = tmp_path / "runs"
    code = cli.main(
        [
            "run",
            str(write_recipe(MINIMAL)),
            "--dry-run",
            "--skip-megatron-checks",
            "--runs-root",
            str(runs),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "gpt, 4x64, tp2 pp2 dp1, 4 ranks on cpu" in out
    assert "--nproc_per_node 4 -m megatron_ext.pretrain_gpt" in out and "--tensorboard-dir" in out
    assert "(missing)" in out  # no golden values for this recipe
    assert not runs.exists()
    assert (
        cli.main(
            [
                "run",
                str(write_recipe(MINIMAL)),
                "--dry-run",
                "parallelism.pp=3",
                "--skip-megatron-checks",
            ]
        )
        == 2
    )


# ---- Hydra-style map overrides --------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides, env",
    [
        (["launch.env={B: 2}"], {"A": 1, "B": 2}),  # merged into the recipe's map
        (["launch.env.B=2"], {"A": 1, "B": 2}),
        (["~launch.env", "launch.env={B: 2}"], {"B": 2}),  # replaced: delete, then set
    ],
)
def test_map_overrides_merge_like_hydra(write_recipe, overrides, env):
    loaded = load(write_recipe(MINIMAL + "launch: {env: {A: 1}}\n"), overrides=overrides)
    assert loaded.recipe.launch.env == env


# ---- logging packages ------------------------------------------------------------------------------
def test_a_logging_flag_needs_its_package(write_recipe, monkeypatch):
    from megatron_ext.recipes import validate as validation

    monkeypatch.setattr(validation, "_module_importable", lambda name: name != "wandb")
    loaded = load(write_recipe(MINIMAL), overrides=["extra_args.--wandb-project=p"])
    assert [str(p) for p in validate(loaded, megatron_checks=False).problems] == [
        "extra_args.--wandb-project: needs the wandb package, which is not importable here; "
        "pip install 'megatron-ext[wandb]' or remove the flag"
    ]


# ---- TensorBoard metrics ---------------------------------------------------------------------------
def test_tensorboard_scalars_are_read_per_step_with_a_log_fallback(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    run = tmp_path / "run"
    writer = SummaryWriter(log_dir=str(run / met.TENSORBOARD_SUBDIR))
    for step, loss in ((1, 5.5), (2, 5.25)):
        writer.add_scalar("lm loss", loss, step)
        writer.add_scalar("lm loss vs samples", loss, step * 8)
    writer.close()
    metrics, source = met.read_run_metrics(run)
    assert source == "tensorboard" and metrics == {"lm loss": {1: 5.5, 2: 5.25}}
    (run / "logs").mkdir()
    (run / "logs" / "rank-0.log").write_text(
        " iteration        1/       2 | elapsed time per iteration (ms): 10.0 | lm loss: 5.500000E+00 |\n"
    )
    metrics, source = met.read_run_metrics(run, "resume")  # no event files there: the logs
    assert source == "logs" and metrics == {}
    assert met.read_run_metrics(tmp_path / "other")[1] == "logs"


def test_summary_versions_name_the_packages_and_the_commit():
    versions = verdict.versions()
    from importlib import metadata

    assert versions["megatron-core"] == metadata.version("megatron-core") and versions["torch"]
    assert (
        versions["megatron-ext-git-commit"] is None
        or len(versions["megatron-ext-git-commit"]) >= 40
    )


# ---- multimodule recipes on the one loader ----------------------------------------------------------
def test_a_mistyped_multimodule_field_is_rejected_before_start():
    from megatron_ext.recipes import RecipeError

    with pytest.raises(RecipeError) as error:
        load(
            REPO_ROOT / "recipes/multimodule_encoder_llm_mhc_pp2.yaml",
            overrides=["model.modules.llm.hidden_sizee=64"],
        )
    assert "unknown key 'model.modules.llm.hidden_sizee' (did you mean 'hidden_size'?)" in str(
        error.value
    )
    loaded = load(
        REPO_ROOT / "recipes/multimodule_encoder_llm_mhc_pp2.yaml", overrides=["launch.nproc=3"]
    )
    problems = [str(p) for p in validate(loaded, megatron_checks=False).problems]
    assert problems and all(p.startswith("model.modules: ") for p in problems), problems


# ---- run on a megatron-core megatron-ext refuses: that first, before any recipe problem ---------
def test_run_names_the_version_refusal_before_any_recipe_problem(tmp_path, capsys, monkeypatch):
    """Issue 39: a refused megatron-core is what run reports, not the recipe's first problem
    (a recipe that does not even exist here) nor every rank's death at start-up."""
    from megatron_ext import registry

    monkeypatch.setattr(registry, "megatron_core_version", lambda: "0.99.0")
    monkeypatch.delenv(registry.ALLOW_UNVERIFIED_ENV, raising=False)
    assert cli.main(["run", str(tmp_path / "no-such-recipe.yaml")]) == runner.EXIT_INVALID
    errors = capsys.readouterr().err
    assert errors.startswith("megatron-ext run: megatron-ext's patches are verified on")
    assert "0.99.0" in errors and "no-such-recipe" not in errors
