"""`megatron-ext --version` and `megatron-ext doctor` as a user runs them."""

import subprocess
import sys

import megatron_ext


def _run(*args):
    return subprocess.run(
        [sys.executable, "-m", "megatron_ext.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout


def test_version():
    assert _run("--version").strip() == f"megatron-ext {megatron_ext.__version__}"


def test_doctor_reports_versions_runtime_and_patches():
    from megatron_ext import registry

    report = _run("doctor")
    assert "megatron-core     0.19.2" in report
    assert "cpu runtime       active" in report
    assert "backend           gloo" in report
    for patch in registry.patches():
        # The "trace" group is applied only while tracing (megatron-ext run --trace), the
        # "startup" one only while an entry imports megatron, the "fault" one only in a rank
        # whose MEGATRON_EXT_FAULT asks for kind=kill-while-saving, the "config" one only while
        # an mHC MLA config is built from the flags.
        inactive = ("trace", "startup", "fault", "config")
        state = "inactive" if patch.group in inactive else "active  "
        assert f"{state} {patch.target}" in report
    for seam in registry.seams():
        assert f"[{seam.kind}] ok {seam.target} (verified on {seam.package}" in report
