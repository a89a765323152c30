"""The Dockerfile cannot be built here (no Docker, no GPU image): check that it parses, uses
NVIDIA's PyTorch image, pins a megatron-core release that setup.py's range admits and that
requirements.txt and the registry name, installs megatron-ext with its tests, defaults to
`megatron-ext doctor`, and declares (and imports at build time) every module that the layers of
the gpu-cluster recipes need."""

import json
import re
import shlex
from pathlib import Path

from packaging.specifiers import SpecifierSet  # noqa: F401  (annotation)

REPO_ROOT = Path(__file__).resolve().parents[2]
INSTRUCTIONS = {
    "FROM",
    "ARG",
    "ENV",
    "WORKDIR",
    "COPY",
    "ADD",
    "RUN",
    "CMD",
    "ENTRYPOINT",
    "LABEL",
    "EXPOSE",
    "USER",
    "VOLUME",
    "SHELL",
    "HEALTHCHECK",
    "STOPSIGNAL",
    "ONBUILD",
}


def parse_dockerfile(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction: comments dropped, continuations joined."""
    instructions, pending = [], ""
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # Docker drops comment lines inside a continuation
        pending += (" " if pending else "") + line
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        keyword, _, args = pending.partition(" ")
        assert keyword.upper() in INSTRUCTIONS, f"line {number}: unknown instruction {keyword!r}"
        assert keyword == keyword.upper(), f"line {number}: write instructions in capitals"
        instructions.append((keyword, args.strip()))
        pending = ""
    assert not pending, "the Dockerfile ends inside a line continuation"
    return instructions


def _megatron_core_pin(text: str) -> str:
    pins = re.findall(r"megatron-core==([0-9][^\"',\s]*)", text)
    assert len(set(pins)) == 1, f"expected one megatron-core pin, got {pins}"
    return pins[0]


def _setup_py_requirement(name: str) -> "SpecifierSet":
    from packaging.requirements import Requirement

    text = (REPO_ROOT / "setup.py").read_text()
    found = [
        Requirement(r)
        for r in re.findall(rf'"((?:{re.escape(name)})[^"]*)"', text)
        if Requirement(r).name == name
    ]
    assert len(found) == 1, f"setup.py declares {name} once, got {found}"
    return found[0].specifier


def _instructions():
    instructions = parse_dockerfile((REPO_ROOT / "Dockerfile").read_text())
    runs = " ".join(a for k, a in instructions if k == "RUN")
    return instructions, runs


def test_dockerfile_parses_and_pins_a_megatron_core_that_setup_py_admits():
    from megatron_ext.registry import VERIFIED_MEGATRON_CORE

    instructions, runs = _instructions()
    keywords = [k for k, _ in instructions]
    assert keywords.count("FROM") == 1 and "CMD" in keywords

    args = dict(a.split("=", 1) for k, a in instructions if k == "ARG" and "=" in a)
    base = next(a for k, a in instructions if k == "FROM")
    base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3", base), (
        f"base image {base!r}: NVIDIA's PyTorch image (it carries apex), with a fixed release tag"
    )

    pin = _megatron_core_pin(runs)
    assert pin in _setup_py_requirement("megatron-core"), (
        "setup.py's range must admit the image's pin"
    )
    assert pin == _megatron_core_pin((REPO_ROOT / "requirements.txt").read_text())
    # 0.19.2: the only verified release on the package index (0.20.0 is verified from builds
    # of Megatron-LM's source, docs/development.md).
    assert pin == VERIFIED_MEGATRON_CORE[0], (
        "the image carries the release the registry is verified on"
    )
    # The image's torch is the base image's; setup.py's range must not force another one.
    assert "torch" not in " ".join(re.findall(r"pip install[^&]*", runs))

    installs = [shlex.split(cmd) for cmd in re.split(r"&&", runs)]
    assert any(
        c[:2] == ["pip", "install"] and c[-1] == "." and "--no-deps" in c for c in installs
    ), "megatron-ext itself, without re-resolving the image's torch"
    copied = " ".join(a for k, a in instructions if k == "COPY")
    for path in (
        "setup.py",
        "megatron_ext",
        "recipes",
        "tests",
        "Makefile",
        "pyproject.toml",
        "scripts",
        "bench",
    ):
        assert path in copied, f"{path} must be in the image (make test-gpu runs the tests there)"

    cmd = [a for k, a in instructions if k == "CMD"][-1]
    assert json.loads(cmd) == ["megatron-ext", "doctor"], "exec form, doctor by default"


# What each layer of a recipe needs beyond megatron-core on a GPU: module -> how it gets into
# the image ("pip:<name>" installed by a RUN, "base" brought by NVIDIA's PyTorch image).
MODULE_SOURCES = {
    "transformer_engine.pytorch": "pip:transformer-engine",
    "apex": "base",
    "mamba_ssm": "pip:mamba-ssm",
    "causal_conv1d": "pip:causal-conv1d",
}


def modules_needed(recipe) -> set[str]:
    """The modules a recipe's model needs: Mamba layers ('M') need mamba-ssm and causal-conv1d
    (megatron's MambaMixer imports both); TE layers need transformer-engine; Megatron's fused
    GPU norms and fused optimizers come from apex."""
    model = recipe.model
    needed = {"apex"} if recipe.launch.device == "gpu" else set()
    if model.type == "hybrid" and "M" in (model.hybrid_layer_pattern or ""):
        needed |= {"mamba_ssm", "causal_conv1d"}
    if model.transformer_impl in ("transformer_engine", "auto") and recipe.launch.device == "gpu":
        needed.add("transformer_engine.pytorch")
    return needed


def test_every_gpu_cluster_recipe_has_its_layer_modules_in_the_image():
    from megatron_ext.recipes import load

    instructions, runs = _instructions()
    env = " ".join(a for k, a in instructions if k == "ENV")
    declared = set(re.search(r'MEGATRON_EXT_GPU_MODULES="([^"]*)"', env).group(1).split())
    assert "${MEGATRON_EXT_GPU_MODULES}" in runs and "import ${module}" in runs, (
        "the build imports every declared module"
    )
    for module in declared:
        source = MODULE_SOURCES[module]
        if source.startswith("pip:"):
            assert re.search(rf'"{re.escape(source[4:])}( @|==)', runs), (
                f"{source[4:]} is installed by a RUN"
            )

    gpu_recipes = [
        p for p in sorted((REPO_ROOT / "recipes").glob("*.yaml")) if "gpu-cluster:" in p.read_text()
    ]
    assert gpu_recipes, "the gpu-cluster recipes"
    for path in gpu_recipes:
        recipe = load(path, "gpu-cluster").recipe
        missing = modules_needed(recipe) - declared
        assert not missing, f"{path.name} [gpu-cluster] needs {sorted(missing)} in the image"
    hybrid_mamba = load(REPO_ROOT / "recipes/hybrid_mhc_tp2_pp2_mtp.yaml", "gpu-cluster").recipe
    assert {"mamba_ssm", "causal_conv1d"} <= modules_needed(hybrid_mamba), (
        "'M' layers are recognised"
    )


def test_the_parser_rejects_what_docker_would():
    import pytest

    with pytest.raises(AssertionError, match="unknown instruction"):
        parse_dockerfile("FROM x\nRUNN echo\n")
    with pytest.raises(AssertionError, match="continuation"):
        parse_dockerfile("FROM x\nRUN echo \\\n")
