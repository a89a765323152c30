"""mHC under pipeline parallelism on 4 ranks: PP=4 (x VPP=2), and TP=2 x PP=2 (x VPP=2) with
sequence parallelism (the exchanged sequence is divided by TP); TP=2 x PP=2 runs mHC-lite's
birkhoff H_res, the others Sinkhorn; mhc_variant deepseek-v4 and glm5 each at PP=4 (1F1B and
ZB-H1), TP=2 x PP=2 with SP and DP=2 x PP=2 with the distributed optimizer."""

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
        # recipes/gpt_mhc_pp4_vpp2.yaml's layout (its recipe run is in the soak tier)
        dict(pp=4, vpp=2, num_layers=8, global_batch_size=8),
        dict(tp=2, pp=2, sequence_parallel=True, h_res_method="birkhoff"),
        dict(tp=2, pp=2, vpp=2, sequence_parallel=True),
        dict(tp=2, pp=2, sequence_parallel=True, variant="glm5"),
        # Each DP rank reduces and steps its own shard of the variant's weights.
        dict(pp=2, use_distributed_optimizer=True, variant="deepseek-v4"),
        # ZB-H1's deferred weight gradients, the learned head's on the last stage among them.
        dict(pp=4, schedule="zb-h1", global_batch_size=16, steps=1, variant="deepseek-v4"),
        # The variants in the layouts the rows above give the other one.
        dict(pp=4, steps=1, variant="deepseek-v4"),
        dict(pp=4, steps=1, variant="glm5"),
        dict(tp=2, pp=2, sequence_parallel=True, steps=1, variant="deepseek-v4"),
        dict(pp=2, use_distributed_optimizer=True, steps=1, variant="glm5"),
        dict(pp=4, schedule="zb-h1", global_batch_size=16, steps=1, variant="glm5"),
    ],
    ids=[
        "pp4",
        "pp4_vpp2",
        "tp2_pp2_sp_birkhoff",
        "tp2_pp2_vpp2_sp",
        "tp2_pp2_sp_glm5",
        "dp2_pp2_distopt_deepseek_v4",
        "pp4_zb_h1_deepseek_v4",
        "pp4_deepseek_v4",
        "pp4_glm5",
        "tp2_pp2_sp_deepseek_v4",
        "dp2_pp2_distopt_glm5",
        "pp4_zb_h1_glm5",
    ],
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
