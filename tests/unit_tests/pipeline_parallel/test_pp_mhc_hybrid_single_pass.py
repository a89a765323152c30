"""Single-pass mHC (megatron_ext.mhc.single_pass) on the Hybrid stack with an MTP depth, under
pipeline parallelism on 2 ranks: the decoder's coefficients ride the payload's ``pre_mix``
field, the MTP depth's first site reads the decoder's last pre, and the run equals the
single-rank reference (the same pattern without '|'): loss, every gradient, the weights."""

import pytest
from mhc_pipeline_cases import all_ranks, recorded_p2p_shapes
from test_pp_mhc_hybrid import check_hybrid, fresh_mtp_loss_tracker, mhc_hybrid_plan  # noqa: F401

pytestmark = [
    pytest.mark.world_size(2),
    pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC recompute"),
]

SINGLE_PASS = dict(mhc_single_pass=True)


def check_single_pass(monkeypatch, pattern: str, **layout):
    """The equivalence run; every exchange is ``[s', b, n*h + n]`` (fp32 pipeline: the
    coefficients take n slots beside the n streams)."""
    plan = mhc_hybrid_plan(pattern, config_overrides=SINGLE_PASS, **layout)
    with recorded_p2p_shapes(monkeypatch) as seen:
        check_hybrid(plan, pattern)
    seq = plan.seq_length // (plan.tp if plan.sequence_parallel else 1)
    expected = (seq, plan.micro_batch_size, plan.hidden_size * 4 + 4)
    shapes = {shape for records in all_ranks(seen) for _, shape in records}
    assert shapes == {expected}, shapes


def test_pp2_attention_mlp_moe_with_mtp_matches_reference(monkeypatch):
    check_single_pass(monkeypatch, "*-E|*-/*-", pp=2, steps=1)
