"""Every pickle of a checkpoint directory is checked before anything loads it (issue 34 item
1): torch DCP's ``.metadata``, the byte items inside ``*.distcp`` and ``*.pt`` files. A pickle
naming any global outside the declared ones is refused in one line naming the file and the
global, without running it; a clean torch_dist save passes."""

from __future__ import annotations

import argparse
import pathlib
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron_ext.checkpoint import preload, safe_pickle


class _WritesAFile:
    """Unpickling this calls pathlib.Path.touch: code execution, observable as a file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def _saved(directory: pathlib.Path, obj=None) -> pathlib.Path:
    """A torch_dist-style iteration directory: a tensor and a pickled (byte) item."""
    state = {"w": torch.ones(3), "common": obj or {"args": argparse.Namespace(hidden_size=8)}}
    dcp.save(state, checkpoint_id=str(directory))
    return directory


def _assert_refused(exc: pytest.ExceptionInfo, file: str, global_name: str) -> None:
    message = str(exc.value)
    assert "\n" not in message, message
    assert file in message and global_name in message and "--trust-pickle" in message, message


def test_a_clean_dcp_save_passes_and_each_pickle_is_counted(tmp_path):
    directory = _saved(tmp_path / "iter_0000001")
    assert safe_pickle.check_iteration_dir(directory) == 2  # .metadata + the byte item


def test_a_payload_in_metadata_is_refused_without_running(tmp_path):
    directory = _saved(tmp_path / "iter_0000001")
    marker = tmp_path / "code-ran"
    (directory / ".metadata").write_bytes(pickle.dumps(_WritesAFile(marker)))
    with pytest.raises(safe_pickle.UnsafeCheckpoint) as refused:
        safe_pickle.check_iteration_dir(directory)
    _assert_refused(refused, str(directory / ".metadata"), "pathlib.Path.touch")
    assert not marker.exists()
    # the check is not vacuous: plain pickle runs the same bytes
    pickle.loads((directory / ".metadata").read_bytes())
    assert marker.exists()


def test_a_payload_in_a_distcp_byte_item_is_refused(tmp_path):
    """torch's DefaultLoadPlanner.load_bytes reads these with weights_only=False."""
    marker = tmp_path / "code-ran"
    directory = _saved(tmp_path / "iter_0000001", {"x": _WritesAFile(marker)})
    with pytest.raises(safe_pickle.UnsafeCheckpoint) as refused:
        safe_pickle.check_iteration_dir(directory)
    # torch.save pickles Path.touch as getattr(Path, "touch"): the refused global is getattr
    _assert_refused(refused, "__0_0.distcp (item 'common.x')", "getattr")
    assert not marker.exists()


def test_a_payload_in_common_pt_is_refused(tmp_path):
    directory = _saved(tmp_path / "iter_0000001")
    marker = tmp_path / "code-ran"
    torch.save({"args": _WritesAFile(marker)}, directory / "common.pt")
    with pytest.raises(safe_pickle.UnsafeCheckpoint) as refused:
        safe_pickle.check_iteration_dir(directory)
    _assert_refused(refused, "common.pt", "getattr")
    assert not marker.exists()


def test_junk_and_escaping_items_are_refused_in_one_line(tmp_path):
    directory = _saved(tmp_path / "iter_0000001")
    (directory / ".metadata").write_bytes(b"\x80\x04junk")
    with pytest.raises(safe_pickle.UnsafeCheckpoint, match="cannot be checked: not a pickle"):
        safe_pickle.check_iteration_dir(directory)
    (directory / ".metadata").write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(safe_pickle.UnsafeCheckpoint, match="not torch DCP's Metadata"):
        safe_pickle.check_iteration_dir(directory)


def test_the_checked_iteration_is_the_one_megatron_would_load(tmp_path):
    root = tmp_path / "checkpoints"
    _saved(root / "iter_0000002")
    _saved(root / "iter_0000004")
    (root / "iter_0000004" / ".metadata").write_bytes(pickle.dumps(_WritesAFile(tmp_path / "m")))
    (root / "latest_checkpointed_iteration.txt").write_text("2")
    assert safe_pickle.iteration_to_load(root) == root / "iter_0000002"
    assert safe_pickle.check_checkpoint(root) == 2
    with pytest.raises(safe_pickle.UnsafeCheckpoint, match="iter_0000004"):
        safe_pickle.check_checkpoint(root, step=4)
    (root / "latest_checkpointed_iteration.txt").unlink()  # no tracker: every iteration
    with pytest.raises(safe_pickle.UnsafeCheckpoint, match="iter_0000004"):
        safe_pickle.check_checkpoint(root)


def test_a_recipe_naming_a_hostile_pretrained_checkpoint_is_refused(tmp_path):
    root = tmp_path / "checkpoints"
    _saved(root / "iter_0000001")
    (root / "latest_checkpointed_iteration.txt").write_text("1")
    recipe = argparse.Namespace(extra_args={"--pretrained-checkpoint": str(root)})
    assert preload.pickle_problem(recipe) is None
    (root / "iter_0000001" / ".metadata").write_bytes(pickle.dumps(_WritesAFile(tmp_path / "m")))
    problem = preload.pickle_problem(recipe)
    assert problem and problem.startswith("extra_args.--pretrained-checkpoint: "), problem
    assert preload.pickle_problem(recipe, trust_pickle=True) is None
    assert not (tmp_path / "m").exists()
