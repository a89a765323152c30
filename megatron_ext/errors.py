"""The two shapes in which megatron-ext reports what is wrong.

:class:`Problem` is one finding of a check that looks at everything before it fails (a recipe,
a parallel plan, a pipeline schedule's sizes, a multi-module plan): where (the field, flag or
dotted recipe path; "" for the whole) and what (the values involved and the fix). A check
returns every problem at once and its caller raises them together.

:class:`MegatronExtError` is the root of every exception megatron-ext raises on purpose, so a
caller can catch the plugin's errors without catching megatron-core's or Python's. Each
subclass also keeps the built-in base it had (``ValueError`` for bad input, ``RuntimeError``
for a failed run, ...), so existing ``except`` clauses still match (megatron-core's own
``except ValueError`` around a config included). The kinds of bad input that several packages
raise live here (:class:`ConfigError`, :class:`SpecError`, :class:`DataError`,
:class:`EnvVariableError`); a kind that belongs to one package lives beside its code
(``RecipeError``, ``ScheduleTextError``, ``ConversionError`` ...). A bare ``ValueError`` is left
only where no user can meet it (tests/unit_tests/test_errors.py keeps the list).

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


class ConfigError(MegatronExtError, ValueError):
    """A model or layer configuration megatron-ext cannot use: a config field out of its range
    or a combination of fields it refuses (the mHC guards, the fused kernels' limits); the
    message names the field and the value to set."""


class SpecError(ConfigError):
    """A module spec that cannot build what its config asks for (a layer without mHC streams in
    an mHC model, a missing hyper-connection submodule, a norm of the wrong kind); the message
    names the spec field and the spec builder that fits."""


class DataError(MegatronExtError, ValueError):
    """Training data described in a way megatron-ext cannot read (a split string, a synthetic
    data pattern); the message names the field and a value that works."""


class EnvVariableError(MegatronExtError, ValueError):
    """An environment variable megatron-ext reads (``MEGATRON_EXT_*``, a recipe's secret on
    resume) that is unset or holds a value it cannot use; the message names the variable."""


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


__all__ = [
    "ConfigError",
    "DataError",
    "EnvVariableError",
    "MegatronExtError",
    "Problem",
    "SpecError",
    "UnsupportedCombinationError",
]


def suggestion(key: str, known: list[str]) -> str:
    """The end of a "not a known key" problem: the closest known key, or all of them."""
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(known)})"
