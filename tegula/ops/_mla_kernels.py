"""The T.* kernels behind ``tegula.ops.attention``'s MLA ops: split-KV decode over a paged (or sparse) KV cache,
the combine of split partial results, and the FP8 KV-cache quantiser and dequantiser.

``mla_decode`` serves dense paged decode, sparse decode and sparse prefill with one body. Its unit of work is a
*group* of query rows that attend to one set of keys: in dense decode a (batch, kv head) pair, whose rows are
the s_q * (h_q / h_kv) query heads of all its query tokens; in sparse decode a (batch, query token) pair; in
sparse prefill a query token. A block takes one schedule item (group, first key, end key, slot) and walks its keys
in tiles of ``BN``: each tile gathers its key rows from the cache (through the block table, or the ``indices``),
zeroing rows that are past the end or invalid, computes S = Q K^T with T.gemm, masks, keeps an online softmax
(base-2 exponentials by ``exp2_softmax``, the scale folded in; lazily rescaled by ``lazy_max``: a row's reference
maximum moves only when the row's scores pass it by more than ``LAZY`` log2 units, so P <= 2^LAZY and the
accumulator is rescaled at few tiles, while the true maximum is tracked for prefill's max_logits), and accumulates P
V, where V is the first ``dv`` columns of the same key tile (MLA: V is part of K); with ``sparse``, a last tile of
at most BN / 2 keys (key counts rarely fill the last tile) computes both products on its first half only, its
second half masked (dense decode keeps whole tiles: there the four gemm calls were ~2% slower, measured). An
item that covers its group alone writes the final output and lse; an item that covers part of a long group writes a
partial (output normalised by its own sum, and its natural-log lse) into a workspace slot, and ``mla_combine``
merges the slots of each group.

The FP8 cache (``fp8``) stores 656 bytes per token: 512 float8_e4m3fn values, 4 float32 scales (one per 128
values) and 64 bfloat16 RoPE values. The kernel receives the same memory as three flat views (fp8, float32,
bfloat16) and dequantises each key row to bfloat16 (exact: the scales are powers of two) while gathering it.
"""
from __future__ import annotations

import math

import tegula
import tegula.language as T

