"""Triton kernels of the routing op (DESIGN.md sections 1 and 4).

Layout: every program owns BLOCK_T token rows of width d, held as a `[BLOCK_T, H_PAD, DH_PAD]`
tile (heads padded to powers of two and masked, so any H dividing d works, d/H = 160 too).
Tensors that vary per source or per reader are reached through int64 tables of their
addresses, so the caller never stacks them; the next tile is loaded before the current one is
used, to keep two reads in flight. All statistics, logits, softmax and the mix run in fp32:
every load is upcast at once (bf16 arithmetic is wrong in the Triton interpreter, and `tl.exp`
rejects bf16).

With w = softmax(logit), P_nh = <dout_h, x_nh>, S_h = sum_n w_nh P_nh and dlogit = w (P - S),
the gradient of source n through one read is
    dx_n = w_n dout + dlogit_n rstd_n (g*q) - rstd_n^3 / D * (sum_h dlogit_nh dots_nh) * x_n
and the query / key-norm weight get `g * A`, `q * A` with A = sum_n dlogit_n rstd_n x_n.
The backward is split the way autograd visits the model, so that each byte is read once:
  - `route_site_bwd_kernel` runs when a read's output gradient arrives: one pass over its
    sources gives S and A (no source gradient is written);
  - `route_source_bwd_kernel` runs once per source, when every read of it has run its
    backward: one pass over the output gradients of those reads gives the source's whole
    gradient, summed in fp32 and written once.
Nothing is accumulated with atomics: partial sums are per program, and the caller sums them
with one deterministic reduction.
"""

import triton
import triton.language as tl


@triton.jit
def _load_tile(ptr, offs, mask):
    return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _address(table, i, count, like_ptr, STRIDE: tl.constexpr = 1, FIELD: tl.constexpr = 0):
    """Entry (i, FIELD) of an address table of `count` rows of STRIDE entries, as a pointer of
    like_ptr's type (row count-1 once i runs past the end). The caller keeps every such address
    16-byte aligned, as Triton assumes of tensor arguments: said here, loads through it are
    16-byte vector loads instead of one load per element."""
    entry = table + STRIDE * tl.minimum(i, count - 1) + FIELD
    return tl.multiple_of(tl.load(entry).to(tl.pointer_type(like_ptr.dtype.element_ty)), 16)


@triton.jit
def _load_rows(ptr, valid, offs, tok, T, col_mask):
    """Token rows of a [T, D] tensor as an fp32 tile; zeros when not `valid` (past a table's end)."""
    rows = T * valid
    return _load_tile(ptr, offs, (tok < rows)[:, None, None] & col_mask[None, :, :])


@triton.jit
def _load_row_tile(table, i, count, like_ptr, offs, tok, T, col_mask):
    """Token rows of tensor i of an address table as an fp32 tile (zeros once i runs past the table)."""
    return _load_rows(_address(table, i, count, like_ptr), i < count, offs, tok, T, col_mask)


