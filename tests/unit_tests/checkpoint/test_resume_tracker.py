"""A ``--load`` tracker holding junk: megatron 0.19.2 exits with status 0 (nothing trained, the
launcher reports success); megatron-ext's entries end the rank with status 1 and one line
naming the file and the fix before ``pretrain`` starts (issue 25 item 3)."""

from __future__ import annotations

import argparse

import pytest

from megatron_ext.checkpoint.tracker import TRACKER_NAME, tracker_problem
from megatron_ext.launch import training


def test_megatron_itself_exits_with_status_0_on_a_junk_tracker(tmp_path):
    from megatron.training.checkpointing import read_metadata

    (tmp_path / TRACKER_NAME).write_text("banana")
    with pytest.raises(SystemExit) as exited:
        read_metadata(str(tmp_path / TRACKER_NAME))
    assert exited.value.code in (None, 0), "upstream changed: revisit check_resume_tracker"


@pytest.mark.parametrize("content", ["banana", "", "-3", "4.5", "٣"])
def test_the_entry_refuses_a_junk_tracker_before_pretrain(tmp_path, content):
    (tmp_path / TRACKER_NAME).write_text(content)
    with pytest.raises(SystemExit) as exited:  # pretrain and its providers are never reached
        training.run_pretrain(argparse.Namespace(load=str(tmp_path)), None, None, None, None)
    message = str(exited.value.code)
    assert message.startswith("error: --load: ") and TRACKER_NAME in message, message
    assert "\n" not in message and "iteration" in message


@pytest.mark.parametrize("content", ["4", "0000012\n", "release"])
def test_a_good_tracker_or_none_passes(tmp_path, content):
    assert tracker_problem(str(tmp_path)) is None, "no tracker: a fresh start"
    (tmp_path / TRACKER_NAME).write_text(content)
    assert tracker_problem(str(tmp_path)) is None
