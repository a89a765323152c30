"""The Dockerfile cannot be built here (no Docker, no GPU image): check that it parses, uses
NVIDIA's PyTorch image, pins the megatron-core release setup.py and requirements.txt pin,
installs megatron-ext, and defaults to `megatron-ext doctor`."""

import json
import re
import shlex
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
INSTRUCTIONS = {"FROM", "ARG", "ENV", "WORKDIR", "COPY", "ADD", "RUN", "CMD", "ENTRYPOINT", "LABEL",
                "EXPOSE", "USER", "VOLUME", "SHELL", "HEALTHCHECK", "STOPSIGNAL", "ONBUILD"}


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


def test_dockerfile_parses_and_pins_the_same_megatron_core_as_setup_py():
    instructions = parse_dockerfile((REPO_ROOT / "Dockerfile").read_text())
    keywords = [k for k, _ in instructions]
    assert keywords.count("FROM") == 1 and "CMD" in keywords

    args = dict(a.split("=", 1) for k, a in instructions if k == "ARG" and "=" in a)
    base = next(a for k, a in instructions if k == "FROM")
    base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3", base), (
        f"base image {base!r}: NVIDIA's PyTorch image (it carries transformer-engine and apex), "
        "with a fixed release tag"
    )

    runs = " ".join(a for k, a in instructions if k == "RUN")
    pin = _megatron_core_pin(runs)
    assert pin == _megatron_core_pin((REPO_ROOT / "setup.py").read_text())
    assert pin == _megatron_core_pin((REPO_ROOT / "requirements.txt").read_text())
    assert pin == "0.19.2"

    installs = [shlex.split(cmd) for cmd in re.split(r"&&", runs)]
    assert any(c[:2] == ["pip", "install"] and c[-1] == "." for c in installs), "megatron-ext itself"
    copied = " ".join(a for k, a in instructions if k == "COPY")
    for path in ("setup.py", "megatron_ext", "recipes"):
        assert path in copied, f"{path} must be in the image"

    cmd = [a for k, a in instructions if k == "CMD"][-1]
    assert json.loads(cmd) == ["megatron-ext", "doctor"], "exec form, doctor by default"


def test_the_parser_rejects_what_docker_would():
    import pytest

    with pytest.raises(AssertionError, match="unknown instruction"):
        parse_dockerfile("FROM x\nRUNN echo\n")
    with pytest.raises(AssertionError, match="continuation"):
        parse_dockerfile("FROM x\nRUN echo \\\n")
