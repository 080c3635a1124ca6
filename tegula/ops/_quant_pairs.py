"""The T.* kernels behind ``tegula.ops.quant`` for bfloat16 inputs read as uint32 words of two elements
(tegula.ops._bf16_pairs): per_token_cast (e4m3, e2m1), per_block_cast and per_channel_cast (e4m3), mode 'cast'.
Same numerics and outputs as their element-wise forms in ``_quant_kernels`` (bit for bit: the tests compare
both); ``quant`` takes these where the words view exists (even columns and row stride, a 4-byte-aligned start).
A whole tile or band with neither NaN nor inf takes its amax as an integer max of bf16 bits and casts without
the NaN select; others the float amax (NaN ignored, T.max's maxNum) and the full cast."""
from __future__ import annotations

import math

import tegula.language as T
from tegula.ops import _bf16_pairs as P
from tegula.ops._quant_kernels import (
    CLAMP_MIN,
    FMT_MAX,
    PACKED_SF,
    ROUND_SF,
    e2m1_code,
    e2m1_sum,
    group_scales,
    scale_of,
    store_scales,
)


def staged_groups(G, W):
    """How many groups of a row per_token_pairs(..., RB > 0) stages (rows with more write their scales per tile,
    and packed UE8M0 scales then need W a multiple of 4 G)."""
    return max(64, 4 * (W // G))


AHEAD = 2048  # words: how far ahead of its cast a whole tile's loop prefetches X (the next tile's amax reads them);
# on an Intel Xeon with a 480 MB L3 (2 vCPUs, KVM), 74880 x 7168, 2 threads, alternated processes, each paired with
# a copy of the same 1 GiB: per_token e4m3 0.782-0.802 of the copy at 1024 words, 0.809-0.830 at 2048 (4096:
# 0.819-0.841), e2m1 0.656-0.666 -> 0.674-0.688, per_block within noise (0.69-0.72 at each). Later, same setup
# (3 rounds each): per_token 0.785-0.787 at 2048, 0.779-0.787 at 4096, 0.781-0.790 at 8192; without the prefetch
# 0.618-0.633 against 0.788-0.803; each tile's codes staged and streamed out (non-temporal) 0.785-0.806 against
# 0.794-0.813 stored in place (not kept); the prefetch into L1 (T0) 0.810-0.839 against 0.810-0.836. With the cast's
# arithmetic removed from the generated C (codes = the words' high halves) the kernel read 0.957-0.970 of the copy
# against 0.812-0.815 whole, 2 pairs: the arithmetic (~10 TSC cycles per 16 words from L1) overlaps memory only in part


def per_token_pairs(fmt, G, W=2048, RB=0):
    """per_token_cast (mode 'cast') of a bfloat16 input read as uint32 words of two elements (_bf16_pairs): X
    (num_tokens, x_words) with row stride ``x_stride`` words; Q (q_rows, q_words) one uint16 (two e4m3 codes) or
    one uint8 (two e2m1 codes) per word. The group amax and the cast read X where it lies, with no float32 tile.
    A whole tile takes the group amax as an integer max of bf16 bits (_pairs_top: 16 lanes per group, then one
    reduction each); if it holds no NaN nor inf, e4m3 casts without the NaN select (e4m3_pair_finite). Otherwise
    (and in a partial tile) the amax is T.reduce_absmax's, NaN ignored, and the cast the full one. e2m1 codes
    are staged as 32-bit words and narrowed in one loop over the tile: stored as bytes from each 16-word group
    loop, gcc vectorised at 128 bits (1.25-1.65x slower); tiles with neither NaN nor inf take _e2m1_pair_finite
    (signs from the word: 0.93, 0.97 of _e2m1_pair's time).
    RB 0: a block is one tile of one row. RB > 0 (for column-major scales): a block is RB whole rows, tile by
    tile, whose scales (rows of up to GMAX groups) are staged and written at the end, RB rows of a group side by
    side: written per tile, a row's scales are 14 words 75 KB apart (18688 x 7168 /128), which slowed the whole
    kernel 2x (X's loads stalling; the lines fall in 4 of the 64 L1 sets). Row-major scales keep RB 0: the
    row-block loop ran 1.08-1.09x slower there.
    1 thread CPU time, 18688 x 7168 bf16, against the float32-tile kernel (per_token_cast) alternated in one
    process, medians of 11: e4m3 /128 27.5 -> 22.2 ms (0.74 -> 0.60 cycles/value); column-major float32 scales
    54.2 -> 26.0; packed UE8M0 30.2 -> 24.0; e2m1 /32 40.4 -> 30.3 (1024 columns, quant._pairs_width).
    A whole tile's cast loop prefetches X AHEAD words on, NC groups (4 lines) a step (T.Pipelined: the copies
    into pf are dropped, their prefetches stay), so the next tiles' amax pass finds its lines in cache: on an Intel
    Xeon (2 cores, KVM) that pass stalled on X's loads for 41% of the e2m1 kernel's samples. 1 thread CPU time,
    18688 x 7168, HEAD vs this alternated over 4 process pairs: e2m1 /32 60.6-65.3 -> 45.6-50.1 ms, e4m3 /128
    51.1-62.4 -> 37.4-41.8 (one prefetch a group of 16 words and the finite test in the loop: 49.5; 2 or 3 tiles
    ahead equal within noise, into L1 instead of L2 ~5% faster in a C copy of the kernel). Groups of at most 16
    words (e2m1 /32) take their amax as one expression a group, which gcc vectorises across 16 groups by
    interleaving permutes (vpermt2d, 1 uop): a per-lane max reduced group by group spent 4 shuffles and a scalar
    store per group and stalled the vector load of the 32 maxima (store forwarding): 1 thread CPU time, a C copy of
    the kernel, 4 process pairs, 49.5-66.8 -> 44.9-61.5 ms (same output bytes).
    Measured and not kept (on a Zen 4): tiles of 3584 / 7168 columns (1.0x / 1.25x the 1792 ones), rows or tiles
    pipelined with the next one prefetched (1.04-1.14x slower: the hardware prefetcher already streams X), the
    next tile's scales computed before this tile's cast (1.2x slower at 1792 columns)."""
    NT, XW, XST = T.dynamic("num_tokens"), T.dynamic("x_words"), T.dynamic("x_stride")
    QR, QW = T.dynamic("q_rows"), T.dynamic("q_words")
    SR, SC, SSM, SSK = T.dynamic("sf_rows"), T.dynamic("sf_cols"), T.dynamic("sf_sm"), T.dynamic("sf_sk")
    GB, GH, WH = W // G, G // 2, W // 2
    L = min(GH, 16)  # lanes of a group's running max
    NC = math.gcd(GB, max(1, 64 // GH))  # groups a step of the cast loops takes (4 lines of X, one prefetch each)
    GMAX = staged_groups(G, W)  # RB > 0: the groups of a row a block stages (longer rows: written per tile)
    qdt = "uint16" if fmt == "e4m3" else "uint8"
    maxv, cmin = FMT_MAX[fmt], CLAMP_MIN[fmt]

    @T.macro
    def tile(X, Q, S, hidden, flags, r0, w0, g0, rr, word, eb, staged):
        """Tile w0 (words) of row r0: its scales written (or staged in word / eb row rr), its codes stored."""
        ngroups = T.ceildiv(hidden, G)
        rnd = (flags & ROUND_SF) != 0
        amax = T.alloc_fragment((1, GB), "float32")
        top = T.alloc_fragment((1,), "float32")
        finite = T.alloc_fragment((1,), "int32")  # a whole tile with neither NaN nor inf
        finite[0] = 0
        if w0 + (WH - 1) < XW:
            amb = T.alloc_fragment((1, GB), "uint32")
            topb = T.alloc_fragment((1,), "uint32")
            if GH <= 16:  # a group's words as one expression a lane: gcc transposes them by permutes
                for i, g in T.Parallel(1, GB):
                    amb[i, g] = _pairs_top(X, r0, w0 + g * GH, GH, 1)
            else:
                lm = T.alloc_fragment((1, GB, L), "uint32")
                for i, g, l in T.Parallel(1, GB, L):
                    lm[i, g, l] = _pairs_top(X, r0, w0 + g * GH + l, GH // L, L)
                T.reduce_max(lm, amb, dim=2)
            T.reduce_max(amb, topb, dim=1)
            if topb[0] < 0x7F800000:
                finite[0] = 1
                for i, g in T.Parallel(1, GB):
                    amax[i, g] = T.reinterpret(amb[i, g] & 0xFFFF0000, "float32")
        if finite[0] == 0:
            pm = T.alloc_fragment((1, GB, GH), "float32")  # per word: the larger |element|, NaN ignored
            for i, g, k in T.Parallel(1, GB, GH):
                pm[i, g, k] = P.abs_max(X[r0, w0 + g * GH + k], 0.0)
            T.reduce_max(pm, amax, dim=2)
            T.reduce_max(amax, top, dim=1)
        inv = T.alloc_fragment((1, GB), "float32")
        wd = T.alloc_fragment((1, GB), "int32")
        ed = T.alloc_fragment((1, GB), "int32")
        group_scales(amax, wd, inv, ed, maxv, cmin, rnd, 1, GB)
        if staged:
            for i, g in T.Parallel(1, GB):
                if g0 + g < GMAX:
                    word[rr, g0 + g] = wd[i, g]
                    eb[rr, g0 + g] = ed[i, g]
        else:
            store_scales(S, wd, ed, r0, g0, NT, ngroups, (flags & PACKED_SF) != 0, 1, GB)
        whole = r0 < QR and w0 + (WH - 1) < QW and w0 + (WH - 1) < XW
        pf = T.alloc_fragment((NC * GH,), "uint32")  # read by nobody: the copies into it go, their prefetches stay
        if fmt == "e2m1" and whole:  # (the form guard_global_access proves from: no per-element guards)
            cw = T.alloc_fragment((1, GB, GH), "uint32")
            if finite[0] == 1:
                for c in T.Pipelined(GB // NC, num_stages=2):
                    T.copy(X[r0, w0 + AHEAD + c * (NC * GH)], pf)
                    for i, g, k in T.Parallel(1, NC, GH):
                        cw[i, c * NC + g, k] = _e2m1_pair_finite(X[r0, w0 + (c * NC + g) * GH + k],
                                                                 inv[i, c * NC + g])
            else:
                for c in T.Pipelined(GB // NC, num_stages=2):
                    T.copy(X[r0, w0 + AHEAD + c * (NC * GH)], pf)
                    for i, g, k in T.Parallel(1, NC, GH):
                        cw[i, c * NC + g, k] = _e2m1_pair(X[r0, w0 + (c * NC + g) * GH + k], inv[i, c * NC + g])
            cf = T.reshape(cw, (WH,))
            for j in T.Parallel(WH):
                Q[r0, w0 + j] = T.cast(cf[j], "uint8")
        elif fmt == "e2m1":
            for i, g, k in T.Parallel(1, GB, GH):
                Q[r0, w0 + g * GH + k] = T.cast(_e2m1_pair(X[r0, w0 + g * GH + k], inv[i, g]), "uint8")
        elif finite[0] == 1 and whole:
            for c in T.Pipelined(GB // NC, num_stages=2):
                T.copy(X[r0, w0 + AHEAD + c * (NC * GH)], pf)
                for i, g, k in T.Parallel(1, NC, GH):
                    Q[r0, w0 + (c * NC + g) * GH + k] = P.e4m3_pair_finite(X[r0, w0 + (c * NC + g) * GH + k],
                                                                           inv[i, c * NC + g])
        elif (flags & ROUND_SF) == 0 or top[0] < T.infinity("float32"):  # |x * inv| <= 448 (1 + 2^-22) or NaN
            for i, g, k in T.Parallel(1, GB, GH):
                x = X[r0, w0 + g * GH + k]
                Q[r0, w0 + g * GH + k] = P.e4m3_pair(P.even(x) * inv[i, g], P.odd(x) * inv[i, g])
        else:  # round_sf meeting amax = inf (inv = -inf): the saturating cast
            for i, g, k in T.Parallel(1, GB, GH):
                x = X[r0, w0 + g * GH + k]
                lo = T.reinterpret(T.cast(P.even(x) * inv[i, g], "float8_e4m3fn"), "uint8")
                hi = T.reinterpret(T.cast(P.odd(x) * inv[i, g], "float8_e4m3fn"), "uint8")
                Q[r0, w0 + g * GH + k] = T.cast(lo, "uint16") | (T.cast(hi, "uint16") << 8)

    @T.prim_func
    def per_token_pairs(X: T.StridedTensor((NT, XW), (XST, 1), "uint32"), Q: T.Tensor((QR, QW), qdt),
                        S: T.StridedTensor((SR, SC), (SSM, SSK), "int32"), hidden: T.int32, flags: T.int32):
        if RB == 0:
            with T.Kernel(T.ceildiv(hidden, W), NT) as (bx, by):
                tile(X, Q, S, hidden, flags, by, bx * WH, bx * GB, 0, None, None, False)
        else:
            with T.Kernel(T.ceildiv(NT, RB)) as by:
                staged = T.ceildiv(hidden, G) <= GMAX
                word = T.alloc_fragment((RB, GMAX), "int32")
                eb = T.alloc_fragment((RB, GMAX), "int32")
                for rr in T.serial(RB):
                    for bx in T.serial(T.ceildiv(hidden, W)):
                        if by * RB + rr < NT:
                            tile(X, Q, S, hidden, flags, by * RB + rr, bx * WH, bx * GB, rr, word, eb, staged)
                if staged:  # RB rows of a group side by side in column-major layouts
                    store_scales(S, word, eb, by * RB, 0, NT, T.ceildiv(hidden, G), (flags & PACKED_SF) != 0, RB,
                                 GMAX)
    return per_token_pairs


@T.macro
def _e2m1_pair_finite(w, inv):
    """_e2m1_pair for inv > 0 (products keep w's signs): odd's code shifted into bits 4..6 as (so << 4) + (so >>
    18) (no carry out of the low 4 bits), the signs w's bits 15 and 31 moved to 3 and 7. Measured and not kept:
    the sums without e2m1_sum's clamp to 6 (a tile's own scale keeps every |x * inv| below 7, where the clamp
    changes no code), 2 of ~27 ops per 16 words: 1 thread, 256 / 74880 x 7168, 12.6-13.6 / 9.3-9.5 GB/s both ways."""
    se = e2m1_sum(P.even(w) * inv)
    so = e2m1_sum(P.odd_abs(w) * inv, True)
    return ((se + (se >> 22)) & 7) | (((so << 4) + (so >> 18)) & 0x70) | ((w >> 12) & 8) | ((w >> 24) & 0x80)


@T.macro
def _e2m1_pair(w, inv):
    """The byte of two e2m1 codes (even's in the low nibble) of word ``w``'s elements times ``inv``."""
    return T.cast(e2m1_code(P.even(w) * inv) | (e2m1_code(P.odd(w) * inv) << 4), "uint32")


def _pairs_top(X, r, w, n, step):
    """The integer max of P.abs_top over the words X[r, w], X[r, w + step], ... (n of them), as one expression."""
    m = P.abs_top(X[r, w])
    for c in range(1, n):
        m = T.max(m, P.abs_top(X[r, w + c * step]))
    return m


def per_block_pairs(bt, bc, HP):
    """per_block_cast (mode 'cast', e4m3) of a bfloat16 input read as uint32 words of two elements (_bf16_pairs): X
    (num_tokens, x_words) contiguous, Q (num_tokens, x_words) uint16, two codes a word; HP columns compiled in. A
    whole band (bt rows, HP <= x_cols) takes the column amax as an integer max of bf16 bits, a word's two columns
    together (both lie in one group: bc is even), one row a pass; with neither NaN nor inf in it, the cast without
    the NaN select (e4m3_pair_finite). Otherwise the float amax (NaN ignored) and the full cast, reads and writes
    past the tensor guarded. 1 thread CPU time, 18688 x 7168, 128 x 128 blocks, against per_block_cast alternated,
    medians of 11: 34.3 -> 32.8 and 32.4 -> 31.2 ms (0.956, 0.958; later 0.964): the cast gains as per_token's, the
    column-max pass (half the samples) is a read from memory either way. That pass alone reads at 19.5 GB/s with 4
    rows a pass (4 streams), 23.7 GB/s with one (torch's int32 max of the same tensor: 26.8): one row a pass took
    the kernel from 30.2 to 27.0 ms (0.894). Measured and not kept: the next band's rows prefetched during the
    cast (a pipelined band loop, 4 or 8 bands a block) 0.97-0.98; the band in column slabs of 512 / 1024 / 3584
    columns (the cast reading the slab from L2), each slab's cast prefetching the next slab, 1.04-1.10 (without
    the prefetch 1.08-1.15); the cast interleaved row by row with the next band's column max 1.08-1.09; one
    prefetch per 1 / 4 / 16 / 32 lines of the next band's row during the cast 1.045 / 1.006 / 0.994 / 0.994;
    the column-max pass prefetching its next 4 rows 0.98-1.01; the codes staged and streamed out 1.09 (1 thread
    process CPU time, 4 rows a pass, against the kernel then). On an Intel Xeon (2 cores, KVM) both passes over a
    whole band prefetch X AHEAD words on, NC groups (4 lines) a step, as per_token_pairs' cast does (the copies into
    pf are dropped, their prefetches stay): 1 thread process CPU time, 0.25 GiB, 7 process pairs alternated (the
    other core busy) 49.0-65.9 ms, median 57.1, against 52.1-69.0, median 64.1. On that Xeon (2 MB L2) column slabs
    (each slab's column max, scales and cast in turn, the cast reading the slab from L2) were slower too: 37376 x
    7168, alternated in one process, slabs of 1024 / 512 / 3584 columns 1.03 / 1.44 / 1.13 (1 thread CPU time),
    1.05 / 1.44 / 1.15 (2 threads wall) of the whole band's time; each row's codes staged and streamed out (so that
    the band might stay in L2 for the cast's re-read) 1.03 / 1.02-1.03; the cast prefetching a whole row (3584
    words) ahead instead of AHEAD, 74880 x 7168, 2 threads, 4 alternating process pairs: 17.3-18.8 GB/s both ways."""
    NT, XW = T.dynamic("num_tokens"), T.dynamic("x_words")
    SR, SC, SSM, SSK = T.dynamic("sf_rows"), T.dynamic("sf_cols"), T.dynamic("sf_sm"), T.dynamic("sf_sk")
    GB, GH, HW = HP // bc, bc // 2, HP // 2
    NC = math.gcd(GB, max(1, 64 // GH))  # groups a step of the column-max pass takes (one prefetch a line)

    @T.prim_func
    def per_block_pairs(X: T.Tensor((NT, XW), "uint32"), Q: T.Tensor((NT, XW), "uint16"),
                        S: T.StridedTensor((SR, SC), (SSM, SSK), "int32"), hidden: T.int32, flags: T.int32):
        with T.Kernel(T.ceildiv(NT, bt)) as by:
            r0 = by * bt
            ngroups = T.ceildiv(hidden, bc)
            rnd = (flags & ROUND_SF) != 0
            packed = (flags & PACKED_SF) != 0
            amax = T.alloc_fragment((1, GB), "float32")
            top = T.alloc_fragment((1,), "float32")
            finite = T.alloc_fragment((1,), "int32")  # a whole band with neither NaN nor inf
            finite[0] = 0
            pf = T.alloc_fragment((NC * GH,), "uint32")  # read by nobody: the copies go, their prefetches stay
            if r0 + (bt - 1) < NT and HW - 1 < XW:
                cw = T.alloc_fragment((GB, GH), "uint32")
                T.fill(cw, 0)
                for r in T.serial(bt):  # one row a pass: one stream from memory (4 rows a pass: 1.09x the time)
                    for c in T.Pipelined(GB // NC, num_stages=2):
                        T.copy(X[r0 + r, AHEAD + c * (NC * GH)], pf)
                        for g, k in T.Parallel(NC, GH):
                            cw[c * NC + g, k] = T.max(cw[c * NC + g, k], P.abs_top(X[r0 + r, (c * NC + g) * GH + k]))
                amb = T.alloc_fragment((GB,), "uint32")
                topb = T.alloc_fragment((1,), "uint32")
                T.reduce_max(cw, amb, dim=1)
                T.reduce_max(T.reshape(amb, (1, GB)), topb, dim=1)
                if topb[0] < 0x7F800000:
                    finite[0] = 1
                    for i, g in T.Parallel(1, GB):
                        amax[i, g] = T.reinterpret(amb[g] & 0xFFFF0000, "float32")
            if finite[0] == 0:
                cf = T.alloc_fragment((GB, GH), "float32")
                T.fill(cf, 0.0)
                for r in T.serial(bt):
                    for g, k in T.Parallel(GB, GH):
                        cf[g, k] = P.abs_max(X[r0 + r, g * GH + k], cf[g, k])
                T.reduce_max(T.reshape(cf, (1, GB, GH)), amax, dim=2)
                T.reduce_max(amax, top, dim=1)
            inv = T.alloc_fragment((1, GB), "float32")
            word = T.alloc_fragment((1, GB), "int32")
            eb = T.alloc_fragment((1, GB), "int32")
            for i, g in T.Parallel(1, GB):
                w_, v_, e_ = scale_of(amax[i, g], 448.0, 1e-4, rnd)
                word[i, g] = w_
                inv[i, g] = v_
                eb[i, g] = e_
            store_scales(S, word, eb, by, 0, T.ceildiv(NT, bt), ngroups, packed, 1, GB)
            if finite[0] == 1 and r0 + (bt - 1) < NT and HW - 1 < XW:
                for r in T.serial(bt):
                    for c in T.Pipelined(GB // NC, num_stages=2):
                        T.copy(X[r0 + r, AHEAD + c * (NC * GH)], pf)
                        for g, k in T.Parallel(NC, GH):
                            Q[r0 + r, (c * NC + g) * GH + k] = P.e4m3_pair_finite(X[r0 + r, (c * NC + g) * GH + k],
                                                                                  inv[0, c * NC + g])
            elif (flags & ROUND_SF) == 0 or top[0] < T.infinity("float32"):  # |x * inv| <= 448 (1 + 2^-22) or NaN
                for r in T.serial(bt):
                    for g, k in T.Parallel(GB, GH):
                        x = X[r0 + r, g * GH + k]
                        Q[r0 + r, g * GH + k] = P.e4m3_pair(P.even(x) * inv[0, g], P.odd(x) * inv[0, g])
            else:  # round_sf meeting amax = inf (inv = -inf): the saturating cast
                for r in T.serial(bt):
                    for g, k in T.Parallel(GB, GH):
                        x = X[r0 + r, g * GH + k]
                        lo = T.reinterpret(T.cast(P.even(x) * inv[0, g], "float8_e4m3fn"), "uint8")
                        hi = T.reinterpret(T.cast(P.odd(x) * inv[0, g], "float8_e4m3fn"), "uint8")
                        Q[r0 + r, g * GH + k] = T.cast(lo, "uint16") | (T.cast(hi, "uint16") << 8)
    return per_block_pairs


def per_channel_pairs(HP, bt=128):
    """per_channel_cast of a bfloat16 input read as uint32 words of two elements (_bf16_pairs): X (num_tokens,
    x_words) contiguous with num_tokens a multiple of bt and x_words = HP / 2 (whole bands only: the caller takes
    per_channel_cast otherwise); Q (num_tokens, x_words) uint16, two codes a word. Each word's two columns keep
    their own amax (integer maxima of their bf16 bits, 4 rows a pass) and scale; a band with neither NaN nor inf
    casts through e4m3_pair_finite2, others take the float amax (NaN ignored) and the full cast. 1 thread CPU
    time, 18688 x 7168, against per_channel_cast alternated, medians of 11-15 in seven runs: new/old 0.941-1.004,
    median 0.965 (34.0 -> 32.9 ms); the column-max pass reads from memory either way. Measured and not kept (1
    thread process CPU time, alternated with this kernel): the column max one row a pass (me and mo loaded and
    stored each row) 1.215, 2 / 8 / 16 rows 1.08 / 1.01 / 0.99; in the 16-bit lanes of a uint16 view of X, one
    row a pass 1.04-1.055, 2 / 4 rows 1.04 / 1.03, one row a pass over 128-column groups 0.973. On the Intel Xeon,
    37376 x 7168, alternated: both passes in 64-word steps prefetching X AHEAD words on (as per_block_pairs) 0.95-
    1.05 (1 thread CPU), 0.97-0.98 (2 threads), the column-max pass alone 1.00: within the noise, not kept. On an
    Intel Xeon with 2 MB L2 and a 480 MB L3, 74880 x 7168, 2 threads, alternated in one process (not kept): the cast
    pass walking the band's rows backwards (those the column max read last first) 1.04x the time (per_block: 1.14x);
    each row's codes staged and streamed out 0.99x; the cast pass prefetching the next row 0.976x, or the next
    band's same row in 64-word steps (so that the next column max reads from cache) 1.07x (1.13x, 1 thread); slabs of
    512 / 896 / 1792 words, each slab's column max interleaved row by row with the previous slab's cast, 0.93-1.09x
    (37376 x 7168, 1 thread); the band as 2 / 4 / 7 column slabs, blocks of their own (each cast reading its slab
    from L2), 1.02 / 0.97 / 0.96x. perf: 64% of the samples in the cast pass, 26% on its loads of X. Later on that
    machine (74880 x 7168, 2 threads, alternating processes): the cast pass prefetching the next row in 64-word steps
    17.5-18.1 GB/s with and without (a C model of the kernel had gained 15%); in that model the column-max pass took
    41 ms a thread and the cast 57, which re-reading a just-read band (1.75 MiB and its codes: past the 2 MiB L2)
    stretched from 79 ms to 114 at 1 thread; the next band's column max interleaved row by row with the cast +5-8%
    there, below the prefetching form."""
    NT, SR = T.dynamic("num_tokens"), T.dynamic("sf_rows")
    HW = HP // 2

    @T.prim_func
    def per_channel_pairs(X: T.Tensor((NT, HW), "uint32"), Q: T.Tensor((NT, HW), "uint16"),
                          S: T.Tensor((SR, HP), "int32"), flags: T.int32):
        with T.Kernel(T.ceildiv(NT, bt)) as by:
            r0 = by * bt
            rnd = (flags & ROUND_SF) != 0
            if r0 + (bt - 1) < NT:  # (always: whole bands; the form that lets the element accesses go unguarded)
                me = T.alloc_fragment((HW,), "uint32")  # |even column| and |odd column| as bf16 bits in the high half
                mo = T.alloc_fragment((HW,), "uint32")
                ae = T.alloc_fragment((HW,), "float32")
                ao = T.alloc_fragment((HW,), "float32")
                T.fill(me, 0)
                T.fill(mo, 0)
                for r in T.serial(bt // 4):
                    for j in T.Parallel(HW):
                        me[j] = T.max(me[j], _pairs_col(X, r0 + r * 4, j, 4, 16))
                        mo[j] = T.max(mo[j], _pairs_col(X, r0 + r * 4, j, 4, 0))
                topb = T.alloc_fragment((1,), "uint32")
                T.reduce_max(T.reshape(me, (1, HW)), topb, dim=1)
                T.reduce_max(T.reshape(mo, (1, HW)), topb, dim=1, clear=False)
                finite = topb[0] < 0x7F800000
                if finite:
                    for j in T.Parallel(HW):
                        ae[j] = T.reinterpret(me[j], "float32")
                        ao[j] = T.reinterpret(mo[j], "float32")
                else:
                    T.fill(ae, 0.0)
                    T.fill(ao, 0.0)
                    for r in T.serial(bt):
                        for j in T.Parallel(HW):
                            a = T.abs(P.even(X[r0 + r, j]))  # a > m ? a : m: max ignoring NaN
                            ae[j] = T.if_then_else(a > ae[j], a, ae[j])
                            b = T.abs(P.odd(X[r0 + r, j]))
                            ao[j] = T.if_then_else(b > ao[j], b, ao[j])
                ie = T.alloc_fragment((HW,), "float32")
                io = T.alloc_fragment((HW,), "float32")
                for j in T.Parallel(HW):
                    w_, v_, e_ = scale_of(ae[j], 448.0, 1e-4, rnd)
                    ie[j] = v_
                    S[by, j * 2] = w_
                    w2, v2, e2 = scale_of(ao[j], 448.0, 1e-4, rnd)
                    io[j] = v2
                    S[by, j * 2 + 1] = w2
                top = T.alloc_fragment((1,), "float32")
                T.reduce_max(T.reshape(ae, (1, HW)), top, dim=1)
                T.reduce_max(T.reshape(ao, (1, HW)), top, dim=1, clear=False)
                if finite:
                    for r in T.serial(bt):
                        for j in T.Parallel(HW):
                            Q[r0 + r, j] = P.e4m3_pair_finite2(X[r0 + r, j], ie[j], io[j])
                elif (flags & ROUND_SF) == 0 or top[0] < T.infinity("float32"):  # |x * inv| <= 448 (1 + 2^-22) or NaN
                    for r in T.serial(bt):
                        for j in T.Parallel(HW):
                            x = X[r0 + r, j]
                            Q[r0 + r, j] = P.e4m3_pair(P.even(x) * ie[j], P.odd(x) * io[j])
                else:  # round_sf meeting amax = inf (inv = -inf): the saturating cast
                    for r in T.serial(bt):
                        for j in T.Parallel(HW):
                            x = X[r0 + r, j]
                            lo = T.reinterpret(T.cast(P.even(x) * ie[j], "float8_e4m3fn"), "uint8")
                            hi = T.reinterpret(T.cast(P.odd(x) * io[j], "float8_e4m3fn"), "uint8")
                            Q[r0 + r, j] = T.cast(lo, "uint16") | (T.cast(hi, "uint16") << 8)
    return per_channel_pairs


def _pairs_col(X, r, j, n, shift):
    """The integer max of one column's |bf16| bits (even: ``shift`` 16, odd: 0) in the high half of a uint32, over
    the rows r .. r + n - 1 of word column j, as one expression."""
    m = (X[r, j] << shift) & 0x7FFF0000
    for u in range(1, n):
        m = T.max(m, (X[r + u, j] << shift) & 0x7FFF0000)
    return m
