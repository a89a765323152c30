"""``validate`` and ``submit --slurm --dry-run`` scan the pickles of the checkpoint a recipe
names (``checkpoint.load``) as ``run`` does, first: a hostile one is refused in one line
naming the file and the global, and its code never runs (no Slurm is started: dry run)."""

from __future__ import annotations

import pathlib
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron_ext import cli

REPO_ROOT = pathlib.Path(__file__).resolve().parents[3]
RECIPE = str(REPO_ROOT / "recipes" / "gpt_mhc_tp2_pp2_sp.yaml")


class _WritesAFile:
    """Unpickling this calls pathlib.Path.touch: code execution, observable as a file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


@pytest.fixture
def hostile(tmp_path) -> tuple[pathlib.Path, pathlib.Path]:
    """(a torch_dist root whose iteration's .metadata runs code when unpickled, marker)."""
    root, marker = tmp_path / "checkpoints", tmp_path / "code-ran"
    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(root / "iter_0000001"), no_dist=True)
    (root / "latest_checkpointed_iteration.txt").write_text("1")
    (root / "iter_0000001" / ".metadata").write_bytes(pickle.dumps(_WritesAFile(marker)))
    return root, marker


def _assert_one_refusal(text: str, marker: pathlib.Path) -> None:
    lines = [line for line in text.splitlines() if "checkpoint.load: " in line]
    assert len(lines) == 1, text
    assert ".metadata" in lines[0] and "touch" in lines[0] and "--trust-pickle" in lines[0]
    assert not marker.exists(), "the checkpoint's pickle ran"


def test_validate_refuses_a_hostile_checkpoint_load(hostile, capsys):
    root, marker = hostile
    code = cli.main(
        ["validate", RECIPE, "--platform", "cpu", "test.type=regular", f"checkpoint.load={root}"]
    )
    assert code == 2
    _assert_one_refusal(capsys.readouterr().out, marker)


def test_submit_dry_run_refuses_a_hostile_checkpoint_load(hostile, capsys, tmp_path):
    root, marker = hostile
    code = cli.main(
        [
            "submit",
            "--slurm",
            "--dry-run",
            RECIPE,
            "--platform",
            "cpu",
            "--run-dir",
            str(tmp_path / "run"),
            "test.type=regular",
            f"checkpoint.load={root}",
        ]
    )
    assert code != 0
    captured = capsys.readouterr()
    assert "#SBATCH" not in captured.out  # no script: refused before it is written
    _assert_one_refusal(captured.err, marker)
