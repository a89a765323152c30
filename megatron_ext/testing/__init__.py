"""Test support: distributed set-up the way megatron-core's own tests do it, and the
equivalence harness that checks a sharded training step against a single-rank reference."""