@triton.jit
def _tile_layout(H: tl.constexpr, DH: tl.constexpr, H_PAD: tl.constexpr, DH_PAD: tl.constexpr):
    head = tl.arange(0, H_PAD)
    col = head[:, None] * DH + tl.arange(0, DH_PAD)[None, :]
    col_mask = (head[:, None] < H) & (tl.arange(0, DH_PAD)[None, :] < DH)
    return head, col, col_mask


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
    """out = the routed mix; lse = per-head log-sum-exp of the logits (all the backward needs)."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head, col, col_mask = _tile_layout(H, DH, H_PAD, DH_PAD)
    offs = tok[:, None, None].to(tl.int64) * D + col[None, :, :]
    mask = (tok < T)[:, None, None] & col_mask[None, :, :]
    gq = _load_tile(g_ptr, col, col_mask) * _load_tile(q_ptr, col, col_mask)

    m = tl.full([BLOCK_T, H_PAD], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_T, H_PAD], tl.float32)
    acc = tl.zeros([BLOCK_T, H_PAD, DH_PAD], tl.float32)
    x_next = _load_row_tile(table, 0, num_sources, src0_ptr, offs, tok, T, col_mask)
    if HAS_NULL:  # the null source: one vector shared by every token
        null = tl.broadcast_to(_load_tile(null_ptr, col, col_mask)[None, :, :], (BLOCK_T, H_PAD, DH_PAD))
        m, l, acc = _softmax_step(null, gq, eps, m, l, acc, D)
    for n in range(0, num_sources):
        x = x_next
        x_next = _load_row_tile(table, n + 1, num_sources, src0_ptr, offs, tok, T, col_mask)
        m, l, acc = _softmax_step(x, gq, eps, m, l, acc, D)
    tl.store(out_ptr + offs, (acc / l[:, :, None]).to(out_ptr.dtype.element_ty), mask=mask)
    if STORE_LSE:
        tl.store(lse_ptr + tok[:, None] * H + head[None, :], m + tl.log(l),
                 mask=(tok < T)[:, None] & (head < H)[None, :])


@triton.jit
def _read_terms(x, dout, lse, gq, eps, D: tl.constexpr):
    """For one source of one read: rstd [T], dots [T, H], weights w [T, H], P = <dout_h, x_h> [T, H]."""
    rstd, dots = _rstd_and_head_dots(x, gq, eps, D)
    return rstd, dots, tl.exp(dots * rstd[:, None] - lse), tl.sum(dout * x, 2)


@triton.jit
def route_site_bwd_kernel(
    table, src0_ptr, null_ptr, q_ptr, g_ptr, lse_ptr, dout_ptr,
    total_ptr, gq_ptr, partial_ptr,
    num_sources, T, eps,
    HAS_NULL: tl.constexpr,
    D: tl.constexpr, H: tl.constexpr, DH: tl.constexpr,
    H_PAD: tl.constexpr, DH_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """The backward of one read, up to the source gradients: S_h per token (`total`, for the
    source kernel), g*q in fp32 (`gq`, so the source kernel never touches the parameters, which
    FSDP may have freed by then), and each program's partial sums of the query's, the key-norm
    weight's and the null source's gradients: rows 0, 1, 2 of `partial_ptr`, each
    [programs, D]. One pass: A = sum_n w (P - S) rstd x is gathered as
    sum_n w P rstd x - S * sum_n w rstd x, since S is only known at the end."""
    pid = tl.program_id(0)
    head, col, col_mask = _tile_layout(H, DH, H_PAD, DH_PAD)
    q, g = _load_tile(q_ptr, col, col_mask), _load_tile(g_ptr, col, col_mask)
    gq = g * q
    if pid == 0:
        tl.store(gq_ptr + col, gq, mask=col_mask)
    dkey = tl.zeros([H_PAD, DH_PAD], tl.float32)
    dnull = tl.zeros([H_PAD, DH_PAD], tl.float32)
    if HAS_NULL:
        null = tl.broadcast_to(_load_tile(null_ptr, col, col_mask)[None, :, :], (BLOCK_T, H_PAD, DH_PAD))

    for block in range(pid, tl.cdiv(T, BLOCK_T), tl.num_programs(0)):  # programs past the end write zeros
        tok = block * BLOCK_T + tl.arange(0, BLOCK_T)
        offs = tok[:, None, None].to(tl.int64) * D + col[None, :, :]
        rows = (tok < T)[:, None, None]
        x_next = _load_row_tile(table, 0, num_sources, src0_ptr, offs, tok, T, col_mask)
        dout = _load_tile(dout_ptr, offs, rows & col_mask[None, :, :])
        # +inf outside the tile makes every weight there exactly 0, so padded rows contribute nothing
        stat_offs = tok[:, None] * H + head[None, :]
        stat_mask = (tok < T)[:, None] & (head < H)[None, :]
        lse = tl.load(lse_ptr + stat_offs, mask=stat_mask, other=float("inf"))

        total = tl.zeros([BLOCK_T, H_PAD], tl.float32)
        wp_x = tl.zeros([BLOCK_T, H_PAD, DH_PAD], tl.float32)  # sum_n w P rstd x
        w_x = tl.zeros([BLOCK_T, H_PAD, DH_PAD], tl.float32)  # sum_n w rstd x
        for n in range(0, num_sources):
            x = x_next
            x_next = _load_row_tile(table, n + 1, num_sources, src0_ptr, offs, tok, T, col_mask)
            rstd, dots, w, p = _read_terms(x, dout, lse, gq, eps, D)
            w_rstd = w * rstd[:, None]
            total += w * p
            wp_x += (w_rstd * p)[:, :, None] * x
            w_x += w_rstd[:, :, None] * x
        if HAS_NULL:
            rstd, dots, w, p = _read_terms(null, dout, lse, gq, eps, D)
            total += w * p
            dlogit = w * (p - total)
            dlogit_rstd = dlogit * rstd[:, None]
            norm_coef = rstd * rstd * rstd / D * tl.sum(dlogit * dots, 1)
            dx = w[:, :, None] * dout + dlogit_rstd[:, :, None] * gq[None, :, :] - norm_coef[:, None, None] * null
            dnull += tl.sum(tl.where(rows, dx, 0.0), 0)
            dkey += tl.sum(dlogit_rstd[:, :, None] * null, 0)
        dkey += tl.sum(wp_x - total[:, :, None] * w_x, 0)
        tl.store(total_ptr + stat_offs, total, mask=stat_mask)

    row = tl.num_programs(0) * D  # one row of partial sums: a [programs, D] block
    tl.store(partial_ptr + pid * D + col, dkey * g, mask=col_mask)
    tl.store(partial_ptr + row + pid * D + col, dkey * q, mask=col_mask)
    if HAS_NULL:
        tl.store(partial_ptr + 2 * row + pid * D + col, dnull, mask=col_mask)


@triton.jit
def route_source_bwd_kernel(
    src_ptr, readers, dout0_ptr, stat0_ptr, grad_in_ptr, dsrc_ptr,
    num_readers, T, eps,
    HAS_GRAD_IN: tl.constexpr,
    D: tl.constexpr, H: tl.constexpr, DH: tl.constexpr,
    H_PAD: tl.constexpr, DH_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """The whole gradient of one source: its terms from every read of it, plus `grad_in` (what
    reached it other than through reads). `readers` is a [num_readers, 4] address table: per
    read, its output gradient, lse, S (fp32 [T, H]) and g*q (fp32 [D])."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head, col, col_mask = _tile_layout(H, DH, H_PAD, DH_PAD)
    offs = tok[:, None, None].to(tl.int64) * D + col[None, :, :]
    mask = (tok < T)[:, None, None] & col_mask[None, :, :]
    stat_offs = tok[:, None] * H + head[None, :]
    stat_mask = (tok < T)[:, None] & (head < H)[None, :]

    x = _load_tile(src_ptr, offs, mask)
    rstd = tl.rsqrt(tl.sum(tl.sum(x * x, 2), 1) / D + eps)
    acc = tl.zeros([BLOCK_T, H_PAD, DH_PAD], tl.float32)  # sum over reads of w dout + dlogit rstd gq
    norm_sum = tl.zeros([BLOCK_T], tl.float32)  # sum over reads of sum_h dlogit dots
    dout_next = _load_rows(_address(readers, 0, num_readers, dout0_ptr, 4, 0), 0 < num_readers, offs, tok, T, col_mask)
    for k in range(0, num_readers):
        dout = dout_next
        dout_next = _load_rows(_address(readers, k + 1, num_readers, dout0_ptr, 4, 0), k + 1 < num_readers,
                               offs, tok, T, col_mask)
        lse = tl.load(_address(readers, k, num_readers, stat0_ptr, 4, 1) + stat_offs, mask=stat_mask,
                      other=float("inf"))
        total = tl.load(_address(readers, k, num_readers, stat0_ptr, 4, 2) + stat_offs, mask=stat_mask, other=0.0)
        gq = _load_tile(_address(readers, k, num_readers, stat0_ptr, 4, 3), col, col_mask)
        dots = tl.sum(x * gq[None, :, :], 2)
        w = tl.exp(dots * rstd[:, None] - lse)
        dlogit = w * (tl.sum(dout * x, 2) - total)
        acc += w[:, :, None] * dout + (dlogit * rstd[:, None])[:, :, None] * gq[None, :, :]
        norm_sum += tl.sum(dlogit * dots, 1)
    dx = acc - (rstd * rstd * rstd / D * norm_sum)[:, None, None] * x
    if HAS_GRAD_IN:
        dx += _load_tile(grad_in_ptr, offs, mask)
    tl.store(dsrc_ptr + offs, dx.to(dsrc_ptr.dtype.element_ty), mask=mask)
