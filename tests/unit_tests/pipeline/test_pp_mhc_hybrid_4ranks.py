"""Hybrid mHC on 4 ranks: TP=2 x PP=2 with sequence parallelism (the exchanged sequence is
divided by TP), with MTP on the last chunk, and with virtual stages and an empty chunk; and
single-pass mHC with MTP at TP=2 x PP=2 + SP (both payload fields split along the sequence)."""

import pytest
from test_pp_mhc_hybrid import check_pipelined, fresh_mtp_loss_tracker  # noqa: F401
from test_pp_mhc_hybrid_single_pass import check_single_pass

pytestmark = [
    pytest.mark.world_size(4),
    pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC recompute"),
]


@pytest.mark.parametrize(
    "pattern, layout",
    [
        ("*-E|*-E/*-", dict(tp=2, pp=2, sequence_parallel=True)),
        ("*-||*E|*-/*-", dict(tp=2, pp=2, vpp=2, sequence_parallel=True)),
    ],
    ids=["tp2_pp2_sp_mtp", "tp2_pp2_vpp2_sp_empty_chunk_mtp"],
)
def test_tp2_pp2_hybrid_mhc_carries_n_streams_and_matches_reference(monkeypatch, pattern, layout):
    check_pipelined(monkeypatch, pattern, **layout)


def test_tp2_pp2_sp_single_pass_with_mtp_matches_reference(monkeypatch):
    """Each TP rank sends its half of the sequence of the streams and of the coefficients;
    the MTP depth's first site reads the decoder's last pre."""
    check_single_pass(monkeypatch, "*-E|*-/*-", tp=2, pp=2, sequence_parallel=True, steps=1)
