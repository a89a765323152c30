"""What a run of every shipped recipe prints and writes stays byte for byte what it was
(issue 35: recipes/ ends at one RunRequest and runs/ starts from it, with no behaviour change).

For each recipe in recipes/*.yaml, in this process and without starting a rank:

- ``dry_run.txt``: the output of ``megatron-ext run recipes/NAME.yaml --dry-run --run-dir D``
  (stdout and stderr together, Megatron's argument checks included);
- ``recipe.yaml``, ``run.json``, ``command.sh``: the files a run writes into its run directory
  before its ranks start (the runner's own writer, called as ``run`` calls it).

They are compared with snapshots/NAME/ stored beside this file, generated from the code before
the RunRequest refactor (commit 3f675fc). What differs from one run to the next is normalised in
both, so the comparison holds on any machine: the run directory (a fresh temporary one) ->
``<RUN_DIR>``, the repository root (``cd`` line of command.sh, absolute golden-values paths) ->
``<REPO>``, the Python interpreter that starts torchrun -> ``<PYTHON>``, and run.json's
``started`` time -> ``<TIME>``; the closing "N upstream warnings hidden" line is left out (it
counts the warnings of this process's first import of Megatron, whichever test made it). The example data the two real-data recipes read is pinned to a
directory that does not exist (``MEGATRON_EXT_EXAMPLE_DATA``), so their dry run refuses them
the same way whether or not ``prepare-data --example`` was run here. Everything else (every message, flag, environment variable and
resolved field) must match.

Regenerate (only for an intended change, and say why in the commit):
``PYTHONPATH=$PWD python tests/unit_tests/runs/test_run_snapshots.py``.
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[2]
SNAPSHOTS = HERE / "snapshots"
RECIPES = sorted((REPO_ROOT / "recipes").glob("*.yaml"))
FILES = ("dry_run.txt", "recipe.yaml", "run.json", "command.sh")
STARTED = re.compile(r'"started": "[^"]*"')
HIDDEN = re.compile(r"^megatron-ext: \d+ upstream warnings? hidden.*\n", re.MULTILINE)
NO_EXAMPLE_DATA = "/nonexistent/megatron-ext-example-data"


def normalised(text: str, run_dir: Path) -> str:
    """``text`` with what varies per run (see the module docstring) replaced by placeholders."""
    text = text.replace(str(run_dir), "<RUN_DIR>")
    text = text.replace(sys.executable, "<PYTHON>")
    text = text.replace(str(REPO_ROOT), "<REPO>")
    text = HIDDEN.sub("", text)
    return STARTED.sub('"started": "<TIME>"', text)


def _write_run_files(recipe: str, run_dir: Path) -> None:
    """The run directory's files, written as ``megatron-ext run`` writes them."""
    from megatron_ext.cli._common import load
    from megatron_ext.recipes.prepare import prepare
    from megatron_ext.runs import runner

    request = prepare(load(recipe, "cpu", [], None, []), megatron_checks=False)
    assert not isinstance(request, list), request
    runner.write_run_files(request, run_dir)


def render(recipe_path: Path, scratch: Path) -> dict[str, str]:
    """The four texts of one recipe, normalised. Run from the repository root."""
    from megatron_ext import cli

    recipe = str(recipe_path.relative_to(REPO_ROOT))
    dry_dir, run_dir = scratch / "dry", scratch / "run"
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MEGATRON_EXT_EXAMPLE_DATA", NO_EXAMPLE_DATA)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            cli.main(["run", recipe, "--dry-run", "--run-dir", str(dry_dir)])
        _write_run_files(recipe, run_dir)
    texts = {"dry_run.txt": normalised(out.getvalue(), dry_dir)}
    for name in FILES[1:]:
        texts[name] = normalised((run_dir / name).read_text(), run_dir)
    return texts


def differences(rendered: dict[str, str], stored: Path) -> list[str]:
    """One line per file that differs from its snapshot: the first differing line of each."""
    found = []
    for name, text in rendered.items():
        snapshot = stored / name
        old = snapshot.read_text() if snapshot.exists() else None
        if old == text:
            continue
        if old is None:
            found.append(f"{snapshot}: no snapshot")
            continue
        new_lines, old_lines = text.splitlines(), old.splitlines()
        line = next(
            (k for k, (a, b) in enumerate(zip(new_lines, old_lines, strict=False)) if a != b),
            min(len(new_lines), len(old_lines)),
        )
        was = old_lines[line] if line < len(old_lines) else "(end)"
        now = new_lines[line] if line < len(new_lines) else "(end)"
        found.append(f"{snapshot} line {line + 1}: was {was!r}, now {now!r}")
    return found


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, dict[str, str]]:
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(REPO_ROOT)
        return {path.stem: render(path, tmp_path_factory.mktemp(path.stem)) for path in RECIPES}


def test_every_shipped_recipe_has_a_snapshot():
    assert RECIPES
    assert sorted(p.name for p in SNAPSHOTS.iterdir() if p.is_dir()) == [p.stem for p in RECIPES]


@pytest.mark.parametrize("name", [p.stem for p in RECIPES])
def test_a_run_prints_and_writes_what_it_did_before(rendered, name):
    assert not differences(rendered[name], SNAPSHOTS / name)


def test_a_changed_message_is_caught(rendered):
    """The comparison can fail: one changed word in a printed line, one in command.sh."""
    name = RECIPES[0].stem
    changed = dict(rendered[name])
    changed["dry_run.txt"] = changed["dry_run.txt"].replace("run directory", "run folder", 1)
    changed["command.sh"] = changed["command.sh"].replace("--seed", "--sead", 1)
    found = differences(changed, SNAPSHOTS / name)
    assert [line.split(" line ")[0] for line in found] == [
        str(SNAPSHOTS / name / "dry_run.txt"),
        str(SNAPSHOTS / name / "command.sh"),
    ]
    assert "run folder" in found[0]


def regenerate() -> None:
    """Write the snapshots from this checkout's code (see the module docstring)."""
    import os
    import tempfile

    os.chdir(REPO_ROOT)
    with tempfile.TemporaryDirectory() as scratch:
        for path in RECIPES:
            target = SNAPSHOTS / path.stem
            target.mkdir(parents=True, exist_ok=True)
            for name, text in render(path, Path(scratch) / path.stem).items():
                (target / name).write_text(text)
            print(f"{target}: {', '.join(FILES)}")


if __name__ == "__main__":
    regenerate()
