/* tegula_gemm.h: the tile GEMM behind T.gemm on the c target.
 *
 *   tg_gemm_<dt>(M, N, K, A, lda, transA, B, ldb, transB, C, ldc, clear)
 *
 * computes C[M,N] (+)= op(A) @ op(B) on one block's tiles. Every operand is row-major with a
 * leading dimension: op(A) is A (M x K) or, when transA, the transpose of A stored K x M; op(B) is
 * B (K x N) or, when transB, the transpose of B stored N x K. clear != 0 overwrites C, otherwise the
 * product is added to it. C must not overlap A or B. <dt> is
 *   f32, f16                 float C; products exact, summed in fp32 with FMA;
 *   bf16, f8e4m3, f8e5m2     float C; the same, except that with AVX512-BF16 (vdpbf16ps) pairs of
 *                            products are summed together and bf16 subnormal inputs (|x| < 2^-126,
 *                            never produced by fp8) and fp32 subnormal partial sums flush to zero;
 *   i8                       int32 C, exact; the addition into C wraps like -fwrapv arithmetic.
 *
 * Selected at compile time from the compiler's target macros (-march=native):
 *   AVX-512 F/BW/VL   8 x 32 register blocks of zmm (tegula_gemm_avx512.h); bf16 and fp8 in bf16
 *                     pairs with vdpbf16ps where __AVX512BF16__, int8 in quads with vpdpbusd where
 *                     __AVX512VNNI__, everything else converted to fp32 panels;
 *   AVX2 + FMA        6 x 16 blocks of ymm, fp32 panels;
 *   anything else     portable C (NEON, SSE, scalar: gcc/clang vectorise the column loops), 4 x 16.
 * With vdpbf16ps, few rows (M <= 8; bf16 up to 16) and B transposed (B is N x K, K contiguous, as in a
 * decode step's x @ W^T), the product is instead a set of dot products along K read straight from B
 * (tg__gemm_dot: no packing of B, each 64 elements of a row of B converted once in registers for all rows
 * of A, a horizontal sum per output at the end). Otherwise
 * the work is GotoBLAS-like, sized for tiles already in L1/L2: B in panels of at most KC x 128,
 * A in panels of at most 64 x KC, a kernel per register block over one panel pair. fp32 operands
 * are read in place where the kernel can (A always, B unless transposed, on AVX-512); the others
 * are packed into the kernel's format (converting, interleaving, 16 x 16 transposes in registers).
 * Without VNNI, int8 products are exact in fp32 and a chunk of K <= 128 sums below 2^24. fp16 is
 * converted to fp32 (vcvtph2ps) on every x86 path: AVX512-FP16 has no fp16 product summed in fp32.
 *
 *   tg_gemm_<dt>_bscaled(M, N, K, A, lda, B, ldb, C, ldc, sa, ldsa, sb, ldsb, kb)   (float C only)
 *
 * is DeepGEMM's block-scaled product, B transposed: C += sum over the blocks t of kb elements of K of
 * sa[i * ldsa + t] * sb[t * ldsb + j] * (A[i, block t] . B[j, block t]) (passes/fuse_gemm_scale makes the calls):
 * scaled in vector lanes on the dot path (1-8 rows), per register block on the panel path (more than 8 rows).
 *
 *   tg_gemm_<dt>_rows(M, N, K, A, lda, transA, brows, bcol, transB, C, ldc, clear)
 *
 * is the same product with B's stored rows anywhere in memory (a tile gathered from a cache): stored row r of B
 * (a row of K x N B, or of N x K B when transB) is the array at the address brows[r] (an int64), from its element
 * bcol on. The rows are packed from there (bf16 pairs), or copied together first (other formats); never the dot
 * path.
 *
 *   tg_gemm_<dt>_next(..., clear, tg_gemm_next a_next, tg_gemm_next b_next)
 *
 * is the same product, and meanwhile prefetches two tiles the caller reads next (a pipelined loop's
 * next copies), a few cache lines between register blocks; a tile with p == NULL is skipped.
 */
#ifndef TEGULA_GEMM_H
#define TEGULA_GEMM_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include "tegula_types.h"

#define TG__ALWAYS_INLINE static inline __attribute__((always_inline))
#define TG__MIN(a, b) ((a) < (b) ? (a) : (b))
#define TG__ROUND(n, m) (((n) + (m) - 1) / (m) * (m))

enum { TG__DT_F32, TG__DT_F16, TG__DT_BF16, TG__DT_E4M3, TG__DT_E5M2, TG__DT_I8 };
enum { TG__F32, TG__BF16, TG__I8 }; /* panel formats: 1, 2 or 4 elements of K per 32-bit unit */

TG__ALWAYS_INLINE int tg__esize(int dt) { return dt == TG__DT_F32 ? 4 : dt <= TG__DT_BF16 ? 2 : 1; }

/* Tiles the caller reads next (the sources of the next step's copies in a pipelined loop): their cache
 * lines are prefetched a few at a time between register blocks, so that those loads overlap this product. */
typedef struct {
    const void *p; /* first byte of the first row */
    long ld;       /* bytes between rows */
    int rows, bytes;
} tg_gemm_next;

typedef struct {
    const char *p[2];
    long ld[2];
    int per_row[2], lines[2], l[2], step;
} tg__pf;

