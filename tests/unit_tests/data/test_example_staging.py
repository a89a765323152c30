"""Issue 41, item 12: ``ensure_example()`` builds into ``<dir>.tmp<pid>``; a signal or an error
must not leave that behind (one was committed), a killed build's staging is removed by the next
one, and Ctrl-C stops tokenizer training instead of waiting for it."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest

from megatron_ext.data import example, tokenizer_training

from recipe_texts import REPO_ROOT


@pytest.mark.parametrize("stop", [KeyboardInterrupt, RuntimeError])
def test_an_interrupted_build_leaves_no_staging_directory(tmp_path, monkeypatch, stop):
    def build_half(directory, workers=1):
        (tmp_path / f"example.tmp{os.getpid()}" / "corpus").mkdir(parents=True)
        raise stop("stopped while training")

    monkeypatch.setattr(example, "make_example", build_half)
    with pytest.raises(stop):
        example.ensure_example(str(tmp_path / "example"))
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_killed_builds_staging_is_removed_by_the_next_build(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / f"example.tmp{dead.pid}" / "corpus").mkdir(parents=True)
    (tmp_path / f"example.tmp{os.getpid()}").mkdir()  # a live build's: left alone
    (tmp_path / "example.tmpx").mkdir()  # not a staging name
    assert example.remove_stale_staging(tmp_path / "example") == [
        tmp_path / f"example.tmp{dead.pid}"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"example.tmp{os.getpid()}",
        "example.tmpx",
    ]


def test_ctrl_c_interrupts_a_training_that_never_returns_to_python():
    """The trainers hold the main thread in native code; :func:`interruptible` waits for them
    in short steps so the signal is seen at once."""
    release = threading.Event()
    # Python's own Ctrl-C handler, also where this session started with SIGINT ignored (a
    # shell's background job): the test is of interruptible(), not of how pytest was started.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    started = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            tokenizer_training.interruptible(release.wait, 600)
    finally:
        release.set()
        signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - started < 60
    assert tokenizer_training.interruptible(sum, [1, 2]) == 3
    with pytest.raises(ZeroDivisionError):
        tokenizer_training.interruptible(divmod, 1, 0)


def test_no_staging_directory_is_committed_and_gitignore_covers_it():
    tracked = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "ls-files"], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert not [p for p in tracked if p.startswith("example_data.tmp")]
    ignored = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "check-ignore", "-q", "example_data.tmp1565/x"]
    )
    assert ignored.returncode == 0
