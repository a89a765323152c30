"""Issue 40 items 3, 4 and 14, issue 41 item 8: what a recipe may hand to the ranks without the
command line's consent (an allow-list of environment keys, remote code only with
``--trust-remote-code``), secrets that never reach a file or the console whatever carries them
in (a Megatron-LM case's ``${HF_TOKEN}``, its ENV_VARS), and secret names judged by whole words
of environment variables only (``model.mhc.single_pass`` is not a password). No rank starts."""

from __future__ import annotations

import json

import pytest
import yaml

from megatron_ext.launch import env_policy, shell
from megatron_ext.recipes import RecipeError, load
from megatron_ext.recipes.loader import dump
from megatron_ext.recipes.prepare import RunDirRecipes, prepare
from megatron_ext.recipes.validate import validate
from megatron_ext.runs import runner
from megatron_ext.runs.options import RunOptions

from recipe_texts import MINIMAL, REPO_ROOT

CASE = REPO_ROOT / "tests/functional_tests/test_cases/gpt/gpt3_mcore_tp2_pp2_cpu"
GRANT_REMOTE = "--trust-remote-code"  # env_policy.REMOTE_CODE_FLAG


def _problems(path, overrides=(), allowed=()) -> list[str]:
    loaded = load(path, "cpu", list(overrides))
    loaded.allowed_env = tuple(allowed)
    return [str(p) for p in validate(loaded, megatron_checks=False).problems]


# ---- item 4: an allow-list of environment keys ------------------------------------------------
ISSUE_KEYS = {
    "PYTHONPYCACHEPREFIX": "/tmp/pyc",
    "HOME": "/tmp/home",
    "OPENSSL_CONF": "/tmp/openssl.cnf",
    "OPENSSL_MODULES": "/tmp/ossl",
    "NCCL_NET_PLUGIN": "/tmp/libnccl-net.so",
    "CUDA_INJECTION64_PATH": "/tmp/inject.so",
    "OMP_TOOL_LIBRARIES": "/tmp/tool.so",
    "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1",
    "JAVA_TOOL_OPTIONS": "-javaagent:/tmp/a.jar",
    # a pattern's family, but a place to load from
    "NCCL_TUNER_PLUGIN": "/tmp/t.so",
    "NCCL_CONF_FILE": "/tmp/nccl.conf",
    "NVTE_CUDA_INCLUDE_PATH": "/tmp/inc",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/home/u/.bashrc",
    "SOMETHING_NEW": "/opt/anything",  # unknown: not on the list, so not allowed
}


@pytest.mark.parametrize("key, value", ISSUE_KEYS.items())
def test_a_key_off_the_allow_list_needs_allow_env(write_recipe, key, value):
    path = write_recipe(MINIMAL)
    problems = _problems(path, [f"launch.env.{key}={value}"])
    mine = [p for p in problems if p.startswith(f"launch.env.{key}:")]
    assert len(mine) == 1 and f"--allow-env {key}" in mine[0] and "\n" not in mine[0], problems
    assert value not in mine[0]
    assert not _problems(path, [f"launch.env.{key}={value}"], allowed=[key])


LEGITIMATE = {
    "NCCL_ALGO": "Ring",
    "NCCL_IB_HCA": "mlx5_0",
    "NCCL_SOCKET_IFNAME": "eth0",
    "NCCL_DEBUG": "INFO",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "TORCH_NCCL_AVOID_RECORD_STREAMS": "1",
    "NVTE_FUSED_ATTN": "0",
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
    "OMP_NUM_THREADS": "4",
    "MKL_NUM_THREADS": "4",
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    "TOKENIZERS_PARALLELISM": "false",
    "WANDB_MODE": "offline",
    "HF_TOKEN": "hf_abc",
    "WANDB_API_KEY": "w123",
}


def test_the_knobs_a_megatron_user_sets_pass_without_allow_env(write_recipe):
    overrides = [f"launch.env.{k}={v}" for k, v in LEGITIMATE.items()]
    assert not _problems(write_recipe(MINIMAL), overrides)
    for key in LEGITIMATE:
        assert env_policy.allowed_reason(key), key  # each with its reason


