"""The T.* kernels behind tegula.ops.gemm: FP8 block-scaled and BF16 GEMMs, dense and MoE-grouped.

Each factory returns a ``T.prim_func``; tegula/ops/gemm.py compiles them through ``tegula.jit`` (one kernel per
tuple of compile-time arguments) and does every argument check. The token dimension M is ``T.dynamic`` in the
M-major kernels (DeepGEMM's ``compiled_dims="nk"``), so one compiled kernel serves every batch size of a weight;
the K-grouped kernels fix M and N instead (``compiled_dims="mn"``) and take the K layout at run time.

FP8 numerics follow DeepGEMM: each 128-wide block of K is multiplied in fp32 (exact fp8 products, T.gemm into a
fresh fp32 fragment), then scaled by ``sa * sb`` and added into the fp32 accumulator; the output is rounded once.
"""
from __future__ import annotations

import tegula.language as T

SF_K = 128  # K elements per scale factor; also the M/N block of a 128 x 128 B scale


def ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def mk_gemm(kind: str, N: int, K: int, groups: int, dtype: str, trans_a: bool, trans_b: bool, out_dtype: str,
            accumulate: bool, sf_dtype: str, sfa_k: int, sfb_mn: int, sfb_k: int, block_m: int, block_n: int,
            chunk_k: int):
    """D (+)= op(A) @ op(B) over M-blocks, for ``kind``:

    - ``dense``: A (m, K) or (K, m) with trans_a; B (1, N, K) with trans_b else (1, K, N); D (m, N); L unused (1,).
    - ``contiguous``: A (m, K); B (G, N, K) / (G, K, N); D (m, N); L (m,) the group of each row, -1 padding
      (its rows of D are written as 0). Every ``block_m`` rows hold one group plus trailing padding.
    - ``masked``: A (G, m, K); B (G, N, K); D (G, m, N); L (G,) rows computed per group (the rest of D is
      left as it is).

    FP8 (``dtype == "float8_e4m3fn"``) takes scales SA (m, sfa_k) ((G, m, sfa_k) masked), per row and
    128-block of K, and SB (G, sfb_mn, sfb_k): per 128 x 128 block of B (sfb_mn = ceil(N/128)) or per row of
    B (sfb_mn = N); ``sf_dtype`` float32 or float8_e8m0fnu (UE8M0 powers of two). BF16 passes (1, 1)
    placeholders. ``accumulate`` reads D as the initial value (DeepGEMM's c, already copied into d).
    ``chunk_k`` (a multiple of 128 dividing align(K, 128) for fp8) is the K of one staged copy.
    """
    m = T.dynamic("m")
    fp8 = dtype == "float8_e4m3fn"
    masked, contiguous = kind == "masked", kind == "contiguous"
    per_row_sfb = fp8 and sfb_mn == N and N != ceil_div(N, SF_K)
    n_chunks = ceil_div(K, chunk_k)
    sub = chunk_k // SF_K if fp8 else 1
    sub_k = SF_K if fp8 else chunk_k
    a_shape = (groups, m, K) if masked else ((K, m) if trans_a else (m, K))
    a_tile = (chunk_k, block_m) if trans_a else (block_m, chunk_k)
    b_shape = (groups, N, K) if trans_b else (groups, K, N)
    b_tile = (block_n, chunk_k) if trans_b else (chunk_k, block_n)
    sa_shape = ((groups, m, sfa_k) if masked else (m, sfa_k)) if fp8 else (1, 1)
    sb_shape = (groups, sfb_mn, sfb_k) if fp8 else (1, 1, 1)
    d_shape = (groups, m, N) if masked else (m, N)
    l_shape = (m,) if contiguous else ((groups,) if masked else (1,))
    grid_z = groups if masked else 1

    @T.prim_func
    def gemm(A: T.Tensor(a_shape, dtype), SA: T.Tensor(sa_shape, sf_dtype), B: T.Tensor(b_shape, dtype),
             SB: T.Tensor(sb_shape, sf_dtype), D: T.Tensor(d_shape, out_dtype), L: T.Tensor(l_shape, "int32")):
        with T.Kernel(T.ceildiv(N, block_n), T.ceildiv(m, block_m), grid_z, threads=128) as (bx, by, bz):
            A_s = T.alloc_shared(a_tile, dtype)
            B_s = T.alloc_shared(b_tile, dtype)
            acc = T.alloc_fragment((block_m, block_n), "float32")
            blk = T.alloc_fragment((block_m, block_n), "float32")
            sa = T.alloc_fragment((block_m, sub), "float32")
            sb = T.alloc_fragment((sub, block_n), "float32")
            rows = T.alloc_fragment((block_m,), "int32")
            top = T.alloc_fragment((1,), "int32")
            live = T.alloc_var("int32")
            row0 = by * block_m
            col0 = bx * block_n
            live = 1
            if contiguous:
                for i in T.Parallel(block_m):
                    rows[i] = T.if_then_else(row0 + i < m, L[T.min(row0 + i, m - 1)], -1)
                T.reduce_max(rows, top, dim=0)
                live = T.if_then_else(top[0] >= 0, 1, 0)
            if masked:
                live = T.if_then_else(row0 < L[bz], 1, 0)
            # the group as a plain value (not a T.alloc_var, whose memory a byte store in the copies below
            # could alias, forcing a reload per element)
            g = top[0] if contiguous else (bz if masked else 0)
            if live == 1:
                if accumulate:
                    T.copy(D[row0, col0], acc)
                else:
                    T.clear(acc)
                for c in T.Pipelined(n_chunks, num_stages=2):
                    if masked:
                        T.copy(A[g, row0:row0 + block_m, c * chunk_k:c * chunk_k + chunk_k], A_s)
                    elif trans_a:
                        T.copy(A[c * chunk_k, row0], A_s)
                    else:
                        T.copy(A[row0, c * chunk_k], A_s)
                    if trans_b:
                        T.copy(B[g, col0:col0 + block_n, c * chunk_k:c * chunk_k + chunk_k], B_s)
                    else:
                        T.copy(B[g, c * chunk_k:c * chunk_k + chunk_k, col0:col0 + block_n], B_s)
                    if fp8:
                        # the chunk's scales first: the loop below is then the plain pattern "gemm of one block of
                        # K into a cleared blk, acc += blk * (sa[i, s] * sb[s, j])" (fuse_gemm_scale on the c target)
                        for i, t in T.Parallel(block_m, sub):
                            if masked:
                                sa[i, t] = T.cast(SA[g, T.min(row0 + i, m - 1), c * sub + t], "float32")
                            else:
                                sa[i, t] = T.cast(SA[T.min(row0 + i, m - 1), c * sub + t], "float32")
                        for t, j in T.Parallel(sub, block_n):
                            if per_row_sfb:
                                sb[t, j] = T.cast(SB[g, T.min(col0 + j, N - 1), c * sub + t], "float32")
                            elif SF_K % block_n == 0:
                                # the block's columns share one 128-row block of B's scales: one load per t,
                                # broadcast (a column's own index, clamped and divided, took ~0.8 ns per element:
                                # 1 x 4096 x 7168, 128-column blocks, 7168 of them a block)
                                sb[t, j] = T.cast(SB[g, col0 // SF_K, c * sub + t], "float32")
                            else:
                                sb[t, j] = T.cast(SB[g, T.min(col0 + j, N - 1) // SF_K, c * sub + t], "float32")
                    for s in T.serial(sub):
                        if fp8:
                            if trans_a:
                                if trans_b:
                                    T.gemm(A_s[s * sub_k:s * sub_k + sub_k, 0:block_m],
                                           B_s[0:block_n, s * sub_k:s * sub_k + sub_k], blk,
                                           transpose_A=True, transpose_B=True, clear_accum=True)
                                else:
                                    T.gemm(A_s[s * sub_k:s * sub_k + sub_k, 0:block_m],
                                           B_s[s * sub_k:s * sub_k + sub_k, 0:block_n], blk,
                                           transpose_A=True, clear_accum=True)
                            else:
                                if trans_b:
                                    T.gemm(A_s[0:block_m, s * sub_k:s * sub_k + sub_k],
                                           B_s[0:block_n, s * sub_k:s * sub_k + sub_k], blk,
                                           transpose_B=True, clear_accum=True)
                                else:
                                    T.gemm(A_s[0:block_m, s * sub_k:s * sub_k + sub_k],
                                           B_s[s * sub_k:s * sub_k + sub_k, 0:block_n], blk, clear_accum=True)
                            for i, j in T.Parallel(block_m, block_n):
                                acc[i, j] += blk[i, j] * (sa[i, s] * sb[s, j])
                        else:
                            T.gemm(A_s, B_s, acc, transpose_A=trans_a, transpose_B=trans_b)
                if masked:
                    for i, j in T.Parallel(block_m, block_n):
                        if row0 + i < L[g] and col0 + j < N:
                            D[g, row0 + i, col0 + j] = acc[i, j]
                else:
                    if contiguous:
                        for i, j in T.Parallel(block_m, block_n):
                            acc[i, j] = T.if_then_else(rows[i] < 0, 0.0, acc[i, j])
                    T.copy(acc, D[row0, col0])
            else:
                if contiguous:
                    T.clear(acc)
                    T.copy(acc, D[row0, col0])

    return gemm


def mk_k_grouped_gemm(M: int, N: int, groups: int, dtype: str, block_m: int, block_n: int):
    """D[g] += A_g^T @ B_g, the weight gradient of a MoE layer. A (sum_k, M) and B (sum_k, N) hold each group's
    rows of K; INFO (G, 3) gives per group the first row, the end row and (FP8) its first row of scales. The
    groups' K is walked in 128-row blocks from the first row; rows of the last block past the end count as
    zeros. FP8 takes per-channel scales SA (kb, M) and SB (kb, N), one per column and 128-row block of each
    group; BF16 passes (1, 1) placeholders. D (G, M, N) fp32 is read and written."""
    k = T.dynamic("k")
    kb = T.dynamic("kb")
    fp8 = dtype == "float8_e4m3fn"
    sa_shape = (kb, M) if fp8 else (1, 1)
    sb_shape = (kb, N) if fp8 else (1, 1)

    @T.prim_func
    def k_grouped_gemm(A: T.Tensor((k, M), dtype), SA: T.Tensor(sa_shape, "float32"), B: T.Tensor((k, N), dtype),
                       SB: T.Tensor(sb_shape, "float32"), D: T.Tensor((groups, M, N), "float32"),
                       INFO: T.Tensor((groups, 3), "int32")):
        with T.Kernel(T.ceildiv(N, block_n), T.ceildiv(M, block_m), groups, threads=128) as (bx, by, bz):
            A_s = T.alloc_shared((SF_K, block_m), dtype)
            B_s = T.alloc_shared((SF_K, block_n), dtype)
            acc = T.alloc_fragment((block_m, block_n), "float32")
            blk = T.alloc_fragment((block_m, block_n), "float32")
            sa = T.alloc_fragment((block_m,), "float32")
            sb = T.alloc_fragment((block_n,), "float32")
            row0 = by * block_m
            col0 = bx * block_n
            start = INFO[bz, 0]
            end = INFO[bz, 1]
            T.copy(D[bz, row0, col0], acc)
            for t in T.serial((end - start + SF_K - 1) // SF_K):
                r0 = start + t * SF_K
                T.copy(A[r0, row0], A_s)
                T.copy(B[r0, col0], B_s)
                if r0 + SF_K > end:
                    for i, j in T.Parallel(SF_K, block_m):
                        A_s[i, j] = T.if_then_else(r0 + i < end, A_s[i, j], T.cast(0, dtype))
                    for i, j in T.Parallel(SF_K, block_n):
                        B_s[i, j] = T.if_then_else(r0 + i < end, B_s[i, j], T.cast(0, dtype))
                if fp8:
                    T.gemm(A_s, B_s, blk, transpose_A=True, clear_accum=True)
                    T.copy(SA[INFO[bz, 2] + t, row0:row0 + block_m], sa)
                    T.copy(SB[INFO[bz, 2] + t, col0:col0 + block_n], sb)
                    for i, j in T.Parallel(block_m, block_n):
                        acc[i, j] += blk[i, j] * (sa[i] * sb[j])
                else:
                    T.gemm(A_s, B_s, acc, transpose_A=True)
            T.copy(acc, D[bz, row0, col0])

    return k_grouped_gemm
