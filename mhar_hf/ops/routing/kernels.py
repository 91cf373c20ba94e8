"""Triton kernels of the routing op (DESIGN.md sections 1 and 4).

Layout: every program owns BLOCK_T token rows of width d, held as a `[BLOCK_T, H_PAD, DH_PAD]`
tile (heads padded to powers of two and masked, so any H dividing d works, d/H = 160 too).
Sources are read through a table of their addresses, so the caller never stacks them; the
next source's tile is loaded before the current one is used, to keep two reads in flight.
All statistics, logits, softmax and the mix run in fp32: every load is upcast at once (bf16
arithmetic is wrong in the Triton interpreter, and `tl.exp` rejects bf16).

The forward keeps an online softmax over the sources and stores only the per-head
log-sum-exp `[tokens, H]`; the backward recomputes each source's rstd and logit from the
source it must read anyway, so nothing larger than that is ever saved.
"""

import triton
import triton.language as tl


@triton.jit
def _load_tile(ptr, offs, mask):
    return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _load_source(table, n, num_sources, elem_ptr, offs, tok, T, col_mask):
    """Source n of the address table as an fp32 tile (zeros once n runs past the table);
    elem_ptr only lends its element type."""
    address = tl.load(table + tl.minimum(n, num_sources - 1)).to(tl.pointer_type(elem_ptr.dtype.element_ty))
    rows = T * (n < num_sources)  # no row is read past the table
    return _load_tile(address, offs, (tok < rows)[:, None, None] & col_mask[None, :, :])


@triton.jit
def _rstd_and_head_dots(x, gq, eps, D: tl.constexpr):
    """rsqrt(mean over the full width of x^2 + eps) per token, and <x_h, (g*q)_h> per token and head."""
    rstd = tl.rsqrt(tl.sum(tl.sum(x * x, 2), 1) / D + eps)
    return rstd, tl.sum(x * gq[None, :, :], 2)


@triton.jit
def _softmax_step(x, gq, eps, m, l, acc, D: tl.constexpr):
    """Fold one source into the running (max, sum, mix) of the online softmax."""
    rstd, dots = _rstd_and_head_dots(x, gq, eps, D)
    logit = dots * rstd[:, None]
    m_new = tl.maximum(m, logit)
    scale = tl.exp(m - m_new)
    p = tl.exp(logit - m_new)
    return m_new, l * scale + p, acc * scale[:, :, None] + p[:, :, None] * x


@triton.jit
def route_fwd_kernel(
    table, src0_ptr, null_ptr, q_ptr, g_ptr, out_ptr, lse_ptr,
    num_sources, T, eps,
    HAS_NULL: tl.constexpr, STORE_LSE: tl.constexpr,
    D: tl.constexpr, H: tl.constexpr, DH: tl.constexpr,
    H_PAD: tl.constexpr, DH_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.arange(0, H_PAD)
    col = head[:, None] * DH + tl.arange(0, DH_PAD)[None, :]
    col_mask = (head[:, None] < H) & (tl.arange(0, DH_PAD)[None, :] < DH)
    offs = tok[:, None, None].to(tl.int64) * D + col[None, :, :]
    mask = (tok < T)[:, None, None] & col_mask[None, :, :]
    gq = _load_tile(g_ptr, col, col_mask) * _load_tile(q_ptr, col, col_mask)

    m = tl.full([BLOCK_T, H_PAD], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_T, H_PAD], tl.float32)
    acc = tl.zeros([BLOCK_T, H_PAD, DH_PAD], tl.float32)
    x_next = _load_source(table, 0, num_sources, src0_ptr, offs, tok, T, col_mask)
    if HAS_NULL:  # the null source: one vector shared by every token
        null = tl.broadcast_to(_load_tile(null_ptr, col, col_mask)[None, :, :], (BLOCK_T, H_PAD, DH_PAD))
        m, l, acc = _softmax_step(null, gq, eps, m, l, acc, D)
    for n in range(0, num_sources):
        x = x_next
        x_next = _load_source(table, n + 1, num_sources, src0_ptr, offs, tok, T, col_mask)
        m, l, acc = _softmax_step(x, gq, eps, m, l, acc, D)
    tl.store(out_ptr + offs, (acc / l[:, :, None]).to(out_ptr.dtype.element_ty), mask=mask)
    if STORE_LSE:
        lse_offs = tok[:, None] * H + head[None, :]
        tl.store(lse_ptr + lse_offs, m + tl.log(l), mask=(tok < T)[:, None] & (head < H)[None, :])


