"""Fixtures shared by the unit tests of every package folder."""

from pathlib import Path

import pytest


@pytest.fixture
def write_recipe(tmp_path):
    """Write a recipe file from YAML text; returns its path."""

    def write(text: str, name: str = "r.yaml") -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    return write
