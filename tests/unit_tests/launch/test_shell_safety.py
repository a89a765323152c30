"""Recipe values never run as shell: hostile names, overrides, environment keys and
container images are quoted into the generated sbatch script and command.sh, or rejected
before anything is written. The scripts are run for real against stub `srun`, `scontrol`,
`sbatch`, `squeue` and `python` on PATH; a canary file proves that no payload executed."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext.launch import slurm
from megatron_ext.launch.shell import UnsafeValueError
from megatron_ext.recipes import load
from megatron_ext.recipes.prepare import prepare
from megatron_ext.recipes.validate import validate
from megatron_ext.runs import runner
from megatron_ext.runs.submit import SlurmOptions, submit
from megatron_ext.testing import timing

from recipe_texts import MINIMAL

STUBS = {
    # Every stub records its argv (NUL-separated) and, for srun, the environment it got.
    "srun": 'printf "%s\\0" "$@" >> "$STUB_LOG/srun.args"; printf "\\n" >> "$STUB_LOG/srun.args"; '
    'env -0 > "$STUB_LOG/srun.env"; exit 0',
    "scontrol": 'if [ "$2" = hostnames ]; then echo node1; else '
    'echo "JobId=42 JobState=COMPLETED ExitCode=0:0"; fi',
    "sbatch": 'SLURM_JOB_ID=42 SLURM_JOB_NODELIST=node1 SLURM_NTASKS=4 bash "${@: -1}" '
    '> "$STUB_LOG/job.out" 2>&1; echo 42',
    "squeue": "exit 0",
    "python": 'printf "%s\\0" "$@" > "$STUB_LOG/python.args"; exit 0',
}


@pytest.fixture
def stubs(tmp_path, monkeypatch):
    bin_dir, log = tmp_path / "bin", tmp_path / "stub-log"
    bin_dir.mkdir()
    log.mkdir()
    for name, body in STUBS.items():
        path = bin_dir / name
        path.write_text(f"#!/bin/bash\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("STUB_LOG", str(log))
    return log


def payloads(canary: Path) -> list[str]:
    """Ways a string can run `touch canary` in a careless script."""
    return [
        f"$(touch {canary})",
        f"`touch {canary}`",
        f"x; touch {canary} #",
        f"x' ; touch {canary}; '",
        f'x" ; touch {canary}; "',
        f"x && touch {canary}",
        f"x | touch {canary}",
    ]


def _write_minimal(tmp_path, extra: str = "") -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(MINIMAL + extra)
    return path


@pytest.mark.parametrize(
    "name",
    [
        "x; rm -rf DIR #",
        "$(touch c)",
        "a\nb",
        "../escape",
        "a/b",
        "..",
        "\x00",
        "n" * 300,
        ".hidden",
        "sp ace",
    ],
)
def test_unsafe_names_are_rejected_before_anything_is_written(tmp_path, name):
    loaded = load(_write_minimal(tmp_path), overrides=[f"name={name}"])
    problems = [str(p) for p in validate(loaded, megatron_checks=False).problems]
    assert any(p.startswith("name:") and "not a safe name" in p for p in problems), problems
    with pytest.raises(UnsafeValueError):
        runner.default_run_dir(
            prepare(loaded, megatron_checks=False, check_pickles=False), tmp_path / "runs"
        )
    assert not (tmp_path / "runs").exists()


def test_unsafe_env_keys_and_line_breaks_in_slurm_fields_are_rejected(tmp_path):
    recipe = _write_minimal(
        tmp_path,
        """
launch:
  env: {"A;touch c": 1, "B C": 2, "NCCL_OK_1": "$(fine, quoted)"}
  slurm: {partition: "p\\ntouch c", sbatch_args: ["--exclusive\\rtouch c"], container_image: "i\\n"}