TG__ALWAYS_INLINE void tg__pf_init(tg__pf *s, const tg_gemm_next *nx, int blocks)
{
    int total = 0;
    for (int t = 0; t < 2; t++) {
        s->p[t] = (const char *)nx[t].p, s->ld[t] = nx[t].ld, s->l[t] = 0;
        s->per_row[t] = (nx[t].bytes + 63) / 64 + 1; /* rows need not start on a line */
        s->lines[t] = nx[t].p ? s->per_row[t] * nx[t].rows : 0;
        total += s->lines[t];
    }
    s->step = (total + blocks - 1) / (blocks > 0 ? blocks : 1);
}

TG__ALWAYS_INLINE void tg__pf_step(tg__pf *s)
{
    for (int t = 0, n = s->step; t < 2; t++)
        for (; n > 0 && s->l[t] < s->lines[t]; n--, s->l[t]++)
            __builtin_prefetch(s->p[t] + (s->l[t] / s->per_row[t]) * s->ld[t] + 64 * (s->l[t] % s->per_row[t]));
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include "tegula_gemm_avx512.h"
#define TG__DIRECT_B 1 /* the kernel masks its loads of B, so an fp32 B is read in place */

#else /* fp32 panels, zero-padded to whole register blocks; element conversion in scalar code */
#define TG__DIRECT_B 0

TG__ALWAYS_INLINE float tg__elem_f32(int dt, const void *p, long i)
{
    switch (dt) {
    case TG__DT_F32: return ((const float *)p)[i];
    case TG__DT_F16: return tg_f16_to_f32(((const tg_f16 *)p)[i]);
    case TG__DT_BF16: return tg_bf16_to_f32(((const tg_bf16 *)p)[i]);
    case TG__DT_E4M3: return tg_f8e4m3_to_f32(((const tg_f8e4m3 *)p)[i]);
    case TG__DT_E5M2: return tg_f8e5m2_to_f32(((const tg_f8e5m2 *)p)[i]);
    default: return (float)((const int8_t *)p)[i];
    }
}

/* dst[r * ldd + c] = src[r * rs + c * cs] as fp32, zero for cols <= c < ldd */
#define TG__PACK_LOOP(DT)                                                                          \
    for (int r = 0; r < rows; r++) {                                                               \
        for (int c = 0; c < cols; c++)                                                             \
            dst[r * ldd + c] = tg__elem_f32(DT, src, r * rs + c * cs);                             \
        for (int c = cols; c < ldd; c++)                                                           \
            dst[r * ldd + c] = 0.0f;                                                               \
    }
static inline void tg__pack_f32(int dt, float *restrict dst, long ldd, const void *src, long rs, long cs, int rows,
                                int cols)
{
    switch (dt) { /* one loop per dtype, so that each vectorises */
    case TG__DT_F32: TG__PACK_LOOP(TG__DT_F32) break;
    case TG__DT_F16: TG__PACK_LOOP(TG__DT_F16) break;
    case TG__DT_BF16: TG__PACK_LOOP(TG__DT_BF16) break;
    case TG__DT_E4M3: TG__PACK_LOOP(TG__DT_E4M3) break;
    case TG__DT_E5M2: TG__PACK_LOOP(TG__DT_E5M2) break;
    default: TG__PACK_LOOP(TG__DT_I8) break;
    }
}
#define tg__pack_rows_f32(dt, dst, ldd, src, ld, rows, cols) tg__pack_f32(dt, dst, ldd, src, ld, 1, rows, cols)
#define tg__pack_cols_f32(dt, dst, ldd, src, ld, rows, cols) tg__pack_f32(dt, dst, ldd, src, 1, ld, rows, cols)

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TG_GEMM_MR 6
#define TG_GEMM_NR 16

/* fp32 kernel, the AVX-512 one's contract with fmt TG__F32: 12 ymm accumulators (two FMA pipes of
 * 4-cycle latency need 8 chains or more), B zero-padded */
TG__ALWAYS_INLINE void tg__kernel(int fmt, int ROWS, int units, int tail, const char *A, long ars, long aus,
                                  const char *B, long bus, int nr, void *C, long ldc, int clear, int c_i32,
                                  const int32_t *cs)
{
    (void)fmt, (void)tail, (void)cs;
    __m256 c0[TG_GEMM_MR], c1[TG_GEMM_MR];
    __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(nr), idx), m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(nr - 8), idx);
    int from_c = !clear && !c_i32, full = nr >= 16;
    for (int i = 0; i < ROWS; i++) {
        const float *c = (const float *)C + i * ldc;
        c0[i] = from_c ? (full ? _mm256_loadu_ps(c) : _mm256_maskload_ps(c, m0)) : _mm256_setzero_ps();
        c1[i] = from_c ? (full ? _mm256_loadu_ps(c + 8) : _mm256_maskload_ps(c + 8, m1)) : _mm256_setzero_ps();
    }
    for (int u = 0; u < units; u++, B += bus) {
        __m256 b0 = _mm256_loadu_ps((const float *)B), b1 = _mm256_loadu_ps((const float *)B + 8);
        for (int i = 0; i < ROWS; i++) {
            __m256 a = _mm256_broadcast_ss((const float *)(A + i * ars + u * aus));
            c0[i] = _mm256_fmadd_ps(a, b0, c0[i]);
            c1[i] = _mm256_fmadd_ps(a, b1, c1[i]);
        }
    }
    for (int i = 0; i < ROWS; i++) {
        __m256 v[2] = {c0[i], c1[i]};
        __m256i m[2] = {m0, m1};
        for (int h = 0; h < 2; h++) {
            float *c = (float *)C + i * ldc + 8 * h;
            if (c_i32) {
                __m256i x = _mm256_cvtps_epi32(v[h]);
                if (!clear)
                    x = _mm256_add_epi32(x, _mm256_maskload_epi32((const int *)c, m[h]));
                v[h] = _mm256_castsi256_ps(x);
            }
            if (full)
                _mm256_storeu_ps(c, v[h]);
            else
                _mm256_maskstore_ps(c, m[h], v[h]);
        }
    }
}

