"""mHC GPT sharded on 2 ranks matches the single-rank reference: loss, every gradient of
every step and the weights after 3 steps. Run:
torchrun --nproc_per_node 2 -m pytest tests/unit_tests/mhc/test_mhc_gpt_distributed.py"""

import pytest

from megatron_ext.config import MHCTransformerConfig
from megatron_ext.testing.equivalence import TrainPlan, check_equivalence

pytestmark = [
    pytest.mark.world_size(2),
    # MHCTransformerConfig's "consider 'mhc' recompute" hint, once per config.
    pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC recompute"),
]


def _check(plan: TrainPlan):
    check_equivalence(plan, config_class=MHCTransformerConfig)


# Why lr=1e-4 here (megatron-ext's plain GPT tests use 1e-3): at initialisation every stream is
# a copy of the embedding, so H_res mixes identical vectors and the gradients of alpha_res and
# of the res part of bias are float rounding noise (~1e-9; 5% to 240% relative error against
# a float64 run). Adam divides each gradient by its own magnitude, so the sharded run and the
# reference (which sum in different orders under SP) move those parameters by different
# fractions of lr. Loss and every gradient are still compared at the plan's tolerances; only
# the update noise of the final-weight comparison shrinks with lr.
MHC_LR = 1e-4


@pytest.mark.parametrize("streams", [2, 4])
def test_tp2_sequence_parallel_matches_reference(streams):
    _check(
        TrainPlan(
            tp=2,
            sequence_parallel=True,
            lr=MHC_LR,
            config_overrides=dict(enable_mhc_connections=True, mhc_num_residual_streams=streams),
        )
    )


def test_dp2_matches_reference():
    _check(
        TrainPlan(
            lr=MHC_LR,
            config_overrides=dict(enable_mhc_connections=True, mhc_num_residual_streams=4),
        )
    )


def test_tp2_sequence_parallel_with_mhc_recompute_matches_reference():
    _check(
        TrainPlan(
            tp=2,
            sequence_parallel=True,
            lr=MHC_LR,
            config_overrides=dict(
                enable_mhc_connections=True,
                mhc_num_residual_streams=4,
                recompute_granularity="selective",
                recompute_modules=["core_attn", "mhc"],
                mhc_recompute_layer_num=3,
            ),
        )
    )


def test_without_the_sequence_parallel_mark_tp2_sp_would_differ(monkeypatch):
    """The harness sees mHC parameters: if their grads were not summed over TP under SP,
    the TP=2 run would differ from the reference."""
    from megatron_ext.mhc import hyper_connection
    from megatron_ext.testing.equivalence import EquivalenceError

    original_init = hyper_connection.HyperConnectionModule.__init__

    def unmarked_init(self, config, layer_number):
        original_init(self, config, layer_number)
        for param in self.parameters():
            param.sequence_parallel = False

    monkeypatch.setattr(hyper_connection.HyperConnectionModule, "__init__", unmarked_init)
    with pytest.raises(EquivalenceError, match="hyper_connection"):
        _check(
            TrainPlan(
                tp=2,
                sequence_parallel=True,
                steps=1,
                lr=MHC_LR,
                config_overrides=dict(enable_mhc_connections=True, mhc_num_residual_streams=2),
            )
        )
