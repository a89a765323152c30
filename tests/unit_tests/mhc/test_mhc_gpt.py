"""GPTModel with mHC residual streams: the forward against the equations written out by hand,
the spec and parameter names, where expansion and contraction happen, and training on CPU."""

import math

import pytest
import torch

from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_ext.mhc import HyperConnectionModule
from megatron_ext.mhc.transformer_block import HyperConnectionTransformerBlock
from megatron_ext.mhc.transformer_layer import HyperConnectionTransformerLayer
from megatron_ext.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_ext.testing.configs import small_config
from megatron_ext.testing.distributed import model_parallel

pytestmark = pytest.mark.filterwarnings("ignore:enable_mhc_connections=True without mHC recompute")

N, H = 2, 4  # streams, hidden size of the hand-checked case
VOCAB, SEQ = 8, 3


def _config(**overrides):
    fields = dict(
        num_layers=1,
        hidden_size=H,
        num_attention_heads=2,
        enable_mhc_connections=True,
        mhc_num_residual_streams=N,
    )
    return small_config(**{**fields, **overrides})


def _gpt(config, mhc=True, seed=7, **kwargs):
    torch.manual_seed(seed)
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(seed)
    return GPTModel(
        config,
        get_gpt_layer_local_spec(enable_mhc_connections=mhc),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        **kwargs,
    )


def _batch(seed=3, batch=1):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch, SEQ), generator=generator)
    positions = torch.arange(SEQ).unsqueeze(0).expand(batch, SEQ)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    return tokens, positions, mask


# ----------------------------------------------------------------------------- by hand, in float64


def _sigmoid(v):
    return 1.0 / (1.0 + math.exp(-v))


def _hand_sinkhorn(logits, iterations):
    """exp(l - rowmax), then `iterations` × (rows to 1, columns to 1), element by element."""
    n = len(logits)
    m = [[math.exp(v - max(row)) for v in row] for row in logits]
    for _ in range(iterations):
        m = [[v / sum(row) for v in row] for row in m]
        col = [sum(m[i][j] for i in range(n)) for j in range(n)]
        m = [[m[i][j] / col[j] for j in range(n)] for i in range(n)]
    return m


def _hand_maps(p, x):
    """H_pre, H_post, H_res of one token's streams x (a list of n*h floats)."""
    n = N
    rms = math.sqrt(sum(v * v for v in x) / len(x))
    r = 1.0 / (rms + 1e-6)
    w = p["mapping_proj.weight"]
    alpha = [p["alpha_pre"][0]] * n + [p["alpha_post"][0]] * n + [p["alpha_res"][0]] * (n * n)
    z = [
        r * sum(w[k][c] * x[c] for c in range(len(x))) * alpha[k] + p["bias"][k]
        for k in range(n * n + 2 * n)
    ]
    h_pre = [_sigmoid(v) for v in z[:n]]
    h_post = [2 * _sigmoid(v) for v in z[n : 2 * n]]
    res = [[z[2 * n + i * n + j] for j in range(n)] for i in range(n)]
    return h_pre, h_post, _hand_sinkhorn(res, 20)


def _layer_norm(v, weight, bias, eps=1e-5):
    mean = v.mean(-1, keepdim=True)
    var = ((v - mean) ** 2).mean(-1, keepdim=True)
    return (v - mean) / torch.sqrt(var + eps) * weight + bias


def _hand_attention(p, x, heads):
    """Megatron's SelfAttention on [s, h]: per query group rows [q, k, v] of linear_qkv."""
    s, h = x.shape
    d = h // heads
    qkv = x @ p["linear_qkv.weight"].T + p["linear_qkv.bias"]
    outputs = []
    for head in range(heads):
        block = qkv[:, head * 3 * d : (head + 1) * 3 * d]
        q, k, v = block[:, :d], block[:, d : 2 * d], block[:, 2 * d :]
        scores = q @ k.T / math.sqrt(d)
        scores = scores.masked_fill(torch.triu(torch.ones(s, s, dtype=torch.bool), 1), -10000.0)
        outputs.append(torch.softmax(scores, dim=-1) @ v)
    return torch.cat(outputs, dim=-1) @ p["linear_proj.weight"].T, p["linear_proj.bias"]


def _hand_mlp(p, x):
    hidden = torch.nn.functional.gelu(x @ p["linear_fc1.weight"].T + p["linear_fc1.bias"])
    return hidden @ p["linear_fc2.weight"].T, p["linear_fc2.bias"]