#else /* portable */
#define TG_GEMM_MR 4
#define TG_GEMM_NR 16

TG__ALWAYS_INLINE void tg__kernel(int fmt, int ROWS, int units, int tail, const char *A, long ars, long aus,
                                  const char *B, long bus, int nr, void *C, long ldc, int clear, int c_i32,
                                  const int32_t *cs)
{
    (void)fmt, (void)tail, (void)cs;
    float acc[TG_GEMM_MR][TG_GEMM_NR] = {{0}};
    for (int u = 0; u < units; u++, B += bus) {
        const float *restrict b = (const float *)B;
        for (int i = 0; i < ROWS; i++) {
            float a = *(const float *)(A + i * ars + u * aus);
#pragma omp simd
            for (int j = 0; j < TG_GEMM_NR; j++)
                acc[i][j] = fmaf(a, b[j], acc[i][j]);
        }
    }
    for (int i = 0; i < ROWS; i++) {
        if (c_i32) {
            int32_t *c = (int32_t *)C + i * ldc;
            for (int j = 0; j < nr; j++)
                c[j] = (clear ? 0 : c[j]) + (int32_t)acc[i][j];
        } else {
            float *c = (float *)C + i * ldc;
            for (int j = 0; j < nr; j++)
                c[j] = clear ? acc[i][j] : c[j] + acc[i][j];
        }
    }
}
#endif
#endif

#ifndef TG__HAVE_BF16_PAIRS
#define TG__HAVE_BF16_PAIRS 0
#endif
#ifndef TG__HAVE_I8_QUADS
#define TG__HAVE_I8_QUADS 0
#endif
#ifndef TG__LOAD64_PERMUTES
#define TG__LOAD64_PERMUTES 0
#endif

TG__ALWAYS_INLINE int tg__fmt(int dt)
{
    if (TG__HAVE_BF16_PAIRS && (dt == TG__DT_BF16 || dt == TG__DT_E4M3 || dt == TG__DT_E5M2))
        return TG__BF16;
    if (TG__HAVE_I8_QUADS && dt == TG__DT_I8)
        return TG__I8;
    return TG__F32;
}

/* Register blocks over an mc x nc panel pair: row blocks of MR, then 4, 2, 1 for the remainder, each
 * with a constant row count so that its accumulators live in registers; whole column blocks, then a
 * masked one. Remainders are computed up front, so that with constant tile sizes the unused cases fold. */
/* C[R x nr] += T[R x nr] * (sa[i * ldsa] * sb[j]): a block-scaled product's register block, T in L1 (rows
 * TG_GEMM_NR apart); the same expression as the T.* update it replaces (passes/fuse_gemm_scale) */
TG__ALWAYS_INLINE void tg__scale_add(int R, int nr, const float *T, float *C, long ldc, const float *sa, long ldsa,
                                     const float *sb)
{
    for (int i = 0; i < R; i++) {
        const float s = sa[i * ldsa];
#pragma omp simd
        for (int j = 0; j < nr; j++)
            C[i * ldc + j] = C[i * ldc + j] + T[i * TG_GEMM_NR + j] * (s * sb[j]);
    }
}

/* scaled: block-scaled (tg__gemm with kb): each register block's product over this panel pair (one block of K)
 * goes to an L1 tile, then C += tile * (sa[i * ldsa] * sb[j]) */
TG__ALWAYS_INLINE void tg__blocks(int fmt, int mc, int nc, int units, int tail, const char *A, long ars, long aus,
                                  const char *B, long bus, char *C, long ldc, int first, int c_i32,
                                  const int32_t *cs, tg__pf *pf, int scaled, const float *sa, long ldsa,
                                  const float *sb)
{
    const int nr = nc % TG_GEMM_NR, nfull = nc - nr;
    float tile[TG_GEMM_MR * TG_GEMM_NR] __attribute__((aligned(64)));
#define TG__K(R, NR)                                                                                           \
    do {                                                                                                       \
        if (scaled) {                                                                                          \
            tg__kernel(fmt, R, units, tail, A + i * ars, ars, aus, B + 4 * j, bus, NR, tile, TG_GEMM_NR, 1, 0,  \
                       cs + j);                                                                                \
            tg__scale_add(R, NR, tile, (float *)C + i * ldc + j, ldc, sa + i * ldsa, ldsa, sb + j);            \
        } else {                                                                                               \
            tg__kernel(fmt, R, units, tail, A + i * ars, ars, aus, B + 4 * j, bus, NR, C + 4 * (i * ldc + j),   \
                       ldc, first, c_i32, cs + j);                                                             \
        }                                                                                                      \
    } while (0)
#define TG__ROW(R)                                                                        \
    {                                                                                     \
        int j = 0;                                                                        \
        for (; j < nfull; j += TG_GEMM_NR) {                                              \
            TG__K(R, TG_GEMM_NR);                                                         \
            if (pf)                                                                       \
                tg__pf_step(pf);                                                          \
        }                                                                                 \
        if (nr)                                                                           \
            TG__K(R, nr);                                                                 \
    }
    int r = mc % TG_GEMM_MR, i = 0;
    for (; i < mc - r; i += TG_GEMM_MR)
        TG__ROW(TG_GEMM_MR)
    if (TG_GEMM_MR > 4 && r >= 4) {
        TG__ROW(4)
        i += 4, r -= 4;
    }
    if (r >= 2) {
        TG__ROW(2)
        i += 2, r -= 2;
    }
    if (r)
        TG__ROW(1)
#undef TG__ROW
#undef TG__K
}

