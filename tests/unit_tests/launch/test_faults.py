"""MEGATRON_EXT_FAULT parsing and firing, the fail-fast exit and its marker line, read back
as the launchers report it (rank, where, original error)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from megatron_ext.launch import faults
from megatron_ext.testing import timing


@pytest.fixture(autouse=True)
def fresh_fault_state(monkeypatch):
    monkeypatch.setattr(faults, "_fault_read", False)
    monkeypatch.setattr(faults, "_fired", False)
    monkeypatch.setattr(faults, "_current_step", None)
    monkeypatch.delenv(faults.FAULT_ENV, raising=False)
    # Earlier tests of this session may have started a world of one (rank 0): these tests
    # speak of the rank through RANK, as a rank before init_process_group does.
    monkeypatch.setattr(faults, "_global_rank", lambda: int(faults.os.environ.get("RANK", "0")))


def test_parse():
    assert faults.parse_fault("rank=2,step=3") == faults.Fault(2, 3, "raise")
    assert faults.parse_fault(" rank=0 , step=1 , kind=kill ") == faults.Fault(0, 1, "kill")
    for bad in (
        "rank=1",
        "rank=a,step=1",
        "rank=1,step=0",
        "rank=1,step=1,kind=explode",
        "rank=1,step=1,kind=kill-while-loading",
        "rank=1,step=1,when=now",
        "garbage",
    ):
        with pytest.raises(ValueError, match=faults.FAULT_ENV):
            faults.parse_fault(bad)


def test_off_by_default_and_fires_once_on_its_rank_and_step(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    for step in range(1, 4):
        faults.at_step(step)  # no MEGATRON_EXT_FAULT: nothing happens
    monkeypatch.setattr(faults, "_fault_read", False)
    monkeypatch.setenv(faults.FAULT_ENV, "rank=1,step=2")
    faults.at_step(1)
    with pytest.raises(faults.InjectedFault, match="rank 1 at step 2"):
        faults.at_step(2)
    faults.at_step(2)  # later micro-batches of the same step: already fired
    monkeypatch.setenv("RANK", "0")


def test_other_ranks_do_not_fire(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv(faults.FAULT_ENV, "rank=1,step=1")
    faults.at_step(1)


def test_fail_fast_exits_at_once_with_the_marker(tmp_path):
    """A rank that raises inside run_failing_fast exits 1 without running exit-time clean-up
    (which could wait on peers), and its log names rank, step, place and error."""
    script = tmp_path / "rank.py"
    script.write_text(
        textwrap.dedent("""
        import atexit, os, time
        from megatron_ext.launch import faults
        os.environ["RANK"] = "3"
        atexit.register(time.sleep, 3600)  # e.g. a barrier on a dead peer: never reached
        def work():
            faults.at_step(5)
            raise ValueError("the original error\\nsecond line")
        faults.run_failing_fast(work)
    """)
    )
    log = tmp_path / "rank-3.log"
    with open(log, "w") as out:
        proc = subprocess.run(
            [sys.executable, str(script)],
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=timing.bound(60),
        )
    assert proc.returncode == 1
    failure = faults.failure_in_log(log)
    assert failure.rank == 3
    assert failure.where.startswith("step 5, rank.py:")
    assert failure.error == "ValueError: the original error second line"
    assert "Traceback" in log.read_text()
    assert faults.first_failure([log, tmp_path / "missing.log"]) == failure


def test_describe_exit():
    assert faults.describe_exit(-9) == "killed by SIGKILL"
    assert faults.describe_exit(3) == "exited with 3"


def test_kill_while_saving_fires_in_the_save_finalisation_only(monkeypatch):
    """kind=kill-while-saving never fires at a step; armed, it wraps megatron's save
    finalisation (registry group "fault"), which kills the rank in the first save at or after
    its step, before the wrapped original runs."""
    from megatron_ext import registry

    target = registry.patches("fault")[0].target
    monkeypatch.setenv("RANK", "1")
    faults.arm_save_fault()
    assert not registry.is_applied(target), "not asked for: nothing wrapped"
    monkeypatch.setattr(faults, "_fault_read", False)
    monkeypatch.setenv(faults.FAULT_ENV, "rank=1,step=2,kind=kill-while-saving")
    assert faults.parse_fault(faults.os.environ[faults.FAULT_ENV]).kind == "kill-while-saving"
    kills, finalised = [], []
    monkeypatch.setattr(faults, "_kill_self", lambda: kills.append(faults._current_step))
    finalize = faults.killing_before_save_finalize(lambda *a: finalised.append(a))
    for step in (1, 2, 3):
        faults.at_step(step)  # never fires at a step
        finalize(step)
    assert kills == [2] and finalised == [(1,), (2,), (3,)]
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(faults, "_fired", False)
    finalize(4)
    assert kills == [2], "another rank's saves are untouched"
    try:
        faults.arm_save_fault()
        assert registry.is_applied(target)
    finally:
        registry.undo("fault")
    assert not registry.is_applied(target)
