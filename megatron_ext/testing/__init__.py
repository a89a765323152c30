"""Test support: distributed set-up the way megatron-core's own tests do it, and the
equivalence harness that checks a sharded training step against a single-rank reference."""

from megatron_ext.testing.distributed import model_parallel
from megatron_ext.testing.equivalence import EquivalenceError, TrainPlan, check_equivalence

__all__ = ["EquivalenceError", "TrainPlan", "check_equivalence", "model_parallel"]