#if TG__HAVE_BF16_PAIRS
/* Few rows of A, B transposed (its rows are columns of C, K contiguous), bf16 or fp8: dot products along K
 * read straight from B, which is neither packed nor transposed (at M = 1..8 that packing costs more than the
 * products). A is converted to bf16 once per chunk of K; row blocks of 4, 2, 1 (tg__dot_rows; blocks of 8
 * spill registers and ran 30% slower per row). Each output ends with a horizontal sum (~3 instructions), so
 * the path pays where M is small or K long: M <= 8, or bf16 (no conversion of B) up to M = 16 with K >= 512
 * (measured on decode shapes: 1.2-1.5x faster than the panels there; fp8 at M = 16 in K = 128 calls 0.8x). */
enum { TG__DOT_KC = 1024 }; /* K per packed chunk of A */
TG__ALWAYS_INLINE int tg__use_dot(int dt, int M, int K) { return M <= 8 || (dt == TG__DT_BF16 && M <= 16 && K >= 512); }

/* rows [i, M) of A in blocks of 4, then one of 2 and one of 1: ROWS(R) computes R rows from row i */
#define TG__ROWS_4_2_1(ROWS)   \
    do {                       \
        for (; i + 4 <= M; i += 4) \
            ROWS(4);           \
        if (M - i >= 2) {      \
            ROWS(2);           \
            i += 2;            \
        }                      \
        if (M - i)             \
            ROWS(1);           \
    } while (0)

TG__ALWAYS_INLINE void tg__gemm_dot(int dt, int M, int N, int K, const void *A, int lda, const void *B, int ldb,
                                    float *C, int ldc, int clear, const tg_gemm_next *next)
{
    const int es = tg__esize(dt);
    uint16_t abuf[16 * TG__DOT_KC] __attribute__((aligned(64)));
    tg__pf pf;
    if (next) { /* one prefetch step per column block */
        int blocks = 0;
        for (int r = M, R = 4; r > 0; R /= 2)
            for (; r >= R; r -= R)
                blocks += (N + 16 / R - 1) / (16 / R);
        tg__pf_init(&pf, next, blocks * ((K + TG__DOT_KC - 1) / TG__DOT_KC));
    }
    for (int k0 = 0; k0 < K; k0 += TG__DOT_KC) {
        const int kc = TG__MIN(TG__DOT_KC, K - k0), ld = TG__ROUND(kc, 64), first = clear && k0 == 0;
        for (int r = 0; r < M; r++)
            for (int k = 0; k < kc; k += 64) {
                __m512i x0, x1;
                tg__load64_bf16(dt, (const char *)A + ((long)r * lda + k0 + k) * es, kc - k, &x0, &x1);
                _mm512_store_si512(abuf + r * ld + k, x0);
                _mm512_store_si512(abuf + r * ld + k + 32, x1);
            }
        const char *b = (const char *)B + (long)k0 * es;
        int i = 0;
#define TG__DROWS(R) tg__dot_rows(dt, R, N, kc, abuf + i * ld, ld, b, (long)ldb * es, C + (long)i * ldc, ldc, first, \
                                  next ? &pf : NULL)
        TG__ROWS_4_2_1(TG__DROWS);
#undef TG__DROWS
    }
}
#endif

#if TG__HAVE_BF16_PAIRS
/* Block-scaled products of 9-16 rows of A (a decode step), e4m3 B transposed, blocks of K a multiple of 64 up to
 * 256 (tileops.gemm.rows_in_lanes mirrors this): C^T's register block is 16 columns (one accumulator each) x the 16
 * rows of A in the lanes. A is packed once, 16 rows x one pair of K a vector (tg__transpose16); B's rows are only
 * converted (16 rows x one block of K at a time, into L1) and each pair broadcast, so B needs no transposes (the
 * panel path's packing of B, two 16 x 16 transposes per 16 x 64 elements, cost about half its products at 16
 * rows). Each block's sums are scaled into running sums in L1 (rows' scales in lanes, the column's broadcast);
 * a 16 x 16 transpose per 16 columns at the end adds them to C. */
TG__ALWAYS_INLINE int tg__lanes16(int M, int N, int K, int kb)
{
    return M > 8 && M <= 16 && N > 0 && kb % 64 == 0 && kb <= 256 && K % kb == 0;
}

/* a buffer of at least `bytes` per thread, kept for later calls */
static inline void *tg__scratch(size_t bytes)
{
    static __thread void *buf;
    static __thread size_t cap;
    if (bytes > cap) {
        free(buf);
        cap = TG__ROUND(bytes, 64);
        buf = aligned_alloc(64, cap);
    }
    return buf;
}

