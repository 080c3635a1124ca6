/* tegula_gemm.h: the tile GEMM behind T.gemm on the c target.
 *
 *   tg_gemm_<dt>(M, N, K, A, lda, transA, B, ldb, transB, C, ldc, clear)
 *
 * computes C[M,N] (+)= op(A) @ op(B) on one block's tiles. Every operand is row-major with a
 * leading dimension: op(A) is A (M x K) or, when transA, the transpose of A stored K x M; op(B) is
 * B (K x N) or, when transB, the transpose of B stored N x K. clear != 0 overwrites C, otherwise the
 * product is added to it. <dt> is f32, bf16, f16, f8e4m3 or f8e5m2 with a float C (inputs are
 * converted exactly, products accumulate in fp32 with FMA), or i8 with an int32 C (exact; the
 * addition into C wraps like the kernel's -fwrapv arithmetic).
 *
 * Layout of the work (GotoBLAS-like, sized for tiles already in L1/L2): a register-blocked kernel
 * computes an MR x NR block of C over a chunk of at most KC steps of K, reading
 *   A as MR rows addressed by (row stride, k stride), so both orientations of an fp32 A are read
 *     in place;
 *   B as kc rows of NR contiguous floats, so an fp32 B without transB is read in place where the
 *     kernel can mask its loads (AVX-512).
 * Anything else (narrow or integer inputs, transB) is first converted into a float panel on the
 * stack (up to 96 KiB per call). An fp32 A @ B^T with at most MR rows skips the panel and takes dot
 * products along K instead. int8 products are exact in fp32 and a chunk's sum stays below 2^24
 * (KC * 2^14 = 2^21), so each chunk is exact in fp32 before it is added into the int32 C.
 * C must not overlap A or B.
 */
#ifndef TEGULA_GEMM_H
#define TEGULA_GEMM_H

#include <stdint.h>
#include <math.h>
#include "tegula_types.h"

#define TG_GEMM_KC 128 /* one pass over K for the usual K <= 128 tiles; keeps int8 exact */
#define TG_GEMM_NC 128 /* columns of a packed B panel: KC x NC floats = 64 KiB */
#define TG_GEMM_MC 64  /* rows of a packed A panel: MC x KC floats = 32 KiB */
#define TG__ALWAYS_INLINE static inline __attribute__((always_inline))
#define TG__MIN(a, b) ((a) < (b) ? (a) : (b))

#ifdef __AVX512F__
#include <immintrin.h>
#define TG_GEMM_MR 8
#define TG_GEMM_NR 32
#define TG_GEMM_DIRECT_B 1

TG__ALWAYS_INLINE __mmask16 tg__gemm_mask(int n)
{
    return n >= 16 ? (__mmask16)0xffff : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}

TG__ALWAYS_INLINE void tg__gemm_store(void *C, long off, __mmask16 m, __m512 acc, int clear, int c_i32)
{
    if (c_i32) {
        __m512i v = _mm512_cvtps_epi32(acc); /* integer-valued, so exact */
        int32_t *c = (int32_t *)C + off;
        if (!clear)
            v = _mm512_add_epi32(v, _mm512_maskz_loadu_epi32(m, c));
        _mm512_mask_storeu_epi32(c, m, v);
    } else {
        float *c = (float *)C + off;
        if (!clear)
            acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(m, c));
        _mm512_mask_storeu_ps(c, m, acc);
    }
}

/* 16 zmm accumulators: enough independent FMAs to cover two pipes of 4-cycle latency. Rows past
 * mr re-read row mr - 1 (never out of bounds) and are not stored; masked loads and stores handle
 * nr < NR, so B may be the caller's own rows. */
TG__ALWAYS_INLINE void tg__gemm_kernel(int kc, const float *A, long ars, long aks, int mr,
                                       const float *B, long ldb, int nr,
                                       void *C, long off, long ldc, int clear, int c_i32)
{
    __m512 c0[TG_GEMM_MR], c1[TG_GEMM_MR];
    const float *a[TG_GEMM_MR];
    for (int i = 0; i < TG_GEMM_MR; i++) {
        c0[i] = c1[i] = _mm512_setzero_ps();
        a[i] = A + (i < mr ? i : mr - 1) * ars;
    }
    __mmask16 m0 = tg__gemm_mask(nr), m1 = tg__gemm_mask(nr - 16);
    for (int k = 0; k < kc; k++, B += ldb) {
        __m512 b0 = _mm512_maskz_loadu_ps(m0, B), b1 = _mm512_maskz_loadu_ps(m1, B + 16);
        for (int i = 0; i < TG_GEMM_MR; i++) {
            __m512 ai = _mm512_set1_ps(a[i][k * aks]);
            c0[i] = _mm512_fmadd_ps(ai, b0, c0[i]);
            c1[i] = _mm512_fmadd_ps(ai, b1, c1[i]);
        }
    }
    for (int i = 0; i < mr; i++, off += ldc) {
        tg__gemm_store(C, off, m0, c0[i], clear, c_i32);
        if (nr > 16)
            tg__gemm_store(C, off + 16, m1, c1[i], clear, c_i32);
    }
}

