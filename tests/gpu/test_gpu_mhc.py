"""GPU checks (one GPU; marked ``gpu``, skipped without CUDA): mHC in Transformer Engine layer
specs (GPT and Hybrid), bf16 through megatron's Float16Module against the fp32 model, and a
one-GPU training run of a small mHC recipe over NCCL. The CPU tests of the same behaviour stay
in tests/unit_tests; these exercise the kernels and the NCCL path that CPU runs never reach.

Run them with ``make test-gpu`` (or ``scripts/gpu_check.sh`` on a bare GPU machine)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC recompute"),
]

REPO_ROOT = Path(__file__).resolve().parents[2]
HIDDEN, HEADS, SEQ, BATCH, VOCAB, STREAMS = 256, 8, 128, 2, 512, 4


def _te():
    return pytest.importorskip(
        "transformer_engine.pytorch", reason="TE layer specs need transformer_engine"
    )


@pytest.fixture
def one_gpu_model_parallel():
    import megatron_ext
    from megatron_ext.testing.distributed import model_parallel

    megatron_ext.install()
    torch.cuda.set_device(0)
    with model_parallel():
        yield


def _config(dtype=torch.float32, **fields):
    from megatron_ext.config import MHCTransformerConfig

    kwargs = dict(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        enable_mhc_connections=True,
        mhc_num_residual_streams=STREAMS,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
    )
    kwargs.update(fields)
    return MHCTransformerConfig(**kwargs)


def _batch():
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator).cuda()
    positions = torch.arange(SEQ, device="cuda").unsqueeze(0).expand(BATCH, SEQ)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool, device="cuda"), diagonal=1)
    return tokens[:, :-1], positions, mask, tokens[:, 1:]


def _loss_and_grads(model):
    tokens, positions, mask, labels = _batch()
    loss = model(tokens, positions, mask, labels=labels).float().mean()
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters() if p.requires_grad]


def _gpt_te(config):
    from megatron_ext.models.gpt import get_gpt_layer_with_transformer_engine_spec

    return _gpt(config, get_gpt_layer_with_transformer_engine_spec(enable_mhc_connections=True))


def _gpt_local(config):
    from megatron_ext.models.gpt import get_gpt_layer_local_spec

    return _gpt(config, get_gpt_layer_local_spec(enable_mhc_connections=True))


def _gpt(config, spec):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_ext.models.gpt import GPTModel

    torch.manual_seed(1)
    model_parallel_cuda_manual_seed(1)
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ).cuda()


def _hybrid_te(config, pattern):
    from megatron_ext.models.hybrid import (
        HybridModel,
        get_hybrid_stack_with_transformer_engine_spec,
    )

    torch.manual_seed(1)
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1)
    spec = get_hybrid_stack_with_transformer_engine_spec(enable_mhc_connections=True)
    return HybridModel(
        config, spec, vocab_size=VOCAB, max_sequence_length=SEQ, hybrid_layer_pattern=pattern
    ).cuda()


def _assert_trains(model):
    loss, grads = _loss_and_grads(model)
    assert torch.isfinite(loss), loss
    hc_grads = [p.grad for n, p in model.named_parameters() if "hyper_connection" in n]
    assert hc_grads and all(g is not None and torch.isfinite(g).all() for g in hc_grads)
    assert any(g.abs().sum() > 0 for g in hc_grads), "the hyper connections get gradients"
    return loss


def test_gpt_te_spec_with_mhc_trains_a_step(one_gpu_model_parallel):
    _te()
    model = _gpt_te(_config())
    assert any("hyper_connection" in n for n, _ in model.named_parameters())
    _assert_trains(model)


@pytest.mark.parametrize("pattern", ["*-*-", "M*-M"])
def test_hybrid_te_spec_with_mhc_trains_a_step(one_gpu_model_parallel, pattern):
    _te()
    if "M" in pattern:
        pytest.importorskip("mamba_ssm", reason="Mamba layers need mamba-ssm")
    model = _hybrid_te(_config(num_layers=len(pattern)), pattern)
    _assert_trains(model)


@pytest.mark.parametrize("layers", ["local", "te"])
def test_bf16_through_float16module_matches_fp32(one_gpu_model_parallel, layers):
    """megatron's Float16Module casts the model to bf16; mHC's mapping maths stay fp32 inside.
    The bf16 loss must follow the fp32 model's with the same weights (megatron-core's local
    layers always, Transformer Engine's where installed)."""
    from megatron.core.transformer.module import Float16Module

    if layers == "te":
        _te()
    build = _gpt_te if layers == "te" else _gpt_local
    reference = build(_config())
    ref_loss, _ = _loss_and_grads(reference)
    config16 = _config(torch.bfloat16)
    model16 = build(config16)
    model16.load_state_dict(reference.state_dict())
    wrapped = Float16Module(config16, model16)
    assert next(model16.parameters()).dtype == torch.bfloat16
    loss16, grads = _loss_and_grads(wrapped)
    assert all(g is None or torch.isfinite(g).all() for g in grads)
    torch.testing.assert_close(loss16, ref_loss, rtol=2e-2, atol=0)


def test_one_gpu_training_run_of_a_small_mhc_recipe_over_nccl(tmp_path):
    """`megatron-ext run` on one GPU: megatron.training.pretrain, NCCL, the mHC GPT recipe at
    TP=PP=1 (TE layers where installed), 6 iterations; the loss must go down."""
    command = [
        sys.executable,
        "-m",
        "megatron_ext.cli",
        "run",
        str(REPO_ROOT / "recipes/gpt_mhc_tp2_pp2_sp.yaml"),
        "--device",
        "gpu",
        "--no-compare",
        "--run-dir",
        str(tmp_path / "run"),
        "parallelism.tp=1",
        "parallelism.pp=1",
        "parallelism.sp=false",
        "training.iterations=6",
        "test.type=regular",
    ]
    # One GPU; none of the rendezvous variables an earlier test of this session may have set.
    rendezvous = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if k not in rendezvous}
    env["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    done = subprocess.run(
        command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    from megatron_ext.runs.metrics import read_golden

    series = read_golden(tmp_path / "run" / "metrics.json")["lm loss"]
    losses = [series[step] for step in sorted(series)]
    assert len(losses) == 6 and all(map(lambda v: v == v, losses)), losses
    assert losses[-1] < losses[0], losses