def _hand_sublayer(connection, norm, sublayer, streams):
    """One mHC sub-layer on streams [s, n, h]: per token maps, aggregate, F, merge."""
    s = streams.shape[0]
    maps = [_hand_maps(connection, streams[t].reshape(-1).tolist()) for t in range(s)]
    aggregated = torch.stack(
        [sum(maps[t][0][i] * streams[t, i] for i in range(N)) for t in range(s)]
    )
    y, bias = sublayer(_layer_norm(aggregated, *norm))
    out = torch.empty_like(streams)
    for t in range(s):
        h_pre, h_post, h_res = maps[t]
        for i in range(N):
            mixed = sum(h_res[j][i] * streams[t, j] for j in range(N))  # H_resᵀ
            out[t, i] = mixed + h_post[i] * (y[t] + bias)
    return out


def _hand_logits(model, tokens):
    """The whole one-layer mHC GPT for one sequence, in float64."""
    p = {
        k: v.detach().double()
        for k, v in model.state_dict().items()
        if v is not None and v.is_floating_point()
    }
    prefix = "decoder.layers.0."

    def sub(name):
        return {
            k[len(prefix + name) + 1 :]: v
            for k, v in p.items()
            if k.startswith(prefix + name + ".")
        }

    embedded = (
        p["embedding.word_embeddings.weight"][tokens[0]]
        + p["embedding.position_embeddings.weight"][:SEQ]
    )
    streams = embedded.unsqueeze(1).repeat(1, N, 1)  # expand: every stream = the embedding
    attention = sub("self_attention")
    streams = _hand_sublayer(
        sub("self_attention_hyper_connection"),
        (p[prefix + "input_layernorm.weight"], p[prefix + "input_layernorm.bias"]),
        lambda x: _hand_attention(attention, x, heads=2),
        streams,
    )
    mlp = sub("mlp")
    streams = _hand_sublayer(
        sub("mlp_hyper_connection"),
        (p[prefix + "pre_mlp_layernorm.weight"], p[prefix + "pre_mlp_layernorm.bias"]),
        lambda x: _hand_mlp(mlp, x),
        streams,
    )
    contracted = streams.mean(dim=1)  # contract: mean over streams
    final = _layer_norm(
        contracted, p["decoder.final_layernorm.weight"], p["decoder.final_layernorm.bias"]
    )
    return final @ p["output_layer.weight"].T


def test_forward_at_initialisation_equals_the_equations_by_hand():
    with model_parallel():
        model = _gpt(_config())
        model.eval()
        tokens, positions, mask = _batch()
        with torch.no_grad():
            logits = model(tokens, positions, mask)  # [b, s, vocab]
        expected = _hand_logits(model, tokens)
    assert logits.shape == (1, SEQ, VOCAB)
    torch.testing.assert_close(logits[0].double(), expected, rtol=1e-5, atol=1e-5)


def test_the_hand_reference_sees_every_mhc_parameter():
    """Moving any hyper-connection parameter moves both the model and the hand reference."""
    with model_parallel():
        model = _gpt(_config())
        model.eval()
        tokens, positions, mask = _batch()
        before = _hand_logits(model, tokens)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "hyper_connection" in name:
                    param.copy_(torch.randn_like(param))
            logits = model(tokens, positions, mask)
        after = _hand_logits(model, tokens)
    assert (before - after).abs().max() > 0.01 * before.abs().max()
    torch.testing.assert_close(logits[0].double(), after, rtol=1e-5, atol=1e-5)


def test_with_zero_gating_mhc_is_exactly_the_plain_residual():
    """alpha = 0 and bias = 0: H_pre = 1/2, H_post = 1, H_res = 1/2 everywhere, so identical
    streams stay identical and each equals the plain pre-norm residual stream."""
    with model_parallel():
        mhc = _gpt(_config(num_layers=2, mhc_init_gating_factor=0.0))
        plain = _gpt(_config(num_layers=2, enable_mhc_connections=False), mhc=False)
        shared = {k: v for k, v in mhc.state_dict().items() if "hyper_connection" not in k}
        missing, unexpected = plain.load_state_dict(shared, strict=False)
        assert not unexpected and not [k for k in missing if not k.endswith("_extra_state")]
        tokens, positions, mask = _batch(batch=2)
        torch.testing.assert_close(
            mhc(tokens, positions, mask), plain(tokens, positions, mask), rtol=0, atol=1e-6
        )


# ----------------------------------------------------------------------------- spec and names


