"""The two shapes in which megatron-ext reports what is wrong.

:class:`Problem` is one finding of a check that looks at everything before it fails (a recipe,
a parallel plan, a pipeline schedule's sizes, a multi-module plan): where (the field, flag or
dotted recipe path; "" for the whole) and what (the values involved and the fix). A check
returns every problem at once and its caller raises them together.

:class:`MegatronExtError` is the root of every exception megatron-ext raises on purpose, so a
caller can catch the plugin's errors without catching megatron-core's or Python's. Each
subclass also keeps the built-in base it had (``ValueError`` for bad input, ``RuntimeError``
for a failed run, ...), so existing ``except`` clauses still match.

Nothing here imports anything of the product, torch or megatron.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass


class MegatronExtError(Exception):
    """Base class of every error megatron-ext raises on purpose."""


class UnsupportedCombinationError(MegatronExtError, NotImplementedError):
    """A combination of settings that megatron-ext rejects (a NotImplementedError); the guards
    (:mod:`megatron_ext.guards`) and the layers that refuse a combination raise it."""


MAX_PROBLEM_CHARS = 400


@dataclass(frozen=True)
class Problem:
    """One thing wrong: where (field, flag or dotted path; "" for the whole input) and what."""

    where: str
    what: str

    def __str__(self) -> str:
        text = f"{self.where}: {self.what}" if self.where else self.what
        if len(text) > MAX_PROBLEM_CHARS:  # a 100 KB value is not echoed back in full
            text = f"{text[: MAX_PROBLEM_CHARS - 40]}... ({len(text)} characters)"
        # One line, whatever a recipe's keys and values hold (newlines, NUL, controls).
        return "".join(
            ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text
        )


__all__ = ["MegatronExtError", "Problem", "UnsupportedCombinationError"]


def suggestion(key: str, known: list[str]) -> str:
    """The end of a "not a known key" problem: the closest known key, or all of them."""
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(known)})"
