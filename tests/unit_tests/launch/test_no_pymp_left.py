"""A failing rank leaves no multiprocessing temporary directory behind (issue 41, item 13: one
`make test` left 27 ``pymp-*`` directories, each with a ``listener-*`` socket). A rank that had
started a Manager (megatron's dist-checkpoint results queue outside megatron.training) and then
failed left through os._exit, which skips multiprocessing's clean-up: the Manager's server
process kept running and its directory stayed."""

from __future__ import annotations

import os
import subprocess
import sys

from recipe_texts import REPO_ROOT

FAILING_RANK_WITH_A_MANAGER = """
import multiprocessing

from megatron_ext.launch import faults


def work(queue):
    queue.put("written")
    raise RuntimeError("this rank fails")


if __name__ == "__main__":
    manager = multiprocessing.get_context("spawn").Manager()
    faults.run_failing_fast(work, manager.Queue())
"""


def test_a_failing_rank_with_a_manager_leaves_no_pymp_directory(tmp_path):
    (tmp_path / "rank.py").write_text(FAILING_RANK_WITH_A_MANAGER)
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    env = {**os.environ, "TMPDIR": str(temporary), "PYTHONPATH": str(REPO_ROOT)}
    log = tmp_path / "rank.log"
    with open(log, "w") as out:  # a file, not a pipe: a server left running would hold a pipe
        code = subprocess.run(
            [sys.executable, str(tmp_path / "rank.py")],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=120,
        ).returncode
    assert code == 1, log.read_text()
    assert "this rank fails" in log.read_text()
    assert sorted(p.name for p in temporary.glob("pymp-*")) == []