@triton.jit
def _source_grad(x, dout, total, lse, gq, eps, D: tl.constexpr):
    """d loss / d x for one source, and its term of sum dlogit * rstd * x (query / norm weight)."""
    rstd, dots = _rstd_and_head_dots(x, gq, eps, D)
    w = tl.exp(dots * rstd[:, None] - lse)
    dlogit = w * (tl.sum(dout * x, 2) - total)
    dlogit_rstd = dlogit * rstd[:, None]
    norm_coef = rstd * rstd * rstd / D * tl.sum(dlogit * dots, 1)
    dx = w[:, :, None] * dout + dlogit_rstd[:, :, None] * gq[None, :, :] - norm_coef[:, None, None] * x
    return dx, tl.sum(dlogit_rstd[:, :, None] * x, 0)


@triton.jit
def _weighted_dot(x, dout, lse, gq, eps, D: tl.constexpr):
    """w_nh * <dout_h, x_nh>: one source's term of S_h."""
    rstd, dots = _rstd_and_head_dots(x, gq, eps, D)
    return tl.exp(dots * rstd[:, None] - lse) * tl.sum(dout * x, 2)


@triton.jit
def route_bwd_kernel(
    table, grad_table, src0_ptr, null_ptr, q_ptr, g_ptr, lse_ptr, dout_ptr, dkey_partial_ptr, dnull_partial_ptr,
    num_sources, T, eps,
    HAS_NULL: tl.constexpr,
    D: tl.constexpr, H: tl.constexpr, DH: tl.constexpr,
    H_PAD: tl.constexpr, DH_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Gradients of every source (written where grad_table points) and per-program partial
    sums for the query / key-norm weight (`sum dlogit * rstd * x`) and the null source.

    With w = softmax(logit), P_nh = <dout_h, x_nh>, S_h = sum_n w_nh P_nh, dlogit = w (P - S):
      dx_n = w_n dout + dlogit_n rstd_n (g*q) - rstd_n^3 / D * (sum_h dlogit_nh dots_nh) * x_n.
    Pass 1 over the sources accumulates S; pass 2 writes dx. Programs stride over token blocks
    in a fixed order and never share an output: the result is bitwise reproducible.
    """
    pid = tl.program_id(0)
    head = tl.arange(0, H_PAD)
    col = head[:, None] * DH + tl.arange(0, DH_PAD)[None, :]
    col_mask = (head[:, None] < H) & (tl.arange(0, DH_PAD)[None, :] < DH)
    gq = _load_tile(g_ptr, col, col_mask) * _load_tile(q_ptr, col, col_mask)
    dkey = tl.zeros([H_PAD, DH_PAD], tl.float32)
    dnull = tl.zeros([H_PAD, DH_PAD], tl.float32)
    if HAS_NULL:
        null = tl.broadcast_to(_load_tile(null_ptr, col, col_mask)[None, :, :], (BLOCK_T, H_PAD, DH_PAD))

    for block in range(pid, tl.cdiv(T, BLOCK_T), tl.num_programs(0)):  # programs past the end write zeros
        tok = block * BLOCK_T + tl.arange(0, BLOCK_T)
        offs = tok[:, None, None].to(tl.int64) * D + col[None, :, :]
        mask = (tok < T)[:, None, None] & col_mask[None, :, :]
        x_next = _load_source(table, 0, num_sources, src0_ptr, offs, tok, T, col_mask)
        dout = _load_tile(dout_ptr, offs, mask)
        # +inf outside the tile makes every weight there exactly 0, so padded rows contribute nothing
        lse = tl.load(lse_ptr + tok[:, None] * H + head[None, :],
                      mask=(tok < T)[:, None] & (head < H)[None, :], other=float("inf"))

        total = tl.zeros([BLOCK_T, H_PAD], tl.float32)  # S_h
        if HAS_NULL:
            total += _weighted_dot(null, dout, lse, gq, eps, D)
        for n in range(0, num_sources):
            x = x_next
            x_next = _load_source(table, n + 1, num_sources, src0_ptr, offs, tok, T, col_mask)
            total += _weighted_dot(x, dout, lse, gq, eps, D)

        x_next = _load_source(table, 0, num_sources, src0_ptr, offs, tok, T, col_mask)
        if HAS_NULL:
            dx, dkey_part = _source_grad(null, dout, total, lse, gq, eps, D)
            dnull += tl.sum(tl.where(mask, dx, 0.0), 0)
            dkey += dkey_part
        for n in range(0, num_sources):
            x = x_next
            x_next = _load_source(table, n + 1, num_sources, src0_ptr, offs, tok, T, col_mask)
            dx, dkey_part = _source_grad(x, dout, total, lse, gq, eps, D)
            dkey += dkey_part
            dsrc = tl.load(grad_table + n).to(tl.pointer_type(src0_ptr.dtype.element_ty))
            tl.store(dsrc + offs, dx.to(src0_ptr.dtype.element_ty), mask=mask)

    tl.store(dkey_partial_ptr + pid * D + col, dkey, mask=col_mask)
    if HAS_NULL:
        tl.store(dnull_partial_ptr + pid * D + col, dnull, mask=col_mask)
