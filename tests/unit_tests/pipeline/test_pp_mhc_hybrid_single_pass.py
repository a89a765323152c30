"""Single-pass mHC (megatron_ext.mhc.single_pass) on the Hybrid stack with an MTP depth, under
pipeline parallelism on 2 ranks: the decoder's coefficients ride the payload's ``pre_mix``
field, the MTP depth's first site reads the decoder's last pre, and the run equals the
single-rank reference (the same pattern without '|'): loss, every gradient, the weights.
(Soak) cutting the received coefficients' gradient makes it differ."""

import os

import pytest
from mhc_pipeline_cases import all_ranks, recorded_p2p_shapes
from test_pp_mhc_hybrid import check_hybrid, fresh_mtp_loss_tracker, mhc_hybrid_plan  # noqa: F401

from megatron_ext.mhc import single_pass
from megatron_ext.pipeline.payload import PRE_MIX
from megatron_ext.testing.equivalence import EquivalenceError

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


@pytest.mark.skipif(
    os.environ.get("MEGATRON_EXT_SOAK") != "1",
    reason="soak only (~8 s on 2 ranks): the GPT single-pass negative control runs in CI",
)
def test_pp2_cutting_the_coefficient_gradient_differs_from_reference(monkeypatch):
    """Negative control: the received ``pre_mix`` detached, the stage-0 site whose pre only
    stage 1 reads gets no gradient through it, and the run differs from the reference."""
    unpack = single_pass.unpack

    def unpack_detached(payload, wire):
        fields = unpack(payload, wire)
        fields[PRE_MIX] = fields[PRE_MIX].detach()
        return fields

    monkeypatch.setattr(single_pass, "unpack", unpack_detached)
    pattern = "*-E|*-/*-"
    plan = mhc_hybrid_plan(pattern, config_overrides=SINGLE_PASS, pp=2, steps=1)
    with pytest.raises(EquivalenceError) as raised:
        check_hybrid(plan, pattern)
    differences = str(raised.value).splitlines()[1:]
    assert differences and all("hyper_connection" in d for d in differences), differences[:5]
