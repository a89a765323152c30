"""GPT with upstream dev's learned contraction (mhc_learned_output_contract=True): upstream
dev's GPT checkpoint keys (decoder.hc_head_fn/base/scale beside main's layer keys), the
contraction the final layernorm sees, and distributed checkpoints that keep the new keys."""

import pytest
import torch

from megatron_ext.mhc import learned_contract
from megatron_ext.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_ext.testing.configs import small_config
from megatron_ext.testing.distributed import model_parallel

pytestmark = pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC recompute")

N, H, VOCAB, SEQ = 2, 8, 16, 4
UPSTREAM_HC_PARAMS = ("mapping_proj.weight", "alpha_pre", "alpha_post", "alpha_res", "bias")


def _gpt(mhc: bool, learned: bool = False) -> GPTModel:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(3)
    model_parallel_cuda_manual_seed(3)
    config = small_config(
        num_layers=2,
        hidden_size=H,
        num_attention_heads=2,
        enable_mhc_connections=mhc,
        mhc_num_residual_streams=N,
        mhc_learned_output_contract=learned,
    )
    return GPTModel(
        config,
        get_gpt_layer_local_spec(enable_mhc_connections=mhc),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
    )


def _dev_gpt_keys(plain: dict) -> set[str]:
    """Upstream dev's GPT mHC keys: the plain layer's, two hyper connections per layer, the
    block's learned contraction."""
    keys = {k for k in plain if "_extra_state" not in k}
    layers = {k.split(".")[2] for k in plain if k.startswith("decoder.layers.")}
    for i in layers:
        for module in ("self_attention_hyper_connection", "mlp_hyper_connection"):
            keys.update(f"decoder.layers.{i}.{module}.{p}" for p in UPSTREAM_HC_PARAMS)
    keys.update(f"decoder.hc_head_{p}" for p in ("fn", "base", "scale"))
    return keys


def test_dev_gpt_keys_and_the_learned_contraction_before_the_final_norm():
    with model_parallel():
        plain = _gpt(mhc=False).state_dict()
        model = _gpt(mhc=True, learned=True)
        state = model.state_dict()
        assert {k for k in state if "_extra_state" not in k} == _dev_gpt_keys(plain)
        assert state["decoder.hc_head_fn"].shape == (N, N * H)
        assert state["decoder.hc_head_base"].shape == (N,) and state[
            "decoder.hc_head_scale"
        ].shape == (1,)
        main_keys = _dev_gpt_keys(plain) - {f"decoder.hc_head_{p}" for p in ("fn", "base", "scale")}
        mean_model = {k for k in _gpt(mhc=True).state_dict() if "_extra_state" not in k}
        assert mean_model == main_keys, (
            "the default (mean) GPT has upstream main's / PR #6401's keys"
        )

        seen = {}
        model.decoder.layers[-1].register_forward_hook(
            lambda m, a, out: seen.update(streams=out[0])
        )
        model.decoder.final_layernorm.register_forward_pre_hook(
            lambda m, a: seen.update(normed_input=a[0])
        )
        tokens = torch.randint(0, VOCAB, (1, SEQ))
        positions = torch.arange(SEQ).unsqueeze(0)
        mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
        model(tokens, positions, mask).sum().backward()
        decoder = model.decoder
        expected = learned_contract(
            seen["streams"],
            decoder.hc_head_fn,
            decoder.hc_head_base,
            decoder.hc_head_scale,
            N,
            decoder.config.layernorm_epsilon,
        )
        torch.testing.assert_close(seen["normed_input"], expected, rtol=0, atol=0)
        assert decoder.hc_head_fn.grad is not None and decoder.hc_head_fn.grad.abs().sum() > 0

        sharded = model.sharded_state_dict()
        assert {"decoder.hc_head_fn", "decoder.hc_head_base", "decoder.hc_head_scale"} <= set(
            sharded
        )
