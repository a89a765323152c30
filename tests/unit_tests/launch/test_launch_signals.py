"""SIGTERM, SIGHUP and Ctrl-C (SIGINT) of the local launcher stop every rank and the helpers
ranks spawned, and a rank that dies by SIGKILL leaves no helper behind. The ranks are a
few lines of Python that spawn a helper child like a checkpoint writer would."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megatron_ext.launch import local
from megatron_ext.testing import timing

RANK_MODULE = """
import os, signal, subprocess, sys, time
rank = int(os.environ["RANK"])
out = sys.argv[2]
helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
with open(os.path.join(out, f"pids-{rank}.json"), "w") as f:
    f.write('{"rank": %d, "helper": %d}' % (os.getpid(), helper.pid))
if sys.argv[1] == "die" and rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)  # no chance to stop its helper
time.sleep(120)
"""

# The driver is started as a terminal starts a command: Ctrl-C raises KeyboardInterrupt. A test
# session started in the background (`make test &`, nohup) hands its children SIGINT ignored,
# and Python then installs no handler of its own: the signal would be lost, not the launcher's.
DRIVER = """
import signal, sys
from pathlib import Path
from megatron_ext.launch import local
signal.signal(signal.SIGINT, signal.default_int_handler)
job = local.LocalJob(module="fake_rank", args=["hang", sys.argv[1]], nproc=2, log_dir=Path(sys.argv[1]) / "logs",
                     env={"PYTHONPATH": sys.argv[1]}, cwd=Path(sys.argv[1]))
try:
    local.launch(job)
except KeyboardInterrupt as exc:  # local.Interrupted (SIGTERM/SIGHUP) or Ctrl-C's own
    signum = getattr(exc, "signum", 2)
    print("interrupted", signum, flush=True)
    sys.exit(128 + signum)
"""


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_for_pids(directory: Path, n: int, idle_timeout: float = 60) -> list[int]:
    timeout = timing.bound(idle_timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = list(directory.glob("pids-*.json"))
        if len(files) == n:
            try:
                return [pid for f in files for pid in json.loads(f.read_text()).values()]
            except ValueError:
                pass  # half written
        time.sleep(0.1)
    raise AssertionError(f"the ranks did not start within {timeout:.0f} s")


@pytest.fixture
def rank_dir(tmp_path):
    (tmp_path / "fake_rank.py").write_text(RANK_MODULE)
    (tmp_path / "driver.py").write_text(DRIVER)
    return tmp_path


# Ctrl-C reaches only the launcher: the ranks run in sessions of their own.
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_stop_signal_ends_every_rank_and_helper(rank_dir, sig):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path.cwd()), os.environ.get("PYTHONPATH", "")]),
    }
    driver = subprocess.Popen(
        [sys.executable, str(rank_dir / "driver.py"), str(rank_dir)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        pids = _wait_for_pids(rank_dir, 2)
        limit = timing.bound(15)  # the launcher's grace (5 s) and two interpreters' exit
        start = time.monotonic()
        driver.send_signal(sig)
        out, _ = driver.communicate(timeout=2 * limit)
        seconds = time.monotonic() - start
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 128 + sig, out
    assert f"interrupted {int(sig)}" in out
    print(limit.explain(seconds))  # shown with -rP: the margin under load
    assert seconds < limit, limit.explain(seconds)
    assert all(_gone(pid) for pid in pids), [p for p in pids if not _gone(p)]


def test_helpers_of_a_killed_rank_are_reaped(rank_dir):
    job = local.LocalJob(
        module="fake_rank",
        args=["die", str(rank_dir)],
        nproc=2,
        log_dir=rank_dir / "logs",
        env={"PYTHONPATH": str(rank_dir)},
        cwd=rank_dir,
        grace_s=0.5,
    )
    result = local.launch(job)
    assert result.returncode == -signal.SIGKILL and result.failed_rank == 1
    pids = [pid for f in rank_dir.glob("pids-*.json") for pid in json.loads(f.read_text()).values()]
    assert len(pids) == 4
    assert all(_gone(pid) for pid in pids), [p for p in pids if not _gone(p)]
