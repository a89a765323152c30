"""The Triton kernels behind :mod:`megatron_ext.mhc.fused` (see its docstring for what each
computes). Imported only by ``megatron_ext.mhc.fused._kernels()``, i.e. on first use: importing
it imports triton, and on CPU ``TRITON_INTERPRET=1`` must already be set by then."""

import triton
import triton.language as tl


@triton.jit
def maps_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    z_ptr,
    proj_ptr,
    pre_ptr,
    post_ptr,
    norm_ptr,
    inv_ptr,
    T,
    NH,
    K,
    eps,
    inv_sqrt_nh,
    N: tl.constexpr,
    KP: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    ks = tl.arange(0, KP)
    row_ok = rows < T
    k_ok = ks < K
    acc = tl.zeros((BT, KP), dtype=tl.float32)
    squares = tl.zeros((BT,), dtype=tl.float32)
    for start in range(0, NH, BC):
        cols = start + tl.arange(0, BC)
        col_ok = cols < NH
        x = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * NH + cols[None, :],
            mask=row_ok[:, None] & col_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        squares += tl.sum(x * x, axis=1)
        w = tl.load(
            w_ptr + ks[None, :] * NH + cols[:, None],
            mask=k_ok[None, :] & col_ok[:, None],
            other=0.0,
        )
        acc += tl.dot(x, w, input_precision="ieee")
    norm = tl.sqrt(squares)
    inv = 1.0 / (norm * inv_sqrt_nh + eps)
    bias = tl.load(bias_ptr + ks, mask=k_ok, other=0.0)
    z = acc * inv[:, None] + bias[None, :]
    out_ok = row_ok[:, None] & k_ok[None, :]
    tl.store(z_ptr + rows[:, None] * K + ks[None, :], z, mask=out_ok)
    tl.store(proj_ptr + rows[:, None] * K + ks[None, :], acc, mask=out_ok)
    gate = tl.sigmoid(z)
    tl.store(
        pre_ptr + rows[:, None] * N + ks[None, :], gate, mask=row_ok[:, None] & (ks[None, :] < N)
    )
    tl.store(
        post_ptr + rows[:, None] * N + (ks[None, :] - N),
        2.0 * gate,
        mask=row_ok[:, None] & (ks[None, :] >= N) & (ks[None, :] < 2 * N),
    )
    tl.store(norm_ptr + rows, norm, mask=row_ok)
    tl.store(inv_ptr + rows, inv, mask=row_ok)


@triton.jit
def _load_m0(z_ptr, rows, T, K, N: tl.constexpr, NP: tl.constexpr):
    """M0 = exp(logits - rowmax) of each token's n x n logits (z[:, 2n:]), padded with 0."""
    i = tl.arange(0, NP)[None, :, None]
    j = tl.arange(0, NP)[None, None, :]
    t = rows[:, None, None]
    ok = (t < T) & (i < N) & (j < N)
    logits = tl.load(z_ptr + t * K + 2 * N + i * N + j, mask=ok, other=-1e30)
    shifted = logits - tl.max(logits, axis=2)[:, :, None]
    return tl.where(ok, tl.exp(shifted), 0.0), ok


@triton.jit
def _row_col_step(m, eps):
    row_sum = tl.sum(m, axis=2)
    m = m / tl.maximum(row_sum, eps)[:, :, None]
    col_sum = tl.sum(m, axis=1)
    return m / tl.maximum(col_sum, eps)[:, None, :]


@triton.jit
def sinkhorn_kernel(
    z_ptr, mix_ptr, T, K, iterations, eps, N: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr
):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    m, ok = _load_m0(z_ptr, rows, T, K, N, NP)
    for _ in range(iterations):
        m = _row_col_step(m, eps)
    i = tl.arange(0, NP)[None, :, None]
    j = tl.arange(0, NP)[None, None, :]
    # mix[t, j, i] = H[t, i, j] (the H_resᵀ orientation), in the activation dtype.
    tl.store(
        mix_ptr + rows[:, None, None] * (N * N) + j * N + i, m.to(mix_ptr.dtype.element_ty), mask=ok
    )


