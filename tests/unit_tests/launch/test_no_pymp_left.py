"""No rank leaves a multiprocessing temporary directory behind (issue 41, item 13: one
`make test` left 27 ``pymp-*`` directories, each with a ``listener-*`` socket).

The cause: PyTorch's DataLoader workers (megatron's train, valid and test loaders, two workers
each) make one as soon as they send a batch (the resource sharer that hands a tensor's shared
memory to the rank), and a signal ends them without multiprocessing's clean-up: the failing
rank's own clean-up terminates them, the launcher stops a run's process groups, a killed rank's
workers are reaped. A rank that failed with a Manager running left the Manager's too. Every test
runs its processes with TMPDIR at a fresh directory and looks for ``pymp-*`` there."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from megatron_ext.launch import local, mp_temp_dir

from recipe_texts import REPO_ROOT


@pytest.fixture
def temp_root(monkeypatch):
    """A fresh, empty system temporary directory for this test's processes (TMPDIR) and the
    launcher's (tempfile.tempdir). Short: a socket path under it must fit in 108 bytes, which
    a pytest tmp_path plus ``pymp-*/listener-*`` nearly fills."""
    root = Path(tempfile.mkdtemp(prefix="t41-"))
    monkeypatch.setenv("TMPDIR", str(root))
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _left_behind(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("pymp-*"))


def _run_rank(script: str, tmp_path: Path, temp_root: Path) -> tuple[int, str]:
    """``script`` as one rank outside any launcher, with TMPDIR at ``temp_root``."""
    (tmp_path / "rank.py").write_text(script)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    env.pop(mp_temp_dir.DIR_ENV, None)
    log = tmp_path / "rank.log"
    with open(log, "w") as out:  # a file, not a pipe: a process left running would hold a pipe
        code = subprocess.run(
            [sys.executable, str(tmp_path / "rank.py")],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=300,
        ).returncode
    return code, log.read_text()


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


def test_a_failing_rank_with_a_manager_leaves_no_pymp_directory(tmp_path, temp_root):
    code, log = _run_rank(FAILING_RANK_WITH_A_MANAGER, tmp_path, temp_root)
    assert code == 1, log
    assert "this rank fails" in log
    assert _left_behind(temp_root) == []


# megatron's loaders as megatron.training builds them: persistent workers, forked (Linux's
# default), tensors in the batches (their memory is shared through a file descriptor).
FAILING_RANK_WITH_DATALOADER_WORKERS = """
import multiprocessing.util
import os

import torch
from torch.utils.data import DataLoader

from megatron_ext.launch import faults


def work():
    loader = iter(DataLoader(torch.arange(64.0).view(16, 4), batch_size=2, num_workers=2,
                             persistent_workers=True))
    for _ in range(4):  # every worker has sent a batch
        next(loader)
    here = os.listdir(multiprocessing.util.get_temp_dir())
    print("worker sockets in the rank's directory:", sum(n.startswith("listener-") for n in here))
    raise RuntimeError("this rank fails with its workers running")


if __name__ == "__main__":
    faults.run_failing_fast(work)
"""


def test_a_failing_rank_with_dataloader_workers_leaves_no_pymp_directory(tmp_path, temp_root):
    """The failing rank's clean-up terminates its workers; their sockets lie in the rank's own
    directory, which that clean-up removes. Before: one directory per worker was left."""
    code, log = _run_rank(FAILING_RANK_WITH_DATALOADER_WORKERS, tmp_path, temp_root)
    assert code == 1, log
    assert "this rank fails with its workers running" in log
    assert _left_behind(temp_root) == []
    assert "worker sockets in the rank's directory: 2" in log, log


# Each rank starts a child that holds a listener-* socket (as a DataLoader worker's resource
# sharer does) and says where; rank 1 is then killed, rank 0 waits until the launcher stops it.
RANK_WITH_A_LISTENING_CHILD = """
import multiprocessing
import os
import signal
import sys
import time
from multiprocessing.connection import Listener

from megatron_ext.launch import faults


def hold_a_socket(ready):
    listener = Listener()
    ready.send(listener.address)
    time.sleep(120)


def work(out):
    context = multiprocessing.get_context("fork")
    theirs, mine = context.Pipe()
    context.Process(target=hold_a_socket, args=(mine,), daemon=True).start()
    address = theirs.recv()
    rank = int(os.environ["RANK"])
    with open(os.path.join(out, f"socket-{rank}"), "w") as f:
        f.write(address)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)


if __name__ == "__main__":
    faults.run_failing_fast(work, sys.argv[1])
"""


def test_a_run_whose_ranks_are_killed_and_stopped_leaves_no_pymp_directory(tmp_path, temp_root):
    """A killed rank and a stopped one run no clean-up at all: the launcher removes the run's
    directory, in which every socket of their children lies. Before: each child left its own."""
    (tmp_path / "listening_rank.py").write_text(RANK_WITH_A_LISTENING_CHILD)
    job = local.LocalJob(
        module="listening_rank",
        args=[str(tmp_path)],
        nproc=2,
        log_dir=tmp_path / "logs",
        env={"PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO_ROOT)])},
        cwd=tmp_path,
        grace_s=0.5,
    )
    result = local.launch(job)
    assert result.returncode == -signal.SIGKILL and result.failed_rank == 1, result
    sockets = [Path((tmp_path / f"socket-{rank}").read_text()) for rank in range(2)]
    assert all(temp_root in s.parents for s in sockets), sockets
    assert _left_behind(temp_root) == []
    assert sockets[0].parent == sockets[1].parent, "one directory for the run's processes"
