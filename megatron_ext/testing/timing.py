"""Wall-clock bounds for tests that watch processes start and end, scaled by how busy the
machine is now.

A test that proves "every rank ended" needs a bound, or a hang would pass as a slow end. An
absolute bound (20 s, 60 s) is written for an idle machine; on a loaded CI machine (load 10-40
on 2 cores) the same start-up and teardown take many times longer and the test fails without a
bug. So a bound is the idle figure times the machine's present slowdown: how much longer than
its own CPU time a reference start-up (a Python interpreter importing the launcher, then a
short busy loop) takes in wall-clock time, or the load average per core if that is higher.
Idle, the slowdown is about 1 and the bounds are the idle figures; both CPU contention and I/O
waits raise it. It is measured once and re-measured when older than ``REFRESH_S`` (the load of
a 20-minute session changes).

``MEGATRON_EXT_SOAK=1`` (the soak tier, run on a quiet machine) keeps the idle figures: that is
where a slow but finite end is caught.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

SOAK_ENV = "MEGATRON_EXT_SOAK"
REFRESH_S = 30.0
# The reference: interpreter start-up and an import (I/O and CPU, as a rank's start), then a busy
# loop until the child has used BUSY_CPU_S of CPU, so that the ratio is not a 50 ms sample.
BUSY_CPU_S = 0.3
_REFERENCE = (
    f"import time, megatron_ext.launch.local\nwhile time.process_time() < {BUSY_CPU_S}:\n    pass\n"
)

_measured: tuple[float, float] | None = None  # (when, slowdown)


def soak() -> bool:
    return os.environ.get(SOAK_ENV) == "1"


def reference_slowdown() -> float:
    """Wall-clock over CPU time of the reference start-up, run now (at least 1)."""
    start = time.monotonic()
    child = subprocess.Popen([sys.executable, "-c", _REFERENCE])
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    wall = time.monotonic() - start
    if child.returncode != 0:
        raise RuntimeError(f"the reference start-up exited {child.returncode}")
    return max(1.0, wall / max(usage.ru_utime + usage.ru_stime, 1e-3))


def load_per_core() -> float:
    return os.getloadavg()[0] / (os.cpu_count() or 1)


def slowdown() -> float:
    """How many times slower than idle this machine runs now (1 under MEGATRON_EXT_SOAK=1)."""
    return 1.0 if soak() else present_slowdown()


def present_slowdown() -> float:
    """How many times slower than idle this machine runs now, in every tier; measured again
    when older than ``REFRESH_S`` (a measurement takes seconds on a busy machine)."""
    global _measured
    now = time.monotonic()
    if _measured is None or now - _measured[0] > REFRESH_S:
        _measured = (now, max(reference_slowdown(), load_per_core()))
    return _measured[1]


class Bound(float):
    """A bound in seconds (a float, usable as a timeout) that says how it was taken."""

    idle_s: float
    factor: float

    def __new__(cls, idle_s: float, factor: float) -> Bound:
        self = super().__new__(cls, idle_s * factor)
        self.idle_s, self.factor = idle_s, factor
        return self

    def explain(self, seconds: float) -> str:
        """An assertion message: how long it took against which bound."""
        return (
            f"{seconds:.1f} s, bound {float(self):.0f} s ({self.idle_s:g} s idle x slowdown "
            f"{self.factor:.1f}; load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores now)"
        )


def bound(idle_s: float) -> Bound:
    """``idle_s``, a bound written for an idle machine, scaled to the machine's present load."""
    return Bound(idle_s, slowdown())


def harness_bound(idle_s: float) -> Bound:
    """``idle_s`` scaled to the machine's present slowdown even in the soak tier: for a wait on
    something a test only needs to happen before it can check its claim (a job to reach an
    iteration, Slurm to notice a lost node, a daemon to start), not for the claim itself. The
    soak tier keeps idle figures to catch a slow but finite end of the product; a harness step
    that is merely slow on a shared machine is not that."""
    return Bound(idle_s, present_slowdown())


def watchdog_env() -> dict[str, str]:
    """The environment for a run a test starts: the stall watchdog's start-up allowance (300 s
    idle, megatron_ext.launch.heartbeat.STARTUP_S) scaled to the load, so that a slow start on a
    busy machine is not taken for a stall. An allowance already set is kept."""
    from megatron_ext.launch import heartbeat

    if os.environ.get(heartbeat.STARTUP_ENV):
        return {}
    return {heartbeat.STARTUP_ENV: f"{bound(heartbeat.STARTUP_S):.0f}"}