def test_the_shipped_recipes_and_cases_need_no_allow_env():
    recipes = sorted((REPO_ROOT / "recipes").glob("*.yaml"))
    cases = sorted((REPO_ROOT / "tests/functional_tests/test_cases").glob("*/*/model_config.yaml"))
    for path in recipes + cases:
        try:
            env = load(path, "cpu").recipe.launch.env
        except RecipeError:
            continue  # a case megatron-ext refuses (inference, checkpoint-consistency)
        assert not env_policy.env_problems(env), path


def test_allow_env_and_trust_remote_code_reach_every_command_line():
    from megatron_ext.cli import build_parser

    parser = build_parser()
    for argv in (
        ["validate", "r.yaml"],
        ["run", "r.yaml"],
        ["run", "--resume", "R"],
        ["submit", "r.yaml", "--slurm"],
        ["import", "case"],
    ):
        args = parser.parse_args([*argv, "--allow-env", "HOME", "--trust-remote-code"])
        assert args.allow_env == ["HOME", GRANT_REMOTE], argv


# ---- item 3: remote code only with a command-line flag ----------------------------------------
@pytest.mark.parametrize(
    "override",
    [
        "extra_args.--trust-remote-code=true",
        # a list value puts the flag on the ranks' command line by itself
        "extra_args.--special-tokens=[a, --trust-remote-code]",
    ],
)
def test_remote_code_from_a_recipe_needs_the_command_line_flag(write_recipe, override):
    path = write_recipe(MINIMAL)
    problems = _problems(path, [override])
    mine = [p for p in problems if "--trust-remote-code" in p]
    assert len(mine) == 1 and mine[0].startswith("extra_args.--trust-remote-code:"), problems
    assert "pass --trust-remote-code on the command line" in mine[0]
    assert not [p for p in _problems(path, [override], [GRANT_REMOTE]) if "remote" in p]
    # --allow-env of any key grants no remote code
    assert [p for p in _problems(path, [override], ["--allow-env"]) if "remote" in p]


def test_remote_code_set_false_is_no_problem(write_recipe):
    assert not _problems(write_recipe(MINIMAL), ["extra_args.--trust-remote-code=false"])


def test_resume_and_submit_refuse_remote_code_without_the_flag(write_recipe, tmp_path, monkeypatch):
    from megatron_ext.runs.submit import SlurmOptions, submit

    monkeypatch.setattr(runner, "_run_phases", lambda *a, **k: pytest.fail("training started"))
    path = write_recipe(MINIMAL + "extra_args: {--trust-remote-code: true}\n")
    lines: list[str] = []
    request = prepare(load(path), megatron_checks=False, check_pickles=False)
    outcome = submit(request, SlurmOptions(), run_dir=tmp_path / "S", echo=lines.append)
    assert outcome.exit_code == runner.EXIT_INVALID
    assert any("--trust-remote-code" in line for line in lines) and not (tmp_path / "S").exists()
    # a run directory made with the grant does not keep it: run --resume asks again
    granted = load(path)
    granted.allowed_env = (GRANT_REMOTE,)
    run_dir = tmp_path / "R"
    runner.write_run_files(prepare(granted, megatron_checks=False, check_pickles=False), run_dir)
    (run_dir / "summary.json").write_text(json.dumps({"status": "stopped"}))
    lines.clear()
    outcome = runner.resume_run(
        run_dir, RunDirRecipes(), RunOptions(megatron_checks=False), echo=lines.append
    )
    assert outcome.exit_code == runner.EXIT_INVALID
    assert any("--trust-remote-code" in line for line in lines), lines


def _write_case(tmp_path, model_args=None, env_vars=None):
    doc = yaml.safe_load((CASE / "model_config.yaml").read_text())
    doc["MODEL_ARGS"].update(model_args or {})
    doc["ENV_VARS"] = {**(doc.get("ENV_VARS") or {}), **(env_vars or {})}
    case = tmp_path / "gpt" / "case"
    case.mkdir(parents=True)
    (case / "model_config.yaml").write_text(yaml.safe_dump(doc))
    return case


