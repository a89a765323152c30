"""Hybrid mHC sharded on 2 ranks matches the single-rank reference: loss, every gradient of
every step and the weights after 3 steps. Run:
torchrun --nproc_per_node 2 -m pytest tests/unit_tests/models/hybrid/test_hybrid_mhc_distributed.py"""

import dataclasses

import pytest

from megatron_ext.config import MHCTransformerConfig
from megatron_ext.testing.equivalence import EquivalenceError, check_equivalence
from megatron_ext.testing.hybrid import hybrid_forward_step, hybrid_model_factory, hybrid_plan

pytestmark = [
    pytest.mark.world_size(2),
    pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC recompute"),
]

# Why 1e-4: see MHC_LR in tests/unit_tests/pipeline/mhc_pipeline_cases.py.
MHC_LR = 1e-4


@pytest.fixture(autouse=True)
def _fresh_mtp_loss_tracker():
    """megatron's MTP loss tracker is global and sized by the first model's MTP depth."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker.clear()
    yield
    MTPLossLoggingHelper.tracker.clear()


def _plan(pattern, streams=4, **kwargs):
    overrides = dict(enable_mhc_connections=True, mhc_num_residual_streams=streams)
    overrides.update(kwargs.pop("config_overrides", {}))
    return hybrid_plan(pattern, lr=MHC_LR, config_overrides=overrides, **kwargs)


def _check(plan, pattern):
    check_equivalence(
        plan,
        factory=hybrid_model_factory(plan, pattern),
        forward_step=hybrid_forward_step,
        config_class=MHCTransformerConfig,
    )


@pytest.mark.parametrize("streams", [2, 4])
def test_tp2_sequence_parallel_attention_mlp_moe_matches_reference(streams):
    pattern = "*-E*-"
    plan = _plan(pattern, streams=streams, tp=2, sequence_parallel=True)
    # Loss and every gradient stay at 1e-5. The weights after 3 Adam steps get 2e-5: Adam
    # normalises a near-zero gradient, so a rounding-level difference in one (an MoE layer's
    # alpha_res at n=2: 1.06e-05 after 3 steps at lr 1e-4) moves that weight by a fraction of lr.
    _check(dataclasses.replace(plan, param_atol=2e-5), pattern)


def test_tp2_sequence_parallel_with_mtp_matches_reference():
    """MTP's per-stream h_proj and e_proj are column-parallel; its input is gathered over
    the sequence and its n-stream output scattered back."""
    pattern = "*-E/*-"
    _check(_plan(pattern, tp=2, sequence_parallel=True), pattern)


def test_tp2_sequence_parallel_with_mhc_recompute_matches_reference():
    pattern = "*-E*-"
    plan = _plan(
        pattern,
        tp=2,
        sequence_parallel=True,
        config_overrides=dict(
            recompute_granularity="selective", recompute_modules=["mhc"], mhc_recompute_layer_num=2
        ),
    )
    _check(plan, pattern)


def test_dp2_matches_reference():
    pattern = "*-E*-/*-"
    _check(_plan(pattern), pattern)


def test_without_the_sequence_parallel_mark_the_learned_contraction_would_differ(monkeypatch):
    """The harness sees the stack's hc_head_* parameters: if their grads were not summed
    over TP under SP, the TP=2 run would differ from the reference."""
    from megatron_ext.models.hybrid import hybrid_stack

    original = hybrid_stack.HybridStack._build_learned_contraction

    def unmarked(self):
        original(self)
        for param in (self.hc_head_fn, self.hc_head_base, self.hc_head_scale):
            param.sequence_parallel = False

    monkeypatch.setattr(hybrid_stack.HybridStack, "_build_learned_contraction", unmarked)
    pattern = "*-"
    with pytest.raises(EquivalenceError, match="decoder.hc_head"):
        _check(_plan(pattern, streams=2, tp=2, sequence_parallel=True, steps=1), pattern)
