"""The T.* kernels behind ``tegula.ops.moe``: top-k gating, DeepSeek's group-limited routing, weight
normalisation, and the token <-> per-expert contiguous layout (mapping, expand, reduce)."""
from __future__ import annotations

import struct

import tegula.language as T
from tegula.ops._tk_math import exp_f32, fma_f32

NEG_INF = float("-inf")
KEY_MIN = -(2**63)
SIGMOID, SQRTSOFTPLUS, SOFTMAX = 0, 1, 2


ORDER_NEG_INF = -2139095041  # order_key's value part for -inf (NaNs with the sign bit set order below it)


@T.macro
def order_key(x, j, E):
    """A distinct int64 key for expert j of value x: x's bits made order-preserving (-0.0 as 0.0) above (E - 1 - j),
    so keys order as the values do, ties to the lower index."""
    bits = T.reinterpret(T.if_then_else(x == 0.0, 0.0, x), "int32")
    order = T.if_then_else(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return _join_key(order, E - 1 - j)


@T.macro
def _join_key(hi, lo):
    """The int64 hi * 2^32 + lo of int32 hi and lo >= 0, by a shift through uint64 (gcc vectorised the product by
    2^32 as a 64-bit multiply, vpmullq: 3 uops)."""
    return T.reinterpret(T.cast(T.cast(hi, "uint32"), "uint64") << 32, "int64") + T.cast(lo, "int64")


@T.macro
def select_keys(key, out_idx, best, BM, N, E, K):
    """out_idx[i, k] = the expert of the k-th largest of key[i, :N] (order_key's keys), for k < K; best[i] ends as
    the K-th key. One masked max per k finds the next entry: the largest key below the previous one. (The loops
    run along the experts; each pass waits on the previous one, so a few rows a block overlap their chains.)"""
    masked = T.alloc_fragment((BM, N), "int64")
    T.reduce_max(key, best, dim=1)
    for k in T.serial(K):
        if k > 0:
            for i, j in T.Parallel(BM, N):
                masked[i, j] = T.if_then_else(key[i, j] < best[i], key[i, j], KEY_MIN)
            T.reduce_max(masked, best, dim=1)
        for i in T.Parallel(BM):
            out_idx[i, k] = E - 1 - T.cast(best[i] & 4294967295, "int32")


@T.macro
def select_topk(v, out_idx, BM, E, K):
    """out_idx[i, k] = the k-th largest of v[i, :] (ties: the lower index; -0.0 equals 0.0), for k < K."""
    key = T.alloc_fragment((BM, E), "int64")
    best = T.alloc_fragment((BM,), "int64")
    for i, j in T.Parallel(BM, E):
        key[i, j] = order_key(v[i, j], j, E)
    select_keys(key, out_idx, best, BM, E, E, K)


def topk_gate(E, K, BM=2):
    """S (num_tokens, E) float32 -> I (num_tokens, K) int64: the K largest per row, descending, ties to the lower
    index. (Two rows a block overlap their selection chains.)"""
    NT = T.dynamic("num_tokens")

    @T.prim_func
    def topk_gate(S: T.Tensor((NT, E), "float32"), I: T.Tensor((NT, K), "int64")):
        with T.Kernel(T.ceildiv(NT, BM)) as by:
            v = T.alloc_fragment((BM, E), "float32")
            idx = T.alloc_fragment((BM, K), "int32")
            T.copy(S[by * BM, 0], v)
            select_topk(v, idx, BM, E, K)
            T.copy(idx, I[by * BM, 0])
    return topk_gate


def _grid(n, serial):
    """(grid, blocks per grid block) of a kernel over n blocks: n x 1, or with ``serial`` 1 x n (one block walks
    them all in turn: no OpenMP region, whose wake-up of sleeping threads costs tens to hundreds of microseconds
    on small inputs). The block's number is then grid index + walk index."""
    return (1, n) if serial else (n, 1)


def _ordered_sum(W, r, K):
    """1e-20 + W[r, 0] + ... + W[r, K - 1], added left to right: one expression (the loop over K unrolled here)."""
    s = W[r, 0] + 1e-20
    for k in range(1, K):
        s = s + W[r, k]
    return s


_SAFE_LO, _SAFE_HI = 2.0 ** -40, 2.0 ** 40   # normalize_weight's range for a division by its reciprocal
_SAFE_LO_BITS, _SAFE_HI_BITS = (struct.unpack("<I", struct.pack("<f", v))[0] for v in (_SAFE_LO, _SAFE_HI))


def _weights_in_range(W, r, K):
    """Whether every |W[r, k]| (k < K) is at most _SAFE_HI and every nonzero one at least _SAFE_LO: an integer
    max / min of the magnitudes' bits (NaN and inf bits lie above _SAFE_HI's; a zero's bits minus 1 wrap past
    every other's, so the min skips it). One expression (the loop over K unrolled here)."""
    hi = T.reinterpret(W[r, 0], "uint32") & 0x7FFFFFFF
    lo = hi - 1
    for k in range(1, K):
        m = T.reinterpret(W[r, k], "uint32") & 0x7FFFFFFF
        hi = T.max(hi, m)
        lo = T.min(lo, m - 1)
    return (hi <= _SAFE_HI_BITS) & (lo >= _SAFE_LO_BITS - 1)


def normalize_weight(K, BM=256, serial=False):
    """W (num_tokens, K) -> D (num_tokens,) = 1e-20 + W[:, 0] + W[:, 1] + ... (in that order), N = W / D.
    Read and written in place (no staging tiles). A block of BM whole rows sums across rows (lane i: row i, the K
    adds in order), so the adds are vector adds, not a scalar chain per row. ``serial``: one block walks every row
    block in turn (a grid of one: no other thread woken, for inputs too small to pay for that)."""
    NT = T.dynamic("num_tokens")

    @T.macro
    def rows(W, D, N, by):
        r0 = by * BM
        d = T.alloc_fragment((BM,), "float32")
        if r0 + (BM - 1) < NT:  # whole blocks: no row tests
            # w / d correctly rounded without a division per value (vdivps: 5 cycles per 8 on an Intel Xeon, 3/4
            # of the kernel's time): y = RN(1 / d) once a row, q = RN(w y), the remainder w - q d exact by an
            # fma, and RN(q + remainder * y) is RN(w / d) (Markstein's theorem) where nothing under- or
            # overflows: every |d| and nonzero |w| of the block in [2^-40, 2^40], else the block divides (so
            # also where d is not finite, as it is not where a w is not). A zero w keeps q (its signed zero).
            # 16384 x 8, one thread, alternated in one process: 43-44 -> 35-37 us
            y = T.alloc_fragment((BM,), "float32")
            bad = T.alloc_fragment((BM,), "int32")
            worst = T.alloc_fragment((1,), "int32")
            for ib, l in T.Parallel(BM // 16, 16):  # 16 rows a vector (a (BM,) loop would fuse with the next)
                dv = _ordered_sum(W, r0 + ib * 16 + l, K)
                d[ib * 16 + l] = dv
                y[ib * 16 + l] = 1.0 / dv
                ad = T.abs(dv)
                ok = (ad >= _SAFE_LO) & (ad <= _SAFE_HI) & _weights_in_range(W, r0 + ib * 16 + l, K)
                bad[ib * 16 + l] = T.if_then_else(ok, 0, 1)
            T.reduce_max(bad, worst, dim=0)
            if worst[0] == 0:
                for i, k in T.Parallel(BM, K):
                    w = W[r0 + i, k]
                    q = w * y[i]
                    q1 = T.fma(T.fma(-q, d[i], w), y[i], q)   # (a variable: inside the select it went scalar)
                    N[r0 + i, k] = T.if_then_else(w == 0.0, q, q1)
            else:
                for i, k in T.Parallel(BM, K):
                    N[r0 + i, k] = W[r0 + i, k] / d[i]
        else:
            for ib, l in T.Parallel(BM // 16, 16):
                d[ib * 16 + l] = _ordered_sum(W, r0 + ib * 16 + l, K)
            for i, k in T.Parallel(BM, K):
                N[r0 + i, k] = W[r0 + i, k] / d[i]
        T.copy(d, D[r0])

    grid, walk = _grid(T.ceildiv(NT, BM), serial)

    @T.prim_func
    def normalize_weight(W: T.Tensor((NT, K), "float32"), D: T.Tensor((NT,), "float32"),
                         N: T.Tensor((NT, K), "float32")):
        with T.Kernel(grid) as b0:
            for w in T.serial(walk):
                rows(W, D, N, b0 + w)
    return normalize_weight


@T.macro
def log1p_f32(u):
    """log(1 + u), accurate for small u (Goldberg: log(w) * u / (w - 1) with w = 1 + u)."""
    w = 1.0 + u
    return T.if_then_else(w == 1.0, u, T.log(w) * (u / (w - 1.0)))


def top2_sum_gate(E, K, NG, NTG, scoring, n_shared, mask_on, fix_on, unmapped_on, phys_on, BM=8):
    """DeepSeek's group-limited routing (TileKernels' top2_sum_gate); see tegula.ops.moe.top2_sum_gate. RL maps
    each global (physical) expert to its number on this rank, or -1 (tegula.ops.moe._rank_local). BM = 8 rows a
    block: the k masked maxima of a row are a chain each pass waits on, and a few rows side by side overlap them
    (against 4 rows, in one process alternated: 16384 tokens 2.56-2.63 vs 2.62-2.68 ms, 2048 0.365 vs 0.387, 256
    and 16 the same).
    Measured on an Intel Xeon (2 vCPUs, KVM), 16384 x 256, 8 groups / 4 kept, top-8, 2 threads, alternated processes:
    - sigmoid and sqrt-softplus scoring prefetch the next block's rows while scoring this block's (the dead-copy
      idiom of T.Pipelined; a block starts on a new 4 KB page, where the hardware prefetcher starts cold): called
      after torch eager's routing (which evicts the logits) 4.03-4.20 -> 3.61-3.66 ms; back to back 2.95 either way.
    - where 2 NTG >= K the K passes run over a short candidate list (narrowed): 2.95-3.01 -> 2.81-2.85 ms back to
      back (CAP 24 instead of 32: the same).
    - the groups' ranks counted with the groups as lanes (was: a (BM, NG, NG) tile summed across lanes, 32
      horizontal reductions a block): 2.80-2.89 -> 2.68-2.70 ms.
    Measured and not kept: prefetching two blocks ahead (3.68-3.70 after eager); the list's threshold from each kept
    group's ceil(K / NTG)-th best key (masked maxima of its int64 keys) 3.01 vs 3.05 ms, its reductions costing what
    the shorter select saved; sigmoid's division by FMAs (a guess from the bits, three Newton steps and Markstein's
    correction, RN(1 / d) for every float32 d in [1, 2^116], checked in C) where the block's logits are >= -80:
    3.31-3.34 vs 2.97-2.99 ms, the division is not what bounds that loop."""
    NT, NL, ND, UST = T.dynamic("num_tokens"), T.dynamic("num_logical"), T.dynamic("num_dup"), T.dynamic("u_stride")
    NM, NF, NR = T.dynamic("mask_len"), T.dynamic("fix_len"), T.dynamic("num_global_experts")
    KP = K + n_shared
    grouped = NG != NTG
    EPG = E // NG if grouped else E
    NK = NTG * EPG  # the kept groups' experts
    CAP = max(32, -(-4 * K // 8) * 8)  # candidates a row the narrowed select takes (whole vectors of 8 keys)
    NARROW = grouped and 2 * NTG >= K and CAP < NK

    @T.macro
    def narrowed(kf, sec, rank, sel, kth):
        """select_keys over the kept groups' keys kf (BM, NK) through a shorter list: the keys at or above the
        smallest second best of the kept groups (each group holds two values at or above its second best, so
        usually 2 NTG >= K keys pass), appended row by row (compressing stores: order bits and index as two int32
        lists). Where every row of the block has K to CAP of them, the K best of all are the K best of those,
        which the K passes find among CAP keys instead of NK; else the block selects over all NK."""
        secm = T.alloc_fragment((BM, NG), "float32")
        thv = T.alloc_fragment((BM,), "float32")
        for i, g in T.Parallel(BM, NG):
            secm[i, g] = T.if_then_else(rank[i, g] < NTG, sec[i, g], T.infinity("float32"))
        T.reduce_min(secm, thv, dim=1)
        hi = T.alloc_fragment((NK,), "int32")
        lo = T.alloc_fragment((NK,), "int32")
        cand = T.alloc_fragment((BM, CAP), "int64")
        fits = T.alloc_var("int32", 1)
        for i in T.serial(BM):
            thr = order_key(thv[i], E - 1, E)  # the smallest key of a value >= thv[i]
            n = T.cast(0, "int32")
            for j in T.serial(NK):
                if kf[i, j] >= thr:
                    hi[n] = T.cast(kf[i, j] >> 32, "int32")
                    lo[n] = T.cast(kf[i, j] & 4294967295, "int32")
                    n = n + 1
            if n < K or n > CAP:
                fits = 0
            for c in T.Parallel(CAP):
                cand[i, c] = T.if_then_else(c < n, _join_key(hi[c], lo[c]), KEY_MIN)  # (c < CAP < NK)
        if fits != 0:
            select_keys(cand, sel, kth, BM, CAP, E, K)
        else:
            select_keys(kf, sel, kth, BM, NK, E, K)

    @T.prim_func
    def top2_sum_gate(L: T.Tensor((NT, E), "float32"), B: T.Tensor((E,), "float32"), M: T.Tensor((NM,), "int8"),
                      F: T.Tensor((NF,), "int8"), PM: T.Tensor((NL, ND), "int32"), LC: T.Tensor((NL,), "int32"),
                      I: T.Tensor((NT, KP), "int64"), U: T.StridedTensor((NT, K), (UST, 1), "int64"),
                      Wo: T.Tensor((NT, KP), "float32"), RL: T.Tensor((NR,), "int32"), scale: T.float32,
                      ep_rank: T.int32):
        with T.Kernel(T.ceildiv(NT, BM)) as by:
            r0 = by * BM
            s = T.alloc_fragment((BM, E), "float32")
            b = T.alloc_fragment((BM, E), "float32")
            if scoring == SOFTMAX:
                lg = T.alloc_fragment((BM, E), "float32")
                mx = T.alloc_fragment((BM,), "float32")
                sm = T.alloc_fragment((BM,), "float32")
                T.copy(L[r0, 0], lg)
                T.reduce_max(lg, mx, dim=1)
                for i, j in T.Parallel(BM, E):
                    s[i, j] = exp_f32(lg[i, j] - mx[i])
                T.reduce_sum(s, sm, dim=1)
                for i, j in T.Parallel(BM, E):
                    s[i, j] = s[i, j] / sm[i]
                    b[i, j] = lg[i, j] + B[j]
            else:  # the logits and bias read where they lie (rows past NT read the last one and are not stored)
                pf = T.alloc_fragment((E,), "float32")  # read by nobody: the copies go, their prefetches stay
                for i in T.Pipelined(BM, num_stages=2):
                    T.copy(L[T.min(r0 + BM - 1 + i, NT - 1), 0], pf)  # (prefetched: the next block's row i)
                    for j in T.Parallel(E):
                        x = L[T.min(r0 + i, NT - 1), j]
                        if scoring == SIGMOID:
                            s[i, j] = 1.0 / (1.0 + exp_f32(-x))
                        else:
                            s[i, j] = T.sqrt(T.if_then_else(x > 20.0, x, log1p_f32(exp_f32(x))))
                        b[i, j] = s[i, j] + B[j]
            if grouped:  # keep the NTG groups with the largest sum of their top two (ties: the lower group)
                bg = T.reshape(b, (BM, NG, EPG))
                t1 = T.alloc_fragment((BM, NG), "float32")
                t2 = T.alloc_fragment((BM, NG), "float32")
                tops = T.alloc_fragment((BM, NG), "int32")
                c1 = T.alloc_fragment((BM, NG, EPG), "int32")
                rest = T.alloc_fragment((BM, NG, EPG), "float32")
                T.reduce_max(bg, t1, dim=2)  # (NaN never wins: the max of the others, -inf if none)
                for i, g, j in T.Parallel(BM, NG, EPG):  # the second best: the best again if it is there twice
                    c1[i, g, j] = T.cast(bg[i, g, j] == t1[i, g], "int32")
                    rest[i, g, j] = T.if_then_else(bg[i, g, j] < t1[i, g], bg[i, g, j], NEG_INF)
                T.reduce_sum(c1, tops, dim=2)
                T.reduce_max(rest, t2, dim=2)
                sec = T.alloc_fragment((BM, NG), "float32")  # each group's second best (never NaN)
                for i, g in T.Parallel(BM, NG):
                    sec[i, g] = T.if_then_else(tops[i, g] > 1, t1[i, g], t2[i, g])
                    t1[i, g] = t1[i, g] + sec[i, g]
                rank = T.alloc_fragment((BM, NG), "int32")
                T.fill(rank, 0)
                for h in T.serial(NG):  # (groups as lanes: no reduction across lanes)
                    for i, g in T.Parallel(BM, NG):
                        rank[i, g] = rank[i, g] + T.cast(t1[i, h] > t1[i, g] or (t1[i, h] == t1[i, g] and h < g),
                                                         "int32")
            sel = T.alloc_fragment((BM, K), "int32")
            full = T.alloc_var("int32", 1)
            if grouped and NK >= K:
                # the K best among the kept groups' experts only (keys carry the expert's index); they are the K best
                # of all unless the K-th is -inf (or a NaN below it), where a dropped group's -inf could rank instead
                slot = T.alloc_fragment((BM, NTG), "int32")
                keyc = T.alloc_fragment((BM, NTG, EPG), "int64")
                kth = T.alloc_fragment((BM,), "int64")
                for i in T.serial(BM):
                    for g in T.serial(NG):
                        if rank[i, g] < NTG:
                            slot[i, rank[i, g]] = g
                for i, g, j in T.Parallel(BM, NTG, EPG):
                    e = T.clamp(slot[i, g], 0, NG - 1) * EPG + j  # (a known range: gcc then reads it as contiguous)
                    keyc[i, g, j] = order_key(b[i, e], e, E)
                if NARROW:
                    narrowed(T.reshape(keyc, (BM, NK)), sec, rank, sel, kth)
                else:
                    select_keys(T.reshape(keyc, (BM, NK)), sel, kth, BM, NK, E, K)
                full = 0
                for i in T.serial(BM):
                    if kth[i] < (ORDER_NEG_INF + 1) * 4294967296:
                        full = 1
            if full != 0:
                if grouped:
                    for i, g, j in T.Parallel(BM, NG, EPG):
                        if rank[i, g] >= NTG:
                            bg[i, g, j] = NEG_INF
                select_topk(b, sel, BM, E, K)
            if fix_on:
                for i, k in T.Parallel(BM, K):
                    r = T.min(r0 + i, NT - 1)
                    if F[T.min(r, NF - 1)] != 0:
                        sel[i, k] = T.cast(T.clamp(U[r, k], 0, E - 1), "int32")
            wsel = T.alloc_fragment((BM, K), "float32")
            tot = T.alloc_fragment((BM,), "float32")
            for i, k in T.Parallel(BM, K):
                wsel[i, k] = s[i, sel[i, k]]
            T.fill(tot, 1e-20)
            for k in T.serial(K):
                for i in T.Parallel(BM):
                    tot[i] = tot[i] + wsel[i, k]
            idx = T.alloc_fragment((BM, KP), "int64")
            wt = T.alloc_fragment((BM, KP), "float32")
            for i, k in T.Parallel(BM, KP):
                if k < K:
                    idx[i, k] = T.cast(sel[i, T.min(k, K - 1)], "int64")
                    wt[i, k] = wsel[i, T.min(k, K - 1)] / tot[i] * scale
                else:
                    idx[i, k] = T.cast(E + k - K, "int64")
                    wt[i, k] = 1.0
            active = T.alloc_fragment((BM,), "int32")
            for i in T.Parallel(BM):
                active[i] = T.cast(M[T.min(r0 + i, NM - 1)] != 0, "int32") if mask_on else 1
            if unmapped_on:
                for i, k in T.Parallel(BM, K):
                    if r0 + i < NT:
                        U[r0 + i, k] = T.if_then_else(active[i] != 0, idx[i, k], T.cast(-1, "int64"))
            for i, k in T.Parallel(BM, KP):
                e = T.cast(idx[i, k], "int32")
                if phys_on:
                    tok = T.cast(r0 + i, "int64")
                    dup = (T.cast(ep_rank, "int64") + tok * 23333) % T.cast(LC[e], "int64")
                    e = PM[e, T.cast(dup, "int32")]
                e2 = T.cast(RL[T.clamp(e, 0, NR - 1)], "int64")
                idx[i, k] = T.if_then_else(active[i] != 0, e2, T.cast(-1, "int64"))
                wt[i, k] = T.if_then_else(active[i] != 0, wt[i, k], 0.0)
            T.copy(idx, I[r0, 0])
            T.copy(wt, Wo[r0, 0])
    return top2_sum_gate


# token <-> per-expert contiguous layout ------------------------------------------------------------------------

def expert_histogram(E, CH=4096, serial=False):
    """Counts of each expert among CH consecutive entries of the flat top-k index: Hst (num_chunks, E); Bad[c]:
    chunk c's entries outside [-1, E) (not counted: the caller refuses the index). ``serial``: see _grid."""
    NE_, NC = T.dynamic("num_entries"), T.dynamic("num_chunks")
    grid, walk = _grid(NC, serial)

    @T.prim_func
    def expert_histogram(Idx: T.Tensor((NE_,), "int64"), Hst: T.Tensor((NC, E), "int32"),
                         Bad: T.Tensor((NC,), "int32")):
        with T.Kernel(grid) as b0:
            cnt = T.alloc_fragment((E,), "int32")
            bad = T.alloc_var("int32", 0)
            for w in T.serial(walk):
                b = b0 + w
                bad = 0
                T.fill(cnt, 0)
                for i in T.serial(T.min(CH, NE_ - b * CH)):
                    e = Idx[b * CH + i]
                    if (e >= 0) & (e < E):
                        cnt[T.cast(e, "int32")] = cnt[T.cast(e, "int32")] + 1
                    elif e != -1:
                        bad = bad + 1
                T.copy(cnt, Hst[b, 0])
                Bad[b] = bad
    return expert_histogram


def expert_layout(E):
    """One block: per-expert sizes aligned up to ``alignment``, their ranges, and each chunk's first position
    per expert (written over Hst)."""
    NC = T.dynamic("num_chunks")

    @T.prim_func
    def expert_layout(Hst: T.Tensor((NC, E), "int32"), Start: T.Tensor((E,), "int32"), End: T.Tensor((E,), "int32"),
                      Count: T.Tensor((E,), "int32"), alignment: T.int32):
        with T.Kernel(1) as _b:
            tot = T.alloc_fragment((E,), "int32")
            run = T.alloc_fragment((E,), "int32")
            T.fill(tot, 0)
            for c in T.serial(NC):
                for e in T.Parallel(E):
                    tot[e] = tot[e] + Hst[c, e]
            acc = T.alloc_var("int32", 0)
            for e in T.serial(E):
                n = (tot[e] + alignment - 1) // alignment * alignment
                Start[e] = acc
                Count[e] = n
                run[e] = acc
                acc = acc + n
                End[e] = acc
            for c in T.serial(NC):
                for e in T.Parallel(E):
                    h = Hst[c, e]
                    Hst[c, e] = run[e]
                    run[e] = run[e] + h
    return expert_layout


def fill_i32(BLK=4096, serial=False):
    N = T.dynamic("n")
    grid, walk = _grid(T.ceildiv(N, BLK), serial)

    @T.prim_func
    def fill_i32(A: T.Tensor((N,), "int32"), v: T.int32):
        with T.Kernel(grid) as b0:
            for w in T.serial(walk):
                for i in T.Parallel(BLK):
                    if (b0 + w) * BLK + i < N:
                        A[(b0 + w) * BLK + i] = v
    return fill_i32


def expert_scatter(E, CH=4096, serial=False):
    """Each entry's position p: its chunk's running position for its expert (entries in order); TTP[n] = p and
    P2TT[p] = n (the one store to a scattered place per entry: positions_of derives the other two arrays from P2TT
    in order). ``serial``: see _grid."""
    NE_, NC, NP = T.dynamic("num_entries"), T.dynamic("num_chunks"), T.dynamic("num_positions")
    grid, walk = _grid(NC, serial)

    @T.prim_func
    def expert_scatter(Idx: T.Tensor((NE_,), "int64"), Hst: T.Tensor((NC, E), "int32"), TTP: T.Tensor((NE_,), "int32"),
                       P2TT: T.Tensor((NP,), "int32")):
        with T.Kernel(grid) as b0:
            run = T.alloc_fragment((E,), "int32")
            for w in T.serial(walk):
                b = b0 + w
                T.copy(Hst[b, 0], run)
                for i in T.serial(T.min(CH, NE_ - b * CH)):
                    n = b * CH + i
                    e = T.cast(Idx[n], "int32")
                    if e >= 0:
                        p = run[e]
                        run[e] = p + 1
                        TTP[n] = p
                        P2TT[p] = n
                    else:
                        TTP[n] = -1
    return expert_scatter


def positions_of(K, BLK=4096, serial=False):
    """From P2TT (each position's entry t * K + k, or -1): P2T[p] = its token, P2E[p] = its expert Idx[entry], -1
    where P2TT is; one pass in position order (the entries' experts gathered from Idx, which fits in cache).
    ``serial``: see _grid."""
    NE_, NP = T.dynamic("num_entries"), T.dynamic("num_positions")
    grid, walk = _grid(T.ceildiv(NP, BLK), serial)

    @T.prim_func
    def positions_of(Idx: T.Tensor((NE_,), "int64"), P2TT: T.Tensor((NP,), "int32"), P2E: T.Tensor((NP,), "int32"),
                     P2T: T.Tensor((NP,), "int32")):
        with T.Kernel(grid) as b0:
            for w in T.serial(walk):
                b = b0 + w
                for i in T.Parallel(BLK):
                    if b * BLK + i < NP:
                        P2T[b * BLK + i] = T.if_then_else(P2TT[b * BLK + i] >= 0, P2TT[b * BLK + i] // K, -1)
                        P2E[b * BLK + i] = T.if_then_else(P2TT[b * BLK + i] >= 0,
                                                          T.cast(Idx[T.max(P2TT[b * BLK + i], 0)], "int32"), -1)
    return positions_of


def expand_rows(dtype="uint8", BW=1024, strided_out=False):
    """Out[p] = X[t] for every (t, k) with p = TTP[t, k] >= 0, and Out[p] = 0 where P2E[p] < 0, BW elements of a
    row per block. The token rows go as bytes ("uint8"); their scale rows as int32 words into an Out of any strides
    (``strided_out``)."""
    NT, K, NP, C = T.dynamic("num_tokens"), T.dynamic("num_topk"), T.dynamic("num_positions"), T.dynamic("cols")
    OSM, OSK = T.dynamic("o_sm"), T.dynamic("o_sk")
    out_t = T.StridedTensor((NP, C), (OSM, OSK), dtype) if strided_out else T.Tensor((NP, C), dtype)

    @T.prim_func
    def expand_rows(X: T.Tensor((NT, C), dtype), TTP: T.Tensor((NT, K), "int32"), P2E: T.Tensor((NP,), "int32"),
                    Out: out_t):
        with T.Kernel(T.ceildiv(C, BW), T.max(NT, NP)) as (bx, r):
            row = T.alloc_fragment((BW,), dtype)
            if r < NP:
                if P2E[r] < 0:
                    T.fill(row, 0)
                    T.copy(row, Out[r, bx * BW])
            if r < NT:
                T.copy(X[r, bx * BW], row)
                for k in T.serial(K):
                    p = TTP[r, k]
                    if p >= 0:
                        T.copy(row, Out[p, bx * BW])
    return expand_rows


def reduce_fused(in_dtype, out_dtype, with_weights, with_xsf, with_sf, W=1024):
    """Out[t] = sum over k of X[TTP[t, k]] * (w[t, k] * xsf[pos]) accumulated as fused multiply-adds in k order,
    times sf[0]; positions < 0 skipped."""
    NT, K, NP, H = T.dynamic("num_tokens"), T.dynamic("num_topk"), T.dynamic("num_positions"), T.dynamic("hidden")
    NWT, NXS = T.dynamic("nw"), T.dynamic("nxs")

    @T.prim_func
    def reduce_fused(X: T.Tensor((NP, H), in_dtype), Wt: T.Tensor((NWT,), "float32"), TTP: T.Tensor((NT, K), "int32"),
                     Out: T.Tensor((NT, H), out_dtype), SF: T.Tensor((1,), "float32"), XS: T.Tensor((NXS,), "float32")):
        with T.Kernel(T.ceildiv(H, W), NT) as (bx, t):
            acc = T.alloc_fragment((W,), "float32")
            xr = T.alloc_fragment((W,), "float32")
            T.fill(acc, 0.0)
            for k in T.serial(K):
                p = TTP[t, k]
                if p >= 0:
                    sv = T.alloc_var("float32", 1.0)
                    if with_weights:
                        sv = Wt[t * K + k]
                    if with_xsf:
                        sv = sv * XS[p]
                    T.copy(X[p, bx * W], xr)
                    for j in T.Parallel(W):
                        acc[j] = fma_f32(xr[j], sv, acc[j])
            if with_sf:
                for j in T.Parallel(W):
                    acc[j] = acc[j] * SF[0]
            T.copy(acc, Out[t, bx * W])
    return reduce_fused
