"""`--one-case-per-test` (tests/conftest.py), which make test's megatron-core 0.20 multi-rank
sessions use to stay within the 30 minutes: each test function's first case, every case of a
function marked ``every_case``, and still only the tests of the session's world."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parents[2]
CASES = textwrap.dedent(
    """
    import pytest

    @pytest.mark.world_size(2)
    @pytest.mark.parametrize("layout", ["pp2", "pp2_vpp2", "pp2_zb_h1"])
    def test_layouts(layout):
        pass

    @pytest.mark.world_size(2)
    @pytest.mark.every_case
    @pytest.mark.parametrize("layout", ["pp2", "pp2_vpp2"])
    def test_all_layouts(layout):
        pass

    @pytest.mark.world_size(2)
    def test_plain():
        pass

    @pytest.mark.world_size(4)
    @pytest.mark.parametrize("layout", ["pp4", "pp4_vpp2"])
    def test_four_ranks(layout):
        pass
    """
)


def _collected(tmp_path: Path, *options: str) -> list[str]:
    (tmp_path / "test_cases.py").write_text(CASES)
    env = {**os.environ, "WORLD_SIZE": "2", "PYTHONPATH": str(TESTS_DIR)}
    done = subprocess.run(  # tests/conftest.py as a plugin, on a file of our own
        [sys.executable, "-m", "pytest", "-p", "conftest", "--collect-only", "-q", *options],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return [line.split("::", 1)[1] for line in done.stdout.splitlines() if "::" in line]


def test_one_case_per_test_keeps_first_cases_every_case_tests_and_the_world(tmp_path):
    # without the option: all three test_layouts cases (a subprocess costs ~10 s: one is enough)
    assert _collected(tmp_path, "--one-case-per-test") == [
        "test_layouts[pp2]",
        "test_all_layouts[pp2]",
        "test_all_layouts[pp2_vpp2]",
        "test_plain",
    ]
