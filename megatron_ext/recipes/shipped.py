"""The recipes and golden values that ship with megatron-ext: where they are (package data of an
installed wheel, ``recipes/`` of a source checkout), what they are, and copying one out to edit,
so ``megatron-ext run`` works after a plain ``pip install``. A copy carries the shipped golden
values only when asked (``--with-golden``): they were measured on the shipped data, and a copy is
usually pointed at other data, where they would only fail (issue 41, item 1).

Nothing here imports torch or megatron."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from megatron_ext.errors import MegatronExtError, suggestion

PACKAGE_DATA = "_recipes"
"""megatron_ext/_recipes in a wheel: setup.py maps the source tree's recipes/ there."""

_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


class ShippedRecipeError(MegatronExtError, ValueError):
    """A shipped recipe that cannot be copied out: no such name, or the destination is taken."""


def shipped_dir() -> Path:
    """The shipped recipes: the wheel's package data, else the checkout's recipes/."""
    package = Path(__file__).resolve().parents[1]
    installed = package / PACKAGE_DATA
    return installed if installed.is_dir() else package.parent / "recipes"


def shipped_recipes() -> dict[str, Path]:
    """name -> recipe file."""
    return {path.stem: path for path in sorted(shipped_dir().glob("*.yaml"))}


def summary(path: Path) -> str:
    """The recipe's description, on one line (without parsing it: a listing must not fail)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    for k, line in enumerate(lines):
        if line.startswith("description:"):
            text = line.split(":", 1)[1].strip()
            if text in (">", "|", ">-", "|-"):
                text = " ".join(
                    more.strip() for more in lines[k + 1 :] if more.startswith("  ")
                ).split(". ")[0]
            return text
    return ""


def copy_out(name: str, destination: Path, with_golden: bool = False) -> list[Path]:
    """Copy recipe ``name`` (and, ``with_golden``, its golden values golden/<name>/) into
    ``destination``; refuses (ShippedRecipeError, one line) an unknown name or any file that already
    exists there."""
    recipes = shipped_recipes()
    if not _NAME.match(name) or name not in recipes:
        raise ShippedRecipeError(f"no shipped recipe {name!r}{suggestion(name, list(recipes))}")
    if destination.exists() and not destination.is_dir():
        raise ShippedRecipeError(f"{destination} is not a directory")
    golden = shipped_dir() / "golden" / name
    pairs = [(recipes[name], destination / recipes[name].name)]
    if with_golden and golden.is_dir():
        pairs += [
            (path, destination / "golden" / name / path.name) for path in sorted(golden.glob("*"))
        ]
    existing = [str(target) for _, target in pairs if target.exists()]
    if existing:
        raise ShippedRecipeError(
            f"{existing[0]} exists; copy into another directory (megatron-ext recipes --copy "
            f"{name} DIR) or move it away"
        )
    for source, target in pairs:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
    return [target for _, target in pairs]
