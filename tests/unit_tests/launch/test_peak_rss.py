"""Every rank's peak RSS reaches the peak-memory line (issue 41, item 10: one run's line had no
entry for rank 1). The launcher measures it with wait4 when it reaps a rank; a rank reaped by
Popen.poll instead (one that ended between the launcher's wait4 and its poll) lost it."""

from __future__ import annotations

import os
import sys

from megatron_ext.launch import local
from megatron_ext.runs import verdict


def test_a_rank_ending_between_reap_and_poll_keeps_its_peak_rss(tmp_path, monkeypatch):
    (tmp_path / "quick_rank.py").write_text("print('done')\n")
    job = local.LocalJob(
        module="quick_rank",
        args=[],
        nproc=2,
        log_dir=tmp_path / "logs",
        env={"PYTHONPATH": str(tmp_path)},
        cwd=tmp_path,
        timeout_s=60,
        python=sys.executable,
    )
    real_reap = local._reap

    def reap_then_let_the_ranks_end(procs, peak_rss_kib):
        real_reap(procs, peak_rss_kib)
        for proc in procs.values():  # wait for the end without reaping (WNOWAIT)
            if proc.returncode is None:
                os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)

    monkeypatch.setattr(local, "_reap", reap_then_let_the_ranks_end)
    result = local.launch(job)
    assert result.returncode == 0
    assert sorted(result.peak_rss_kib) == [0, 1]
    assert all(kib > 0 for kib in result.peak_rss_kib.values())


def test_the_peak_memory_line_names_every_rank_and_says_na_for_a_missing_one():
    phases = [{"phase": "train", "peak_rss_mib": {"0": 100.0, "2": 120.0, "3": 90.0}}]
    performance = verdict._performance(1, {}, phases, world_size=4)
    assert performance["peak_rss_mib_per_rank"] == {"0": 100.0, "1": None, "2": 120.0, "3": 90.0}
    assert verdict._performance_lines(performance) == [
        "peak RSS per rank (MiB): 0: 100, 1: n/a, 2: 120, 3: 90"
    ]