static int tg__gemm_lanes16(int dt, int M, int N, int K, const void *A, int lda, const void *B, int ldb, float *C,
                             int ldc, const float *sa, int ldsa, const float *sb, int ldsb, int kb)
{
    const int es = tg__esize(dt), nb = K / kb, ub = kb / 2;
    __m512i *at = (__m512i *)tg__scratch((size_t)K * 32 + (size_t)nb * 64 + 16 * 64); /* unit u of rows: at[u] */
    if (!at)
        return 0; /* no memory: the caller takes the panel path */
    __m512 *sav = (__m512 *)(at + K / 2);          /* block t's scales of A's rows */
    float *tot = (float *)(sav + nb);              /* column c's running sums: tot[16 c ..]; in L1, not registers
                                                    * (with the 16 accumulators they would spill one of those) */
    uint16_t bc[16 * 256] __attribute__((aligned(64))); /* 16 rows of B, one block, bf16 */
    for (int k0 = 0; k0 < K; k0 += 64) {
        __m512i v[16], w[16];
        for (int r = 0; r < 16; r++) {
            v[r] = w[r] = _mm512_setzero_si512();
            if (r < M)
                tg__load64_bf16(dt, (const char *)A + ((long)r * lda + k0) * es, 64, &v[r], &w[r]);
        }
        tg__transpose16(v);
        tg__transpose16(w);
        for (int q = 0; q < 16; q++) {
            _mm512_store_si512(at + k0 / 2 + q, v[q]);
            _mm512_store_si512(at + k0 / 2 + 16 + q, w[q]);
        }
    }
    for (int t = 0; t < nb; t++) {
        float x[16] __attribute__((aligned(64)));
        for (int r = 0; r < 16; r++)
            x[r] = r < M ? sa[(long)r * ldsa + t] : 0.0f;
        sav[t] = _mm512_load_ps(x);
    }
    for (int j0 = 0; j0 < N; j0 += 16) {
        const int nc = TG__MIN(16, N - j0);
        for (int c = 0; c < 16; c++)
            _mm512_store_ps(tot + 16 * c, _mm512_setzero_ps());
        for (int t = 0; t < nb; t++) {
            for (int c = 0; c < 16; c++) {
                const char *b = (const char *)B + ((long)(j0 + TG__MIN(c, nc - 1)) * ldb + (long)t * kb) * es;
                for (int k = 0; k < kb; k += 64) {
                    __m512i x0, x1;
                    /* the next block along the row (16 streams of B read in place; 1 thread, from DRAM: 1-4%
                     * faster than two blocks ahead, 2-9% than four, 11-19% than nothing ahead) */
                    if (t + 1 < nb)
                        __builtin_prefetch(b + (long)(kb + k) * es);
                    tg__load64_bf16(dt, b + (long)k * es, 64, &x0, &x1);
                    _mm512_store_si512(bc + c * kb + k, x0);
                    _mm512_store_si512(bc + c * kb + k + 32, x1);
                }
            }
            __m512 acc[16];
            for (int c = 0; c < 16; c++)
                acc[c] = _mm512_setzero_ps();
            const __m512i *a = at + (long)t * ub;
            for (int u = 0; u < ub; u++) {
                const __m512bh av = (__m512bh)_mm512_load_si512(a + u);
                for (int c = 0; c < 16; c++) {
#if defined(__GNUC__) && defined(__x86_64__)
                    /* the pair as vdpbf16ps's embedded broadcast (gcc broadcasts it into a register of its own,
                     * and with the 16 accumulators and e4m3's tables one accumulator then lives on the stack) */
                    __asm__("vdpbf16ps %1%{1to16%}, %2, %0" : "+v"(acc[c]) : "m"(*(const uint32_t *)(bc + c * kb + 2 * u)), "v"(av));
#else
                    uint32_t p;
                    memcpy(&p, bc + c * kb + 2 * u, 4);
                    acc[c] = _mm512_dpbf16_ps(acc[c], av, (__m512bh)_mm512_set1_epi32((int)p));
#endif
                }
            }
            const float *sbt = sb + (long)t * ldsb + j0;
            for (int c = 0; c < 16; c++)
                _mm512_store_ps(tot + 16 * c, _mm512_fmadd_ps(acc[c], _mm512_mul_ps(sav[t], _mm512_set1_ps(sbt[TG__MIN(c, nc - 1)])),
                                                              _mm512_load_ps(tot + 16 * c)));
        }
        __m512i r[16];
        for (int c = 0; c < 16; c++)
            r[c] = _mm512_castps_si512(_mm512_load_ps(tot + 16 * c));
        tg__transpose16(r); /* r[i]: row i, columns j0 .. j0 + 15 */
        const __mmask16 cm = tg__m16(nc);
        for (int i = 0; i < M; i++) {
            float *cp = C + (long)i * ldc + j0;
            _mm512_mask_storeu_ps(cp, cm, _mm512_add_ps(_mm512_maskz_loadu_ps(cm, cp), _mm512_castsi512_ps(r[i])));
        }
    }
    return 1;
}
#endif

