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


@pytest.fixture(autouse=True)
def _fresh_mtp_loss_tracker():
    """megatron's MTP loss tracker is global and sized by the first model's MTP depth."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker.clear()
    yield
    MTPLossLoggingHelper.tracker.clear()


N, H, LAYERS, VOCAB, SEQ = 4, 16, 3, 32, 12


def _model(method, variant="megatron"):
    config = small_config(
        mhc_variant=variant,
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


def _direct_amplitudes(name, h_pre, h_post, x):
    """The amplitude figures: Σ H_pre, Σ H_post and each stream's RMS over h (numpy)."""
    streams = x[:8, :1].detach().double().numpy().reshape(-1, N, x.shape[-1] // N)
    rms = np.sqrt((streams**2).mean(axis=-1))
    return {
        f"{name}/h_pre_sum_max": h_pre.sum(axis=1).max(),
        f"{name}/h_post_sum_max": h_post.sum(axis=1).max(),
        f"{name}/stream_rms_min": rms.min(),
        f"{name}/stream_rms_max": rms.max(),
    }


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
        figures[f"{name}/h_res_identity_dist"] = max(
            np.sqrt(((m - np.eye(N)) ** 2).sum()) for m in h_res
        )
        figures[f"{name}/h_res_uniform_dist"] = max(
            np.sqrt(((m - 1 / N) ** 2).sum()) for m in h_res
        )
        figures[f"{name}/h_pre_min"], figures[f"{name}/h_pre_max"] = h_pre.min(), h_pre.max()
        figures[f"{name}/h_post_min"], figures[f"{name}/h_post_max"] = h_post.min(), h_post.max()
        figures.update(_direct_amplitudes(name, h_pre, h_post, x))
        operator = np.transpose(h_res, (0, 2, 1))  # x -> H_resᵀ x
        composite = operator if composite is None else np.matmul(operator, composite)
    figures["mhc/forward_gain"] = np.abs(composite).sum(axis=2).max()
    figures["mhc/backward_gain"] = np.abs(composite).sum(axis=1).max()
    return figures


@pytest.mark.parametrize(
    "method, variant",
    [("sinkhorn", "megatron"), ("birkhoff", "megatron"), ("sinkhorn", "deepseek-v4")],
)
def test_stats_match_a_direct_computation(monkeypatch, method, variant):
    inputs = []
    streams_in = HyperConnectionModule.streams_in

    def capturing(self, x):
        inputs.append((self, x.detach().clone()))
        return streams_in(self, x)

    monkeypatch.setattr(HyperConnectionModule, "streams_in", capturing)
    recorder = stats.enable()
    try:
        with model_parallel(seed=2):
            model = _model(method, variant)
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


def _entry(layer, h_res, positions=None, index=0, depth=0):
    tokens = h_res.shape[0]
    positions = torch.arange(tokens) if positions is None else positions
    maps = torch.rand(tokens, N, dtype=torch.float64)
    name = f"mhc/layer{layer:02d}.s{index}" if not depth else f"mhc/mtp{depth}.layer{layer:02d}"
    return stats.Entry(name, (depth, layer, index), positions, maps, maps, h_res, maps)


def test_sublayers_combine_in_global_layer_order_whatever_the_rank_order():
    """Ranks' contributions arrive in rank order, VPP chunks interleave (rank 0 holds layers 1
    and 3): the operators must be multiplied by layer, not by rank. Non-stochastic operators,
    so any other order gives other gains."""
    generator = torch.Generator().manual_seed(0)
    h_res = [torch.rand(3, N, N, generator=generator, dtype=torch.float64) for _ in range(4)]
    expected = stats.gains(stats.compose([h.transpose(-1, -2) for h in h_res]))
    rank0 = [_entry(1, h_res[0]), _entry(3, h_res[2])]
    rank1 = [_entry(4, h_res[3]), _entry(2, h_res[1])]
    for contributions in ([rank0, rank1], [rank1, [], rank0]):
        figures = stats.combine(contributions)
        assert {k: figures[k] for k in stats.GAIN_NAMES} == pytest.approx(expected, rel=1e-12)
    wrong = stats.gains(stats.compose([h.transpose(-1, -2) for h in h_res[::-1]]))
    assert wrong != pytest.approx(expected, rel=1e-3)


def test_sample_tokens_split_over_ranks_merge_by_position():
    """CP and SP split the sample: each rank's tokens (any order, some held twice, as TP
    copies would be) merge into the single rank's figures; a sub-layer missing some
    positions gives no gains rather than wrong ones."""
    generator = torch.Generator().manual_seed(1)
    h_res = [torch.rand(8, N, N, generator=generator, dtype=torch.float64) for _ in range(2)]
    cp0, cp1 = torch.tensor([0, 1, 6, 7]), torch.tensor([2, 3, 4, 5])

    def part(positions):
        return [stats.Entry(*e[:2], positions, *(t[positions] for t in e[3:])) for e in full]

    full = [_entry(1, h_res[0]), _entry(2, h_res[1])]
    full[0] = full[0]._replace(h_pre=torch.rand(8, N, dtype=torch.float64, generator=generator))
    whole = stats.combine([full])
    assert stats.combine([part(cp1), part(cp0), part(cp0[:2])]) == pytest.approx(whole)
    assert set(stats.combine([part(cp0)])) & set(stats.GAIN_NAMES) == set(stats.GAIN_NAMES)
    partial = [part(cp0)[0], part(torch.arange(8))[1]]
    assert not set(stats.combine([partial])) & set(stats.GAIN_NAMES)


def test_mtp_depths_have_their_own_gains_after_the_decoders():
    generator = torch.Generator().manual_seed(2)
    h_res = [torch.rand(2, N, N, generator=generator, dtype=torch.float64) for _ in range(3)]
    entries = [_entry(1, h_res[0]), _entry(2, h_res[1]), _entry(1, h_res[2], depth=1)]
    figures = stats.combine([entries[::-1]])
    operators = [h.transpose(-1, -2) for h in h_res]
    assert {k: figures[k] for k in stats.GAIN_NAMES} == pytest.approx(
        stats.gains(stats.compose(operators[:2]))
    )
    assert {k: figures[k] for k in stats.MTP_GAIN_NAMES} == pytest.approx(
        stats.gains(stats.compose(operators), stats.MTP_GAIN_NAMES)
    )
    assert "mhc/mtp1.layer01/h_res_row_err" in figures


@pytest.mark.parametrize(
    "tp, cp, sp, expected",
    [
        (2, 1, True, [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]]),
        (2, 1, False, [list(range(16))] * 2),
        (1, 2, False, [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]]),
        (2, 2, True, [[0, 1, 2, 3], [12, 13, 14, 15], [4, 5, 6, 7], [8, 9, 10, 11]]),
    ],
)
def test_global_positions_of_a_ranks_tokens(tp, cp, sp, expected):
    """megatron's split of a 16-token sequence: CP's load-balanced chunks, then SP's slices."""
    found = []
    for cp_rank in range(cp):
        for tp_rank in range(tp):
            groups = {"tp": (tp_rank, tp), "cp": (cp_rank, cp), "dp": (0, 1)}
            local = 16 // cp // (tp if sp else 1)
            found.append(stats.global_positions(local, groups, sp).tolist())
    assert found == expected


