"""Context parallelism (megatron-ext's local CP attention) with mHC on 4 ranks, through the
equivalence harness: loss, every gradient of every step and the final weights equal the
single-rank run. GPT at CP=2 (x DP=2), CP=2 x PP=2 and CP=2 x TP=2 with sequence parallelism;
Hybrid (rotary positions) at CP=2 x PP=2 with MTP. Pipelined runs also check that every P2P
tensor is [s/cp (/tp under SP), b, n*h]. A negative control shows the harness catches wrong
global positions."""

import pytest
from mhc_pipeline_cases import (
    all_ranks,
    assert_every_exchange_is_n_streams_wide,
    check_mhc,
    mhc_plan,
    recorded_p2p_shapes,
)
from test_pp_mhc_hybrid import check_pipelined, fresh_mtp_loss_tracker  # noqa: F401

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


def cp_plan(**layout):
    return mhc_plan(config_overrides=PER_TOKEN, **SMALL, **layout)


@pytest.mark.parametrize(
    "layout",
    [dict(cp=2), dict(cp=2, pp=2), dict(cp=2, tp=2, sequence_parallel=True)],
    ids=["cp2_dp2", "cp2_pp2", "cp2_tp2_sp"],
)
def test_gpt_mhc_context_parallel_matches_reference(monkeypatch, layout):
    plan = cp_plan(**layout)
    with recorded_p2p_shapes(monkeypatch) as seen:
        check_mhc(plan)
    if plan.pp > 1:
        assert_every_exchange_is_n_streams_wide(plan, all_ranks(seen))


def test_hybrid_mhc_cp2_pp2_mtp_matches_reference(monkeypatch):
    # Megatron scales each CP rank's MTP loss by that rank's token counts before and after the
    # MTP roll; masking every chunk's first token makes them agree with the whole sequence's.
    check_pipelined(
        monkeypatch,
        "*-|*-/*-",
        cp=2,
        pp=2,
        steps=2,
        global_batch_size=4,
        loss_mask_zero_every=16 // 4,
        config_overrides=dict(PER_TOKEN),
    )


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