""",
    )
    problems = [str(p) for p in validate(load(recipe), megatron_checks=False).problems]
    for where in (
        "launch.env.A;touch c",
        "launch.env.B C",
        "launch.slurm.partition",
        "launch.slurm.sbatch_args[0]",
        "launch.slurm.container_image",
    ):
        assert any(p.startswith(where + ":") for p in problems), (where, problems)
    assert not any(p.startswith("launch.env.NCCL_OK_1") for p in problems)


def test_sbatch_script_refuses_a_line_break_on_an_sbatch_line(tmp_path):
    base = dict(
        run_dir=tmp_path,
        steps=[],
        nodes=1,
        tasks_per_node=1,
        device="cpu",
        workdir=tmp_path,
        python="python",
    )
    for field, value in [
        ("name", "a\ntouch c"),
        ("partition", "p\rx"),
        ("account", "a\x00"),
        ("sbatch_args", ["--x\ntouch c"]),
    ]:
        with pytest.raises(UnsafeValueError):
            slurm.sbatch_script(slurm.SlurmJob(**{"name": "ok", **base, field: value}))
    with pytest.raises(UnsafeValueError, match="not a variable name"):
        slurm.sbatch_script(slurm.SlurmJob(name="ok", env={"A;b": "1"}, **base))


def _srun_calls(log: Path) -> list[list[str]]:
    text = (log / "srun.args").read_text()
    return [call.split("\0")[:-1] for call in text.split("\0\n") if call]


def test_generated_scripts_run_hostile_values_as_data(tmp_path, stubs, monkeypatch):
    """submit (stub sbatch runs the script with bash) and command.sh, with hostile
    overrides, environment values, description, container image and mounts and a run
    directory full of shell syntax: the canary is never created and every value arrives
    verbatim."""
    canary = tmp_path / "canary"
    hostile = payloads(canary)
    overrides = [f"launch.env.HOSTILE_{i}={p}" for i, p in enumerate(hostile)]
    overrides += [f"extra_args.--hostile-{i}={p}" for i, p in enumerate(hostile)]
    overrides += [f"description=line one\ntouch {canary}\n", "test.type=ckpt-resume"]
    loaded = load(_write_minimal(tmp_path), overrides=overrides)
    # the variables are not tuning knobs: the user allows them (--allow-env) for this test
    loaded.allowed_env = tuple(f"HOSTILE_{i}" for i in range(len(hostile)))
    # No whitespace: a run directory with it is refused for #SBATCH lines (issue 34, item 10;
    # runs/test_hostile_use.py); ${IFS} runs the same payload when unquoted.
    run_dir = tmp_path / f"run$(touch${{IFS}}{canary})`touch${{IFS}}{canary}`;x"
    image = f"nvcr.io/img:1$(touch {canary})"
    mount = f"/data:/data;touch {canary}"
    monkeypatch.chdir(tmp_path)
    (run_dir / "checkpoints").mkdir(parents=True)  # what the (stubbed) training step leaves

    outcome = submit(
        prepare(loaded, megatron_checks=False, check_pickles=False),
        SlurmOptions(container_image=image, container_mounts=[mount]),
        run_dir=run_dir,
        echo=lambda _: None,
    )
    job_out = (stubs / "job.out").read_text()
    assert not canary.exists(), job_out
    calls = _srun_calls(stubs)
    assert len(calls) == 2, (job_out, calls)  # train and resume
    train = calls[0]
    assert f"--container-image={image}" in train
    assert any(a.startswith("--container-mounts=") and mount in a for a in train)
    assert f"--output={run_dir}/logs/rank-%t.log" in train
    # As the recipe holds them (an override is YAML: " #" starts a comment there).
    flags = {k: str(v) for k, v in loaded.recipe.extra_args.items()}
    envs = {k: str(v) for k, v in loaded.recipe.launch.env.items()}
    assert sum(f"touch {canary}" in v for v in [*flags.values(), *envs.values()]) == 2 * len(
        hostile
    )
    for i in range(len(hostile)):
        assert train[train.index(f"--hostile-{i}") + 1] == flags[f"--hostile-{i}"]
    env = dict(e.split("=", 1) for e in (stubs / "srun.env").read_text().split("\0") if "=" in e)
    for i in range(len(hostile)):
        assert env[f"HOSTILE_{i}"] == envs[f"HOSTILE_{i}"]
    # the resume step (the last srun) beats into its own directory, which the script made
    assert env["MEGATRON_EXT_HEARTBEAT_DIR"] == f"{run_dir.resolve()}/logs/resume/heartbeat"
    assert Path(env["MEGATRON_EXT_HEARTBEAT_DIR"]).is_dir()
    assert outcome.run_dir == run_dir.resolve()

    # command.sh of the same run, with the interpreter replaced by the stub.
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bin" / "python"))
    script = tmp_path / "command.sh"
    script.write_text(
        runner.command_script(prepare(loaded, megatron_checks=False, check_pickles=False), run_dir)
    )
    proc = subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, timeout=timing.bound(60)
    )
    assert proc.returncode == 0, proc.stderr
    assert not canary.exists(), script.read_text()
    args = (stubs / "python.args").read_text().split("\0")[:-1]
    for i in range(len(hostile)):
        assert args[args.index(f"--hostile-{i}") + 1] == flags[f"--hostile-{i}"]
    assert (
        run_dir / "checkpoints" / "latest_checkpointed_iteration.txt"
    ).read_text().strip() == "4"
