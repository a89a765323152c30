"""A user's own Megatron-LM checkout: version guard on the imported code, dataset helpers,
upstream's own mHC flags, ModelOpt with mHC, and the flag spellings of upstream dev."""

import argparse
import dataclasses
import os
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest

from megatron_ext import checkout, registry
from megatron_ext.testing import timing

REPO_ROOT = Path(__file__).resolve().parents[2]


def _fake_checkout(root: Path, version=(0, 19, 1)) -> Path:
    """A directory laid out like Megatron-LM: megatron/core/package_info.py as upstream writes it."""
    core = root / "megatron" / "core"
    core.mkdir(parents=True)
    (root / "megatron" / "__init__.py").write_text("")
    (core / "__init__.py").write_text("")
    major, minor, patch = version
    (core / "package_info.py").write_text(
        f'MAJOR = {major}\nMINOR = {minor}\nPATCH = {patch}\nPRE_RELEASE = ""\n'
        "VERSION = (MAJOR, MINOR, PATCH, PRE_RELEASE)\n"
        "__version__ = '.'.join(map(str, VERSION[:3])) + '+abc1234'\n"
    )
    return core


def test_the_guard_reads_the_imported_code_and_names_a_checkout(tmp_path):
    core = _fake_checkout(tmp_path)
    script = textwrap.dedent("""
        from megatron_ext import registry
        code = registry.imported_megatron_core()
        print(code.version)
        try:
            registry.check_megatron_core_version(registry.patches("core"))
        except registry.UnverifiedMegatronCoreError as exc:
            print(exc)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO_ROOT)])}
    env.pop(registry.ALLOW_UNVERIFIED_ENV, None)
    out = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=timing.bound(120),
    )
    assert out.returncode == 0, out.stderr
    version, message = out.stdout.splitlines()[:2]
    assert version == "0.19.1", (
        "the code's package_info, not pip's metadata (0.19.2) nor the git suffix"
    )
    installed = metadata.version("megatron-core")
    assert (
        f"code at {core}" in message and f"not the installed megatron-core {installed}" in message
    )
    assert "megatron-core==0.19.2" in message and registry.ALLOW_UNVERIFIED_ENV in message


def test_the_installed_wheel_is_its_own_code():
    code = registry.imported_megatron_core()
    assert code.version == metadata.version("megatron-core") and code.from_distribution
    assert code.version in registry.VERIFIED_MEGATRON_CORE
    assert "checkout" not in code.describe()


def test_dataset_helpers_prebuilt_are_used_as_they_are(tmp_path):
    built = []
    assert (
        checkout.ensure_dataset_helpers(lambda: built.append(1), str(tmp_path), lambda: None)
        == "prebuilt"
    )
    assert not built, "no make where the extension imports"


def test_dataset_helpers_are_built_with_the_checkouts_makefile(tmp_path, monkeypatch):
    # A Makefile that "builds" a module, standing in for helpers.cpp -> helpers_cpp*.so.
    (tmp_path / "Makefile").write_text("default:\n\techo 'VALUE = 42' > fake_helpers_cpp.py\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    build = lambda: subprocess.run(["make", "-s", "-C", str(tmp_path)], check=True)  # noqa: E731
    importer = lambda: __import__("fake_helpers_cpp")  # noqa: E731
    assert checkout.ensure_dataset_helpers(build, str(tmp_path), importer) == "built"
    assert __import__("fake_helpers_cpp").VALUE == 42
    sys.modules.pop("fake_helpers_cpp", None)


def test_dataset_helpers_missing_without_a_makefile_say_how_to_build_them(tmp_path):
    def missing():
        raise ImportError("No module named 'megatron.core.datasets.helpers_cpp'")

    with pytest.raises(checkout.DatasetHelpersMissing, match=rf"make -C {tmp_path}"):
        checkout.ensure_dataset_helpers(lambda: None, str(tmp_path), missing)

    def failing_make():  # what megatron's compile_helpers does when make fails
        raise SystemExit(1)

    (tmp_path / "Makefile").write_text("default:\n\tfalse\n")
    with pytest.raises(checkout.DatasetHelpersMissing, match="pybind11"):
        checkout.ensure_dataset_helpers(failing_make, str(tmp_path), missing)


def test_the_registry_entry_builds_helpers_only_when_missing():
    entry = next(p for p in registry.patches("core") if p.target.endswith(":compile_helpers"))
    ran = []
    replacement = entry.make(lambda: ran.append("make"))
    replacement()  # the wheel's prebuilt extension imports: megatron's make is not run
    assert ran == []


def test_a_megatron_lm_with_its_own_mhc_is_refused_in_one_line():
    @dataclasses.dataclass
    class MainConfig:  # upstream main's TransformerConfig declares the field
        enable_mhc_connections: bool = False

    with pytest.raises(SystemExit) as exc:
        checkout.refuse_upstream_mhc("pretrain_gpt.py", "megatron_ext.pretrain_gpt", MainConfig)
    message = str(exc.value)
    assert "\n" not in message and "--enable-mhc-connections" in message
    assert "-m megatron_ext.pretrain_gpt" in message and "core_v0.19" in message
    # megatron-core 0.19.2 has no mHC of its own: nothing to refuse. (0.20 has: the patched
    # core_v0.19 scripts refuse it, as they refuse main's class above.)
    from megatron_ext import native_mhc as native

    if native.config_declares_mhc():
        with pytest.raises(SystemExit, match="--enable-mhc-connections"):
            checkout.refuse_upstream_mhc("pretrain_gpt.py", "megatron_ext.pretrain_gpt")
    else:
        checkout.refuse_upstream_mhc("pretrain_gpt.py", "megatron_ext.pretrain_gpt")


def test_modelopt_with_mhc_is_refused_by_name():
    with pytest.raises(SystemExit, match="ModelOpt"):
        checkout.refuse_modelopt_with_mhc(
            argparse.Namespace(enable_mhc_connections=True, modelopt_enabled=True)
        )
    checkout.refuse_modelopt_with_mhc(
        argparse.Namespace(enable_mhc_connections=True, modelopt_enabled=False)
    )
    checkout.refuse_modelopt_with_mhc(
        argparse.Namespace(enable_mhc_connections=False, modelopt_enabled=True)
    )


def test_modelopt_with_zb_h1_is_refused_by_name():
    with pytest.raises(SystemExit, match=r"--pipeline-schedule zb-h1 cannot be combined with Mod"):
        checkout.refuse_modelopt_with_mhc(
            argparse.Namespace(modelopt_enabled=True, pipeline_schedule="zb-h1")
        )
    checkout.refuse_modelopt_with_mhc(
        argparse.Namespace(modelopt_enabled=True, pipeline_schedule="1f1b")
    )
    checkout.refuse_modelopt_with_mhc(
        argparse.Namespace(modelopt_enabled=False, pipeline_schedule="zb-h1")
    )


def test_upstream_dev_flag_spellings_are_aliases():
    from megatron_ext.pretrain_gpt import add_megatron_ext_args

    parser = add_megatron_ext_args(argparse.ArgumentParser())
    args = parser.parse_args(["--enable-hyper-connections", "--num-residual-streams", "2"])
    assert args.enable_mhc_connections is True and args.mhc_num_residual_streams == 2
    args = parser.parse_args(["--enable-mhc-connections", "--mhc-num-residual-streams", "8"])
    assert args.enable_mhc_connections is True and args.mhc_num_residual_streams == 8
    assert parser.parse_args([]).enable_mhc_connections is False


def test_flags_a_megatron_lm_already_declares_are_not_declared_twice():
    from megatron_ext.pretrain_gpt import add_megatron_ext_args

    parser = argparse.ArgumentParser()
    parser.add_argument("--enable-mhc-connections", action="store_true")  # as upstream main does
    add_megatron_ext_args(parser)  # argparse would raise "conflicting option string"
    assert parser.parse_args(["--enable-hyper-connections"]).enable_mhc_connections is True