/* The one driver behind every tg_gemm_<dt>; dt is a constant at every call. */
TG__ALWAYS_INLINE void tg__gemm_s(int dt, int M, int N, int K, const void *A, int lda, int transA, const void *B,
                                  int ldb, int transB, void *C, int ldc, int clear, const tg_gemm_next *next,
                                  int scaled, const float *sa, int ldsa, const float *sb, int ldsb, int kb,
                                  const int64_t *brows, int bcol)
{
    enum { NC = 128, MC = 64 }; /* the most columns of a packed B panel and rows of a packed A panel */
    const int fmt = tg__fmt(dt), es = tg__esize(dt), c_i32 = dt == TG__DT_I8;
    const int epu = fmt == TG__F32 ? 1 : fmt == TG__BF16 ? 2 : 4; /* elements per unit */
    const int b_direct = TG__DIRECT_B && dt == TG__DT_F32 && !transB && !brows;
    const int a_direct = dt == TG__DT_F32 || (dt == TG__DT_BF16 && fmt == TG__BF16 && !transA);
    /* e4m3 with B transposed and A not: both converted 64 elements at a time, in the order that conversion
     * leaves them (a third fewer shuffles than 32 in K order); the products pair up alike */
    const int perm64 = TG__LOAD64_PERMUTES && dt == TG__DT_E4M3 && fmt == TG__BF16 && transB && !transA;
    /* operands read in place are not cut into panels, so that constant M and N reach the blocking */
    const int MCc = a_direct ? M : MC, NCc = b_direct ? N : NC;
    const char *a8 = (const char *)A, *b8 = (const char *)B;
    if (K <= 0) {
        for (int i = 0; clear && i < M; i++)
            memset((char *)C + 4L * i * ldc, 0, 4L * N);
        return;
    }
#if TG__HAVE_BF16_PAIRS
    if (!scaled && !brows && fmt == TG__BF16 && transB && !transA && tg__use_dot(dt, M, K)) {
        tg__gemm_dot(dt, M, N, K, A, lda, B, ldb, (float *)C, ldc, clear, next);
        return;
    }
#endif
#if TG__HAVE_BF16_PAIRS
    /* block-scaled, 9-16 rows (a decode step), e4m3 B transposed: A's rows in vector lanes, B's rows converted
     * and broadcast a pair at a time (tg__gemm_lanes16) */
    if (scaled && perm64 && !brows && tg__lanes16(M, N, K, kb) &&
        tg__gemm_lanes16(dt, M, N, K, A, lda, B, ldb, (float *)C, ldc, sa, ldsa, sb, ldsb, kb))
        return;
#endif
    tg__pf pf;
    if (next)
        tg__pf_init(&pf, next, ((M + TG_GEMM_MR - 1) / TG_GEMM_MR) * ((N + TG_GEMM_NR - 1) / TG_GEMM_NR));
    /* K per panel: the B panel is at most 64 KiB, KC <= 128 keeps int8 exact in fp32 */
    const int KC = scaled ? kb : b_direct ? K : 128 * epu;
    char bbuf[128 * NC * 4] __attribute__((aligned(64)));
    char abuf[MC * 128 * 4] __attribute__((aligned(64)));
    int32_t cs[NC] __attribute__((aligned(64)));
    char gbuf[brows ? 128 * NC * 4 : 1] __attribute__((aligned(64))); /* a panel's rows of B, gathered (brows) */
    for (int k0 = 0; k0 < K; k0 += KC) {
        /* scaled: K is whole blocks, so kc is the constant kb (the register blocks' strides fold) */
        const int kc = scaled ? KC : TG__MIN(KC, K - k0), first = clear && k0 == 0;
        /* a partial last unit: read in part from a bf16 A in place; packed A and B are zero-padded */
        /* perm64: both panels hold K in tg__load64_bf16's order, whole 64-element groups (zero-padded) */
        const int tail = fmt == TG__BF16 && !perm64 ? kc % 2 : 0;
        const int units = perm64 ? TG__ROUND(kc, 64) / 2 : fmt == TG__BF16 ? kc / 2 : (kc + epu - 1) / epu;
        for (int j0 = 0; j0 < N; j0 += NCc) {
            const int nc = TG__MIN(NCc, N - j0), ldd = TG__ROUND(nc, 32);
            const char *bp = bbuf;
            long bus = 4L * ldd;
            const char *bsrc = brows ? gbuf : b8 + (transB ? (long)j0 * ldb + k0 : (long)k0 * ldb + j0) * es;
            int ldbx = ldb;
            /* brows: B's stored row r is at the address brows[r], from its element bcol on; bf16 pairs are packed
             * from there, other formats from a copy of the panel's rows (then a B of leading dimension ldbx) */
            const int64_t *rw = brows ? brows + (transB ? j0 : k0) : NULL;
            const long roff = (long)(bcol + (transB ? k0 : j0)) * es;
            const int fused = brows && fmt == TG__BF16 && !perm64;
            if (brows && !fused) {
                const int nrow = transB ? nc : kc, len = transB ? kc : nc;
                for (int r = 0; r < nrow; r++)
                    memcpy(gbuf + (long)r * len * es, (const char *)(intptr_t)rw[r] + roff, (size_t)len * es);
                ldbx = len;
            }
            if (b_direct) {
                bp = bsrc;
                bus = 4L * ldb;
            } else if (fmt == TG__F32) {
                if (transB)
                    tg__pack_cols_f32(dt, (float *)bbuf, TG__DIRECT_B ? ldd : TG__ROUND(nc, TG_GEMM_NR), bsrc, ldbx, kc, nc);
                else
                    tg__pack_rows_f32(dt, (float *)bbuf, TG__DIRECT_B ? ldd : TG__ROUND(nc, TG_GEMM_NR), bsrc, ldbx, kc, nc);
                if (!TG__DIRECT_B)
                    bus = 4L * TG__ROUND(nc, TG_GEMM_NR);
            }
#if TG__HAVE_BF16_PAIRS
            else if (fused)
                tg__pack_pairs_rows(dt, (uint16_t *)bbuf, ldd, rw, roff, !transB, kc, nc);
            else if (perm64)
                tg__pack_pairs64(dt, (uint16_t *)bbuf, ldd, bsrc, ldbx, kc, nc);
            else if (fmt == TG__BF16)
                tg__pack_pairs(dt, (uint16_t *)bbuf, ldd, bsrc, transB ? 1 : ldbx, transB ? ldbx : 1, kc, nc);
#endif
#if TG__HAVE_I8_QUADS
            else if (fmt == TG__I8) {
                memset(cs, 0, sizeof cs);
                tg__pack_quads((int8_t *)bbuf, ldd, (const int8_t *)bsrc, transB ? 1 : ldbx, transB ? ldbx : 1, kc, nc, cs);
            }
#endif
            for (int i0 = 0; i0 < M; i0 += MCc) {
                const int mc = TG__MIN(MCc, M - i0);
                const char *asrc = a8 + (transA ? (long)k0 * lda + i0 : (long)i0 * lda + k0) * es;
                const char *ap = abuf;
                long ars, aus; /* byte strides of A's rows and units */
                if (a_direct) {
                    ap = asrc, ars = transA ? 4 : (long)lda * es, aus = transA ? 4L * lda : 4;
                } else if (fmt == TG__F32) {
                    int ld = TG__ROUND(transA ? mc : kc, 16);
                    tg__pack_rows_f32(dt, (float *)abuf, ld, asrc, lda, transA ? kc : mc, transA ? mc : kc);
                    ars = transA ? 4 : 4L * ld, aus = transA ? 4L * ld : 4;
                }
#if TG__HAVE_BF16_PAIRS
                else if (fmt == TG__BF16 && !transA) {
                    int ld = TG__ROUND(kc, perm64 ? 64 : 32);
                    if (perm64)
                        tg__pack_rows64_bf16(dt, (uint16_t *)abuf, ld, asrc, lda, mc, kc);
                    else
                        tg__pack_rows_bf16(dt, (uint16_t *)abuf, ld, asrc, lda, mc, kc);
                    ars = 2L * ld, aus = 4;
                } else if (fmt == TG__BF16) {
                    int ld = TG__ROUND(mc, 32);
                    tg__pack_pairs(dt, (uint16_t *)abuf, ld, asrc, lda, 1, kc, mc);
                    ars = 4, aus = 4L * ld;
                }
#endif
#if TG__HAVE_I8_QUADS
                else if (fmt == TG__I8 && !transA) {
                    int ld = TG__ROUND(kc, 64);
                    tg__pack_rows_u8((int8_t *)abuf, ld, (const int8_t *)asrc, lda, mc, kc);
                    ars = ld, aus = 4;
                } else if (fmt == TG__I8) {
                    int ld = TG__ROUND(mc, 32);
                    tg__pack_quads((int8_t *)abuf, ld, (const int8_t *)asrc, lda, 1, kc, mc, NULL);
                    ars = 4, aus = 4L * ld;
                }
#endif
                else {
                    ars = aus = 0; /* unreachable */
                }
                tg__blocks(fmt, mc, nc, units, tail, ap, ars, aus, bp, bus, (char *)C + 4 * ((long)i0 * ldc + j0), ldc,
                           first, c_i32, cs, next ? &pf : NULL, scaled, scaled ? sa + (long)i0 * ldsa + k0 / KC : NULL,
                           ldsa, scaled ? sb + (long)(k0 / KC) * ldsb + j0 : NULL);
            }
        }
    }
}

