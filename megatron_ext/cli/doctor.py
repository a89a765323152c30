"""``megatron-ext doctor``: versions, devices, optional packages and active patches."""

from __future__ import annotations

import argparse
import importlib.util
import platform
from importlib import metadata

NAME = "doctor"
HELP = "report versions, devices, optional packages and active patches"


def _package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def doctor_report() -> list[str]:
    """What megatron-ext runs on, and what it changed: one fact per line."""
    import torch

    import megatron_ext
    from megatron_ext import (
        declarations,  # noqa: F401  (every Patch and Seam reported below)
        registry,
        runtime,
    )

    gpu = torch.cuda.is_available()
    refusal = _install_as_a_launcher_would(gpu)
    lines = [
        f"megatron-ext      {megatron_ext.__version__}",
        f"megatron-core     {_package_version('megatron-core')} "
        f"(verified: {', '.join(registry.VERIFIED_MEGATRON_CORE)})",
        f"megatron-core code {registry.imported_megatron_core().describe()}",
        f"torch             {torch.__version__}",
        f"python            {platform.python_version()}",
        f"gpu               {torch.cuda.get_device_name(0) if gpu else 'none'}",
        f"backend           {'nccl' if gpu else 'gloo'}",
        f"transformer-engine {'present' if _importable('transformer_engine') else 'absent'}",
        f"apex              {'present' if _importable('apex') else 'absent'}",
        f"cpu runtime       {'active' if runtime.cpu_active() else 'off'}",
        *([f"install refused    {refusal}"] if refusal else []),
        "patch registry:",
    ]
    for patch in registry.patches(every=True):
        state = "active" if registry.is_applied(patch.target) else "inactive"
        if not registry.applies(patch):
            state = "n/a"  # a version-scoped fix for code this megatron-core does not have
        verified = ", ".join(patch.verified)
        lines.append(f"  [{patch.group:4}] {state:8} {patch.target} (verified on {verified})")
        lines.append(f"         why: {patch.why}")
    lines.append("private seams (depended on, not replaced; checked by install()):")
    for seam in registry.seams():
        problem = registry.seam_problem(seam)
        state = "ok" if problem is None else "BROKEN"
        verified = f"{seam.package} {', '.join(seam.verified)}"
        lines.append(f"  [{seam.kind}] {state} {seam.target} (verified on {verified})")
        lines.append(f"         why: {seam.why}" if problem is None else f"         {problem}")
    if runtime.cpu_active():
        lines.append(
            "cpu runtime also pushes: CudaToCpuMode (device='cuda' -> cpu, Tensor.cuda(), Tensor.type())"
        )
    return lines


def _install_as_a_launcher_would(gpu: bool) -> str | None:
    """What a launcher would do on this machine (the CPU runtime without a GPU, install()
    with one); the refusal's message when megatron-ext refuses this megatron-core, so the
    report still comes and the verdict says why."""
    import megatron_ext
    from megatron_ext import registry, runtime

    try:
        if gpu:
            megatron_ext.install()
        else:
            runtime.use_cpu()
    except (registry.UnverifiedMegatronCoreError, registry.SeamMismatchError) as refusal:
        return str(refusal).splitlines()[0]
    return None


def verdict() -> tuple[bool, str]:
    """(ready, one line): whether this megatron-core is a verified one and every private seam
    megatron-ext depends on is where it should be."""
    from megatron_ext import registry

    problems = []
    version = _package_version("megatron-core")
    if version not in registry.VERIFIED_MEGATRON_CORE:
        problems.append(
            f"megatron-core {version} is not a verified version "
            f"({', '.join(registry.VERIFIED_MEGATRON_CORE)})"
        )
    broken = [seam.target for seam in registry.seams() if registry.seam_problem(seam)]
    if broken:
        problems.append(f"{len(broken)} private seam(s) BROKEN: {', '.join(broken)}")
    if problems:
        return False, "verdict: NOT READY - " + "; ".join(problems) + " (details below)"
    return True, (
        f"verdict: ready - megatron-core {version} verified, every private seam in place "
        "(details below)"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser  # doctor takes no arguments


def main(args: argparse.Namespace) -> int:
    del args
    report = doctor_report()  # first: it applies the runtime the verdict judges
    ready, line = verdict()
    print("\n".join([line, *report]))
    return 0 if ready else 1