#else /* portable: gcc vectorises the j loops (AVX2, NEON, ...) */
#define TG_GEMM_MR 4
#define TG_GEMM_NR 16
#define TG_GEMM_DIRECT_B 0 /* the kernel reads NR columns, so B is always a zero-padded panel */

TG__ALWAYS_INLINE void tg__gemm_kernel(int kc, const float *A, long ars, long aks, int mr,
                                       const float *restrict B, long ldb, int nr,
                                       void *C, long off, long ldc, int clear, int c_i32)
{
    float acc[TG_GEMM_MR][TG_GEMM_NR] = {{0}};
    const float *a[TG_GEMM_MR];
    for (int i = 0; i < TG_GEMM_MR; i++)
        a[i] = A + (i < mr ? i : mr - 1) * ars;
    for (int k = 0; k < kc; k++, B += ldb)
        for (int i = 0; i < TG_GEMM_MR; i++) {
            float ai = a[i][k * aks];
#pragma omp simd
            for (int j = 0; j < TG_GEMM_NR; j++)
                acc[i][j] = fmaf(ai, B[j], acc[i][j]);
        }
    for (int i = 0; i < mr; i++, off += ldc) {
        if (c_i32) {
            int32_t *c = (int32_t *)C + off;
            for (int j = 0; j < nr; j++)
                c[j] = (clear ? 0 : c[j]) + (int32_t)acc[i][j];
        } else {
            float *c = (float *)C + off;
            for (int j = 0; j < nr; j++)
                c[j] = clear ? acc[i][j] : c[j] + acc[i][j];
        }
    }
}
#endif

/* dst[r * ldd + c] = float(src[off + r * rs + c * cs]) for r < rows, c < cols; zero up to dcols. */
typedef void tg__gemm_pack_fn(float *restrict dst, int ldd, const void *src, long off, long rs, long cs,
                              int rows, int cols, int dcols);

#define TG__GEMM_PACK(NAME, T, CVT)                                                                     \
    static inline void NAME(float *restrict dst, int ldd, const void *src, long off, long rs, long cs,  \
                            int rows, int cols, int dcols)                                              \
    {                                                                                                   \
        const T *s = (const T *)src + off;                                                              \
        if (cs == 1) {                                                                                  \
            for (int r = 0; r < rows; r++)                                                              \
                for (int c = 0; c < cols; c++)                                                          \
                    dst[r * ldd + c] = CVT(s[r * rs + c]);                                              \
        } else { /* transposing, 16 source rows at a time: few lines live at a power-of-two stride */ \
            for (int c0 = 0; c0 < cols; c0 += 16)                                                      \
                for (int r = 0; r < rows; r++)                                                          \
                    for (int c = c0; c < TG__MIN(c0 + 16, cols); c++)                                   \
                        dst[r * ldd + c] = CVT(s[r * rs + c * cs]);                                     \
        }                                                                                               \
        for (int r = 0; r < rows; r++)                                                                  \
            for (int c = cols; c < dcols; c++)                                                          \
                dst[r * ldd + c] = 0.0f;                                                                \
    }
#define TG__GEMM_AS_FLOAT(x) ((float)(x))
TG__GEMM_PACK(tg__gemm_pack_f32, float, TG__GEMM_AS_FLOAT)
TG__GEMM_PACK(tg__gemm_pack_i8, int8_t, TG__GEMM_AS_FLOAT)
TG__GEMM_PACK(tg__gemm_pack_bf16, tg_bf16, tg_bf16_to_f32)
TG__GEMM_PACK(tg__gemm_pack_f16, tg_f16, tg_f16_to_f32)
TG__GEMM_PACK(tg__gemm_pack_f8e4m3, tg_f8e4m3, tg_f8e4m3_to_f32)
TG__GEMM_PACK(tg__gemm_pack_f8e5m2, tg_f8e5m2, tg_f8e5m2_to_f32)

/* C[i][j] (+)= (row i of A) . (row j of B) for an fp32 A @ B^T with few rows (GEMV-like), where
 * packing B would cost more than the product: 16-lane partial sums, four columns at a time. */
TG__ALWAYS_INLINE void tg__gemm_dot_f32(int M, int N, int K, const float *A, int lda,
                                        const float *B, int ldb, float *C, int ldc, int clear)
{
    for (int i = 0; i < M; i++) {
        const float *a = A + (long)i * lda;
        for (int j0 = 0; j0 < N; j0 += 4) {
            float acc[4][16] = {{0}};
            const float *b[4];
            for (int q = 0; q < 4; q++)
                b[q] = B + (long)TG__MIN(j0 + q, N - 1) * ldb;
            int k = 0;
            for (; k + 16 <= K; k += 16)
                for (int q = 0; q < 4; q++)
#pragma omp simd
                    for (int l = 0; l < 16; l++)
                        acc[q][l] = fmaf(a[k + l], b[q][k + l], acc[q][l]);
            for (; k < K; k++)
                for (int q = 0; q < 4; q++)
                    acc[q][0] = fmaf(a[k], b[q][k], acc[q][0]);
            for (int q = 0; q < 4 && j0 + q < N; q++) {
                float s = 0.0f;
                for (int l = 0; l < 16; l++)
                    s += acc[q][l];
                float *c = C + (long)i * ldc + j0 + q;
                *c = clear ? s : *c + s;
            }
        }
    }
}