LOG2E = math.log2(math.e)
FP8_NOPE, FP8_TILE, FP8_ROPE = 512, 128, 64
LAZY = 8.0   # log2 units a row maximum may pass the reference maximum before the output is rescaled
FP8_BYTES = FP8_NOPE + 4 * (FP8_NOPE // FP8_TILE) + 2 * FP8_ROPE   # 656 bytes per token
# 2^f on |f| <= 0.5, degree 5 with 2^0 = 1 exactly: 1.7e-7 relative (fitted to the relative error on Chebyshev nodes)
EXP2_POLY = (1.3264727e-03, 9.671513e-03, 5.5507336e-02, 2.4022242e-01, 6.931470036506653e-01, 1.0)


@T.macro
def exp2_softmax(x):
    """2^x for the exponents of an online softmax (x <= LAZY, or -inf): the T.exp2 of the prelude spans the whole
    float32 range (a degree-6 polynomial and 2^n in two steps); here x is clamped to [-127, 127], n = rint(x) is
    read from the low mantissa bits of x + 1.5 * 2^23, 2^n is built as one float (n = -127 gives 0: 2^-inf = 0),
    and 2^(x - n) is a degree-5 polynomial (1.7e-7 relative). NaN stays NaN."""
    xc = T.if_then_else(x < -127.0, -127.0, T.if_then_else(x > 127.0, 127.0, x))
    t = xc + 12582912.0
    f = xc - (t - 12582912.0)
    p = T.fma(f, EXP2_POLY[0], EXP2_POLY[1])
    p = T.fma(p, f, EXP2_POLY[2])
    p = T.fma(p, f, EXP2_POLY[3])
    p = T.fma(p, f, EXP2_POLY[4])
    p = T.fma(p, f, EXP2_POLY[5])
    return p * T.reinterpret((T.reinterpret(t, "uint32") << 23) + T.uint32(0x3F800000), "float32")


@T.macro
def lazy_max(m_cur, m, ms, alpha, grew, r, sl2):
    """Row r's step of the lazily rescaled online softmax: the reference maximum m[r] moves only when the tile's
    maximum m_cur[r] passes it by more than LAZY (log2 units), so exponentials stay <= 2^LAZY and the output is
    rescaled at few tiles; ms[r] = the reference in log2 units (0 while it is -inf), alpha[r] the factor the
    running sums and output take, grew[r] 1 where the reference moved."""
    upd = m_cur[r] > m[r] and (m[r] == -T.infinity("float32") or (m_cur[r] - m[r]) * sl2 > LAZY)
    m_new = T.if_then_else(upd, m_cur[r], m[r])
    ms[r] = T.if_then_else(m_new == -T.infinity("float32"), 0.0, m_new * sl2)
    alpha[r] = T.if_then_else(upd, T.exp2(m[r] * sl2 - ms[r]), 1.0)
    grew[r] = T.if_then_else(upd, 1.0, 0.0)
    m[r] = m_new


def mla_decode(rb, nrb, sq, hpk, h_kv, d, dv, ps, sparse, causal, fp8, dtype, has_sink, with_max,
               block_n=64, num_stages=2):
    """Split-KV MLA attention over one schedule item per block; see the module docstring.

    Compile-time: ``rb`` rows per block (``nrb`` row blocks cover the group's sq * hpk rows), ``sq`` query tokens
    per group and ``hpk`` query heads per kv head, ``h_kv`` kv heads, ``d`` / ``dv`` head dims, ``ps`` tokens per
    page, ``sparse`` (keys named by Tab[group, t] instead of pages Tab[batch, t // ps]), ``causal`` (bottom-right),
    ``fp8`` cache, ``dtype`` of q / the key tile, ``has_sink``, ``with_max`` (write the row maxima: prefill).
    Runtime: Q (groups, sq, h_kv, hpk, d); the cache as flat views KVa (+ KVs, KVr for fp8); Tab (rows, cols) int32;
    Lens (groups,) valid keys per group; Sched (items, 4) int32 = (group, start, end, slot); Sink (h_q or 1,);
    outputs Out (groups, sq, h_kv, hpk, dv), Lse (groups, h_kv, hpk, sq), MaxL (groups or 0, h_kv, hpk, sq),
    workspace Opart (slots, h_kv, rows, dv) / Lpart (slots, h_kv, rows); scalars: sb (cache elements per page),
    rs (per token), hs (per kv head), n_tok (keys addressable: sparse indices outside [0, n_tok) are invalid),
    scale (softmax scale).
    """
    rows = sq * hpk
    BN = block_n
    kv_dtype = "float8_e4m3fn" if fp8 else dtype
    groups, n_items, n_slots = T.dynamic("groups"), T.dynamic("n_items"), T.dynamic("n_slots")
    na, ns, nr = T.dynamic("na", "int64"), T.dynamic("ns", "int64"), T.dynamic("nr", "int64")   # caches > 2^31
    tab_rows, tab_cols, n_sink, n_max = T.dynamic("tab_rows"), T.dynamic("tab_cols"), T.dynamic("n_sink"), \
        T.dynamic("n_max")
    neg_inf = -T.infinity("float32")

    @T.macro
    def row_offset(Tab, g, hk, t, sb, rs, hs, n_tok):
        """The cache offset of key t of group g, and whether it names a cache row."""
        if sparse:
            idx = Tab[g, t]
            return (T.cast(idx // ps, "int64") * sb + T.cast(idx % ps, "int64") * rs + hk * hs,
                    idx >= 0 and idx < n_tok)
        return T.cast(Tab[g, t // ps], "int64") * sb + T.cast(t % ps, "int64") * rs + hk * hs, True

    @T.macro
    def gather_keys(KVa, KVs, KVr, Tab, g, hk, start, k, end, valid, off, K_s, Raw, sb, rs, hs, n_tok):
        """Key tile k of the item into K_s (dequantised for fp8); rows that are not valid are zero (the cache may
        hold NaN there). A copy per key row, also for whole pages: each T.copy's start is an expression of k, so
        T.Pipelined prefetches the next tile's row just before copying this tile's one, and these prefetches
        spread over the gather (one bulk copy per page with its page-sized prefetch burst was 1-9% slower,
        measured)."""
        t0 = start + k * BN
        for i in T.serial(BN):
            t = T.min(t0 + i, end - 1)
            o, ok = row_offset(Tab, g, hk, t, sb, rs, hs, n_tok)
            valid[i] = T.if_then_else(t0 + i < end and ok, 1, 0)
            off[i] = o
            if valid[i] != 0:
                if fp8:
                    T.copy(KVa[o:o + FP8_BYTES], Raw[i * FP8_BYTES:(i + 1) * FP8_BYTES])
                else:
                    T.copy(KVa[o:o + d], K_s[i, :])
            else:
                for j in T.Parallel(d):
                    K_s[i, j] = T.cast(0, dtype)
        if fp8:
            for i in T.serial(BN):
                if valid[i] != 0:
                    for c in range(FP8_NOPE // FP8_TILE):
                        sc = KVs[off[i] // 4 + FP8_NOPE // 4 + c]
                        for j in T.Parallel(FP8_TILE):
                            K_s[i, c * FP8_TILE + j] = T.cast(
                                T.cast(Raw[i * FP8_BYTES + c * FP8_TILE + j], "float32") * sc, dtype)
                    for j in T.Parallel(FP8_ROPE):
                        K_s[i, FP8_NOPE + j] = KVr[off[i] // 2 + (FP8_NOPE + 4 * FP8_NOPE // FP8_TILE) // 2 + j]

    @T.prim_func
    def main(
        Q: T.Tensor((groups, sq, h_kv, hpk, d), dtype),
        KVa: T.Tensor((na,), kv_dtype),
        KVs: T.Tensor((ns,), "float32"),
        KVr: T.Tensor((nr,), "bfloat16"),
        Tab: T.Tensor((tab_rows, tab_cols), "int32"),
        Lens: T.Tensor((groups,), "int32"),
        Sched: T.Tensor((n_items, 4), "int32"),
        Sink: T.Tensor((n_sink,), "float32"),
        Out: T.Tensor((groups, sq, h_kv, hpk, dv), dtype),
        Lse: T.Tensor((groups, h_kv, hpk, sq), "float32"),
        MaxL: T.Tensor((n_max, h_kv, hpk, sq), "float32"),
        Opart: T.Tensor((n_slots, h_kv, rows, dv), "float32"),
        Lpart: T.Tensor((n_slots, h_kv, rows), "float32"),
        sb: T.int64,
        rs: T.int32,
        hs: T.int32,
        n_tok: T.int32,
        scale: T.float32,
    ):
        with T.Kernel(n_items, h_kv, nrb, threads=128) as (it, hk, rbk):
            Q_s = T.alloc_shared((rb, d), dtype)
            K_s = T.alloc_shared((BN, d), dtype)
            S = T.alloc_fragment((rb, BN), "float32")
            P_s = T.alloc_shared((rb, BN), dtype)
            acc = T.alloc_fragment((rb, dv), "float32")
            m = T.alloc_fragment((rb,), "float32")
            m_cur = T.alloc_fragment((rb,), "float32")
            ms = T.alloc_fragment((rb,), "float32")
            alpha = T.alloc_fragment((rb,), "float32")
            l_sum = T.alloc_fragment((rb,), "float32")
            p_sum = T.alloc_fragment((rb,), "float32")
            off = T.alloc_fragment((BN,), "int64")
            Raw = T.alloc_shared((BN * FP8_BYTES if fp8 else 1,), kv_dtype)
            grew = T.alloc_fragment((rb,), "float32")
            any_grew = T.alloc_fragment((1,), "float32")
            valid = T.alloc_fragment((BN,), "int32")
            bias = T.alloc_fragment((BN,), "float32")
            mt = T.alloc_fragment((rb,), "float32")
            lim = T.alloc_fragment((rb,), "int32")  # causal: the last key each row may see (bottom-right aligned)

            g = Sched[it, 0]
            start = Sched[it, 1]
            end = T.min(Sched[it, 2], Lens[g])
            slot = Sched[it, 3]
            r0 = rbk * rb
            sl2 = scale * LOG2E

            for r, j in T.Parallel(rb, d):
                Q_s[r, j] = Q[g, (r0 + r) // hpk, hk, (r0 + r) % hpk, j]
            if causal:
                for r in T.Parallel(rb):
                    lim[r] = Lens[g] - sq + (r0 + r) // hpk
            T.fill(acc, 0)
            T.fill(l_sum, 0)
            T.fill(m, neg_inf)
            T.fill(mt, neg_inf)
            if sparse:
                T.fill(S, 0)   # a half tile leaves S's second half as it was: finite, so masking it gives -inf

            for k in T.Pipelined(T.ceildiv(end - start, BN), num_stages=num_stages):
                t0 = start + k * BN
                gather_keys(KVa, KVs, KVr, Tab, g, hk, start, k, end, valid, off, K_s, Raw, sb, rs, hs, n_tok)
                if sparse:   # a last tile of at most BN / 2 keys: both products on its first half
                    half = end - t0 <= BN // 2
                    if half:
                        T.gemm(Q_s, K_s[0:BN // 2, :], S[:, 0:BN // 2], transpose_B=True, clear_accum=True)
                    else:
                        T.gemm(Q_s, K_s, S, transpose_B=True, clear_accum=True)
                else:
                    T.gemm(Q_s, K_s, S, transpose_B=True, clear_accum=True)
                for i in T.Parallel(BN):
                    bias[i] = T.if_then_else(valid[i] != 0, 0.0, neg_inf)
                if causal:
                    for r, i in T.Parallel(rb, BN):
                        S[r, i] = T.if_then_else(t0 + i <= lim[r], S[r, i] + bias[i], neg_inf)
                else:
                    for r, i in T.Parallel(rb, BN):
                        S[r, i] = S[r, i] + bias[i]
                T.reduce_max(S, m_cur, dim=1)
                for r in T.Parallel(rb):
                    lazy_max(m_cur, m, ms, alpha, grew, r, sl2)
                    if with_max:
                        mt[r] = T.max(mt[r], m_cur[r])
                for r, i in T.Parallel(rb, BN):
                    S[r, i] = exp2_softmax(S[r, i] * sl2 - ms[r])
                T.reduce_sum(S, p_sum, dim=1)
                for r in T.Parallel(rb):
                    l_sum[r] = l_sum[r] * alpha[r] + p_sum[r]
                T.copy(S, P_s)
                T.reduce_max(grew, any_grew, dim=0)
                if any_grew[0] > 0.0:   # the output rescales only when some row's reference maximum moved
                    for r, j in T.Parallel(rb, dv):
                        acc[r, j] *= alpha[r]
                if sparse:
                    if half:
                        T.gemm(P_s[:, 0:BN // 2], K_s[0:BN // 2, 0:dv], acc)
                    else:
                        T.gemm(P_s, K_s[:, 0:dv], acc)
                else:
                    T.gemm(P_s, K_s[:, 0:dv], acc)

            if slot < 0:
                for r, j in T.Parallel(rb, dv):
                    w = 1.0 / l_sum[r]
                    if has_sink:
                        w = w / (1.0 + T.exp(Sink[hk * hpk + (r0 + r) % hpk] - (m[r] * scale + T.log(l_sum[r]))))
                    w = T.if_then_else(l_sum[r] == 0.0, 0.0, w)   # a row without keys: 0 (even with a sink)
                    Out[g, (r0 + r) // hpk, hk, (r0 + r) % hpk, j] = acc[r, j] * w
                for r in T.Parallel(rb):
                    Lse[g, hk, (r0 + r) % hpk, (r0 + r) // hpk] = T.if_then_else(
                        l_sum[r] == 0.0, T.infinity("float32"), m[r] * scale + T.log(l_sum[r]))
                    if with_max:
                        MaxL[g, hk, (r0 + r) % hpk, (r0 + r) // hpk] = mt[r] * scale
            else:
                for r, j in T.Parallel(rb, dv):
                    Opart[slot, hk, r0 + r, j] = acc[r, j] * T.if_then_else(l_sum[r] == 0.0, 0.0, 1.0 / l_sum[r])
                for r in T.Parallel(rb):
                    Lpart[slot, hk, r0 + r] = T.if_then_else(l_sum[r] == 0.0, neg_inf, m[r] * scale + T.log(l_sum[r]))

    return main


def mla_combine(sq, hpk, h_kv, dv, dtype, has_sink, chunk=16):
    """Merge the split partials of each group: lse = log(sum_i exp(lse_i)), out = sum_i exp(lse_i - lse) out_i,
    then the sink factor; a group without partial slots (NS[g + 1] == NS[g]) was written by ``mla_decode``."""
    rows = sq * hpk
    groups, n_slots, n_sink, n_ns = T.dynamic("groups"), T.dynamic("n_slots"), T.dynamic("n_sink"), T.dynamic("n_ns")
    nch = T.ceildiv(rows, chunk)
    neg_inf = -T.infinity("float32")

    @T.prim_func
    def main(
        Opart: T.Tensor((n_slots, h_kv, rows, dv), "float32"),
        Lpart: T.Tensor((n_slots, h_kv, rows), "float32"),
        NS: T.Tensor((n_ns,), "int32"),   # groups + 1 entries
        Sink: T.Tensor((n_sink,), "float32"),
        Out: T.Tensor((groups, sq, h_kv, hpk, dv), dtype),
        Lse: T.Tensor((groups, h_kv, hpk, sq), "float32"),
    ):
        with T.Kernel(groups, h_kv, nch, threads=128) as (g, hk, c):
            acc = T.alloc_fragment((chunk, dv), "float32")
            mx = T.alloc_fragment((chunk,), "float32")
            tot = T.alloc_fragment((chunk,), "float32")
            lse = T.alloc_fragment((chunk,), "float32")
            s0 = NS[g]
            n = NS[g + 1] - s0
            if n > 0:
                r0 = c * chunk
                T.fill(mx, neg_inf)
                T.fill(tot, 0)
                T.fill(acc, 0)
                for s in T.serial(n):
                    for r in T.Parallel(chunk):
                        mx[r] = T.max(mx[r], Lpart[s0 + s, hk, T.min(r0 + r, rows - 1)])
                for s in T.serial(n):
                    for r in T.Parallel(chunk):
                        tot[r] += T.exp(Lpart[s0 + s, hk, T.min(r0 + r, rows - 1)]
                                        - T.if_then_else(mx[r] == neg_inf, 0.0, mx[r]))
                for r in T.Parallel(chunk):
                    lse[r] = T.if_then_else(tot[r] == 0.0, neg_inf, mx[r] + T.log(tot[r]))
                for s in T.serial(n):
                    for r, j in T.Parallel(chunk, dv):
                        acc[r, j] += T.if_then_else(
                            lse[r] == neg_inf, 0.0,
                            T.exp(Lpart[s0 + s, hk, T.min(r0 + r, rows - 1)] - lse[r])
                            * Opart[s0 + s, hk, T.min(r0 + r, rows - 1), j])
                for r, j in T.Parallel(chunk, dv):
                    if r0 + r < rows:
                        w = 1.0
                        if has_sink:
                            w = T.if_then_else(lse[r] == neg_inf, 0.0,
                                               1.0 / (1.0 + T.exp(Sink[hk * hpk + (r0 + r) % hpk] - lse[r])))
                        Out[g, (r0 + r) // hpk, hk, (r0 + r) % hpk, j] = acc[r, j] * w
                for r in T.Parallel(chunk):
                    if r0 + r < rows:
                        Lse[g, hk, (r0 + r) % hpk, (r0 + r) // hpk] = T.if_then_else(
                            lse[r] == neg_inf, T.infinity("float32"), lse[r])

    return main


def kv_quant_fp8(block_tokens):
    """bf16 MLA cache rows X (tokens, 576) -> the three parts of FP8 rows, strided views of one (tokens, 656)-byte
    buffer: Q8 (fp8 values), Sc (fp32 scales), R (bf16 RoPE). For each 128-value tile the scale is
    2^ceil(log2(max(amax / 448, 1e-4))) (a power of two, computed from the bits), values / scale round to
    float8_e4m3fn; the 64 RoPE values are copied."""
    n, s8, s32, s16 = T.dynamic("n"), T.dynamic("s8"), T.dynamic("s32"), T.dynamic("s16")
    BT = block_tokens

    @T.prim_func
    def main(X: T.Tensor((n, 576), "bfloat16"), Q8: T.StridedTensor((n, FP8_NOPE), (s8, 1), "float8_e4m3fn"),
             Sc: T.StridedTensor((n, 4), (s32, 1), "float32"), R: T.StridedTensor((n, FP8_ROPE), (s16, 1), "bfloat16")):
        with T.Kernel(T.ceildiv(n, BT), threads=128) as bx:
            x = T.alloc_fragment((BT, FP8_NOPE), "float32")
            amax = T.alloc_fragment((BT, 4), "float32")
            inv = T.alloc_fragment((BT, 4), "float32")
            T.copy(X[bx * BT, 0], x)
            for i, c in T.Parallel(BT, 4):
                amax[i, c] = 0.0
            for c in range(4):
                T.reduce_absmax(x[:, c * FP8_TILE:(c + 1) * FP8_TILE], amax[:, c], dim=1)
            for i, c in T.Parallel(BT, 4):
                v = T.max(amax[i, c] / 448.0, T.float32(1e-4))
                bits = T.reinterpret(v, "int32")
                e = (bits >> 23) + T.if_then_else((bits & 0x7FFFFF) != 0, 1, 0)
                inv[i, c] = T.reinterpret(e << 23, "float32")
            for i, j in T.Parallel(BT, FP8_NOPE):
                x[i, j] = x[i, j] / inv[i, j // FP8_TILE]
            T.copy(x, Q8[bx * BT, 0])
            T.copy(inv, Sc[bx * BT, 0])
            T.copy(X[bx * BT:(bx + 1) * BT, FP8_NOPE:576], R[bx * BT:(bx + 1) * BT, :])

    return main


def kv_dequant_fp8(block_tokens):
    """The inverse of ``kv_quant_fp8`` (same strided views in, X out): value * scale in float32, rounded to
    bfloat16 (exact for the quantiser's power-of-two scales)."""
    n, s8, s32, s16 = T.dynamic("n"), T.dynamic("s8"), T.dynamic("s32"), T.dynamic("s16")
    BT = block_tokens

    @T.prim_func
    def main(Q8: T.StridedTensor((n, FP8_NOPE), (s8, 1), "float8_e4m3fn"),
             Sc: T.StridedTensor((n, 4), (s32, 1), "float32"), R: T.StridedTensor((n, FP8_ROPE), (s16, 1), "bfloat16"),
             X: T.Tensor((n, 576), "bfloat16")):
        with T.Kernel(T.ceildiv(n, BT), threads=128) as bx:
            for i, j in T.Parallel(BT, FP8_NOPE):
                if bx * BT + i < n:
                    X[bx * BT + i, j] = T.cast(T.cast(Q8[bx * BT + i, j], "float32") * Sc[bx * BT + i, j // FP8_TILE],
                                               "bfloat16")
            T.copy(R[bx * BT:(bx + 1) * BT, :], X[bx * BT:(bx + 1) * BT, FP8_NOPE:576])

    return main


def compact_indices():
    """Sparse attention's key lists with the keys that count moved to the front: row r of Out holds, in order, the
    entries Tab[r, t] with t < Lens[r] and 0 <= Tab[r, t] < n_tok, and Cnt[r] their number (Out past it is left as
    it was). ``mla_decode`` then walks Cnt[r] keys instead of Lens[r], so skipped entries (-1) cost neither a
    gather nor a share of the products."""
    rows, cols = T.dynamic("rows"), T.dynamic("cols")

    @T.prim_func
    def main(Tab: T.Tensor((rows, cols), "int32"), Lens: T.Tensor((rows,), "int32"),
             Out: T.Tensor((rows, cols), "int32"), Cnt: T.Tensor((rows,), "int32"), n_tok: T.int32):
        with T.Kernel(rows, threads=1) as r:
            n = T.alloc_var("int32", 0)
            for t in T.serial(T.min(Lens[r], cols)):
                idx = Tab[r, t]
                Out[r, n] = idx   # n <= t: in the row; overwritten by the next key when idx does not count
                n = n + T.if_then_else(idx >= 0 and idx < n_tok, 1, 0)
            Cnt[r] = n

    return main


_FACTORIES: dict = {}
_MAKERS = {"decode": (mla_decode, None), "combine": (mla_combine, None), "quant": (kv_quant_fp8, None),
           "dequant": (kv_dequant_fp8, None),
           "compact": (compact_indices, None)}


def get(kind: str, target: str, *args):
    """The compiled ``kind`` kernel for ``target``, cached per argument tuple (tegula.jit)."""
    fac = _FACTORIES.get((kind, target))
    if fac is None:
        make, out_idx = _MAKERS[kind]
        fac = _FACTORIES[(kind, target)] = tegula.jit(make, out_idx=out_idx, target=target)
    return fac(*args)