def test_an_imported_case_turning_on_remote_code_needs_the_flag(tmp_path, capsys):
    from megatron_ext.cli import main as cli_main

    case = _write_case(tmp_path, {"--trust-remote-code": True})
    out = tmp_path / "imported.yaml"
    assert cli_main(["import", str(case), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "MODEL_ARGS.--trust-remote-code" in err and not out.exists(), err
    assert cli_main(["import", str(case), "-o", str(out), "--trust-remote-code"]) == 0
    assert yaml.safe_load(out.read_text())["extra_args"]["--trust-remote-code"] is True


# ---- item 14: secrets never reach a file or the console ---------------------------------------
TOKEN = "hf_SeCrEt_0123456789"


@pytest.mark.parametrize(
    "value",
    ["${HF_TOKEN}", "https://user:${HF_TOKEN}@example.org/data", "${PLAIN_LOOKING}"],
)
def test_a_secret_placeholder_in_model_args_is_never_filled_in(
    tmp_path, capsys, monkeypatch, value
):
    from megatron_ext.cli import main as cli_main

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("PLAIN_LOOKING", TOKEN)  # a harmless name holding the secret's value
    case = _write_case(tmp_path, {"--wandb-exp-name": value})
    with pytest.raises(RecipeError) as raised:
        load(case / "model_config.yaml", "cpu")
    shown = str(raised.value)
    assert "MODEL_ARGS.--wandb-exp-name" in shown and TOKEN not in shown, shown
    out = tmp_path / "imported.yaml"
    assert cli_main(["import", str(case), "-o", str(out)]) == 2
    console = capsys.readouterr()
    assert TOKEN not in console.out + console.err and not out.exists()
    assert "MODEL_ARGS.--wandb-exp-name" in console.err


def test_a_case_env_vars_secret_is_neither_printed_nor_written(tmp_path, capsys):
    from megatron_ext.cli import main as cli_main

    case = _write_case(tmp_path, env_vars={"HF_TOKEN": TOKEN})
    assert cli_main(["import", str(case)]) == 0  # printed on the console
    printed = capsys.readouterr().out
    assert TOKEN not in printed and "ENV_VARS.HF_TOKEN is a secret" in printed
    out = tmp_path / "imported.yaml"
    assert cli_main(["import", str(case), "-o", str(out)]) == 0
    assert TOKEN not in out.read_text() + capsys.readouterr().out
    # run directly, the ranks still get it from the case; no file holds it
    loaded = load(case / "model_config.yaml", "cpu")
    request = prepare(loaded, megatron_checks=False, check_pickles=False)
    assert request.launch.environment["HF_TOKEN"] == TOKEN
    run_dir = tmp_path / "R"
    runner.write_run_files(request, run_dir)
    for written in run_dir.rglob("*"):
        if written.is_file():
            assert TOKEN not in written.read_text(errors="replace"), written


# ---- issue 41 item 8: secret names are whole words of environment variables -------------------
@pytest.mark.parametrize(
    "override",
    [
        "model.mhc.single_pass=false",
        "model.mhc={single_pass: true}",
        "launch.env.TOKENIZERS_PARALLELISM=false",
        "data.tokenizer={type: NullTokenizer, vocab_size: 128}",
        "extra_args.--fim-eod-token=<eod>",
    ],
)
def test_a_field_or_knob_with_a_secret_looking_word_is_shown_as_given(write_recipe, override):
    assert shell.redact_override(override) == override
    loaded = load(write_recipe(MINIMAL), overrides=[override])
    request = prepare(loaded, megatron_checks=False, check_pickles=False)
    assert request.display.shown_overrides == (override,)
    assert f"# overrides: {override}" in dump(loaded)


def test_real_secrets_stay_redacted_in_every_form():
    for override in (
        "launch.env.HF_TOKEN=x1",
        "launch.env.DB_PASS=x1",
        "launch.env.hfToken=x1",
        "launch.env.NGC_APIKEY=x1",
        "platforms.gpu.launch.env.GH_PAT=x1",
        "launch.env={MY_DB_PASSWD: x1, A: 1}",
        "launch={env: {AWS_SECRET_ACCESS_KEY: x1}}",
    ):
        assert "x1" not in shell.redact_override(override), override
    for name in ("TOKENIZERS_PARALLELISM", "NCCL_IB_PKEY", "MONKEY", "PASSES", "KEYBOARD_LAYOUT"):
        assert not shell.is_secret(name), name
