"""What a recipe may name: run directories, platforms, Slurm job names.

A recipe is data someone may have sent you. Its ``name`` and platform name become file names
(run directory, golden-value path) and the Slurm job name, so they must come from a safe
character set with no path separators (:func:`name_problem`), and the run directory must stay
inside the runs root (:func:`megatron_ext.files.inside`). The rules for everything a generated script holds
(quoting, environment keys, ``#SBATCH`` lines, secrets) are
:mod:`megatron_ext.launch.shell`'s, which the recipe code uses as the launchers do.
"""

from __future__ import annotations

import re

from megatron_ext.errors import Problem
from megatron_ext.files import inside  # noqa: F401  (the run directory stays in the runs root)

SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}\Z")
SAFE_NAME_TEXT = "1-100 characters from A-Z a-z 0-9 . _ -, starting with a letter or digit"


def name_problem(where: str, value: str) -> Problem | None:
    if SAFE_NAME.match(value or ""):
        return None
    return Problem(where, f"{value!r} is not a safe name: use {SAFE_NAME_TEXT}")
