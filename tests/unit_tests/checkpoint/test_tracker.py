"""The checkpoint tracker is replaced in one rename: a reader (or a kill) between megatron's
open and write never sees an empty latest_checkpointed_iteration.txt."""

import megatron_ext
from megatron_ext.checkpoint.tracker import TRACKER_NAME, AtomicTrackerStorage


def _write_like_megatron(storage, path, text, seen):
    with storage.open(str(path), "w") as f:  # megatron's save_checkpoint, iter_finalize_fn
        seen.append(path.read_text())  # what a reader (or a kill) finds mid-write
        f.write(text)


def test_the_tracker_is_never_seen_empty(tmp_path):
    megatron_ext.install()
    from megatron.training import checkpointing

    assert isinstance(checkpointing.maybe_msc, AtomicTrackerStorage), (
        "installed through the registry"
    )
    tracker, seen = tmp_path / TRACKER_NAME, []
    tracker.write_text("4")
    _write_like_megatron(checkpointing.maybe_msc, tracker, "5", seen)
    assert seen == ["4"] and tracker.read_text() == "5"
    assert sorted(p.name for p in tmp_path.iterdir()) == [TRACKER_NAME], "no temporary file left"
    other = tmp_path / "other.txt"
    with checkpointing.maybe_msc.open(str(other), "w") as f:
        f.write("x")
    assert other.read_text() == "x" and checkpointing.maybe_msc.os is __import__("os"), (
        "the rest is delegated"
    )


def test_upstream_truncates_the_tracker_first(tmp_path):
    from megatron.core.msc_utils import maybe_msc as upstream  # what checkpointing imports

    tracker, seen = tmp_path / TRACKER_NAME, []
    tracker.write_text("4")
    _write_like_megatron(upstream, tracker, "5", seen)
    assert seen == [""], "upstream's in-place rewrite is empty mid-write"