TG__ALWAYS_INLINE void tg__gemm(int dt, int M, int N, int K, const void *A, int lda, int transA, const void *B,
                                int ldb, int transB, void *C, int ldc, int clear, const tg_gemm_next *next)
{
    tg__gemm_s(dt, M, N, K, A, lda, transA, B, ldb, transB, C, ldc, clear, next, 0, NULL, 0, NULL, 0, 1, NULL, 0);
}

/* tg_gemm_<dt>_bscaled: C[M,N] += sum over the blocks t of kb elements of K (K a multiple of kb) of
 * sa[i * ldsa + t] * sb[t * ldsb + j] * (A[i, block t] . B[j, block t]), B transposed (N x K) and A not: DeepGEMM's
 * block-scaled product, the scale of each block applied in fp32 to that block's sum. On the dot-product path
 * (tg__dot_rows_scaled) each block's sums stay in vector lanes and are scaled there, summed across lanes once per
 * ~1024 of K instead of once per block; elsewhere each block is a tg__gemm into a buffer, then scaled and added. */
TG__ALWAYS_INLINE void tg__gemm_bscaled(int dt, int M, int N, int K, const void *A, int lda, const void *B, int ldb,
                                        float *C, int ldc, const float *sa, int ldsa, const float *sb, int ldsb, int kb)
{
    const int es = tg__esize(dt);
    if (K <= 0 || kb <= 0)
        return;
#if TG__HAVE_BF16_PAIRS
    /* fused for 2-8 rows and K >= 2048 (e4m3, 1 thread, weights from DRAM: 4 x 2112 x 7168 1.76-2.2 -> 1.36-1.6 ms),
     * 2-4 rows from K = 1536 (x 24576: 2 rows 5.1 -> 3.4 ms, 4 rows 4.1-4.2 -> 3.8; 8 rows there 6.1 -> 6.6, kept);
     * one row of A up to K = 4096 in whole rows of B; longer rows measured 5-20% slower fused than a gemm per block,
     * which they keep */
    /* one row with K <= TG__ROW1_KMAX: whole rows of B in address order (tg__dot_row1_scaled) */
    if (tg__fmt(dt) == TG__BF16 && M == 1 && K <= TG__ROW1_KMAX && kb % 64 == 0 && kb <= TG__SCALED_KB) {
        tg__dot_row1_scaled(dt, N, K, kb, (const char *)A, (const char *)B, (long)ldb * es, C, sa, sb, ldsb);
        return;
    }
    if (tg__fmt(dt) == TG__BF16 && M >= 2 && (K >= 2048 || (M <= 4 && K >= 1536)) && tg__use_dot(dt, M, K) &&
        kb % 64 == 0 && kb <= TG__SCALED_KB) {
        int i = 0;
#define TG__SROWS(R) tg__dot_rows_scaled(dt, R, N, K, kb, (const char *)A + (long)i * lda * es, lda, (const char *)B, \
                                         (long)ldb * es, C + (long)i * ldc, ldc, sa + (long)i * ldsa, ldsa, sb, ldsb)
        TG__ROWS_4_2_1(TG__SROWS);
#undef TG__SROWS
        return;
    }
