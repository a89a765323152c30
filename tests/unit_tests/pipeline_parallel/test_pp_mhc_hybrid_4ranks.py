"""Hybrid mHC on 4 ranks: TP=2 x PP=2 with sequence parallelism (the exchanged sequence is
divided by TP), with MTP on the last chunk, and with virtual stages and an empty chunk."""

import pytest
from test_pp_mhc_hybrid import check_pipelined, fresh_mtp_loss_tracker  # noqa: F401

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
