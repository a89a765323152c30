"""Stand-in for the deferred weight gradients (the real module comes from branch zb-wgrad).

Nothing is deferred: a backward pass under :func:`capture` computes every gradient, and
:func:`run` has nothing left to do. ZB-H1 stays a correct schedule with this module (its W
steps are empty).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from megatron_ext.errors import MegatronExtError


class PendingWeightGradientError(MegatronExtError, RuntimeError):
    """A weight gradient was still deferred where every one must have run."""


def deferral_enabled(config: Any) -> bool:
    return getattr(config, "pipeline_schedule", "1f1b") == "zb-h1"


@contextlib.contextmanager
def capture(microbatch: int) -> Iterator[None]:
    yield


def run(microbatch: int) -> None:
    return None


def pending() -> list[int]:
    return []