def test_mhc_spec_uses_the_mhc_layer_and_two_hyper_connections():
    spec = get_gpt_layer_local_spec(enable_mhc_connections=True)
    assert spec.module is HyperConnectionTransformerLayer
    assert spec.submodules.self_attention_hyper_connection is HyperConnectionModule
    assert spec.submodules.mlp_hyper_connection is HyperConnectionModule
    assert spec.submodules.cross_attention_hyper_connection is IdentityOp
    assert get_gpt_layer_local_spec().module is TransformerLayer
    plain = get_gpt_layer_local_spec().submodules
    for field in (
        "input_layernorm",
        "self_attention",
        "pre_mlp_layernorm",
        "sharded_state_dict_keys_map",
    ):
        assert getattr(spec.submodules, field) == getattr(plain, field), field
    assert spec.submodules.mlp.func == plain.mlp.func  # a fresh functools.partial each call


def test_parameter_and_checkpoint_names_follow_upstream():
    with model_parallel():
        model = _gpt(_config(num_layers=2))
        names = {name for name, _ in model.named_parameters()}
        keys = {
            entry.key
            for entry in nested_values(model.sharded_state_dict())
            if hasattr(entry, "key")
        }
    for connection in ("self_attention_hyper_connection", "mlp_hyper_connection"):
        for leaf in ("mapping_proj.weight", "alpha_pre", "alpha_post", "alpha_res", "bias"):
            assert f"decoder.layers.0.{connection}.{leaf}" in names
            assert f"decoder.layers.{connection}.{leaf}" in keys  # stacked over layers
    assert isinstance(model.decoder, HyperConnectionTransformerBlock)


# ------------------------------------------------------------------ expand / contract placement


def _stage(config, pre_process, post_process):
    return _gpt(config, pre_process=pre_process, post_process=post_process)


def test_expansion_only_with_the_embedding_and_contraction_only_with_the_final_norm():
    """Pipeline-style stages built in one process: the first stage returns the n-stream
    residual, a middle stage maps n streams to n streams, the last contracts."""
    config = _config(num_layers=2)
    s, b = SEQ, 2
    with model_parallel():
        first = _stage(config, True, False)
        middle = _stage(config, False, False)
        last = _stage(config, False, True)
        tokens, positions, mask = _batch(batch=b)
        out = first(tokens, positions, mask)
        assert out.shape == (s, b, N * H) and out._base is None
        assert first.decoder.final_layernorm is None and not first.decoder.contracts_streams

        middle.set_input_tensor(out)
        out = middle(None, None, mask)
        assert out.shape == (s, b, N * H)

        last.set_input_tensor(out)
        logits = last(None, None, mask)
        assert logits.shape == (b, s, VOCAB)
        assert last.decoder.contracts_streams


def test_block_expansion_is_a_viewless_stream_major_copy():
    with model_parallel():
        block = _gpt(_config()).decoder
        x = torch.randn(SEQ, 1, 2, H).transpose(1, 2)[:, 0]  # a view
        expanded = block.expand_streams(x)
    assert expanded._base is None and expanded.is_contiguous()
    for i in range(N):
        assert torch.equal(expanded[..., i * H : (i + 1) * H], x)


def test_final_norm_contracts_by_the_mean():
    with model_parallel():
        block = _gpt(_config()).decoder
        streams = torch.randn(SEQ, 2, N * H)
        normed = block.final_layernorm(streams)
        expected = torch.nn.functional.layer_norm(
            streams.view(SEQ, 2, N, H).mean(2),
            (H,),
            block.final_layernorm.weight,
            block.final_layernorm.bias,
            eps=1e-5,
        )
    torch.testing.assert_close(normed, expected)


# ----------------------------------------------------------------------------- training


def test_mhc_gpt_loss_decreases_over_20_steps_on_a_fixed_batch():
    config = _config(
        num_layers=2, hidden_size=32, num_attention_heads=4, mhc_num_residual_streams=4
    )
    with model_parallel():
        model = GPTModel(
            config,
            get_gpt_layer_local_spec(enable_mhc_connections=True),
            vocab_size=64,
            max_sequence_length=16,
        )
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 64, (4, 17), generator=generator)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        positions = torch.arange(16).unsqueeze(0).expand(4, 16)
        mask = torch.triu(torch.ones(1, 1, 16, 16, dtype=torch.bool), diagonal=1)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for _ in range(20):
            optimizer.zero_grad()
            loss = model(inputs, positions, mask, labels=labels).mean()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.7 * losses[0], losses
    assert all(grads[n] is not None for n in grads if "hyper_connection" in n)
