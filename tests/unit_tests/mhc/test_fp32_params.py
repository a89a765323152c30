"""bf16 training keeps the mHC parameters fp32 (upstream's mark_keep_in_fp32, absent in
megatron-core 0.19.2): under megatron's Float16Module the five parameters of every hyper
connection stay fp32, megatron's DDP gives them fp32 gradient buffers, and megatron's mixed-
precision optimizer steps them in fp32, while every other parameter is bf16."""

import pytest
import torch

from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer.module import Float16Module

from megatron_ext.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_ext.testing.configs import small_config
from megatron_ext.testing.distributed import model_parallel

pytestmark = pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC recompute")

VOCAB, SEQ, BATCH = 64, 16, 2


def _is_mhc(name: str) -> bool:
    return "hyper_connection" in name


def test_mhc_parameters_stay_fp32_under_float16module_and_train_in_fp32():
    with model_parallel(seed=1):
        config = small_config(
            num_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            enable_mhc_connections=True,
            mhc_num_residual_streams=4,
            bf16=True,
            params_dtype=torch.bfloat16,
        )
        model = GPTModel(
            config,
            get_gpt_layer_local_spec(enable_mhc_connections=True),
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
        )
        model = Float16Module(config, model)
        dtypes = {name: p.dtype for name, p in model.named_parameters()}
        assert any(_is_mhc(name) for name in dtypes)
        for name, dtype in dtypes.items():
            assert dtype == (torch.float32 if _is_mhc(name) else torch.bfloat16), name

        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-2, bf16=True, params_dtype=torch.bfloat16),
            [ddp],
            use_gloo_process_groups=False,
        )
        before = {n: p.detach().clone() for n, p in ddp.named_parameters() if _is_mhc(n)}

        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
        positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
        mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
        loss = ddp(tokens, positions, mask, labels=tokens).float().mean()
        loss.backward()
        finalize_model_grads([ddp])
        for name, param in ddp.named_parameters():
            if _is_mhc(name):
                assert param.main_grad.dtype == torch.float32, name
                assert param.main_grad.abs().sum() > 0, name
        succeeded, _, _ = optimizer.step()
        assert succeeded
        for name, param in ddp.named_parameters():
            if _is_mhc(name):
                assert param.dtype == torch.float32, name
                assert not torch.equal(param.detach(), before[name]), f"{name} was not updated"


def _kept_fp32(name: str) -> bool:
    return _is_mhc(name) or "hc_head_" in name


def _assert_mhc_fp32_rest_bf16(model):
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    heads = [name for name in dtypes if "hc_head_" in name]
    for name, dtype in dtypes.items():
        assert dtype == (torch.float32 if _kept_fp32(name) else torch.bfloat16), name
    return heads


def test_learned_contraction_heads_stay_fp32_under_float16module():
    """The hc_head_* parameters (GPT learned contraction; Hybrid stack and each Hybrid MTP
    depth) stay fp32 in a bf16 model, and a bf16 forward+backward gives them fp32 grads."""
    from megatron_ext.models.hybrid import HybridModel, get_hybrid_stack_local_spec

    with model_parallel(seed=1):
        fields = dict(
            hidden_size=32,
            num_attention_heads=4,
            enable_mhc_connections=True,
            mhc_num_residual_streams=2,
            bf16=True,
            params_dtype=torch.bfloat16,
        )
        gpt_config = small_config(num_layers=2, mhc_learned_output_contract=True, **fields)
        gpt = Float16Module(
            gpt_config,
            GPTModel(
                gpt_config,
                get_gpt_layer_local_spec(enable_mhc_connections=True),
                vocab_size=VOCAB,
                max_sequence_length=SEQ,
            ),
        )
        hybrid_config = small_config(num_layers=2, mtp_num_layers=1, **fields)
        hybrid = Float16Module(
            hybrid_config,
            HybridModel(
                hybrid_config,
                get_hybrid_stack_local_spec(enable_mhc_connections=True),
                vocab_size=VOCAB,
                max_sequence_length=SEQ,
                hybrid_layer_pattern="*-/*-",
            ),
        )
        assert len(_assert_mhc_fp32_rest_bf16(gpt)) == 3
        assert len(_assert_mhc_fp32_rest_bf16(hybrid)) == 6  # stack + one MTP depth

        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
        positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
        mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
        for model in (gpt, hybrid):
            model(tokens, positions, mask, labels=tokens).float().mean().backward()
            for name, param in model.named_parameters():
                if "hc_head_" in name:
                    assert param.grad is not None and param.grad.dtype == torch.float32, name
