"""The errors of multi-module pipelines.

Plan errors are raised before any process group exists. Errors found while building (a model
factory failing on some ranks, an output ndim that contradicts the plan) are agreed on by all
ranks, so every rank raises the same error and none is left waiting in a collective. Errors
found in the first micro-batch (a wrong output ndim, an ambiguous shape) are raised on the
rank that finds them and carried downstream to every rank waiting for that micro-batch.
"""

from __future__ import annotations

from megatron_ext.errors import MegatronExtError, Problem


class MultiModuleError(MegatronExtError, RuntimeError):
    """Base class of everything this package raises on purpose."""


class MultiModulePlanError(MultiModuleError, ValueError):
    """The plan (modules, rank ranges, topology, config) cannot run; nothing was started.

    ``problems`` holds one :class:`~megatron_ext.errors.Problem` each; the message lists them all.
    """

    def __init__(self, problems: list[Problem]):
        self.problems = list(problems)
        lines = "\n  - ".join(map(str, self.problems))
        super().__init__(f"{len(self.problems)} problem(s) in the multi-module plan:\n  - {lines}")


class MultiModuleBuildError(MultiModuleError):
    """Building the modules failed on some rank(s); raised identically on every rank."""


class OutputNdimError(MultiModuleError):
    """A module's output does not have the ndim its bridges were built for."""


class AmbiguousShapeError(MultiModuleError):
    """A 3-D tensor with a singleton last dim was about to cross an intra-module P2P link,
    where it would arrive as a 2-D tensor."""


class BridgeShapeError(MultiModuleError):
    """A module's output does not have the width the module it feeds takes (e.g. an encoder
    and a language model built with different hidden sizes)."""
