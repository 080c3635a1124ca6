"""The T.* kernel behind ``tegula.ops.attention.flash_attn_varlen_func``: flash attention forward over packed
variable-length sequences with grouped-query heads.

One block per (query tile of BM rows, query head, sequence): it reads the sequence's bounds from the cumulative
lengths, walks the key tiles of BN keys the tile may see (with ``causal``, aligned to the bottom-right: query i of a
sequence with lq queries and lk keys sees keys j <= i + lk - lq), and keeps the online softmax of
examples/flash_attention.py. Tiles wholly inside the sequence and below the diagonal skip the mask; the others
mask by select and zero the value rows past the sequence (those rows belong to the next sequence). The grid takes
each head's query tiles last first: with ``causal`` a tile's cost grows with its index and the threads take blocks
in grid order, a few at a time, so the grid ends on the cheapest tiles and the threads finish together. s 2048 h 16
d 128, BM 128: per-block CPU times measured on one thread (fp32 0.11 ms for the first query tile ... 1.77 ms for
the last) replayed through the 2-thread schedule (chunks of 2 blocks) give a makespan 1.0% above an even split in
grid order, 0.1% last first (bf16 1.1% -> 0.0%).

float32 runs key-major: the block keeps Q^T and computes the scores transposed, S^T = K Q^T (keys x queries), so
that the c target's prelude GEMM packs no operand (fp32 A either way round and an untransposed fp32 B are read as
they lie: K_s and Q^T, then S^T and V_s; row-major scores had K_s transposed into panels at every tile), and the
softmax reduces over keys with vertical vector operations, one query per lane (row-major scores end each row
with a horizontal reduction). s 2048 h 16 d 128 causal, 1 thread, CPU time, alternated A/B in one process,
medians of 9 / 15: 212.6 -> 208.3 ms, 214.0 -> 209.6 ms. bf16 keeps row-major scores (its gemms pack bf16
pairs either way, and P is rounded to bf16 for P V). With ``causal``, a key tile that lies wholly past the
diagonal of the first half of the query tile (the last of BM = 2 BN) is computed for the second half only, in
both gemms (its first half is masked: P = 0): 205.7 -> 202.5 ms. float32 also rescales lazily, as
_mla_kernels: a row's reference maximum moves only when its scores pass it by more than LAZY log2 units (P <=
2^LAZY, far inside float32's range), so acc is rescaled at few tiles: 205.6 -> 201.9 ms, 206.4 -> 201.7 ms.
Q^T is made on chip from a row-major copy of the query rows (a transposing load from Q, whose rows lie h_q * d
apart, was ~4% of the time): 203.4 -> 198.9 ms.
"""
from __future__ import annotations

import math

import tegula
import tegula.language as T
from tegula.ops._mla_kernels import exp2_softmax, lazy_max

LAZY = 8.0   # float32: log2 units a row's maximum may pass its reference maximum before acc is rescaled

LOG2E = math.log2(math.e)


