"""`megatron-ext --version` and `megatron-ext doctor` as a user runs them."""

import re
import subprocess
import sys

import megatron_ext
from megatron_ext.testing import timing


def _run(*args, stderr=False):
    done = subprocess.run(
        [sys.executable, "-m", "megatron_ext.cli", *args],
        capture_output=True,
        text=True,
        timeout=timing.bound(120),
        check=True,
    )
    return (done.stdout, done.stderr) if stderr else done.stdout


def test_version():
    assert _run("--version").strip() == f"megatron-ext {megatron_ext.__version__}"


def test_doctor_reports_versions_runtime_and_patches():
    from megatron_ext import registry

    version = registry.megatron_core_version()  # 0.19.2, or 0.20.0 in the 0.20 lane
    report, errors = _run("doctor", stderr=True)
    # Issue 25 item 19: the verdict first, and no upstream start-up warnings before it; issue
    # 35: they are counted into one line at the end (doctor imports megatron, so there are some).
    assert report.startswith(f"verdict: ready - megatron-core {version} verified")
    assert re.fullmatch(
        r"megatron-ext: \d+ upstream warnings hidden; --verbose shows them\n", errors
    )
    assert f"megatron-core     {version}" in report
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
    for patch in registry.patches(every=True):
        if not registry.applies(patch):  # a version-scoped fix for code this one lacks
            assert f"n/a      {patch.target}" in report


def test_doctor_gives_its_verdict_on_an_unverified_megatron_core(monkeypatch, capsys):
    """Issue 39: on a megatron-core it refuses, doctor still reports and ends in a verdict
    (it used to end in the traceback of install()'s refusal)."""
    import argparse

    from megatron_ext import registry
    from megatron_ext.cli import doctor

    megatron_ext.uninstall()
    monkeypatch.setattr(registry, "megatron_core_version", lambda: "0.99.0")
    monkeypatch.setattr(doctor, "_package_version", lambda name: "0.99.0")
    monkeypatch.delenv(registry.ALLOW_UNVERIFIED_ENV, raising=False)
    try:
        exit_code = doctor.main(argparse.Namespace())
    finally:
        megatron_ext.uninstall()
    report = capsys.readouterr().out
    assert exit_code == 1
    assert report.startswith("verdict: NOT READY - megatron-core 0.99.0 is not a verified version")
    assert "install refused    megatron-ext's patches are verified on megatron-core" in report


def test_the_program_exits_without_the_interpreter_teardown():
    """After the work: exit handlers run and the output is flushed, then the process ends
    without tearing the interpreter down (seconds once megatron is imported; issue 25 item
    18). An object whose finalizer only teardown would run stands in for that cost."""
    import time

    script = (
        "import atexit, sys, time\n"
        "class Teardown:\n"
        "    def __del__(self):\n"
        "        time.sleep(30); print('TEARDOWN', flush=True)\n"
        "kept = Teardown()\n"
        "atexit.register(lambda: print('ATEXIT'))\n"
        "sys.argv = ['megatron-ext']\n"
        "sys.stdout.write('unflushed, ')\n"
        "from megatron_ext.cli import console_main\n"
        "console_main()\n"
    )
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    elapsed = time.monotonic() - start
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("unflushed, usage: megatron-ext")
    assert "ATEXIT" in done.stdout and "TEARDOWN" not in done.stdout
    assert elapsed < 30, elapsed


def test_help_texts_are_plain_text_and_every_option_has_one():
    """Issue 25 item 19: no raw reStructuredText in --help, no option without help."""
    from megatron_ext import cli

    parser = cli.build_parser()
    texts = [parser.format_help()]
    subparsers = next(a for a in parser._actions if a.choices and "run" in a.choices)
    for name, sub in subparsers.choices.items():
        texts.append(sub.format_help())
        for action in sub._actions:
            assert action.help, f"megatron-ext {name} {action.option_strings or action.dest}"
    for text in texts:
        assert "``" not in text and ":func:" not in text and ":class:" not in text, text


def test_shipped_recipes_are_listed_and_copied_out_with_their_golden_values(tmp_path, capsys):
    """Issue 25 item 19: a pip-installed megatron-ext has its recipes (setup.py ships them as
    package data; scripts/check_wheel_install.sh checks the wheel) and copies one out."""
    from megatron_ext import cli
    from megatron_ext.recipes import load

    assert cli.main(["recipes"]) == 0
    listing = capsys.readouterr().out
    assert listing.startswith("gpt_mhc_cp2_pp2  ") and "\ngpt_tp2_pp2 " in listing
    assert cli.main(["recipes", "--copy", "gpt_tp2_pp2", str(tmp_path), "--with-golden"]) == 0
    loaded = load(tmp_path / "gpt_tp2_pp2.yaml")
    assert loaded.golden_path() == tmp_path / "golden/gpt_tp2_pp2/golden_values_cpu.json"
    assert loaded.golden_path().is_file()
    capsys.readouterr()
    assert cli.main(["recipes", "--copy", "gpt_tp2_pp2", str(tmp_path)]) == 2  # never overwrites
    assert cli.main(["recipes", "--copy", "gpt_tp2", str(tmp_path)]) == 2
    errors = capsys.readouterr().err
    assert "gpt_tp2_pp2.yaml exists" in errors and "did you mean 'gpt_tp2_pp2'?" in errors


def test_a_copied_recipe_carries_no_golden_values_unless_asked(tmp_path, capsys):
    """Issue 41, item 1: the shipped golden values were measured on the shipped data; a copy
    pointed at a user's corpus would fail against them, so ``--copy`` leaves them out."""
    from megatron_ext import cli
    from megatron_ext.recipes import load

    assert cli.main(["recipes", "--copy", "gpt_mhc_pp2_real_data", str(tmp_path)]) == 0
    written = capsys.readouterr().out
    assert "golden" not in written and not (tmp_path / "golden").exists(), written
    assert not load(tmp_path / "gpt_mhc_pp2_real_data.yaml").golden_path().exists()


def test_verbose_shows_the_upstream_warnings_doctor_hides():
    from megatron_ext.cli import _quiet

    report, errors = _run("doctor", "--verbose", stderr=True)
    assert report.startswith("verdict: ready")
    assert "Transformer Engine and Apex are not installed" in errors
    assert "upstream warnings hidden" not in errors
    hidden_by_default = [m for m in _quiet.UPSTREAM_NOISE if re.search(m, errors)]
    assert len(hidden_by_default) >= 2, errors
