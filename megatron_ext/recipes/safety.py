"""What a recipe may name. A recipe is data someone may have sent you: its ``name`` and platform
become file names (run directory, golden-value path) and the Slurm job name, so they come from a
safe character set without path separators (:func:`name_problem`); the run directory stays in
the runs root (:func:`megatron_ext.files.inside`), and what a generated script holds follows
:mod:`megatron_ext.launch.shell`'s rules, as in the launchers.
"""

from __future__ import annotations

import re

from megatron_ext.errors import Problem

SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}\Z")
SAFE_NAME_TEXT = "1-100 characters from A-Z a-z 0-9 . _ -, starting with a letter or digit"


def name_problem(where: str, value: str) -> Problem | None:
    if SAFE_NAME.match(value or ""):
        return None
    return Problem(where, f"{value!r} is not a safe name: use {SAFE_NAME_TEXT}")
