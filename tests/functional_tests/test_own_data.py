"""The README's "Train on your own data", followed word for word on a corpus megatron-ext does
not ship (issue 41): the long descriptions of the Python packages installed here (their
METADATA files), never downloaded. Its commands run as a user types them (train-tokenizer,
prepare-data, recipes --copy, the YAML edit, validate, run); only the iteration count is
lowered and prepare-data uses one worker. The run has no golden values for this data: it ends
"nothing compared", exit 0, and `runs` says "finished, not compared" (before, the copied recipe
carried the example corpus's golden values and the run ended FAILED, exit 1)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path

import yaml

from megatron_ext.testing import timing

REPO_ROOT = Path(__file__).resolve().parents[2]
ITERATIONS = 4


def installed_package_texts(max_chars: int = 600_000) -> list[str]:
    """The description bodies of the installed distributions' METADATA (after the headers)."""
    texts, total = [], 0
    site = Path(sysconfig.get_paths()["purelib"])
    for metadata in sorted(site.glob("*.dist-info/METADATA")):
        body = metadata.read_text(encoding="utf-8", errors="replace").split("\n\n", 1)[-1]
        for part in re.split(r"\n\s*\n", body):
            part = part.strip()
            if len(part) >= 80:
                texts.append(part)
                total += len(part)
        if total >= max_chars:
            break
    return texts


def readme_section() -> tuple[list[str], dict, str]:
    """The section's commands (continuations joined, comments dropped), its YAML edit and the
    recipe file it says to edit."""
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme.split("## Train on your own data", 1)[1].split("\n## ", 1)[0]
    commands = []
    for lang, body in re.findall(r"```(\w*)\n(.*?)```", section, re.S):
        if lang == "bash":
            joined = body.replace("\\\n", " ")
            commands += [re.split(r"\s+#\s", c)[0].strip() for c in joined.splitlines() if c]
    edit = next(
        yaml.safe_load(b)
        for lang, b in re.findall(r"```(\w*)\n(.*?)```", section, re.S)
        if lang == "yaml"
    )
    target = re.search(r"Edit `([^`]+\.yaml)`", section)
    assert target, "the README names the file to edit"
    return commands, edit, target.group(1)


def megatron_ext(words: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, **timing.watchdog_env(), "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        [sys.executable, "-m", "megatron_ext.cli", *words],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timing.bound(900),
    )


def as_typed_here(command: str) -> list[str]:
    words = shlex.split(command)
    assert words[0] == "megatron-ext", command
    words = words[1:]
    if "--workers" in words:  # one process: the machine running the tests is shared
        words[words.index("--workers") + 1] = "1"
    return [
        re.sub(r"^training\.iterations=\d+$", f"training.iterations={ITERATIONS}", w) for w in words
    ]


def test_the_readme_own_data_path_ends_green_on_a_corpus_not_shipped(tmp_path):
    texts = installed_package_texts()
    assert len(texts) >= 300, len(texts)  # enough for 98,1,1 to give valid and test a document
    with open(tmp_path / "corpus.jsonl", "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")

    commands, edit, target = readme_section()
    assert [c.split()[1] for c in commands] == [
        "train-tokenizer",
        "prepare-data",
        "recipes",
        "validate",
        "run",
    ], commands
    for command in commands:
        if command.split()[1] == "validate":  # the YAML edit comes before it
            recipe = tmp_path / target
            document = yaml.safe_load(recipe.read_text())
            document["data"] = edit["data"]
            document["test"] = {**document["test"], **edit["test"]}
            recipe.write_text(yaml.safe_dump(document))
        done = megatron_ext(as_typed_here(command), tmp_path)
        assert done.returncode == 0, (command, done.stdout[-3000:], done.stderr[-3000:])

    assert not (tmp_path / "my_run" / "golden").exists(), "a copy carries no golden values"
    out = done.stdout
    assert "golden values: not compared" in out and "FAILED" not in out, out[-3000:]
    assert "nothing compared with golden values" in out.splitlines()[-1], out[-500:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["reports"] == [] and summary["golden_values"], summary
    assert (run_dir / "loss.png").read_bytes()[:4] == b"\x89PNG"
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert sorted(map(int, metrics["lm loss"]["values"])) == list(range(1, ITERATIONS + 1))
    listing = megatron_ext(["runs"], tmp_path)
    assert "finished, not compared" in listing.stdout, listing.stdout