# ------------------------------------------------------------------ multi-token prediction
def _away_from_init(model):
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "hyper_connection" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 2.0)


def _first_inputs(monkeypatch):
    """(connection, streams) of every hyper connection's first call, in call order."""
    inputs, seen = [], set()
    record = HyperConnectionModule._record_sample

    def capturing(self, x):
        if id(self) not in seen:
            seen.add(id(self))
            inputs.append((self, x.detach().clone()))
        return record(self, x)

    monkeypatch.setattr(HyperConnectionModule, "_record_sample", capturing)
    return inputs


def _direct_maps(connection, x):
    maps = (t.detach().double().numpy() for t in reference_mappings(connection, x[:8, :1]))
    h_pre, h_post, h_res = maps
    return h_pre.reshape(-1, N), h_post.reshape(-1, N), h_res.reshape(-1, N, N)


def _direct_gains(operators, names):
    composite = operators[0]
    for operator in operators[1:]:
        composite = np.matmul(operator, composite)
    return {
        names[0]: np.abs(composite).sum(axis=2).max(),
        names[1]: np.abs(composite).sum(axis=1).max(),
    }


@pytest.mark.parametrize("method", ["sinkhorn", "birkhoff"])
def test_hybrid_mtp_stats_match_a_direct_computation(monkeypatch, method):
    """Hybrid with the learned contraction and two MTP depths (each carrying the n streams):
    the decoder's gains are the decoder's layers only; the MTP gains compose the decoder's
    layers, then depth 1's, then depth 2's (the call order); MTP sub-layers are reported under
    their depth."""
    from megatron_ext.config import MHCTransformerConfig
    from megatron_ext.testing.equivalence import make_microbatches, transformer_config
    from megatron_ext.testing.hybrid import hybrid_forward_step, hybrid_model_factory, hybrid_plan

    pattern = "*-/*-/*-"
    plan = hybrid_plan(
        pattern,
        seq_length=SEQ,
        config_overrides=dict(
            enable_mhc_connections=True, mhc_num_residual_streams=N, mhc_h_res_method=method
        ),
    )
    inputs = _first_inputs(monkeypatch)
    recorder = stats.enable()
    try:
        with model_parallel(seed=2):
            config = transformer_config(plan, parallel=False, config_class=MHCTransformerConfig)
            model = hybrid_model_factory(plan, pattern)(config, True, True, None)
            _away_from_init(model)
            model.train()
            output, _ = hybrid_forward_step(iter(make_microbatches(plan, 0)), model)
            output.sum().backward()  # the whole step runs (nothing recorded twice)
            figures = stats.collect(recorder)
    finally:
        stats.disable()
    mtp = {id(m): depth for depth, layer in enumerate(model.mtp.layers, 1) for m in layer.modules()}
    assert len(inputs) == 6 and [mtp.get(id(c), 0) for c, _ in inputs] == [0, 0, 1, 1, 2, 2]
    expected, operators = {}, []
    for connection, x in inputs:
        h_pre, h_post, h_res = _direct_maps(connection, x)
        depth = mtp.get(id(connection), 0)
        scope = f"mtp{depth}." if depth else ""
        name = f"mhc/{scope}layer{connection.layer_number:02d}.{connection.stats_sublayer}"
        expected[f"{name}/h_res_row_err"] = np.abs(h_res.sum(axis=2) - 1).max()
        expected[f"{name}/h_res_col_err"] = np.abs(h_res.sum(axis=1) - 1).max()
        expected[f"{name}/h_res_identity_dist"] = max(
            np.sqrt(((m - np.eye(N)) ** 2).sum()) for m in h_res
        )
        expected[f"{name}/h_res_uniform_dist"] = max(
            np.sqrt(((m - 1 / N) ** 2).sum()) for m in h_res
        )
        expected[f"{name}/h_pre_min"], expected[f"{name}/h_pre_max"] = h_pre.min(), h_pre.max()
        expected[f"{name}/h_post_min"] = h_post.min()
        expected[f"{name}/h_post_max"] = h_post.max()
        expected.update(_direct_amplitudes(name, h_pre, h_post, x))
        operators.append(np.transpose(h_res, (0, 2, 1)))
    expected.update(_direct_gains(operators[:2], stats.GAIN_NAMES))
    expected.update(_direct_gains(operators, stats.MTP_GAIN_NAMES))
    assert "mhc/mtp2.layer02.mlp/h_res_row_err" in expected
    assert figures.keys() == expected.keys()
    for name, value in expected.items():
        assert figures[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    if method == "birkhoff":
        for name in stats.GAIN_NAMES + stats.MTP_GAIN_NAMES:
            assert abs(figures[name] - 1) <= 1e-5, name
    else:  # the MTP path is longer: its gain differs from the decoder's
        assert figures[stats.MTP_BACKWARD_GAIN] != pytest.approx(figures[stats.BACKWARD_GAIN])


@pytest.mark.parametrize("method", ["sinkhorn", "birkhoff"])
def test_gpt_mtp_layers_have_no_hyper_connections_and_leave_the_gains_alone(method):
    """GPT's MTP layers are plain layers on the decoder's contracted output: with either
    H_res method the model trains, the MTP projection gets a gradient and the figures are
    the decoder's alone (no MTP names, no MTP gains)."""
    from megatron.core.models.gpt import gpt_layer_specs as core_specs

    recorder = stats.enable()
    try:
        with model_parallel(seed=2):
            config = small_config(
                num_layers=2,
                hidden_size=H,
                num_attention_heads=2,
                enable_mhc_connections=True,
                mhc_num_residual_streams=N,
                mhc_h_res_method=method,
                mtp_num_layers=1,
            )
            mtp = core_specs.get_gpt_mtp_block_spec(
                config, get_gpt_layer_local_spec(), use_transformer_engine=False
            )
            model = GPTModel(
                config,
                get_gpt_layer_local_spec(enable_mhc_connections=True),
                vocab_size=VOCAB,
                max_sequence_length=SEQ,
                position_embedding_type="rope",
                mtp_block_spec=mtp,
            )
            model.train()
            tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
            positions = torch.arange(SEQ).unsqueeze(0).expand(2, SEQ)
            mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
            model(tokens, positions, mask, labels=tokens).sum().backward()
            figures = stats.collect(recorder)
    finally:
        stats.disable()
    assert model.mtp.layers[0].eh_proj.weight.grad.abs().sum() > 0
    assert not any(isinstance(m, HyperConnectionModule) for m in model.mtp.modules())
    assert len([k for k in figures if k.endswith("/h_res_row_err")]) == 4  # 2 layers x 2
    assert set(stats.GAIN_NAMES) <= set(figures) and not set(stats.MTP_GAIN_NAMES) & set(figures)
    if method == "birkhoff":
        assert all(abs(figures[name] - 1) <= 1e-5 for name in stats.GAIN_NAMES)


def test_the_runner_records_every_gain_under_the_names_stats_writes():
    """mhc_report keeps the names as text (the runner does not import torch)."""
    from megatron_ext.runs import mhc_report

    assert mhc_report.GAIN_NAMES == stats.GAIN_NAMES + stats.MTP_GAIN_NAMES
