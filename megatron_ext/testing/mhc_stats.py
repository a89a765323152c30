"""Checking the mHC statistics of a sharded run against the single-rank reference's, inside
an equivalence-harness run (:func:`megatron_ext.testing.equivalence.check_equivalence`): the
same figures from the same weights and micro-batch, however the model is split."""

from __future__ import annotations

import math

from megatron_ext.mhc import stats


class StatsCheck:
    """Records the samples of both runs; ``on_gradients`` for check_equivalence compares the
    first step's figures and keeps the last step's (a trained few-step model's)."""

    def __init__(self, steps: int, rtol: float = 1e-5, reference_rank: int | None = None):
        # reference_rank: the one rank the single-rank reference runs on (a multi-module
        # pipeline's harness); its figures are shared with every rank. None: every rank.
        self.steps, self.rtol, self.reference_rank = steps, rtol, reference_rank
        self.recorder = stats.enable()
        self.reference: dict | None = None
        self.first: dict | None = None
        self.last: dict | None = None

    def on_gradients(self, step: int, chunks: list) -> None:
        ours = {id(m) for chunk in chunks for m in chunk.modules()}
        sharded = {k: v for k, v in self.recorder.samples.items() if k in ours}
        if step == 0:
            others = {k: v for k, v in self.recorder.samples.items() if k not in ours}
            self.reference = stats.combine([stats.contribution(others, holders_only=False)])
            if self.reference_rank is not None:
                import torch.distributed as dist

                shared = [self.reference]
                dist.broadcast_object_list(shared, src=self.reference_rank)
                self.reference = shared[0]
        own = stats.Recorder(samples=sharded)
        figures = stats.collect(own)
        if step == 0:
            self.first = figures
        self.last = figures
        self.recorder.samples.clear()  # the next step records afresh

    def problems(self) -> list[str]:
        found = []
        if not self.reference or self.first is None:
            return ["no mHC statistics were recorded"]
        if set(self.first) != set(self.reference):
            found.append(f"figures differ: {sorted(set(self.first) ^ set(self.reference))}")
        for name, expected in self.reference.items():
            got = self.first.get(name)
            if got is not None and not math.isclose(got, expected, rel_tol=self.rtol, abs_tol=1e-6):
                found.append(f"{name}: sharded {got!r}, single rank {expected!r}")
        return found

    def close(self) -> None:
        stats.disable()