@triton.jit
def sinkhorn_backward_kernel(
    z_ptr,
    grad_mix_ptr,
    grad_z_ptr,
    T,
    K,
    iterations,
    eps,
    N: tl.constexpr,
    NP: tl.constexpr,
    BT: tl.constexpr,
):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    m0, ok = _load_m0(z_ptr, rows, T, K, N, NP)
    i = tl.arange(0, NP)[None, :, None]
    j = tl.arange(0, NP)[None, None, :]
    t = rows[:, None, None]
    grad = tl.load(grad_mix_ptr + t * (N * N) + j * N + i, mask=ok, other=0.0).to(tl.float32)
    for back in range(iterations):
        # Re-run iterations 0 .. k-1 (k counts down) to get iteration k's input.
        m = m0
        for _ in range(iterations - 1 - back):
            m = _row_col_step(m, eps)
        row_sum = tl.sum(m, axis=2)
        row_div = tl.maximum(row_sum, eps)
        after_row = m / row_div[:, :, None]
        col_sum = tl.sum(after_row, axis=1)
        col_div = tl.maximum(col_sum, eps)
        after_col = after_row / col_div[:, None, :]
        # y = x / max(Σx, eps): dx = (g - [Σx > eps] Σ(g·y)) / max(Σx, eps)
        through = tl.where(col_sum > eps, tl.sum(grad * after_col, axis=1), 0.0)
        grad = (grad - through[:, None, :]) / col_div[:, None, :]
        through = tl.where(row_sum > eps, tl.sum(grad * after_row, axis=2), 0.0)
        grad = (grad - through[:, :, None]) / row_div[:, :, None]
        # Padding (n not a power of two, tokens past T) must stay 0: its sums are 0, so each
        # step would divide it by eps, overflow to inf within a few iterations and turn the
        # real entries NaN through 0 * inf.
        grad = tl.where(ok, grad, 0.0)
    # d exp(l - rowmax)/dl = M0 (the shift cancels in the first row normalisation).
    tl.store(grad_z_ptr + t * K + 2 * N + i * N + j, grad * m0, mask=ok)


