"""A deterministic English corpus from the docstrings of the installed Python standard library.

The text ships with every Python, needs no network and is real prose (API documentation). The
sources are parsed with :mod:`ast`, never imported, so reading them runs no code. The corpus
depends only on the Python version (its patch release can change a docstring): :func:`digest`
names it, and the example records it next to the files.
"""

from __future__ import annotations

import ast
import hashlib
import json
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

MIN_CHARS = 40
"""Docstrings shorter than this ("Return self.") carry little text; they are left out."""


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources() -> list[Path]:
    """The top-level ``*.py`` modules of the standard library, in name order."""
    return sorted(stdlib_dir().glob("*.py"), key=lambda p: p.name)


def _docstrings(tree: ast.AST) -> Iterator[str]:
    """Every docstring of a module, its classes and functions, in source order."""
    nodes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    for node in ast.walk(tree):
        if isinstance(node, nodes):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) >= MIN_CHARS:
                yield doc


def documents(source: Path) -> list[str]:
    """The docstrings of one module (none when it does not parse under this Python)."""
    try:
        tree = ast.parse(source.read_text(encoding="utf-8"), filename=str(source))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    return list(_docstrings(tree))


def build(max_chars: int | None = None) -> list[dict]:
    """The corpus as JSONL records ``{"text", "module"}``, modules in name order, cut after
    ``max_chars`` characters of text in all."""
    records, total = [], 0
    for source in stdlib_sources():
        for text in documents(source):
            records.append({"text": text, "module": source.stem})
            total += len(text)
            if max_chars is not None and total >= max_chars:
                return records
    return records


def write_jsonl(records: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


def digest(records: list[dict]) -> str:
    """sha256 of the corpus text: two machines with the same digest train on the same bytes."""
    h = hashlib.sha256()
    for record in records:
        h.update(record["text"].encode("utf-8") + b"\0")
    return h.hexdigest()


def python_version() -> str:
    return ".".join(map(str, sys.version_info[:3]))
