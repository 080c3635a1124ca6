"""``tegula.ops.norm``: RMSNorm, and RMSNorm fused with TileKernels' per-token cast, kernels in T.*.

    from tegula.ops.norm import rmsnorm, rmsnorm_forward_and_per_token_cast

- ``rmsnorm(x, weight, eps=1e-6) -> y``: x (num_tokens, hidden) float32 / bfloat16 / float16, any row stride;
  weight (hidden,) of any of those dtypes; y in x's dtype.
- ``rmsnorm_forward_and_per_token_cast(x, weight, eps=1e-6, fmt='e4m3', num_per_channels=128,
  use_tma_aligned_col_major_sf=False, round_sf=False, use_packed_ue8m0=False) -> (out, sf)``: the float32 RMSNorm
  output cast as ``tegula.ops.quant.per_token_cast`` casts (same formats, scale layouts and numerics); the
  normalised row is not rounded to x's dtype in between. With bfloat16 x and weight, fmt 'e4m3' and groups of
  16-128 columns (norm._pairs: even widths, strides and offsets) the rows are read as uint32 words of two elements
  (rmsnorm_cast_pairs_kernel, _bf16_pairs); else element by element (rmsnorm_cast_kernel); the same bits.

Numerics, float32 throughout: y = x * w * rstd (left to right), rstd = 1 / sqrt(ss / hidden + eps), ss the sum of
x * x in a fixed order: 32 lanes (lane l takes the columns l, l + 32, ...) accumulated in column order, then the
lanes folded pairwise (l + 16 into l, then 8, 4, 2, 1). One compiled kernel serves every token count and hidden size.
"""
from __future__ import annotations

import tegula.language as T
from tegula.ops import _bf16_pairs as P
from tegula.ops import _tk
from tegula.ops._quant_kernels import (
    CLAMP_MIN,
    FMT_MAX,
    OUT_DTYPE,
    PACKED_SF,
    ROUND_SF,
    e4m3_in_range,
    group_scales,
    scale_of,
    store_quantized,
    store_scales,
)
from tegula.ops._tk import ceil_div

__all__ = ["rmsnorm", "rmsnorm_forward_and_per_token_cast"]

LANES = 32
STREAM_MIN = _tk.STREAM_MIN  # outputs of at least this many values are written with streaming stores
_DT = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}


@T.macro
def _finish_rstd(acc, rstd, hidden, eps, BM):
    """rstd[i] = 1 / sqrt(sum / hidden + eps) from the BM x LANES (32) lane sums of squares in acc, folded in halves
    into lane 0 (the order every rmsnorm kernel sums in)."""
    for step in T.unroll(5):
        half = 16 >> step
        for i, lane in T.Parallel(BM, 16):
            if lane < half:
                acc[i, lane] = acc[i, lane] + acc[i, lane + half]
    for i in T.Parallel(BM):
        rstd[i] = 1.0 / T.sqrt(acc[i, 0] / T.cast(hidden, "float32") + eps)


