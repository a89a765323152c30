"""What ``prepare-data`` accepts before it tokenizes anything, and the limits it reads input
within (issue 34, item 12): each breach is one line naming the flag or the line and the fix.

- ``--json-keys`` become part of the output file names (``PREFIX_{key}_document``), so a key
  is a plain name (letters, digits, ``_ . -``), never a path;
- ``--output-prefix`` must name a file in a directory (or one that can be created), not a
  path through an existing file;
- ``--vocab-size`` (NullTokenizer) is a size from 1 to 2**31; ``--workers`` from 1 to four
  per CPU core (1000 processes would only thrash the machine);
- a JSONL line is at most :data:`MAX_LINE_BYTES` (a 50 MB document peaked at 9.1 GB resident:
  the JSON text, its str, the token list and the ids array all live at once), nests at most
  as deep as Python's JSON parser can follow, and holds no integer past Python's 4300-digit
  limit;
- a NullTokenizer id must lie in ``[0, vocab_size)``: the ids array's dtype is chosen from
  the vocabulary size, and a larger id would not fit it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

MAX_LINE_BYTES = 16 * 1024 * 1024
SAFE_KEY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}\Z")
MAX_VOCAB = 2**31


def max_workers() -> int:
    return 4 * max(os.cpu_count() or 1, 1)


def argument_problem(
    json_keys: list[str], output_prefix: str, vocab_size: int | None, workers: int | None
) -> str | None:
    """The first flag that cannot work, as one line (None: all can)."""
    for key in json_keys:
        if not SAFE_KEY.match(key) or key in (".", ".."):
            return (
                f"--json-keys {key!r}: a key becomes part of the output file name; use "
                "letters, digits, _ . - (no path)"
            )
    if vocab_size is not None and not 1 <= vocab_size <= MAX_VOCAB:
        return f"--vocab-size {vocab_size}: give a vocabulary size from 1 to 2**31"
    if workers is not None and workers > max_workers():
        return (
            f"--workers {workers}: more than four per CPU core ({max_workers()} here); give fewer"
        )
    parent = Path(output_prefix).parent
    for above in (parent, *parent.parents):
        if above.exists():
            if not above.is_dir():
                return (
                    f"--output-prefix {output_prefix}: {above} is a file, not a directory; "
                    "give a prefix inside a directory"
                )
            break
    return None


def line_too_long(line_no: int, nbytes: int, where: str) -> str:
    return (
        f"{where}:{line_no}: a line of more than {MAX_LINE_BYTES // (1024 * 1024)} MiB; split "
        f"the document (prepare-data reads one document a line and bounds its size)"
    )
