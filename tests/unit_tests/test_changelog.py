"""The version follows the CHANGELOG: ``megatron_ext.__version__`` is the newest released
heading of CHANGELOG.md, whose released headings carry a date, and later work waits under
"Unreleased" at the top."""

from __future__ import annotations

import datetime
import re
from pathlib import Path

import megatron_ext

CHANGELOG = Path(__file__).resolve().parents[2] / "CHANGELOG.md"
RELEASED = re.compile(r"^## (\d+\.\d+\.\d+) - (\d{4}-\d{2}-\d{2})$")


def headings(text: str) -> list[str]:
    return [line.rstrip() for line in text.splitlines() if line.startswith("## ")]


def releases(text: str) -> list[tuple[str, datetime.date]]:
    """(version, date) of every released heading, newest first; a second-level heading that
    is neither "Unreleased" nor ``## X.Y.Z - YYYY-MM-DD`` is an error."""
    found = []
    for heading in headings(text):
        if heading == "## Unreleased":
            continue
        match = RELEASED.match(heading)
        assert match, f"CHANGELOG.md heading {heading!r} is not '## X.Y.Z - YYYY-MM-DD'"
        found.append((match.group(1), datetime.date.fromisoformat(match.group(2))))
    return found


def newest_release(text: str) -> str:
    found = releases(text)
    assert found, "CHANGELOG.md has no released version"
    return found[0][0]


def test_version_is_the_newest_released_changelog_heading():
    assert megatron_ext.__version__ == newest_release(CHANGELOG.read_text())


def test_unreleased_comes_first_and_releases_go_back_in_time():
    text = CHANGELOG.read_text()
    assert headings(text)[0] == "## Unreleased", "later work goes under '## Unreleased' at the top"
    found = releases(text)
    versions = [tuple(int(part) for part in version.split(".")) for version, _ in found]
    assert versions == sorted(versions, reverse=True), versions
    dates = [date for _, date in found]
    assert dates == sorted(dates, reverse=True), dates


def test_the_check_fails_on_a_version_the_changelog_has_not_released():
    major, minor, _ = (int(part) for part in megatron_ext.__version__.split("."))
    ahead = f"{major}.{minor + 1}.0"  # a version this checkout has not released
    text = (
        f"# Changelog\n\n## Unreleased\n\n## {ahead} - 2099-01-05\n\n"
        f"## {megatron_ext.__version__} - 2026-12-02\n"
    )
    assert newest_release(text) == ahead != megatron_ext.__version__
    undated = "## Unreleased\n\n## 0.2.0\n"
    try:
        releases(undated)
    except AssertionError as error:
        assert "'## 0.2.0'" in str(error)
    else:
        raise AssertionError("an undated release heading passed")
