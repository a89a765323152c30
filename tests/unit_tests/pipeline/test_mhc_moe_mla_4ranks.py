"""GPT MoE with mHC on 4 ranks: expert parallelism across pipeline stages (EP=2 x PP=2,
alltoall dispatcher, aux loss on) matches the single-rank reference, and every P2P edge
carries the n streams, [s, b, n*h]."""

import os

import pytest
from mhc_moe_mla_cases import MLA, check, moe_plan
from mhc_pipeline_cases import (
    all_ranks,
    assert_every_exchange_is_n_streams_wide,
    recorded_p2p_shapes,
)

pytestmark = [
    pytest.mark.world_size(4),
    pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC recompute"),
]


SOAK = pytest.mark.skipif(
    os.environ.get("MEGATRON_EXT_SOAK") != "1",
    reason="soak only (~35 s on 4 ranks): CI covers deepseek-v4 + MoE + MLA at PP2 (2 ranks)",
)


@pytest.mark.parametrize(
    "variant",
    ["megatron", pytest.param("deepseek-v4", marks=SOAK), pytest.param("glm5", marks=SOAK)],
)
def test_moe_mhc_ep2_pp2_matches_reference_with_n_stream_p2p(monkeypatch, variant):
    """deepseek-v4: DeepSeek-V4's maps and learned head, on MoE + MLA."""
    overrides = dict(MLA, mhc_variant=variant) if variant != "megatron" else {}
    plan = moe_plan(ep=2, pp=2, num_layers=4, config_overrides=overrides)
    with recorded_p2p_shapes(monkeypatch) as seen:
        check(plan)
    assert_every_exchange_is_n_streams_wide(plan, all_ranks(seen))
