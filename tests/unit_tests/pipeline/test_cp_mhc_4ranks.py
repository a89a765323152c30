"""Context parallelism (megatron-ext's local CP attention) with mHC on 4 ranks, through the
equivalence harness: loss, every gradient of every step and the final weights equal the
single-rank run. GPT at CP=2 (x DP=2), CP=2 x PP=2 and CP=2 x TP=2 with sequence parallelism;
Hybrid (rotary positions, learned contraction) at CP=2 x PP=2 with MTP; each with Sinkhorn and
birkhoff H_res. Every run also checks the mHC statistics against the single rank's: at 16
tokens a CP=2 rank holds chunks of 4, so the 8 sampled positions lie on both CP ranks (and on
two TP ranks' SP slices); mhc_variant deepseek-v4 and glm5 at CP=2 x PP=2. Pipelined runs also check that every P2P tensor is [s/cp (/tp under
SP), b, n*h]. A negative control shows the harness catches wrong global positions."""

import pytest
from mhc_pipeline_cases import (
    all_ranks,
    assert_birkhoff_gains_are_one,
    assert_every_exchange_is_n_streams_wide,
    check_mhc,
    check_mhc_and_stats,
    mhc_plan,
    recorded_p2p_shapes,
)
from test_pp_mhc_hybrid import check_pipelined, fresh_mtp_loss_tracker  # noqa: F401

from megatron_ext.mhc.stats import MTP_GAIN_NAMES

pytestmark = [
    pytest.mark.world_size(4),
    pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC recompute"),
]

# Megatron's exact CP loss: the token count is summed over DP x CP in finalize_model_grads.
# (Without it each CP rank divides by its own token count, which differs from one rank's
# per-token mean whenever the loss mask is uneven across the sequence.)
PER_TOKEN = dict(calculate_per_token_loss=True)


# Small runs: 2 layers (one per stage under PP), 2 micro-batches per step, 2 steps.
SMALL = dict(steps=2, num_layers=2, global_batch_size=4)


def cp_plan(method: str = "sinkhorn", variant: str = "megatron", **layout):
    overrides = dict(PER_TOKEN, mhc_h_res_method=method, mhc_variant=variant)
    return mhc_plan(config_overrides=overrides, **SMALL, **layout)


@pytest.mark.parametrize(
    "method, layout",
    [
        ("sinkhorn", dict(cp=2)),
        ("sinkhorn", dict(cp=2, pp=2)),
        ("sinkhorn", dict(cp=2, tp=2, sequence_parallel=True)),
        ("birkhoff", dict(cp=2, pp=2)),
        ("birkhoff", dict(cp=2, tp=2, sequence_parallel=True)),
        ("sinkhorn", dict(cp=2, pp=2, variant="deepseek-v4")),
        ("sinkhorn", dict(cp=2, pp=2, variant="glm5")),
    ],
    ids=[
        "cp2_dp2",
        "cp2_pp2",
        "cp2_tp2_sp",
        "birkhoff_cp2_pp2",
        "birkhoff_cp2_tp2_sp",
        "cp2_pp2_deepseek_v4",
        "cp2_pp2_glm5",
    ],
)
def test_gpt_mhc_context_parallel_matches_reference(monkeypatch, method, layout):
    plan = cp_plan(method, **layout)
    with recorded_p2p_shapes(monkeypatch) as seen:
        check = check_mhc_and_stats(plan)
    if plan.pp > 1:
        assert_every_exchange_is_n_streams_wide(plan, all_ranks(seen))
    if method == "birkhoff":
        assert_birkhoff_gains_are_one(check)


@pytest.mark.parametrize("method", ["sinkhorn", "birkhoff"])
def test_hybrid_mhc_cp2_pp2_mtp_matches_reference(monkeypatch, method):
    # Megatron scales each CP rank's MTP loss by that rank's token counts before and after the
    # MTP roll; masking every chunk's first token makes them agree with the whole sequence's.
    check = check_pipelined(
        monkeypatch,
        "*-|*-/*-",
        cp=2,
        pp=2,
        steps=2,
        global_batch_size=4,
        loss_mask_zero_every=16 // 4,
        config_overrides=dict(PER_TOKEN, mhc_h_res_method=method),
        with_stats=True,
    )
    assert set(MTP_GAIN_NAMES) <= set(check.first)
    if method == "birkhoff":
        assert_birkhoff_gains_are_one(check, MTP_GAIN_NAMES)


def test_wrong_global_positions_are_caught(monkeypatch):
    """Negative control: an attention that takes its tokens for one contiguous block (no
    load-balanced offsets) masks the wrong keys, and the harness sees it."""
    import torch

    from megatron_ext.models.context_parallel import ContextParallelDotProductAttention
    from megatron_ext.testing.equivalence import EquivalenceError

    def contiguous(self, local_seq_length, cp_rank, device):
        start = cp_rank * local_seq_length
        return torch.arange(start, start + local_seq_length, device=device)

    monkeypatch.setattr(ContextParallelDotProductAttention, "token_positions", contiguous)
    with pytest.raises(EquivalenceError, match="step 0: loss"):
        check_mhc(
            mhc_plan(cp=2, steps=1, num_layers=2, global_batch_size=4, config_overrides=PER_TOKEN)
        )


def test_a_stats_sample_of_local_positions_is_caught(monkeypatch):
    """Negative control: taking each rank's first local tokens as the sample (what a sample
    blind to CP's chunks would do) makes the statistics differ from the single rank's."""
    import torch

    from megatron_ext.mhc import stats

    def local_only(local_length, groups, sequence_parallel):
        return torch.arange(local_length)

    monkeypatch.setattr(stats, "global_positions", local_only)
    with pytest.raises(AssertionError, match="sharded .*, single rank"):
        check_mhc_and_stats(cp_plan(cp=2, tp=2, sequence_parallel=True))