@triton.jit
def aggregate_kernel(
    x_ptr,
    pre_ptr,
    out_ptr,
    T,
    H,
    N: tl.constexpr,
    NP: tl.constexpr,
    BT: tl.constexpr,
    BH: tl.constexpr,
):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    hs = tl.program_id(1) * BH + tl.arange(0, BH)
    streams = tl.arange(0, NP)
    t = rows[:, None, None].to(tl.int64)
    ok = (t < T) & (streams[None, :, None] < N) & (hs[None, None, :] < H)
    x = tl.load(
        x_ptr + t * (N * H) + streams[None, :, None] * H + hs[None, None, :], mask=ok, other=0.0
    )
    pre = tl.load(
        pre_ptr + rows[:, None] * N + streams[None, :],
        mask=(rows[:, None] < T) & (streams[None, :] < N),
        other=0.0,
    )
    # The maps are applied in the activation dtype, as the native path does.
    pre = pre.to(x.dtype).to(tl.float32)
    out = tl.sum(pre[:, :, None] * x.to(tl.float32), axis=1)
    tl.store(
        out_ptr + rows[:, None].to(tl.int64) * H + hs[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=(rows[:, None] < T) & (hs[None, :] < H),
    )


@triton.jit
def aggregate_backward_kernel(
    x_ptr,
    grad_ptr,
    grad_pre_ptr,
    T,
    H,
    N: tl.constexpr,
    NP: tl.constexpr,
    BT: tl.constexpr,
    BH: tl.constexpr,
):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    streams = tl.arange(0, NP)
    t = rows[:, None, None].to(tl.int64)
    acc = tl.zeros((BT, NP), dtype=tl.float32)
    for start in range(0, H, BH):
        hs = start + tl.arange(0, BH)
        ok = (t < T) & (streams[None, :, None] < N) & (hs[None, None, :] < H)
        x = tl.load(
            x_ptr + t * (N * H) + streams[None, :, None] * H + hs[None, None, :], mask=ok, other=0.0
        ).to(tl.float32)
        g = tl.load(
            grad_ptr + rows[:, None].to(tl.int64) * H + hs[None, :],
            mask=(rows[:, None] < T) & (hs[None, :] < H),
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(x * g[:, None, :], axis=2)
    tl.store(
        grad_pre_ptr + rows[:, None] * N + streams[None, :],
        acc,
        mask=(rows[:, None] < T) & (streams[None, :] < N),
    )


@triton.jit
def streams_grad_kernel(
    x_ptr,
    grad_agg_ptr,
    pre_ptr,
    gp_ptr,
    w_ptr,
    coef_ptr,
    grad_x_ptr,
    T,
    H,
    K,
    N: tl.constexpr,
    KP: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
):
    """dL/dx = pre_i · g_agg + gp · W + coef · x, one [BT, BC] tile of [T, n*h]."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    ks = tl.arange(0, KP)
    row_ok = rows[:, None] < T
    col_ok = cols[None, :] < N * H
    ok = row_ok & col_ok
    r64 = rows[:, None].to(tl.int64)
    x = tl.load(x_ptr + r64 * (N * H) + cols[None, :], mask=ok, other=0.0)
    stream = cols[None, :] // H
    g = tl.load(grad_agg_ptr + r64 * H + (cols[None, :] - stream * H), mask=ok, other=0.0).to(
        tl.float32
    )
    pre = tl.load(pre_ptr + rows[:, None] * N + stream, mask=ok, other=0.0)
    pre = pre.to(x.dtype).to(tl.float32)
    gp = tl.load(
        gp_ptr + rows[:, None] * K + ks[None, :], mask=row_ok & (ks[None, :] < K), other=0.0
    )
    w = tl.load(
        w_ptr + ks[:, None] * (N * H) + cols[None, :], mask=(ks[:, None] < K) & col_ok, other=0.0
    )
    coef = tl.load(coef_ptr + rows, mask=rows < T, other=0.0)
    grad = pre * g + tl.dot(gp, w, input_precision="ieee") + coef[:, None] * x.to(tl.float32)
    tl.store(
        grad_x_ptr + r64 * (N * H) + cols[None, :], grad.to(grad_x_ptr.dtype.element_ty), mask=ok
    )


@triton.jit
def _keep_scale(seed_ptr, rows, streams, hs, H, p, N: tl.constexpr):
    """Dropout's per-element factor (0 or 1/(1-p)): a Philox draw of the element's index in
    [T, n, h], so backward regenerates the forward's mask from the seed."""
    seed = tl.load(seed_ptr)
    index = (rows[:, None, None] * N + streams[None, :, None]) * H + hs[None, None, :]
    keep = tl.rand(seed, index) >= p
    return tl.where(keep, 1.0 / (1.0 - p), 0.0)


@triton.jit
def merge_kernel(
    mix_ptr,
    x_ptr,
    post_ptr,
    y_ptr,
    bias_ptr,
    seed_ptr,
    out_ptr,
    T,
    H,
    p,
    N: tl.constexpr,
    NP: tl.constexpr,
    BT: tl.constexpr,
    BH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DROPOUT: tl.constexpr,
):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    hs = tl.program_id(1) * BH + tl.arange(0, BH)
    streams = tl.arange(0, NP)
    t = rows[:, None, None].to(tl.int64)
    stream_ok = streams[None, :] < N
    row_ok = rows[:, None] < T
    ok = (t < T) & (streams[None, :, None] < N) & (hs[None, None, :] < H)
    x = tl.load(
        x_ptr + t * (N * H) + streams[None, :, None] * H + hs[None, None, :], mask=ok, other=0.0
    ).to(tl.float32)
    y = tl.load(
        y_ptr + rows[:, None].to(tl.int64) * H + hs[None, :],
        mask=row_ok & (hs[None, :] < H),
        other=0.0,
    ).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + hs, mask=hs < H, other=0.0).to(tl.float32)[None, :]
    post = tl.load(
        post_ptr + rows[:, None] * N + streams[None, :], mask=row_ok & stream_ok, other=0.0
    ).to(tl.float32)
    update = post[:, :, None] * y[:, None, :]
    if DROPOUT:
        update = update * _keep_scale(seed_ptr, rows, streams, hs, H, p, N)
    # mixed[t, i] = Σ_j mix[t, i, j] x[t, j]: one [BT, NP, NP] x [BT, NP, BH] contraction.
    mix = tl.load(
        mix_ptr
        + rows[:, None, None] * (N * N)
        + streams[None, :, None] * N
        + streams[None, None, :],
        mask=(rows[:, None, None] < T)
        & (streams[None, :, None] < N)
        & (streams[None, None, :] < N),
        other=0.0,
    ).to(tl.float32)
    mixed = tl.sum(mix[:, :, :, None] * x[:, None, :, :], axis=2)
    tl.store(
        out_ptr + t * (N * H) + streams[None, :, None] * H + hs[None, None, :],
        (mixed + update).to(out_ptr.dtype.element_ty),
        mask=ok,
    )


@triton.jit
def merge_backward_kernel(
    grad_ptr,
    mix_ptr,
    x_ptr,
    post_ptr,
    y_ptr,
    bias_ptr,
    seed_ptr,
    grad_x_ptr,
    grad_y_ptr,
    grad_mix_ptr,
    grad_post_ptr,
    T,
    H,
    p,
    N: tl.constexpr,
    NP: tl.constexpr,
    BT: tl.constexpr,
    BH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DROPOUT: tl.constexpr,
):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    streams = tl.arange(0, NP)
    t = rows[:, None, None].to(tl.int64)
    row_ok = rows[:, None] < T
    pair_ok = (
        (rows[:, None, None] < T) & (streams[None, :, None] < N) & (streams[None, None, :] < N)
    )
    mix = tl.load(
        mix_ptr
        + rows[:, None, None] * (N * N)
        + streams[None, :, None] * N
        + streams[None, None, :],
        mask=pair_ok,
        other=0.0,
    ).to(tl.float32)
    post = tl.load(
        post_ptr + rows[:, None] * N + streams[None, :],
        mask=row_ok & (streams[None, :] < N),
        other=0.0,
    ).to(tl.float32)
    grad_mix = tl.zeros((BT, NP, NP), dtype=tl.float32)
    grad_post = tl.zeros((BT, NP), dtype=tl.float32)
    for start in range(0, H, BH):
        hs = start + tl.arange(0, BH)
        ok = (t < T) & (streams[None, :, None] < N) & (hs[None, None, :] < H)
        offsets = t * (N * H) + streams[None, :, None] * H + hs[None, None, :]
        g = tl.load(grad_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
        y = tl.load(
            y_ptr + rows[:, None].to(tl.int64) * H + hs[None, :],
            mask=row_ok & (hs[None, :] < H),
            other=0.0,
        ).to(tl.float32)
        if HAS_BIAS:
            y = y + tl.load(bias_ptr + hs, mask=hs < H, other=0.0).to(tl.float32)[None, :]
        g_update = g
        if DROPOUT:
            g_update = g * _keep_scale(seed_ptr, rows, streams, hs, H, p, N)
        # dx_j = Σ_i mix[i, j] g_i ; dmix[i, j] = Σ_h g_i x_j ; dpost_i = Σ_h g'_i y ;
        # dy = Σ_i post_i g'_i  (g' = g through the dropout factor)
        grad_x = tl.sum(mix[:, :, :, None] * g[:, :, None, :], axis=1)
        tl.store(grad_x_ptr + offsets, grad_x.to(grad_x_ptr.dtype.element_ty), mask=ok)
        grad_mix += tl.sum(g[:, :, None, :] * x[:, None, :, :], axis=3)
        grad_post += tl.sum(g_update * y[:, None, :], axis=2)
        grad_y = tl.sum(post[:, :, None] * g_update, axis=1)
        tl.store(
            grad_y_ptr + rows[:, None].to(tl.int64) * H + hs[None, :],
            grad_y,
            mask=row_ok & (hs[None, :] < H),
        )
    tl.store(
        grad_mix_ptr
        + rows[:, None, None] * (N * N)
        + streams[None, :, None] * N
        + streams[None, None, :],
        grad_mix,
        mask=pair_ok,
    )
    tl.store(
        grad_post_ptr + rows[:, None] * N + streams[None, :],
        grad_post,
        mask=row_ok & (streams[None, :] < N),
    )