#endif
    /* more rows (compute-bound tiles): the panel path with each register block's product of a block of K scaled
     * into C from an L1 tile (tg__blocks), no pass over a block accumulator in L2; kb is then the K of a panel, at
     * most 128 units (e4m3 256 x 128 tiles, K 256 per call, 1 thread, in L2: 186-191 -> 196-202 GFLOP/s; 4096 x 2112
     * x 7168: 0.88 -> 0.95 of tegula's bf16) */
    const int epu = tg__fmt(dt) == TG__F32 ? 1 : 2;
    if (M > 8 && kb <= 128 * epu && K % kb == 0) {
        tg__gemm_s(dt, M, N, K, A, lda, 0, B, ldb, 1, C, ldc, 0, NULL, 1, sa, ldsa, sb, ldsb, kb, NULL, 0);
        return;
    }
    enum { BM = 16, BN = 64 };
    float tmp[BM * BN];
    for (int i0 = 0; i0 < M; i0 += BM)
        for (int j0 = 0; j0 < N; j0 += BN) {
            const int mc = TG__MIN(BM, M - i0), nc = TG__MIN(BN, N - j0);
            for (int t = 0; t < K / kb; t++) {
                tg__gemm(dt, mc, nc, kb, (const char *)A + ((long)i0 * lda + (long)t * kb) * es, lda, 0,
                         (const char *)B + ((long)j0 * ldb + (long)t * kb) * es, ldb, 1, tmp, BN, 1, NULL);
                for (int i = 0; i < mc; i++) {
                    const float s = sa[(long)(i0 + i) * ldsa + t];
                    for (int j = 0; j < nc; j++)
                        C[(long)(i0 + i) * ldc + j0 + j] += tmp[i * BN + j] * (s * sb[(long)t * ldsb + j0 + j]);
                }
            }
        }
}

/* tg_gemm_<dt>_next: the same, and `next` (2 tiles; p == NULL for none) is prefetched meanwhile */
#define TG__GEMM_DEFINE(NAME, DT, TIN, TC)                                                              \
    static inline void tg_gemm_##NAME(int M, int N, int K, const TIN *A, int lda, int transA, const TIN *B, \
                                      int ldb, int transB, TC *C, int ldc, int clear)                   \
    {                                                                                                   \
        tg__gemm(DT, M, N, K, A, lda, transA, B, ldb, transB, C, ldc, clear, NULL);                     \
    }                                                                                                   \
    static inline void tg_gemm_##NAME##_next(int M, int N, int K, const TIN *A, int lda, int transA,    \
                                             const TIN *B, int ldb, int transB, TC *C, int ldc, int clear, \
                                             tg_gemm_next a_next, tg_gemm_next b_next)                  \
    {                                                                                                   \
        tg_gemm_next next[2] = {a_next, b_next};                                                        \
        tg__gemm(DT, M, N, K, A, lda, transA, B, ldb, transB, C, ldc, clear, next);                     \
    }                                                                                                   \
    static inline void tg_gemm_##NAME##_rows(int M, int N, int K, const TIN *A, int lda, int transA,    \
                                             const int64_t *brows, int bcol, int transB, TC *C, int ldc, \
                                             int clear)                                                 \
    {                                                                                                   \
        tg__gemm_s(DT, M, N, K, A, lda, transA, NULL, 0, transB, C, ldc, clear, NULL, 0, NULL, 0, NULL, 0, 1, \
                   brows, bcol);                                                                        \
    }
/* tg_gemm_<dt>_bscaled(M, N, K, A, lda, B, ldb, C, ldc, sa, ldsa, sb, ldsb, kb): float C only */
#define TG__GEMM_BSCALED(NAME, DT, TIN)                                                                 \
    static inline void tg_gemm_##NAME##_bscaled(int M, int N, int K, const TIN *A, int lda, const TIN *B, int ldb, \
                                                float *C, int ldc, const float *sa, int ldsa, const float *sb, \
                                                int ldsb, int kb)                                       \
    {                                                                                                   \
        tg__gemm_bscaled(DT, M, N, K, A, lda, B, ldb, C, ldc, sa, ldsa, sb, ldsb, kb);                  \
    }
TG__GEMM_DEFINE(f32, TG__DT_F32, float, float)
TG__GEMM_DEFINE(bf16, TG__DT_BF16, tg_bf16, float)
TG__GEMM_DEFINE(f16, TG__DT_F16, tg_f16, float)
TG__GEMM_DEFINE(f8e4m3, TG__DT_E4M3, tg_f8e4m3, float)
TG__GEMM_DEFINE(f8e5m2, TG__DT_E5M2, tg_f8e5m2, float)
TG__GEMM_DEFINE(i8, TG__DT_I8, int8_t, int32_t)
TG__GEMM_BSCALED(f32, TG__DT_F32, float)
TG__GEMM_BSCALED(bf16, TG__DT_BF16, tg_bf16)
TG__GEMM_BSCALED(f16, TG__DT_F16, tg_f16)
TG__GEMM_BSCALED(f8e4m3, TG__DT_E4M3, tg_f8e4m3)
TG__GEMM_BSCALED(f8e5m2, TG__DT_E5M2, tg_f8e5m2)

#endif /* TEGULA_GEMM_H */