def flash_varlen(h_q, h_kv, d, dv, causal, dtype, block_m=64, block_n=64, num_stages=2):
    """Q (total_q, h_q, d), K (total_k, h_kv, d), V (total_k, h_kv, dv), CuQ / CuK (batch + 1,) int32 -> Out
    (total_q, h_q, dv) in ``dtype``, Lse (h_q, total_q) float32 (natural log; +inf for a row without keys).
    Grid (m_tiles, h_q, batch); ``m_tiles`` = ceil(max_seqlen_q / block_m), ``scale`` the softmax scale."""
    BM, BN = block_m, block_n
    hpk = h_q // h_kv
    total_q, total_k, nb1 = T.dynamic("total_q"), T.dynamic("total_k"), T.dynamic("nb1")
    neg_inf = -T.infinity("float32")
    key_major = dtype == "float32"   # see the module docstring
    QB = 16 if BM % 16 == 0 else 1   # queries per band of the Q^T load
    HB = BM // 2   # causal: the last key tiles of a query tile may lie past the diagonal of its first HB queries

    @T.macro
    def scores(Q_s, K_s, S):
        if key_major:
            T.gemm(K_s, Q_s, S, clear_accum=True)   # S^T = K Q^T
        else:
            T.gemm(Q_s, K_s, S, transpose_B=True, clear_accum=True)

    @T.macro
    def load_kv(K, V, K_s, V_s, k0, n0, lk, kvh, full):
        if full:
            T.copy(K[k0 + n0:k0 + n0 + BN, kvh, :], K_s)
            T.copy(V[k0 + n0:k0 + n0 + BN, kvh, :], V_s)
        else:  # rows past the sequence are another sequence's (or outside k / v): zero them
            for i, j in T.Parallel(BN, d):
                K_s[i, j] = T.if_then_else(n0 + i < lk, K[k0 + n0 + i, kvh, j], T.cast(0, dtype))
            for i, j in T.Parallel(BN, dv):
                V_s[i, j] = T.if_then_else(n0 + i < lk, V[k0 + n0 + i, kvh, j], T.cast(0, dtype))

    @T.prim_func
    def main(Q: T.Tensor((total_q, h_q, d), dtype), K: T.Tensor((total_k, h_kv, d), dtype),
             V: T.Tensor((total_k, h_kv, dv), dtype), CuQ: T.Tensor((nb1,), "int32"), CuK: T.Tensor((nb1,), "int32"),
             Out: T.Tensor((total_q, h_q, dv), dtype), Lse: T.Tensor((h_q, total_q), "float32"),
             m_tiles: T.int32, scale: T.float32):
        with T.Kernel(m_tiles, h_q, nb1 - 1, threads=128) as (bx, by, bz):
            K_s = T.alloc_shared((BN, d), dtype)
            V_s = T.alloc_shared((BN, dv), dtype)
            acc = T.alloc_fragment((BM, dv), "float32")
            m = T.alloc_fragment((BM,), "float32")
            m_cur = T.alloc_fragment((BM,), "float32")
            ms = T.alloc_fragment((BM,), "float32")
            alpha = T.alloc_fragment((BM,), "float32")
            l_sum = T.alloc_fragment((BM,), "float32")
            p_sum = T.alloc_fragment((BM,), "float32")
            grew = T.alloc_fragment((BM,), "float32")
            any_grew = T.alloc_fragment((1,), "float32")
            Q_s = T.alloc_shared((d, BM) if key_major else (BM, d), dtype)
            S = T.alloc_fragment((BN, BM) if key_major else (BM, BN), "float32")
            P_s = T.alloc_shared((BM, BN), dtype)
            Q_r = T.alloc_shared((BM, d), dtype) if key_major else None   # the query rows, for Q^T

            q0 = CuQ[bz]
            lq = CuQ[bz + 1] - q0
            k0 = CuK[bz]
            lk = CuK[bz + 1] - k0
            m0 = (m_tiles - 1 - bx) * BM   # the costliest (causal: last) query tiles first, so the grid ends light
            kvh = by // hpk
            sl2 = scale * LOG2E
            if m0 < lq:
                if key_major:   # the rows of Q (zero past the sequence), then Q^T on chip in bands of QB queries
                    for i, j in T.Parallel(BM, d):
                        Q_r[i, j] = T.if_then_else(m0 + i < lq, Q[q0 + m0 + i, by, j], T.cast(0, dtype))
                    for i0 in T.serial(BM // QB):
                        for j, i in T.Parallel(d, QB):
                            Q_s[j, i0 * QB + i] = Q_r[i0 * QB + i, j]
                else:
                    for i, j in T.Parallel(BM, d):
                        Q_s[i, j] = T.if_then_else(m0 + i < lq, Q[q0 + m0 + i, by, j], T.cast(0, dtype))
                T.fill(acc, 0)
                T.fill(l_sum, 0)
                T.fill(m, neg_inf)
                shift = lk - lq                 # causal: query row i sees keys j <= i + shift
                n_end = T.min(lk, m0 + BM + shift) if causal else lk
                n_full = (T.min(lk, m0 + shift + 1) if causal else lk) // BN   # tiles that need no mask
                for k in T.Pipelined(T.ceildiv(T.max(n_end, 0), BN), num_stages=num_stages):
                    n0 = k * BN
                    if k < n_full:
                        load_kv(K, V, K_s, V_s, k0, n0, lk, kvh, True)
                        scores(Q_s, K_s, S)
                    else:
                        load_kv(K, V, K_s, V_s, k0, n0, lk, kvh, False)
                        if key_major and causal:   # a tile past the first half's diagonal: scores of the second
                            if m0 + HB - 1 + shift < n0:
                                T.gemm(K_s, Q_s[:, HB:BM], S[:, HB:BM], clear_accum=True)
                            else:
                                scores(Q_s, K_s, S)
                        else:
                            scores(Q_s, K_s, S)
                        if key_major:
                            for j, i in T.Parallel(BN, BM):
                                ok = n0 + j < lk and (m0 + i + shift >= n0 + j if causal else True)
                                S[j, i] = T.if_then_else(ok, S[j, i], neg_inf)
                        else:
                            for i, j in T.Parallel(BM, BN):
                                ok = n0 + j < lk and (m0 + i + shift >= n0 + j if causal else True)
                                S[i, j] = T.if_then_else(ok, S[i, j], neg_inf)
                    if key_major:   # over the keys: vertical maxima, one query per lane
                        T.fill(m_cur, neg_inf)
                        for j in T.serial(BN):
                            for i in T.Parallel(BM):
                                m_cur[i] = T.max(m_cur[i], S[j, i])
                    else:
                        T.reduce_max(S, m_cur, dim=1)
                    if key_major:   # lazy: the reference maximum moves only when passed by more than LAZY (log2)
                        for i in T.Parallel(BM):
                            lazy_max(m_cur, m, ms, alpha, grew, i, sl2)
                    else:
                        for i in T.Parallel(BM):
                            m_new = T.max(m[i], m_cur[i])
                            ms[i] = T.if_then_else(m_new == neg_inf, 0.0, m_new * sl2)
                            alpha[i] = T.exp2(m[i] * sl2 - ms[i])
                            grew[i] = T.if_then_else(m_new > m[i], 1.0, 0.0)
                            m[i] = m_new
                    if key_major:
                        T.fill(p_sum, 0)
                        for j in T.serial(BN):
                            for i in T.Parallel(BM):
                                S[j, i] = exp2_softmax(S[j, i] * sl2 - ms[i])
                                p_sum[i] += S[j, i]
                    else:
                        for i, j in T.Parallel(BM, BN):
                            S[i, j] = exp2_softmax(S[i, j] * sl2 - ms[i])
                        T.reduce_sum(S, p_sum, dim=1)
                    for i in T.Parallel(BM):
                        l_sum[i] = l_sum[i] * alpha[i] + p_sum[i]
                    T.reduce_max(grew, any_grew, dim=0)
                    if any_grew[0] > 0.0:   # the output rescales only when some row's maximum grew
                        for i, j in T.Parallel(BM, dv):
                            acc[i, j] *= alpha[i]
                    if key_major and causal:
                        if m0 + HB - 1 + shift < n0:   # the first half's P is 0 here (masked: its S is -inf)
                            T.gemm(S[:, HB:BM], V_s, acc[HB:BM, :], transpose_A=True)
                        else:
                            T.gemm(S, V_s, acc, transpose_A=True)
                    elif key_major:
                        T.gemm(S, V_s, acc, transpose_A=True)
                    else:
                        T.copy(S, P_s)
                        T.gemm(P_s, V_s, acc)
                for i, j in T.Parallel(BM, dv):
                    if m0 + i < lq:
                        Out[q0 + m0 + i, by, j] = acc[i, j] * T.if_then_else(l_sum[i] == 0.0, 0.0, 1.0 / l_sum[i])
                for i in T.Parallel(BM):
                    if m0 + i < lq:
                        Lse[by, q0 + m0 + i] = T.if_then_else(l_sum[i] == 0.0, T.infinity("float32"),
                                                              m[i] * scale + T.log(l_sum[i]))

    return main


_FACTORIES: dict = {}


def get(target: str, *args):
    """The compiled varlen kernel for ``target``, cached per argument tuple (tegula.jit)."""
    fac = _FACTORIES.get(target)
    if fac is None:
        fac = _FACTORIES[target] = tegula.jit(flash_varlen, target=target)
    return fac(*args)
