"""The local context-parallel core attention alone: CP=2 and CP=2 x TP=2 (4 ranks) give the
outputs and Q/K/V gradients of megatron's DotProductAttention on the whole sequence, causal
mask, with grouped-query attention."""

import pytest
import torch

from megatron_ext.testing.distributed import model_parallel

pytestmark = pytest.mark.world_size(4)

SEQ, BATCH, HEADS, GROUPS, HEAD_DIM = 16, 2, 4, 2, 8


def _config(tp: int, cp: int):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.testing.configs import CPU_SAFE_FIELDS

    return TransformerConfig(
        num_layers=1,
        hidden_size=HEADS * HEAD_DIM,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        **CPU_SAFE_FIELDS,
    )


def _inputs():
    generator = torch.Generator().manual_seed(7)
    q = torch.randn(SEQ, BATCH, HEADS, HEAD_DIM, generator=generator)
    k = torch.randn(SEQ, BATCH, GROUPS, HEAD_DIM, generator=generator)
    v = torch.randn(SEQ, BATCH, GROUPS, HEAD_DIM, generator=generator)
    grad_out = torch.randn(SEQ, BATCH, HEADS, HEAD_DIM, generator=generator)
    return q, k, v, grad_out


def _reference():
    """megatron-core's own DotProductAttention, one rank, whole sequence."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    q, k, v, grad_out = _inputs()
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    with model_parallel():
        attention = DotProductAttention(_config(1, 1), 1, AttnMaskType.causal, "self")
        out = attention(q, k, v, None)
    out.backward(grad_out.flatten(2))
    return out.detach().view(SEQ, BATCH, HEADS, HEAD_DIM), q.grad, k.grad, v.grad


def _sharded(tp: int, cp: int, attention_class=None):
    """(output, dq, dk, dv) of this rank: its heads, its sequence chunks."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_ext.models.context_parallel import (
        ContextParallelDotProductAttention,
        local_token_positions,
    )

    q, k, v, grad_out = _inputs()
    with model_parallel(tp=tp, cp=cp):
        tp_rank, cp_rank = ps.get_tensor_model_parallel_rank(), ps.get_context_parallel_rank()
        tokens = local_token_positions(SEQ // cp, cp, cp_rank)

        def mine(t):
            per_rank = t.shape[2] // tp
            return t[tokens][:, :, tp_rank * per_rank : (tp_rank + 1) * per_rank].clone()

        local_q, local_k, local_v = (mine(t).requires_grad_() for t in (q, k, v))
        attention = (attention_class or ContextParallelDotProductAttention)(
            _config(tp, cp), 1, AttnMaskType.causal, "self"
        )
        out = attention(local_q, local_k, local_v, None)
        out.backward(mine(grad_out).flatten(2))
    shards = (out.detach().view(local_q.shape), local_q.grad, local_k.grad, local_v.grad)
    return shards, mine


@pytest.mark.parametrize("tp,cp", [(1, 2), (2, 2)])
def test_cp_attention_matches_whole_sequence(tp, cp):
    reference = _reference()
    shards, mine = _sharded(tp, cp)
    for name, got, expected in zip(("output", "dq", "dk", "dv"), shards, reference, strict=True):
        torch.testing.assert_close(got, mine(expected), atol=1e-5, rtol=1e-5, msg=name)


def test_contiguous_positions_are_caught():
    """Negative control: treating the load-balanced chunks as one contiguous block (wrong
    global offsets) changes the mask, and the comparison sees it."""
    from megatron_ext.models.context_parallel import ContextParallelDotProductAttention

    class Contiguous(ContextParallelDotProductAttention):
        def token_positions(self, local_seq_length, cp_rank, device):
            start = cp_rank * local_seq_length
            return torch.arange(start, start + local_seq_length, device=device)

    reference = _reference()
    shards, mine = _sharded(1, 2, Contiguous)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(shards[0], mine(reference[0]), atol=1e-5, rtol=1e-5)


def test_non_causal_mask_is_refused():
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_ext.models.context_parallel import ContextParallelDotProductAttention

    with model_parallel(cp=2):
        with pytest.raises(NotImplementedError, match="causal masks only.*padding"):
            ContextParallelDotProductAttention(_config(1, 2), 1, AttnMaskType.padding, "self")