/* The one driver behind every tg_gemm_<dt>: f32 says the inputs are float (read in place where the
 * kernel allows), pack converts the others, c_i32 says C is int32. */
TG__ALWAYS_INLINE void tg__gemm(int M, int N, int K, const void *A, int lda, int transA,
                                const void *B, int ldb, int transB, void *C, int ldc, int clear,
                                int f32, tg__gemm_pack_fn *pack, int c_i32)
{
    if (K <= 0) {
        for (int i = 0; clear && i < M; i++)
            for (int j = 0; j < N; j++) {
                if (c_i32)
                    ((int32_t *)C)[(long)i * ldc + j] = 0;
                else
                    ((float *)C)[(long)i * ldc + j] = 0.0f;
            }
        return;
    }
    if (f32 && transB && !transA && M <= TG_GEMM_MR && !c_i32) {
        tg__gemm_dot_f32(M, N, K, (const float *)A, lda, (const float *)B, ldb, (float *)C, ldc, clear);
        return;
    }
    float bbuf[TG_GEMM_KC * TG_GEMM_NC] __attribute__((aligned(64)));
    float abuf[TG_GEMM_MC * TG_GEMM_KC] __attribute__((aligned(64)));
    for (int k0 = 0; k0 < K; k0 += TG_GEMM_KC) {
        int kc = TG__MIN(TG_GEMM_KC, K - k0), first = clear && k0 == 0;
        for (int j0 = 0; j0 < N; j0 += TG_GEMM_NC) {
            int nc = TG__MIN(TG_GEMM_NC, N - j0);
            const float *bp = bbuf;
            long ldbp = (nc + TG_GEMM_NR - 1) / TG_GEMM_NR * TG_GEMM_NR;
            if (f32 && !transB && TG_GEMM_DIRECT_B) {
                bp = (const float *)B + (long)k0 * ldb + j0;
                ldbp = ldb;
            } else if (transB) {
                pack(bbuf, ldbp, B, (long)j0 * ldb + k0, 1, ldb, kc, nc, ldbp);
            } else {
                pack(bbuf, ldbp, B, (long)k0 * ldb + j0, ldb, 1, kc, nc, ldbp);
            }
            for (int i0 = 0; i0 < M; i0 += TG_GEMM_MC) {
                int mc = TG__MIN(TG_GEMM_MC, M - i0);
                /* op(A)[i][k] is ap[i * ars + k * aks] */
                const float *ap = abuf;
                long ars = transA ? 1 : (f32 ? lda : kc), aks = transA ? (f32 ? lda : mc) : 1;
                if (f32)
                    ap = (const float *)A + (transA ? (long)k0 * lda + i0 : (long)i0 * lda + k0);
                else if (transA)
                    pack(abuf, mc, A, (long)k0 * lda + i0, lda, 1, kc, mc, mc);
                else
                    pack(abuf, kc, A, (long)i0 * lda + k0, lda, 1, mc, kc, kc);
                for (int i = 0; i < mc; i += TG_GEMM_MR)
                    for (int j = 0; j < nc; j += TG_GEMM_NR)
                        tg__gemm_kernel(kc, ap + i * ars, ars, aks, TG__MIN(TG_GEMM_MR, mc - i),
                                        bp + j, ldbp, TG__MIN(TG_GEMM_NR, nc - j),
                                        C, (long)(i0 + i) * ldc + j0 + j, ldc, first, c_i32);
            }
        }
    }
}

#define TG__GEMM_DEFINE(DT, TIN, TC, F32, PACK, C_I32)                                                 \
    static inline void tg_gemm_##DT(int M, int N, int K, const TIN *A, int lda, int transA,            \
                                    const TIN *B, int ldb, int transB, TC *C, int ldc, int clear)      \
    {                                                                                                   \
        tg__gemm(M, N, K, A, lda, transA, B, ldb, transB, C, ldc, clear, F32, PACK, C_I32);             \
    }
TG__GEMM_DEFINE(f32, float, float, 1, tg__gemm_pack_f32, 0)
TG__GEMM_DEFINE(bf16, tg_bf16, float, 0, tg__gemm_pack_bf16, 0)
TG__GEMM_DEFINE(f16, tg_f16, float, 0, tg__gemm_pack_f16, 0)
TG__GEMM_DEFINE(f8e4m3, tg_f8e4m3, float, 0, tg__gemm_pack_f8e4m3, 0)
TG__GEMM_DEFINE(f8e5m2, tg_f8e5m2, float, 0, tg__gemm_pack_f8e5m2, 0)
TG__GEMM_DEFINE(i8, int8_t, int32_t, 0, tg__gemm_pack_i8, 1)

#endif /* TEGULA_GEMM_H */
