"""mHC under pipeline parallelism on 4 ranks: PP=4, and TP=2 x PP=2 (x VPP=2) with sequence
parallelism (the exchanged sequence is divided by TP); TP=2 x PP=2 runs mHC-lite's birkhoff
H_res, the others Sinkhorn."""

import pytest
from mhc_pipeline_cases import (
    all_ranks,
    assert_birkhoff_gains_are_one,
    assert_every_exchange_is_n_streams_wide,
    check_mhc_and_stats,
    mhc_plan,
    recorded_p2p_shapes,
)

pytestmark = [
    pytest.mark.world_size(4),
    pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC recompute"),
]


@pytest.mark.parametrize(
    "layout",
    [
        dict(pp=4),
        dict(tp=2, pp=2, sequence_parallel=True, h_res_method="birkhoff"),
        dict(tp=2, pp=2, vpp=2, sequence_parallel=True),
        dict(tp=2, pp=2, sequence_parallel=True, variant="glm5"),
    ],
    ids=["pp4", "tp2_pp2_sp_birkhoff", "tp2_pp2_vpp2_sp", "tp2_pp2_sp_glm5"],
)
def test_mhc_pipeline_carries_n_streams_and_matches_reference(monkeypatch, layout):
    layout = dict(layout)
    method = dict(mhc_h_res_method=layout.pop("h_res_method", "sinkhorn"))
    method["mhc_variant"] = layout.pop("variant", "megatron")
    plan = mhc_plan(**layout, config_overrides=method)
    with recorded_p2p_shapes(monkeypatch) as seen:
        check = check_mhc_and_stats(plan)  # the mHC statistics equal the single rank's too
    assert_every_exchange_is_n_streams_wide(plan, all_ranks(seen))
    if method["mhc_h_res_method"] == "birkhoff":
        assert_birkhoff_gains_are_one(check)