@T.macro
def _rstd(X, xf, acc, rstd, r0, hidden, eps, BM, W, touch=None):
    """touch (a (BM, W) tile of X's dtype, or None): each whole chunk is first copied into it, a copy that nothing
    reads (the compiler drops it where the chunk lies inside X) but that a pipelined loop prefetches the next
    iteration's chunk for; the squares are summed straight from X either way."""
    T.fill(acc, 0.0)
    xv = T.reshape(xf, (BM, W // LANES, LANES))
    for c in T.serial(T.ceildiv(hidden, W)):
        if c * W + (W - 1) < hidden:  # a whole chunk
            if touch is not None:
                T.copy(X[r0, c * W], touch)
            for cc in T.serial(W // LANES):
                for i, lane in T.Parallel(BM, LANES):
                    x = T.cast(X[r0 + i, c * W + cc * LANES + lane], "float32")
                    acc[i, lane] = acc[i, lane] + x * x
        else:
            T.copy(X[r0, c * W], xf)
            for cc in T.serial(W // LANES):
                for i, lane in T.Parallel(BM, LANES):
                    acc[i, lane] = acc[i, lane] + xv[i, cc, lane] * xv[i, cc, lane]
    _finish_rstd(acc, rstd, hidden, eps, BM)


@T.macro
def _normalised(X, Wt, xf, wf, rstd, r0, c0, hidden, BM, W):
    if c0 + (W - 1) < hidden:  # a whole chunk: x and w converted as they are read, one pass
        for i, j in T.Parallel(BM, W):
            xf[i, j] = T.cast(X[r0 + i, c0 + j], "float32") * T.cast(Wt[c0 + j], "float32") * rstd[i]
    else:
        T.copy(X[r0, c0], xf)
        T.copy(Wt[c0], wf)
        for i, j in T.Parallel(BM, W):
            xf[i, j] = xf[i, j] * wf[j] * rstd[i]


@T.macro
def _rows(X, Wt, Y, xf, wf, acc, rstd, r0, H, eps, stream, in_dtype, BM, W, touch):
    """rows r0 .. r0 + BM - 1 normalised into Y (stream: whole chunks written by streaming copies)."""
    _rstd(X, xf, acc, rstd, r0, H, eps, BM, W, touch)
    for c in T.serial(T.ceildiv(H, W)):
        if c * W + (W - 1) < H and stream:  # a whole chunk of a large output: streamed (no line read)
            T.copy(Wt[c * W], wf)  # widened once for the block's rows
            for i, j in T.Parallel(BM, W):
                xf[i, j] = T.cast(X[r0 + i, c * W + j], "float32") * wf[j] * rstd[i]
            for i in T.serial(BM):
                T.copy(xf[i, 0:W], Y[r0 + i, c * W:c * W + W], eviction_policy="evict_first")
        elif c * W + (W - 1) < H:  # a whole chunk: normalised, rounded and stored in one pass
            for i, j in T.Parallel(BM, W):
                Y[r0 + i, c * W + j] = T.cast(T.cast(X[r0 + i, c * W + j], "float32") *
                                              T.cast(Wt[c * W + j], "float32") * rstd[i], in_dtype)
        else:
            _normalised(X, Wt, xf, wf, rstd, r0, c * W, H, BM, W)
            T.copy(xf, Y[r0, c * W])


def rmsnorm_kernel(in_dtype, w_dtype, W=256, BM=4, G=32):
    """A block takes G groups of BM rows; where G > 1 the group loop is pipelined: the first pass copies each chunk
    into a tile nothing reads (_rstd's touch), which the pipelining precedes by a prefetch of the next group's
    chunk, so that the second pass's arithmetic overlaps the next group's reads, and sums the squares from X (the
    chunk staged in float32 by that copy and summed from the tile instead took 1.04-1.05x the time)."""
    NT, H, XST = T.dynamic("num_tokens"), T.dynamic("hidden"), T.dynamic("x_stride")
    streams = in_dtype in ("bfloat16", "float32")

    @T.prim_func
    def rmsnorm(X: T.StridedTensor((NT, H), (XST, 1), in_dtype), Wt: T.Tensor((H,), w_dtype),
                Y: T.Tensor((NT, H), in_dtype), eps: T.float32):
        with T.Kernel(T.ceildiv(NT, BM * G)) as bg:
            xf = T.alloc_fragment((BM, W), "float32")
            wf = T.alloc_fragment((W,), "float32")
            acc = T.alloc_fragment((BM, LANES), "float32")
            rstd = T.alloc_fragment((BM,), "float32")
            touch = T.alloc_fragment((BM, W), in_dtype) if G > 1 else None
            stream = streams and NT >= (STREAM_MIN + H - 1) // H
            for g in T.Pipelined(G, num_stages=2):
                r0 = (bg * G + g) * BM
                if r0 < NT:
                    _rows(X, Wt, Y, xf, wf, acc, rstd, r0, H, eps, stream, in_dtype, BM, W, touch)
    return rmsnorm


def rmsnorm_cast_kernel(in_dtype, w_dtype, fmt, G, W=1024, BM=1):
    """G in (16, 32, 64, 128): scales per group, chunk by chunk; G == 0: one scale per row (a third pass)."""
    NT, H, XST = T.dynamic("num_tokens"), T.dynamic("hidden"), T.dynamic("x_stride")
    QC = T.dynamic("q_cols")
    SR, SC, SSM, SSK = T.dynamic("sf_rows"), T.dynamic("sf_cols"), T.dynamic("sf_sm"), T.dynamic("sf_sk")
    maxv, cmin = FMT_MAX[fmt], CLAMP_MIN[fmt]
    Gt = G or W
    GB = W // Gt

    @T.prim_func
    def rmsnorm_cast(X: T.StridedTensor((NT, H), (XST, 1), in_dtype), Wt: T.Tensor((H,), w_dtype),
                     Q: T.Tensor((NT, H if fmt == "e4m3" else QC), OUT_DTYPE[fmt]),
                     S: T.StridedTensor((SR, SC), (SSM, SSK), "int32"),
                     eps: T.float32, flags: T.int32):
        with T.Kernel(T.ceildiv(NT, BM)) as by:
            r0 = by * BM
            rnd = (flags & ROUND_SF) != 0
            packed = (flags & PACKED_SF) != 0
            xf = T.alloc_fragment((BM, W), "float32")
            wf = T.alloc_fragment((W,), "float32")
            acc = T.alloc_fragment((BM, LANES), "float32")
            rstd = T.alloc_fragment((BM,), "float32")
            amax = T.alloc_fragment((BM, GB), "float32")
            inv = T.alloc_fragment((BM, GB), "float32")
            word = T.alloc_fragment((BM, GB), "int32")
            eb = T.alloc_fragment((BM, GB), "int32")
            xg = T.reshape(xf, (BM, GB, Gt))
            _rstd(X, xf, acc, rstd, r0, H, eps, BM, W)
            if G == 0:
                rmax = T.alloc_fragment((BM,), "float32")
                part = T.alloc_fragment((BM,), "float32")
                T.fill(rmax, 0.0)
                for c in T.serial(T.ceildiv(H, W)):
                    _normalised(X, Wt, xf, wf, rstd, r0, c * W, H, BM, W)
                    T.reduce_absmax(xf, part, dim=1)
                    for i in T.Parallel(BM):
                        rmax[i] = T.max(rmax[i], part[i])
                for i, g in T.Parallel(BM, GB):
                    w_, v_, e_ = scale_of(rmax[i], maxv, cmin, rnd)
                    inv[i, g] = v_
                    if r0 + i < NT and g == 0:
                        S[r0 + i, 0] = T.if_then_else(packed, e_, w_)
            top = T.alloc_fragment((1,), "float32")  # the largest amax of the chunk (G == 0: of the row)
            if G == 0:
                T.reduce_max(T.reshape(rmax, (1, BM)), top, dim=1)
            for c in T.serial(T.ceildiv(H, W)):
                _normalised(X, Wt, xf, wf, rstd, r0, c * W, H, BM, W)
                if G != 0:
                    T.reduce_absmax(xg, amax, dim=2)
                    T.reduce_max(T.reshape(amax, (1, BM * GB)), top, dim=1)
                    group_scales(amax, word, inv, eb, maxv, cmin, rnd, BM, GB)
                    store_scales(S, word, eb, r0, c * GB, NT, T.ceildiv(H, G), packed, BM, GB)
                # x * inv is within 448 (1 + 2^-22) or NaN (as in _quant_kernels.per_token_cast) unless round_sf
                # meets an infinite amax: then the full cast
                if fmt == "e4m3" and c * W + (W - 1) < H and ((flags & ROUND_SF) == 0 or
                                                              top[0] < T.infinity("float32")):
                    for i, g, k in T.Parallel(BM, GB, Gt):
                        Q[r0 + i, c * W + g * Gt + k] = e4m3_in_range(xg[i, g, k] * inv[i, g])
                elif fmt == "e4m3" and c * W + (W - 1) < H:  # scale, narrow and store in one pass
                    for i, g, k in T.Parallel(BM, GB, Gt):
                        Q[r0 + i, c * W + g * Gt + k] = T.cast(xg[i, g, k] * inv[i, g], "float8_e4m3fn")
                else:
                    for i, g, k in T.Parallel(BM, GB, Gt):
                        xg[i, g, k] = xg[i, g, k] * inv[i, g]
                    store_quantized(Q, xf, r0, c * W, fmt, BM, W)
    return rmsnorm_cast


@T.macro
def _rstd_pairs(X, acc2, acc, rstd, r0, H2, eps, BM, W2, part, Wt=None, gmax=None, GH=16, GMAX=0):
    """_rstd of a bfloat16 X read as uint32 words (_bf16_pairs; H2 words a row): lane l of the module docstring's
    32 is half l % 2 of word lane l // 2 (acc2[i, l % 2, l // 2]), so each lane sums the same columns in the same
    order and the fold is _rstd's. With ``gmax`` ((GMAX,) uint32, BM 1, GH >= 16 words a group): also gmax[g] = the
    largest |x * w| of group g (weight Wt) as float32 bits (an integer max: inf and NaN above every finite value),
    for the groups of the whole chunks below GMAX (_fused_cast)."""
    T.fill(acc2, 0.0)
    for c in T.serial(T.ceildiv(H2, W2)):
        if c * W2 + (W2 - 1) < H2:
            if gmax is not None:
                NG = W2 // GH
                gm = T.alloc_fragment((NG, 16), "uint32")
                gr = T.alloc_fragment((NG,), "uint32")
                T.fill(gm, 0)
                for g in T.serial(NG):
                    for j in T.unroll(GH // 16):  # the words in order: lane l's sums add what _rstd's add
                        for l in T.Parallel(16):
                            w = X[r0, c * W2 + g * GH + j * 16 + l]
                            ww = Wt[c * W2 + g * GH + j * 16 + l]
                            acc2[0, 0, l] = acc2[0, 0, l] + P.even(w) * P.even(w)
                            acc2[0, 1, l] = acc2[0, 1, l] + P.odd(w) * P.odd(w)
                            gm[g, l] = T.max(gm[g, l], P.mag_max(P.even(w) * P.even(ww), P.odd(w) * P.odd(ww)))
                T.reduce_max(gm, gr, dim=1)
                for g in T.Parallel(NG):
                    if c * NG + g < GMAX:
                        gmax[T.min(c * NG + g, GMAX - 1)] = gr[g]
            else:
                for cc in T.serial(W2 // 16):
                    for i, l in T.Parallel(BM, 16):
                        w = X[r0 + i, c * W2 + cc * 16 + l]
                        acc2[i, 0, l] = acc2[i, 0, l] + P.even(w) * P.even(w)
                        acc2[i, 1, l] = acc2[i, 1, l] + P.odd(w) * P.odd(w)
        else:
            T.copy(X[r0, c * W2], part)  # zeros past the row's end
            for cc in T.serial(W2 // 16):
                for i, l in T.Parallel(BM, 16):
                    w = part[i, cc * 16 + l]
                    acc2[i, 0, l] = acc2[i, 0, l] + P.even(w) * P.even(w)
                    acc2[i, 1, l] = acc2[i, 1, l] + P.odd(w) * P.odd(w)
    for i, lane in T.Parallel(BM, LANES):
        acc[i, lane] = acc2[i, lane % 2, lane // 2]
    _finish_rstd(acc, rstd, H2 * 2, eps, BM)


@T.macro
def _pair_products(X, Wt, xr, xc, wc, rstd, xe, xo, ab, BM, GB, GH, pf=None):
    """xe / xo = the even / odd elements of X's words times the weight's times rstd; ab (BM, GB, L) = per lane l of
    each group the largest magnitude of the values of its words l, l + L, ... as float32 bits (an integer max: NaN
    above inf), L = min(GH, 16). The running max stays in a register across the group's GH / L words. An (BM, GB,
    GH) tile of per-word maxima reduced afterwards (gcc kept that reduction's accumulator on the stack) took 1.027x
    this form's time (1 thread CPU time, 18688 x 7168 /128, medians of 7 alternated rounds in each of 36 processes:
    quartiles 0.991-1.052, 25 of 36 above 1; one process alone varies 0.95-1.11 with where its pages land).
    ``pf`` (BM, GH): each group step also copies the same group of the next BM rows into it, for the prefetch."""
    L = min(GH, 16)
    T.fill(ab, 0)
    for g in T.Pipelined(GB, num_stages=2):
        if pf is not None:
            T.copy(X[xr + BM, xc + g * GH], pf)
        for i, l in T.Parallel(BM, L):
            for j in T.unroll(GH // L):
                w = X[xr + i, xc + g * GH + j * L + l]
                ww = Wt[wc + g * GH + j * L + l]
                ve = P.even(w) * P.even(ww) * rstd[i]
                vo = P.odd(w) * P.odd(ww) * rstd[i]
                xe[i, g, j * L + l] = ve
                xo[i, g, j * L + l] = vo
                ab[i, g, l] = T.max(ab[i, g, l], P.mag_max(ve, vo))


@T.macro
def pair_cast(Q, S, xe, xo, ab, r0, q0, g0, NT, ngroups, whole, maxv, cmin, flags, BM, GB, GH):
    """The per-group cast of the values xe / xo (the even / odd elements of GB groups of 2 GH, ab their lanes' larger
    magnitude's bits) into Q's uint16 code pairs at Q[r0, q0] and their scales at group g0 (as _quant_kernels'
    per_token_cast, the same bits). The amax is ab's integer max where that is finite (no NaN nor inf among the
    values: then the cast needs no NaN select), else T.reduce_absmax's (NaN ignored) and the full cast; whole: the
    tile lies inside Q (else it is stored through a tile)."""
    rnd = (flags & ROUND_SF) != 0
    amb = T.alloc_fragment((BM, GB), "uint32")
    topb = T.alloc_fragment((1,), "uint32")
    amax = T.alloc_fragment((BM, GB), "float32")
    am2 = T.alloc_fragment((BM, GB), "float32")
    top = T.alloc_fragment((1,), "float32")
    inv = T.alloc_fragment((BM, GB), "float32")
    word = T.alloc_fragment((BM, GB), "int32")
    eb = T.alloc_fragment((BM, GB), "int32")
    T.reduce_max(ab, amb, dim=2)
    T.reduce_max(T.reshape(amb, (1, BM * GB)), topb, dim=1)
    finite = topb[0] < 0x7F800000
    if finite:
        for i, g in T.Parallel(BM, GB):
            amax[i, g] = T.reinterpret(amb[i, g], "float32")
    else:
        T.reduce_absmax(xe, amax, dim=2)
        T.reduce_absmax(xo, am2, dim=2)
        for i, g in T.Parallel(BM, GB):
            amax[i, g] = T.if_then_else(am2[i, g] > amax[i, g], am2[i, g], amax[i, g])
        T.reduce_max(T.reshape(amax, (1, BM * GB)), top, dim=1)
    group_scales(amax, word, inv, eb, maxv, cmin, rnd, BM, GB)
    store_scales(S, word, eb, r0, g0, NT, ngroups, (flags & PACKED_SF) != 0, BM, GB)
    if finite and whole:
        for i, g, k in T.Parallel(BM, GB, GH):
            Q[r0 + i, q0 + g * GH + k] = P.e4m3_pair_values(xe[i, g, k] * inv[i, g], xo[i, g, k] * inv[i, g])
    else:
        q = T.alloc_fragment((BM, GB, GH), "uint16")
        if finite or (flags & ROUND_SF) == 0 or top[0] < T.infinity("float32"):
            for i, g, k in T.Parallel(BM, GB, GH):  # within 448 (1 + 2^-22) or NaN
                q[i, g, k] = P.e4m3_pair(xe[i, g, k] * inv[i, g], xo[i, g, k] * inv[i, g])
        else:  # round_sf meeting amax = inf (inv = -inf): the saturating cast
            for i, g, k in T.Parallel(BM, GB, GH):
                lo = T.reinterpret(T.cast(xe[i, g, k] * inv[i, g], "float8_e4m3fn"), "uint8")
                hi = T.reinterpret(T.cast(xo[i, g, k] * inv[i, g], "float8_e4m3fn"), "uint8")
                q[i, g, k] = T.cast(lo, "uint16") | (T.cast(hi, "uint16") << 8)
        T.copy(T.reshape(q, (BM, GB * GH)), Q[r0, q0])


@T.macro
def _fused_cast(X, Wt, Q, S, gmax, rstd, touch, r0, H2, NT, ngroups, maxv, cmin, flags, GMAX, GB, GH, W2):
    """The cast of row r0 (whole chunks of W2 words) from _rstd_pairs' group maxima of |x * w| (all finite, rstd
    finite): a group's amax is RN(max |x * w| * rstd), which equals the largest |RN(x * w) * rstd| (rounding is
    monotonic), so each value is computed once, as it is cast, with no float32 tile; its words of the next row
    are prefetched group by group (the copies into touch are dropped)."""
    rnd = (flags & ROUND_SF) != 0
    amax = T.alloc_fragment((1, GMAX), "float32")
    inv = T.alloc_fragment((1, GMAX), "float32")
    word = T.alloc_fragment((1, GMAX), "int32")
    eb = T.alloc_fragment((1, GMAX), "int32")
    for i, g in T.Parallel(1, GMAX):
        amax[i, g] = T.reinterpret(gmax[g], "float32") * rstd[i]
    group_scales(amax, word, inv, eb, maxv, cmin, rnd, 1, GMAX)
    store_scales(S, word, eb, r0, 0, NT, ngroups, (flags & PACKED_SF) != 0, 1, GMAX)
    for c in T.serial(H2 // W2):
        if c * W2 + (W2 - 1) < H2:  # (always: the fact that proves the reads inside X)
            for g in T.Pipelined(GB, num_stages=2):
                T.copy(X[r0 + 1, c * W2 + g * GH], touch)
                for k in T.Parallel(GH):
                    w = X[r0, c * W2 + g * GH + k]
                    ww = Wt[c * W2 + g * GH + k]
                    s = inv[0, c * GB + g]
                    Q[r0, c * W2 + g * GH + k] = P.e4m3_pair_values(P.even(w) * P.even(ww) * rstd[0] * s,
                                                                    P.odd(w) * P.odd(ww) * rstd[0] * s)


def rmsnorm_cast_pairs_kernel(G, RB=32, W=1024, BM=1):
    """rmsnorm_cast_kernel for bfloat16 x and weight, fmt e4m3 and G in (16, 32, 64, 128), on the rows read as
    uint32 words (_bf16_pairs: each element widened by one op, no shuffles) and Q written as uint16 pairs of codes
    (pair_cast); the same bits. A block takes RB rows; in a whole chunk of the second pass each group of words is
    also copied from the next row into a tile nothing reads (the compiler drops the copy), which the pipelined
    group loop of _pair_products precedes by a prefetch, so the next row's first pass finds its chunk in cache
    (a chunk's 33 prefetches issued together held 20% of the kernel's samples on this Intel Xeon; spread over the
    groups, 1 thread CPU time, a C copy of the kernel, 6 process pairs: new / old 0.91-1.03, median 0.955).
    Earlier, on a Zen 4, 1 thread CPU time, 18688 x 7168 /128, alternated with rmsnorm_cast_kernel in one process:
    52.5 -> 47.2 ms (1.42 -> 1.28 cycles/value) without the prefetch; with it, RB 4 / 16 / 32 / 64 measured 0.879 /
    0.847 / 0.828 / 0.829 of rmsnorm_cast_kernel's time.
    Rows of whole chunks with at most GMAX groups of at least 32 columns (FUSED) take two passes instead of three:
    the sum of squares also keeps each group's max |x * w| (_rstd_pairs), and where those and rstd are finite
    _fused_cast casts each value as it computes it (no float32 tile of the row, no products pass); other rows (a
    non-finite product, eps 0 on a zero row) go on to the chunk loop. On the Intel Xeon, 37376 x 7168 /128,
    alternated with the three-pass form in one process: 1 thread CPU time 137.2 -> 121.2 ms, 2 threads wall 72.6
    -> 62.6; against the commit before, separate processes, 2 threads: 11.9-12.3 -> 12.9-14.3 GB/s. Measured and
    not kept: each chunk's codes staged and streamed out (non-temporal stores), 1.02x the time at 1 and 2 threads;
    on a later Xeon (2 MiB L2, 74880 x 7168, 2 threads, alternating processes) the weight widened once a block into
    float32 even / odd tiles, 21.9-22.1 vs 22.4-23.0 GB/s from cache (256 rows), 16.9-17.0 vs 16.8-17.4 from memory.
    The sum of squares as one fma a value would not be the same bits: for |x| < 2^-63 the square underflows and
    rounds, and the fma's single rounding then differs from the reference's square-then-add on ties. On that Xeon,
    1 thread, 64 rows (in L2), the generated C with parts removed: 22.1-23.5 TSC cycles per 16 words (2.6 GHz TSC,
    ~3.6-4 GHz core), 11.3-11.9 without the second pass's cast arithmetic, 19.9-20.2 without the group max, 9.4-10.1
    without both (a core computes 11.0-11.3 GB/s of it; 0.8 of a 26 GB/s two-thread copy asks 10.4 of each core).
    From memory (74880 x 7168, 2 threads) the kernel with both removed read 0.72-0.74 of the copy at one moment and
    0.58-0.62 at another, the whole kernel 0.60 at both. Measured and not kept there: the next row's prefetch split
    between both passes (half of each group in each), 1 / 2 rows ahead, 0.575-0.583 / 0.587-0.594 against
    0.609-0.619 (alternated processes); chunks of W 3584 / 7168 columns instead of 1024 (1 thread, from L2) 23.3-24.1
    / 22.6-23.1 against 22.3-23.2 TSC cycles per 16 words."""
    NT, H2, XST = T.dynamic("num_tokens"), T.dynamic("hidden2"), T.dynamic("x_stride2")
    SR, SC, SSM, SSK = T.dynamic("sf_rows"), T.dynamic("sf_cols"), T.dynamic("sf_sm"), T.dynamic("sf_sk")
    maxv, cmin = FMT_MAX["e4m3"], CLAMP_MIN["e4m3"]
    GB, GH, W2 = W // G, G // 2, W // 2
    FUSED = BM == 1 and GH >= 16  # rows of whole chunks and at most GMAX groups take _fused_cast
    GMAX = 128

    @T.prim_func
    def rmsnorm_cast_pairs(X: T.StridedTensor((NT, H2), (XST, 1), "uint32"), Wt: T.Tensor((H2,), "uint32"),
                           Q: T.Tensor((NT, H2), "uint16"), S: T.StridedTensor((SR, SC), (SSM, SSK), "int32"),
                           eps: T.float32, flags: T.int32):
        with T.Kernel(T.ceildiv(NT, BM * RB)) as bg:
            acc2 = T.alloc_fragment((BM, 2, 16), "float32")
            acc = T.alloc_fragment((BM, LANES), "float32")
            rstd = T.alloc_fragment((BM,), "float32")
            xe = T.alloc_fragment((BM, GB, GH), "float32")
            xo = T.alloc_fragment((BM, GB, GH), "float32")
            ab = T.alloc_fragment((BM, GB, min(GH, 16)), "uint32")
            xs = T.alloc_fragment((BM, W2), "uint32")
            ws = T.alloc_fragment((W2,), "uint32")
            touch = T.alloc_fragment((BM, GH), "uint32")
            gmax = T.alloc_fragment((GMAX,), "uint32")  # past a row's groups: 0
            gtop = T.alloc_fragment((1,), "uint32")
            T.fill(gmax, 0)
            ngroups = T.ceildiv(H2 * 2, G)
            for rb in T.Pipelined(RB, num_stages=2):
                r0 = (bg * RB + rb) * BM
                fused = r0 < NT and FUSED and H2 % W2 == 0 and ngroups <= GMAX  # this row takes _fused_cast
                if fused:
                    _rstd_pairs(X, acc2, acc, rstd, r0, H2, eps, BM, W2, xs, Wt, gmax, GH, GMAX)
                    T.reduce_max(T.reshape(gmax, (1, GMAX)), gtop, dim=1)
                    fused = gtop[0] < 0x7F800000 and rstd[0] < T.infinity("float32")
                elif r0 < NT:
                    _rstd_pairs(X, acc2, acc, rstd, r0, H2, eps, BM, W2, xs)
                if fused:
                    _fused_cast(X, Wt, Q, S, gmax, rstd, touch, r0, H2, NT, ngroups, maxv, cmin, flags, GMAX, GB, GH,
                                W2)
                elif r0 < NT:
                    for c in T.serial(T.ceildiv(H2, W2)):
                        whole = c * W2 + (W2 - 1) < H2 and r0 + (BM - 1) < NT
                        if whole:
                            _pair_products(X, Wt, r0, c * W2, c * W2, rstd, xe, xo, ab, BM, GB, GH, touch)
                        else:  # staged: zeros past the row's end
                            T.copy(X[r0, c * W2], xs)
                            T.copy(Wt[c * W2], ws)
                            _pair_products(xs, ws, 0, 0, 0, rstd, xe, xo, ab, BM, GB, GH)
                        pair_cast(Q, S, xe, xo, ab, r0, c * W2, c * GB, NT, T.ceildiv(H2 * 2, G), whole, maxv, cmin,
                                  flags, BM, GB, GH)
    return rmsnorm_cast_pairs


def _check(x, weight, eps):
    t = _tk.torch()
    dts = (t.float32, t.bfloat16, t.float16)
    _tk.check_tensor(x, "x", dts, 2)
    _tk.check_tensor(weight, "weight", dts, 1)
    if weight.shape[0] != x.shape[1]:
        raise ValueError(f"weight must have {x.shape[1]} entries (x's hidden size), got {weight.shape[0]}")
    eps = _tk.check_float(eps, "eps")
    return _tk.rows_stride1(x), weight.contiguous(), eps


def rmsnorm(x, weight, eps: float = 1e-6):
    """RMSNorm of each row of x (num_tokens, hidden): x * weight * rstd in float32, rounded to x's dtype."""
    t = _tk.torch()
    x, weight, eps = _check(x, weight, eps)
    y = t.empty(x.shape, dtype=x.dtype)
    if x.numel():  # where the output streams: groups of 4 rows (each chunk of the weight widened once for 4 rows),
        big = x.numel() >= STREAM_MIN  # 8 or 32 groups a block, the next group prefetched; else one row a block
        _tk.kernel(rmsnorm_kernel, _DT[str(x.dtype)], _DT[str(weight.dtype)], 256, 4 if big else 1,
                   _groups(x.shape[0]) if big else 1)(x, weight, y, eps)
    return y


def _groups(num_tokens: int) -> int:
    """Groups of 4 rows per block of the streamed rmsnorm: a block's first group is not prefetched, so 32 where
    that still leaves each thread 8 blocks, else 8. 37376 x 7168 bf16, 32 vs 8 alternated in one process, medians
    of 11 rounds: 1 thread process CPU time 0.958, 0.967 of the time; 2 threads wall 0.963, 0.961 (64: 0.950)."""
    return 32 if num_tokens >= 4 * 32 * 8 * _tk.threads() else 8


def _pairs(x, weight) -> bool:
    """Whether x and weight can be read as uint32 words of two bfloat16 (_bf16_pairs): both bfloat16, even columns
    and row stride, 4-byte-aligned starts at even element offsets (torch's view as int32; x's last stride is 1:
    _check)."""
    t = _tk.torch()
    return (x.dtype == t.bfloat16 and weight.dtype == t.bfloat16 and x.shape[1] % 2 == 0 and x.stride(0) % 2 == 0
            and all(v.data_ptr() % 4 == 0 and v.storage_offset() % 2 == 0 for v in (x, weight)))


def rmsnorm_forward_and_per_token_cast(x, weight, eps: float = 1e-6, fmt: str = "e4m3", num_per_channels: int = 128,
                                       use_tma_aligned_col_major_sf: bool = False, round_sf: bool = False,
                                       use_packed_ue8m0: bool = False):
    """RMSNorm fused with the per-token cast: ``(out, sf)`` as ``per_token_cast(rmsnorm_float32(x), fmt,
    num_per_channels, ...)`` returns them."""
    x, weight, eps = _check(x, weight, eps)
    _tk.check_choice(fmt, "fmt", ("e4m3", "e2m1"))
    flags = _tk.check_sf_flags(use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)
    num_tokens, hidden = x.shape
    G = _tk.check_int(num_per_channels, "num_per_channels", lo=1)
    if G not in (16, 32, 64, 128) and G != hidden:
        raise ValueError(f"num_per_channels must be 16, 32, 64, 128 or hidden ({hidden}), got {G}")
    if fmt == "e2m1" and hidden % 2:
        raise ValueError(f"fmt='e2m1' packs two values per byte: hidden must be even, got {hidden}")
    row = G not in (16, 32, 64, 128)
    from tegula.ops.quant import _out
    out, out_k = _out(num_tokens, hidden, fmt)
    sf_user, sf_k = _tk.alloc_sf(num_tokens, 1 if row else ceil_div(hidden, G), use_tma_aligned_col_major_sf,
                                 use_packed_ue8m0)
    if num_tokens > 0 and hidden > 0 and not row and fmt == "e4m3" and _pairs(x, weight):
        t = _tk.torch()
        k = _tk.kernel(rmsnorm_cast_pairs_kernel, G, 32 if num_tokens >= 32 * 8 * _tk.threads() else 4)
        k(x.view(t.uint32), weight.view(t.uint32), out_k.view(t.uint16), sf_k, eps, flags)
    elif num_tokens > 0 and hidden > 0:
        k = _tk.kernel(rmsnorm_cast_kernel, _DT[str(x.dtype)], _DT[str(weight.dtype)], fmt, 0 if row else G)
        k(x, weight, out_k, sf_k, eps, flags)
    return out, sf_user
