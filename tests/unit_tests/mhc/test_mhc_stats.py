"""mHC statistics (megatron_ext.mhc.stats) on a single rank against a direct computation: the
streams each hyper connection saw (captured independently), the maps by the reference formulas,
the row/column residuals and ranges, and the composite gains by explicit float64 matrix
products in layer order."""

import numpy as np
import pytest
import torch

from megatron_ext.mhc import HyperConnectionModule, stats
from megatron_ext.mhc.reference import reference_mappings
from megatron_ext.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_ext.testing.configs import small_config
from megatron_ext.testing.distributed import model_parallel

pytestmark = pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC recompute")

N, H, LAYERS, VOCAB, SEQ = 4, 16, 3, 32, 12


def _model(method):
    config = small_config(
        num_layers=LAYERS,
        hidden_size=H,
        num_attention_heads=2,
        enable_mhc_connections=True,
        mhc_num_residual_streams=N,
        mhc_h_res_method=method,
    )
    torch.manual_seed(5)
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(enable_mhc_connections=True),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
    )
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # away from init, so H_res is far from uniform
        for name, param in model.named_parameters():
            if "hyper_connection" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 2.0)
    return model


def _forward(model):
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
    positions = torch.arange(SEQ).unsqueeze(0).expand(2, SEQ)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    model.train()
    return model(tokens, positions, mask)


def _direct(inputs):
    """Figures from the captured streams, one loop per formula (float64, numpy)."""
    figures, composite = {}, None
    for connection, x in inputs:
        h_pre, h_post, h_res = (
            t.detach().double().numpy() for t in reference_mappings(connection, x[:8, :1])
        )
        h_pre, h_post, h_res = h_pre.reshape(-1, N), h_post.reshape(-1, N), h_res.reshape(-1, N, N)
        name = f"mhc/layer{connection.layer_number:02d}.{connection.stats_sublayer}"
        figures[f"{name}/h_res_row_err"] = np.abs(h_res.sum(axis=2) - 1).max()
        figures[f"{name}/h_res_col_err"] = np.abs(h_res.sum(axis=1) - 1).max()
        figures[f"{name}/h_pre_min"], figures[f"{name}/h_pre_max"] = h_pre.min(), h_pre.max()
        figures[f"{name}/h_post_min"], figures[f"{name}/h_post_max"] = h_post.min(), h_post.max()
        operator = np.transpose(h_res, (0, 2, 1))  # x -> H_resᵀ x
        composite = operator if composite is None else np.matmul(operator, composite)
    figures["mhc/forward_gain"] = np.abs(composite).sum(axis=2).max()
    figures["mhc/backward_gain"] = np.abs(composite).sum(axis=1).max()
    return figures


@pytest.mark.parametrize("method", ["sinkhorn", "birkhoff"])
def test_stats_match_a_direct_computation(monkeypatch, method):
    inputs = []
    streams_in = HyperConnectionModule.streams_in

    def capturing(self, x):
        inputs.append((self, x.detach().clone()))
        return streams_in(self, x)

    monkeypatch.setattr(HyperConnectionModule, "streams_in", capturing)
    recorder = stats.enable()
    try:
        with model_parallel(seed=2):
            model = _model(method)
            _forward(model)
            figures = stats.collect(recorder)
    finally:
        stats.disable()
    assert len(inputs) == 2 * LAYERS
    expected = _direct(inputs)
    assert figures.keys() == expected.keys()
    for name, value in expected.items():
        assert figures[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    if method == "birkhoff":
        assert abs(figures["mhc/forward_gain"] - 1) <= 1e-5
        assert abs(figures["mhc/backward_gain"] - 1) <= 1e-5
        assert max(v for k, v in figures.items() if k.endswith("_err")) <= 1e-6
    else:  # 20 Sinkhorn iterations at these logits leave a visible residual and gain. They
        # end on a column normalisation, so H_res's columns (the operator's rows, the forward
        # gain) are exact and its rows (the backward gain) are not.
        assert max(v for k, v in figures.items() if k.endswith("_err")) > 1e-6
        assert figures["mhc/backward_gain"] != pytest.approx(1.0, abs=1e-5)


def test_nothing_is_recorded_in_eval_or_when_disarmed():
    recorder = stats.enable()
    try:
        with model_parallel(seed=2):
            model = _model("sinkhorn")
            model.eval()
            generator = torch.Generator().manual_seed(3)
            tokens = torch.randint(0, VOCAB, (1, SEQ), generator=generator)
            mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
            model(tokens, torch.arange(SEQ).unsqueeze(0), mask)
            assert not recorder.samples
            recorder.armed = False
            _forward(model)
            assert not recorder.samples
    finally:
        stats.disable()


def test_chunk_products_combine_in_global_layer_order_whatever_the_rank_order():
    """Ranks' contributions arrive in rank order, VPP chunks interleave (rank 0 holds layers 1
    and 3): the products must be multiplied by layer, not by rank. Non-stochastic operators,
    so any other order gives other gains."""
    generator = torch.Generator().manual_seed(0)
    operators = [torch.rand(3, 4, 4, generator=generator, dtype=torch.float64) for _ in range(4)]
    expected = stats.gains(stats.compose(operators))
    rank0 = ({}, [((1, 0), operators[0]), ((3, 0), operators[2])])
    rank1 = ({}, [((2, 0), operators[1]), ((4, 0), operators[3])])
    for contributions in ([rank0, rank1], [rank1, None, rank0]):
        assert stats.combine(contributions) == pytest.approx(expected, rel=1e-12)
    wrong = stats.gains(stats.compose(operators[::-1]))
    assert wrong != pytest.approx(expected, rel=1e-3)
