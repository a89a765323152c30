"""Issue 40, items 1, 2 and 6: :func:`megatron_ext.checkpoint.preload.directories_to_load`
names the one iteration directory megatron-core 0.19.2 opens for a run (tracker, ``--ckpt-step``
as int or text, ``release``, ``--pretrained-checkpoint`` only without a tracker in the load root,
a newer global non-persistent save), and the pre-start pickle check looks exactly there. A
tracker, ``.metadata`` or checkpoint file that is a FIFO is refused in one line, at once."""

from __future__ import annotations

import argparse
import os
import pathlib
import pickle
import signal

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron_ext.checkpoint import preload, safe_pickle


class _WritesAFile:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


@pytest.fixture(autouse=True)
def _never_block():
    """A blocked open or read fails the test instead of hanging it."""

    def _alarm(*_):
        raise TimeoutError("blocked")

    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def _save(directory: pathlib.Path, hostile_marker: pathlib.Path | None = None) -> pathlib.Path:
    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(directory), no_dist=True)
    if hostile_marker is not None:
        (directory / ".metadata").write_bytes(pickle.dumps(_WritesAFile(hostile_marker)))
    return directory


def _root(tmp_path, tracker: str = "2", hostile: tuple[int, ...] = (4,)) -> pathlib.Path:
    root = tmp_path / "checkpoints"
    for iteration in (2, 4):
        marker = tmp_path / "code-ran" if iteration in hostile else None
        _save(root / f"iter_{iteration:07d}", marker)
    (root / "latest_checkpointed_iteration.txt").write_text(tracker)
    return root


def _recipe(extra=None, load=None):
    return argparse.Namespace(
        extra_args=dict(extra or {}), checkpoint=argparse.Namespace(load=load)
    )


@pytest.mark.parametrize("step", [4, "4", " 4"])
def test_ckpt_step_with_checkpoint_load_is_the_directory_checked(tmp_path, step):
    root = _root(tmp_path)
    recipe = _recipe({"--ckpt-step": step}, load=str(root))
    assert [d for _, d in preload.directories_to_load(recipe)] == [root / "iter_0000004"]
    problem = preload.pickle_problem(recipe)
    assert problem and problem.startswith("checkpoint.load: ") and "iter_0000004" in problem
    assert "\n" not in problem and not (tmp_path / "code-ran").exists()
    assert preload.pickle_problem(_recipe(load=str(root))) is None  # the tracker's 2 is clean


def test_ckpt_step_applies_to_a_resume_and_to_load(tmp_path):
    root = _root(tmp_path)
    assert "iter_0000004" in (preload.pickle_problem(_recipe({"--ckpt-step": "4"}), root) or "")
    assert preload.pickle_problem(_recipe({"--ckpt-step": 0}), root) is None  # 0: the tracker
    recipe = _recipe({"--load": str(root), "--ckpt-step": 4})
    assert "extra_args.--load" in (preload.pickle_problem(recipe) or "")


def test_a_release_tracker_wins_over_the_step(tmp_path):
    root = _root(tmp_path, tracker="release", hostile=())
    _save(root / "release", tmp_path / "code-ran")
    dirs = preload.directories_to_load(_recipe({"--ckpt-step": 4}, load=None), root)
    assert [d for _, d in dirs] == [root / "release"]


def test_pretrained_checkpoint_only_when_the_load_root_has_no_tracker(tmp_path):
    root = _root(tmp_path, tracker="4")  # hostile, but not what megatron loads below
    clean = tmp_path / "clean"
    _save(clean / "iter_0000002")
    (clean / "latest_checkpointed_iteration.txt").write_text("2")
    recipe = _recipe({"--load": str(clean), "--pretrained-checkpoint": str(root)})
    assert preload.pickle_problem(recipe) is None
    (clean / "latest_checkpointed_iteration.txt").unlink()
    problem = preload.pickle_problem(recipe)
    assert problem and problem.startswith("extra_args.--pretrained-checkpoint: "), problem


def test_a_newer_global_non_persistent_save_is_the_one_checked(tmp_path):
    root = _root(tmp_path, hostile=())
    np_root = root / "non_persistent"
    _save(np_root / "iter_0000003", tmp_path / "code-ran")
    (np_root / "latest_checkpointed_iteration.txt").write_text("3")
    plain = _recipe()
    assert preload.pickle_problem(plain, root) is None  # megatron ignores it without the type
    recipe = _recipe({"--non-persistent-ckpt-type": "global"})
    problem = preload.pickle_problem(recipe, root)
    assert problem and "non-persistent" in problem and "iter_0000003" in problem, problem
    # an explicit --non-persistent-global-ckpt-dir, given with checkpoint.load
    elsewhere = tmp_path / "np"
    np_root.rename(elsewhere)
    recipe = _recipe(
        {
            "--non-persistent-ckpt-type": "global",
            "--non-persistent-global-ckpt-dir": str(elsewhere),
        },
        load=str(root),
    )
    assert "iter_0000003" in (preload.pickle_problem(recipe) or "")
    # older than the persistent one: megatron loads the persistent save
    (elsewhere / "latest_checkpointed_iteration.txt").write_text("1")
    assert preload.pickle_problem(recipe) is None
    assert not (tmp_path / "code-ran").exists()


def test_a_local_non_persistent_save_is_refused_unless_trusted(tmp_path):
    root = _root(tmp_path, hostile=())
    recipe = _recipe({"--non-persistent-ckpt-type": "local"})
    assert "--trust-pickle" in (preload.pickle_problem(recipe, root) or "")
    assert preload.pickle_problem(recipe, root, trust_pickle=True) is None
    assert preload.pickle_problem(recipe) is None  # nothing is loaded at all


def test_a_fifo_tracker_is_refused_at_once(tmp_path):
    root = _root(tmp_path, hostile=())
    (root / "latest_checkpointed_iteration.txt").unlink()
    os.mkfifo(root / "latest_checkpointed_iteration.txt")
    problem = preload.pickle_problem(_recipe(), root)
    assert problem and "is a FIFO, not a regular file" in problem and "\n" not in problem
    np_root = root / "non_persistent"
    np_root.mkdir()
    os.mkfifo(np_root / "latest_checkpointed_iteration.txt")
    (root / "latest_checkpointed_iteration.txt").unlink()
    recipe = _recipe({"--non-persistent-ckpt-type": "global"})
    assert "FIFO" in (preload.pickle_problem(recipe, root) or "")
    with pytest.raises(safe_pickle.UnsafeCheckpoint, match="FIFO"):
        safe_pickle.iteration_to_load(np_root)


@pytest.mark.parametrize("name", [".metadata", "__0_0.distcp", "common.pt"])
def test_a_fifo_inside_the_checkpoint_is_refused_at_once(tmp_path, name):
    root = _root(tmp_path, hostile=())
    target = root / "iter_0000002" / name
    target.unlink(missing_ok=True)
    os.mkfifo(target)
    problem = preload.pickle_problem(_recipe(), root)
    assert problem and "is a FIFO, not a regular file" in problem and name in problem, problem
    assert "\n" not in problem


def test_convert_checkpoint_refuses_a_fifo_input(tmp_path, capsys):
    from megatron_ext import cli

    fifo = tmp_path / "in.pt"
    os.mkfifo(fifo)
    out = str(tmp_path / "out.pt")
    code = cli.main(
        [
            "convert-checkpoint",
            str(fifo),
            out,
            "--format",
            "torch",
            "--model",
            "gpt",
            "--to",
            "upstream",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code != 0 and "is a FIFO, not a regular file" in err and "\n" not in err, err
    assert not (tmp_path / "out.pt").exists()
