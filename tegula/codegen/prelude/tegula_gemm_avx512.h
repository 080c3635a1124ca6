/* tegula_gemm_avx512.h: the AVX-512 kernels and packing routines behind tegula_gemm.h.
 *
 * Included by tegula_gemm.h when the target has AVX-512 F, BW and VL. Three panel formats, each a
 * 32-bit "unit" of K per column of C, so that one register-blocked kernel serves all of them:
 *   TG__F32   one fp32 per unit, vfmadd231ps (every dtype on a target without the instructions below);
 *   TG__BF16  a pair of bf16 per unit, vdpbf16ps (__AVX512BF16__: bf16, and fp8 converted to bf16,
 *             which holds every e4m3/e5m2 value exactly); measured at twice the fp32 FMA rate on Zen 4;
 *   TG__I8    four int8 per unit, vpdpbusd (__AVX512VNNI__): A is packed offset to unsigned by +128 (an
 *             xor of the sign bit) and 128 * (column sums of B) is subtracted at the end, so int32 is exact.
 * A panel of B is KU unit rows of contiguous columns; A is read one unit at a time, broadcast.
 */
#ifndef TEGULA_GEMM_AVX512_H
#define TEGULA_GEMM_AVX512_H

#include <immintrin.h>

#define TG_GEMM_MR 8  /* rows of the register block */
#define TG_GEMM_NR 32 /* columns: two zmm, so 16 accumulators (Zen 4 / SKX: 1-2 FMA per cycle, 4-cycle latency) */

TG__ALWAYS_INLINE __mmask16 tg__m16(int n) { return n >= 16 ? (__mmask16)0xffff : n <= 0 ? 0 : (__mmask16)((1u << n) - 1); }
TG__ALWAYS_INLINE __mmask32 tg__m32(int n) { return n >= 32 ? 0xffffffffu : n <= 0 ? 0 : (__mmask32)((1u << n) - 1); }
TG__ALWAYS_INLINE __mmask64 tg__m64(int n) { return n >= 64 ? ~0ull : n <= 0 ? 0 : (__mmask64)((1ull << n) - 1); }

/* ---- conversions of 16 / 32 narrow elements in registers ------------------------------------- */

/* fp8 -> fp32, exact. e5m2 is the top byte of an f16; e4m3 moved into an f16's fields is its value
 * scaled by 2^-8 (subnormals included: vcvtph2ps ignores DAZ), so one exact multiply; 0x7f is NaN. */
TG__ALWAYS_INLINE __m512 tg__f8x16_f32(int dt, __m128i b)
{
    __m256i w = _mm256_cvtepu8_epi16(b);
    if (dt == TG__DT_E5M2)
        return _mm512_cvtph_ps(_mm256_slli_epi16(w, 8));
    __m256i em = _mm256_and_si256(w, _mm256_set1_epi16(0x7f));
    __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_xor_si256(w, em), 8), _mm256_slli_epi16(em, 7));
    __m512 f = _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
    return _mm512_mask_mov_ps(f, _mm256_cmpeq_epi16_mask(em, _mm256_set1_epi16(0x7f)), _mm512_set1_ps(NAN));
}

/* the first n <= 16 elements at p (dtype dt) as fp32, zeros past n */
TG__ALWAYS_INLINE __m512 tg__load16_f32(int dt, const void *p, int n)
{
    __mmask16 m = tg__m16(n);
    switch (dt) {
    case TG__DT_F32: return _mm512_maskz_loadu_ps(m, p);
    case TG__DT_F16: return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
    case TG__DT_BF16:
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
    case TG__DT_I8: return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
    default: return tg__f8x16_f32(dt, _mm_maskz_loadu_epi8(m, p));
    }
}

/* 16 x 16 transpose of 32-bit elements: r[i] holds row i on entry, column i on return */
TG__ALWAYS_INLINE void tg__transpose16(__m512i r[16])
{
    __m512i t[16];
    for (int i = 0; i < 16; i += 4) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
        t[i + 2] = _mm512_unpacklo_epi32(r[i + 2], r[i + 3]);
        t[i + 3] = _mm512_unpackhi_epi32(r[i + 2], r[i + 3]);
    }
    for (int i = 0; i < 16; i += 4) { /* r[i + c], lane L: column 4L + c of rows i..i+3 */
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int c = 0; c < 4; c++) { /* gather lane L of r[c], r[4 + c], r[8 + c], r[12 + c] */
        __m512i a = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), b = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
        __m512i e = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xee), f = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xee);
        t[c] = _mm512_shuffle_i32x4(a, b, 0x88);
        t[4 + c] = _mm512_shuffle_i32x4(a, b, 0xdd);
        t[8 + c] = _mm512_shuffle_i32x4(e, f, 0x88);
        t[12 + c] = _mm512_shuffle_i32x4(e, f, 0xdd);
    }
    for (int i = 0; i < 16; i++)
        r[i] = t[i];
}

/* ---- fp32 panels -------------------------------------------------------------------------------- */

/* dst[r * ldd + c] = src[r * ld + c] as fp32, r < rows, c < cols */
static inline void tg__pack_rows_f32(int dt, float *dst, long ldd, const void *src, long ld, int rows, int cols)
{
    int es = tg__esize(dt);
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c += 16)
            _mm512_storeu_ps(dst + r * ldd + c, tg__load16_f32(dt, (const char *)src + (r * ld + c) * es, cols - c));
}

/* dst[r * ldd + c] = src[c * ld + r] as fp32 (a transpose, 16 x 16 in registers); rows of dst are
 * written in whole vectors up to a multiple of 16 columns */
static inline void tg__pack_cols_f32(int dt, float *dst, long ldd, const void *src, long ld, int rows, int cols)
{
    int es = tg__esize(dt);
    __m512i v[16];
    for (int c0 = 0; c0 < cols; c0 += 16)
        for (int r0 = 0; r0 < rows; r0 += 16) {
            for (int q = 0; q < 16; q++)
                v[q] = c0 + q < cols ? _mm512_castps_si512(tg__load16_f32(dt, (const char *)src + ((c0 + q) * ld + r0) * es,
                                                                          rows - r0))
                                     : _mm512_setzero_si512();
            tg__transpose16(v);
            for (int r = 0; r < 16 && r0 + r < rows; r++)
                _mm512_storeu_si512(dst + (r0 + r) * ldd + c0, v[r]);
        }
}

/* ---- bf16 pair panels (vdpbf16ps) ------------------------------------------------------------- */
#ifdef __AVX512BF16__
#define TG__HAVE_BF16_PAIRS 1

#ifdef __AVX512VBMI__
/* e4m3 -> bf16 by table: the high and low byte of bf16(|x|) for each of the 128 codes of |x| (vpermi2b reads
 * only the low 7 bits of an index, so the sign bit needs no masking; it is or-ed into the high byte) */
static const uint8_t tg__e4m3_hi8[128] __attribute__((aligned(64))) = {
    0x00, 0x3b, 0x3b, 0x3b, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c,
    0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d,
    0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e,
    0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f,
    0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40,
    0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41,
    0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42,
    0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x7f};
static const uint8_t tg__e4m3_lo8[128] __attribute__((aligned(64))) = {
    0x00, 0x00, 0x80, 0xc0, 0x00, 0x20, 0x40, 0x60, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xc0};

/* 64 e4m3 codes -> the low bytes (*lo) and high bytes (*hi) of their bf16 values, byte for byte */
TG__ALWAYS_INLINE void tg__e4m3_bytes(__m512i x, __m512i *lo, __m512i *hi)
{
    __m512i h = _mm512_permutex2var_epi8(_mm512_load_si512(tg__e4m3_hi8), x, _mm512_load_si512(tg__e4m3_hi8 + 64));
    *lo = _mm512_permutex2var_epi8(_mm512_load_si512(tg__e4m3_lo8), x, _mm512_load_si512(tg__e4m3_lo8 + 64));
    *hi = _mm512_ternarylogic_epi32(h, x, _mm512_set1_epi8((char)0x80), 0xf8); /* h | (x & 0x80) */
}
#endif

/* the first n <= 32 elements at p (bf16 or fp8) as bf16 words, zeros past n */
TG__ALWAYS_INLINE __m512i tg__load32_bf16(int dt, const void *p, int n)
{
    if (dt == TG__DT_BF16)
        return _mm512_maskz_loadu_epi16(tg__m32(n), p);
#ifdef __AVX512VBMI__
    if (dt == TG__DT_E4M3) { /* two table lookups (vpermi2b) and an interleave: 5x cheaper than via fp32 */
        static const uint8_t pairs[64] __attribute__((aligned(64))) = { /* low byte i, high byte i: word i */
            0,  64, 1,  65, 2,  66, 3,  67, 4,  68, 5,  69, 6,  70, 7,  71, 8,  72, 9,  73, 10, 74,
            11, 75, 12, 76, 13, 77, 14, 78, 15, 79, 16, 80, 17, 81, 18, 82, 19, 83, 20, 84, 21, 85,
            22, 86, 23, 87, 24, 88, 25, 89, 26, 90, 27, 91, 28, 92, 29, 93, 30, 94, 31, 95};
        __m512i lo, hi;
        tg__e4m3_bytes(_mm512_maskz_loadu_epi8((__mmask64)tg__m32(n), p), &lo, &hi);
        return _mm512_permutex2var_epi8(lo, _mm512_load_si512(pairs), hi);
    }
#endif
    __m256i b = _mm256_maskz_loadu_epi8(tg__m32(n), p);
    __m512 lo = tg__f8x16_f32(dt, _mm256_castsi256_si128(b)), hi = tg__f8x16_f32(dt, _mm256_extracti128_si256(b, 1));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo); /* exact: every fp8 value is a bf16 value */
}

/* dst[r * ldd + c] = src[r * ld + c] as bf16 (fp8 converted), c < cols rounded up to 32 */
static inline void tg__pack_rows_bf16(int dt, uint16_t *dst, long ldd, const void *src, long ld, int rows, int cols)
{
    int es = tg__esize(dt);
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c += 32)
            _mm512_storeu_si512(dst + r * ldd + c, tg__load32_bf16(dt, (const char *)src + (r * ld + c) * es, cols - c));
}

/* Pair panel of S[k][x] = src[k * ks + x * xs] (one of ks, xs is 1), k < K, x < X: the 32-bit word
 * at dst + 2 * (p * ldd + x) holds S[2p][x] low and S[2p + 1][x] high (zero past K). */
static inline void tg__pack_pairs(int dt, uint16_t *dst, long ldd, const void *src, long ks, long xs, int K, int X)
{
    static const uint16_t perm[64] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                      8,  40, 9,  41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47,
                                      16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                      24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
    const char *s = (const char *)src;
    int es = tg__esize(dt), P = (K + 1) / 2;
    if (xs == 1) { /* rows of S are contiguous: interleave two rows */
        __m512i lo = _mm512_loadu_si512(perm), hi = _mm512_loadu_si512(perm + 32);
        for (int p = 0; p < P; p++)
            for (int x = 0; x < X; x += 32) {
                __m512i r0 = tg__load32_bf16(dt, s + (2 * p * ks + x) * es, X - x);
                __m512i r1 = 2 * p + 1 < K ? tg__load32_bf16(dt, s + ((2 * p + 1) * ks + x) * es, X - x)
                                           : _mm512_setzero_si512();
                _mm512_storeu_si512(dst + 2 * (p * ldd + x), _mm512_permutex2var_epi16(r0, lo, r1));
                _mm512_storeu_si512(dst + 2 * (p * ldd + x) + 32, _mm512_permutex2var_epi16(r0, hi, r1));
            }
        return;
    }
    __m512i v[16]; /* columns of S are contiguous: each is 16 pairs, transpose 16 x 16 pairs */
    for (int x0 = 0; x0 < X; x0 += 16)
        for (int p0 = 0; p0 < P; p0 += 16) {
            for (int q = 0; q < 16; q++)
                v[q] = x0 + q < X ? tg__load32_bf16(dt, s + ((x0 + q) * xs + 2 * p0) * es, K - 2 * p0)
                                  : _mm512_setzero_si512();
            tg__transpose16(v);
            for (int r = 0; r < 16 && p0 + r < P; r++)
                _mm512_storeu_si512(dst + 2 * ((p0 + r) * ldd + x0), v[r]);
        }
}

/* tg__pack_pairs for a B whose stored rows lie anywhere (tg_gemm_<dt>_rows): stored row r starts at the address
 * rows[r] + off bytes. rows_k: the stored rows are rows of S (S[k][x] = row k, element x: B not transposed), else
 * columns of S (B transposed). The same panel as tg__pack_pairs, with no copy of the rows first. */
static inline void tg__pack_pairs_rows(int dt, uint16_t *dst, long ldd, const int64_t *rows, long off, int rows_k,
                                       int K, int X)
{
    static const uint16_t perm[64] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                      8,  40, 9,  41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47,
                                      16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                      24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
    const int es = tg__esize(dt), P = (K + 1) / 2;
#define TG__ROW(r) ((const char *)(intptr_t)rows[r] + off)
    if (rows_k) { /* interleave two rows */
        __m512i lo = _mm512_loadu_si512(perm), hi = _mm512_loadu_si512(perm + 32);
        for (int p = 0; p < P; p++)
            for (int x = 0; x < X; x += 32) {
                __m512i r0 = tg__load32_bf16(dt, TG__ROW(2 * p) + (long)x * es, X - x);
                __m512i r1 = 2 * p + 1 < K ? tg__load32_bf16(dt, TG__ROW(2 * p + 1) + (long)x * es, X - x)
                                           : _mm512_setzero_si512();
                _mm512_storeu_si512(dst + 2 * (p * ldd + x), _mm512_permutex2var_epi16(r0, lo, r1));
                _mm512_storeu_si512(dst + 2 * (p * ldd + x) + 32, _mm512_permutex2var_epi16(r0, hi, r1));
            }
        return;
    }
    __m512i v[16]; /* each row is 16 pairs of a column of S: transpose 16 x 16 pairs */
    for (int x0 = 0; x0 < X; x0 += 16)
        for (int p0 = 0; p0 < P; p0 += 16) {
            for (int q = 0; q < 16; q++)
                v[q] = x0 + q < X ? tg__load32_bf16(dt, TG__ROW(x0 + q) + 2L * p0 * es, K - 2 * p0)
                                  : _mm512_setzero_si512();
            tg__transpose16(v);
            for (int r = 0; r < 16 && p0 + r < P; r++)
                _mm512_storeu_si512(dst + 2 * ((p0 + r) * ldd + x0), v[r]);
        }
#undef TG__ROW
}

/* ---- dot products along K (tg__gemm_dot) ----------------------------------------------------- */

/* The first n <= 64 elements at p (bf16 or fp8) as bf16 words in two vectors, zeros past n. The
 * elements come in an order of their own (e4m3 with VBMI: the low and high bytes of the table lookup
 * interleaved 128 bits at a time, elements 16L + 0..7 of each 128-bit lane L in *x0, 16L + 8..15 in *x1);
 * a dot product of two operands both loaded so is the same sum. */
TG__ALWAYS_INLINE void tg__load64_bf16(int dt, const void *p, int n, __m512i *x0, __m512i *x1)
{
#ifdef __AVX512VBMI__
    if (dt == TG__DT_E4M3) {
        __m512i lo, hi;
        tg__e4m3_bytes(_mm512_maskz_loadu_epi8(tg__m64(n), p), &lo, &hi);
        *x0 = _mm512_unpacklo_epi8(lo, hi);
        *x1 = _mm512_unpackhi_epi8(lo, hi);
        return;
    }
#endif
    *x0 = tg__load32_bf16(dt, p, n);
    *x1 = tg__load32_bf16(dt, (const char *)p + 32 * tg__esize(dt), n - 32);
}

#ifdef __AVX512VBMI__
#define TG__LOAD64_PERMUTES 1 /* tg__load64_bf16 leaves e4m3 out of K order */
#endif

/* dst[r * ldd + c] = src[r * ld + c] as bf16 in tg__load64_bf16's order, c < cols rounded up to 64 */
static inline void tg__pack_rows64_bf16(int dt, uint16_t *dst, long ldd, const void *src, long ld, int rows, int cols)
{
    int es = tg__esize(dt);
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c += 64) {
            __m512i x0, x1;
            tg__load64_bf16(dt, (const char *)src + (r * ld + c) * es, cols - c, &x0, &x1);
            _mm512_storeu_si512(dst + r * ldd + c, x0);
            _mm512_storeu_si512(dst + r * ldd + c + 32, x1);
        }
}

/* The pair panel of tg__pack_pairs for S[k][x] = src[x * xs + k] (columns of S contiguous), K in
 * tg__load64_bf16's order: 16 columns x 64 elements converted (the second halves parked in L1), two
 * 16 x 16 transposes of pairs; zero up to K rounded to 64. */
static inline void tg__pack_pairs64(int dt, uint16_t *dst, long ldd, const void *src, long xs, int K, int X)
{
    const char *s = (const char *)src;
    int es = tg__esize(dt);
    __m512i v[16], w[16] __attribute__((aligned(64)));
    for (int x0 = 0; x0 < X; x0 += 16)
        for (int k0 = 0; k0 < K; k0 += 64) {
            for (int q = 0; q < 16; q++) {
                __m512i hi = _mm512_setzero_si512();
                v[q] = hi;
                if (x0 + q < X)
                    tg__load64_bf16(dt, s + ((x0 + q) * xs + k0) * es, K - k0, &v[q], &hi);
                _mm512_store_si512(&w[q], hi);
            }
            tg__transpose16(v);
            for (int r = 0; r < 16; r++)
                _mm512_storeu_si512(dst + 2 * ((k0 / 2 + r) * ldd + x0), v[r]);
            for (int q = 0; q < 16; q++)
                v[q] = _mm512_load_si512(&w[q]);
            tg__transpose16(v);
            for (int r = 0; r < 16; r++)
                _mm512_storeu_si512(dst + 2 * ((k0 / 2 + 16 + r) * ldd + x0), v[r]);
        }
}

/* One vector whose lane e is the sum of v[e]'s 16 lanes: a reduction tree of 45 instructions. */
TG__ALWAYS_INLINE __m512 tg__hsum16(const __m512 v[16])
{
    __m512 w[8], z[4], y[2];
    for (int j = 0; j < 8; j++) /* 128-bit lane L of w[j]: lane-L partial sums of v[2j], v[2j + 1], twice */
        w[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
    for (int k = 0; k < 4; k++) { /* lane L, element p of z[k]: the lane-L sum of v[4k + p] */
        __m512d a = _mm512_castps_pd(w[2 * k]), b = _mm512_castps_pd(w[2 * k + 1]);
        z[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int t = 0; t < 2; t++) /* lanes of y[t]: halves of z[2t], then of z[2t + 1] */
        y[t] = _mm512_add_ps(_mm512_shuffle_f32x4(z[2 * t], z[2 * t + 1], 0x88),
                             _mm512_shuffle_f32x4(z[2 * t], z[2 * t + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xdd));
}

/* C[ROWS x N] (+)= A[ROWS x kc] B^T, B's rows (columns of C) ldb bytes apart, K contiguous: ROWS x 16 / ROWS
 * accumulators; each 64 elements of K of a column of B are loaded once (tg__load64_bf16) for every row. A is
 * packed: row r's elements k..k+63, loaded the same way, at a + r * lda + k (two vectors). */
TG__ALWAYS_INLINE void tg__dot_rows(int dt, int ROWS, int N, int kc, const uint16_t *a, long lda, const char *B,
                                    long ldb, float *C, long ldc, int first, tg__pf *pf)
{
    const int COLS = 16 / ROWS, es = tg__esize(dt), kfull = kc & ~63;
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int j0 = 0; j0 < N; j0 += COLS) {
        const char *b = B + (long)j0 * ldb;
        long cl[16]; /* byte offsets of the block's columns; past N, column N - 1 again (masked at the end) */
        for (int c = 0; c < COLS; c++)
            cl[c] = (j0 + c < N ? c : N - 1 - j0) * ldb;
        __m512 acc[16];
        for (int e = 0; e < 16; e++)
            acc[e] = _mm512_setzero_ps();
#define TG__DSTEP(N)                                                                               \
        for (int c = 0; c < COLS; c++) {                                                           \
            __m512i b0, b1;                                                                        \
            tg__load64_bf16(dt, b + cl[c] + (long)k * es, N, &b0, &b1);                            \
            for (int r = 0; r < ROWS; r++) {                                                       \
                const __m512bh *ar = (const __m512bh *)(a + r * lda + k);                          \
                acc[r * COLS + c] = _mm512_dpbf16_ps(acc[r * COLS + c], ar[0], (__m512bh)b0);      \
                acc[r * COLS + c] = _mm512_dpbf16_ps(acc[r * COLS + c], ar[1], (__m512bh)b1);      \
            }                                                                                      \
        }
        int k = 0;
        for (; k < kfull; k += 64)
            TG__DSTEP(64)
        if (k < kc)
            TG__DSTEP(kc - k)
#undef TG__DSTEP
        __m512 sum = tg__hsum16(acc); /* lane r * COLS + c: row r, column j0 + c */
        __mmask16 m = tg__m16(N - j0 < COLS ? N - j0 : COLS);
        for (int r = 0; r < ROWS; r++) {
            __m512 v = ROWS == 1 ? sum : _mm512_permutexvar_ps(_mm512_add_epi32(iota, _mm512_set1_epi32(r * COLS)), sum);
            float *c = C + r * ldc + j0;
            _mm512_mask_storeu_ps(c, m, first ? v : _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, c)));
        }
        if (pf)
            tg__pf_step(pf);
    }
}

/* tg__dot_rows with per-block scales (tg_gemm_<dt>_bscaled): C[ROWS x N] += sum over the blocks t of kb elements
 * of K (kb a multiple of 64, at most TG__SCALED_KB; K a multiple of kb) of sa[r * ldsa + t] * sb[t * ldsb + j] *
 * (row r of A . column j of B over block t). Each block's dot products stay 16-lane vectors, are scaled by one
 * fused multiply-add into running sums kept in L1 (tot) and summed across lanes once at the end, not once per
 * block. Blocks outer, columns inner: as with one gemm per block, the columns of a group of TG__SCALED_NG are read
 * a block at a time in turn (as many streams for the prefetchers), the next lines of each prefetched ahead. */
enum { TG__SCALED_NG = 32, TG__SCALED_KB = 256 }; /* columns per group (its running sums: ROWS x NG vectors) */
#define TG__SCALED_PFD 256 /* bytes ahead along a column of B prefetched (4 x 2112 x 7168 from DRAM: 2.05 -> 1.40 ms) */
TG__ALWAYS_INLINE void tg__dot_rows_scaled(int dt, int ROWS, int N, int K, int kb, const char *A, long lda,
                                           const char *B, long ldb, float *C, long ldc, const float *sa, long ldsa,
                                           const float *sb, long ldsb)
{
    enum { NG = TG__SCALED_NG };
    const int COLS = 16 / ROWS, es = tg__esize(dt);
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i rowlane = _mm512_srli_epi32(iota, ROWS == 4 ? 2 : 3); /* lane e: e / COLS (ROWS 2 or 4) */
    uint16_t abuf[4 * TG__SCALED_KB] __attribute__((aligned(64)));
    __m512 tot[4 * NG]; /* column block cb, output e = r * COLS + c: tot[cb * 16 + e] */
    float sct[16] __attribute__((aligned(64)));
    long cl[NG + 16];
    for (int j00 = 0; j00 < N; j00 += NG) {
        const int ncb = (TG__MIN(NG, N - j00) + COLS - 1) / COLS;
        for (int c = 0; c < ncb * COLS; c++) /* byte offsets of the columns; past N, column N - 1 (masked) */
            cl[c] = (long)(j00 + c < N ? j00 + c : N - 1) * ldb;
        for (int e = 0; e < ncb * 16; e++)
            tot[e] = _mm512_setzero_ps();
        for (int t = 0; t < K / kb; t++) {
            const int k0 = t * kb;
            for (int r = 0; r < ROWS; r++)
                for (int k = 0; k < kb; k += 64) {
                    __m512i x0, x1;
                    tg__load64_bf16(dt, A + ((long)r * lda + k0 + k) * es, 64, &x0, &x1);
                    _mm512_store_si512(abuf + r * kb + k, x0);
                    _mm512_store_si512(abuf + r * kb + k + 32, x1);
                }
            const __m128 s4 = _mm_setr_ps(sa[t], ROWS > 1 ? sa[ldsa + t] : 0.0f, ROWS > 2 ? sa[2 * ldsa + t] : 0.0f,
                                          ROWS > 3 ? sa[3 * ldsa + t] : 0.0f); /* sav, lane r * COLS + c: row r's */
            const __m512 sav = ROWS == 1 ? _mm512_broadcastss_ps(s4) : _mm512_permutexvar_ps(rowlane, _mm512_castps128_ps512(s4));
            const char *b = B + (long)k0 * es;
            for (int cb = 0; cb < ncb; cb++) {
                const int j0 = j00 + cb * COLS;
                const float *sbt = sb + (long)t * ldsb + j0;
                __m512 sbv = COLS == 16 ? _mm512_maskz_loadu_ps(tg__m16(N - j0), sbt)
                           : COLS == 8 ? _mm512_broadcast_f32x8(_mm256_maskz_loadu_ps((__mmask8)tg__m16(N - j0), sbt))
                           : COLS == 4 ? _mm512_broadcast_f32x4(_mm_maskz_loadu_ps((__mmask8)tg__m16(N - j0), sbt))
                           : _mm512_set1_ps(sbt[0]);
                _mm512_store_ps(sct, _mm512_mul_ps(sav, sbv));
                __m512 acc[16];
                for (int e = 0; e < 16; e++)
                    acc[e] = _mm512_setzero_ps();
                for (int k = 0; k < kb; k += 64)
                    for (int c = 0; c < COLS; c++) {
                        __m512i b0, b1;
                        __builtin_prefetch(b + cl[cb * COLS + c] + (long)k * es + TG__SCALED_PFD);
                        tg__load64_bf16(dt, b + cl[cb * COLS + c] + (long)k * es, 64, &b0, &b1);
                        for (int r = 0; r < ROWS; r++) {
                            const __m512bh *x = (const __m512bh *)(abuf + r * kb + k);
                            acc[r * COLS + c] = _mm512_dpbf16_ps(acc[r * COLS + c], x[0], (__m512bh)b0);
                            acc[r * COLS + c] = _mm512_dpbf16_ps(acc[r * COLS + c], x[1], (__m512bh)b1);
                        }
                    }
                for (int e = 0; e < 16; e++)
                    tot[cb * 16 + e] = _mm512_fmadd_ps(acc[e], _mm512_set1_ps(sct[e]), tot[cb * 16 + e]);
            }
        }
        for (int cb = 0; cb < ncb; cb++) {
            const int j0 = j00 + cb * COLS;
            __m512 sum = tg__hsum16(tot + cb * 16); /* lane r * COLS + c: row r, column j0 + c */
            __mmask16 m = tg__m16(N - j0 < COLS ? N - j0 : COLS);
            for (int r = 0; r < ROWS; r++) {
                __m512 v = r == 0 ? sum : _mm512_permutexvar_ps(_mm512_add_epi32(iota, _mm512_set1_epi32(r * COLS)), sum);
                float *c = C + r * ldc + j0;
                _mm512_mask_storeu_ps(c, m, _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, c)));
            }
        }
    }
}

/* tg__dot_rows_scaled for one row of A and K <= TG__ROW1_KMAX (a decode step with short weight rows): each row of B
 * (column of C) is read whole along K, in address order, with one 16-lane running sum that each block's products are
 * scaled into; S <= 8 groups of 16 rows side by side, 64 bytes of each in turn, so that S streams of 16 * K
 * contiguous bytes are in flight (from DRAM, 1 thread, 4K pages, e4m3: 1 x 24576 x 1536 9.9 -> 18.4 GB/s, 1 x 7168 x
 * 2048 11.9 -> 18.0, where 16 rows read a block of K at a time are 16 streams of only 24-32 lines each; 4 groups
 * 17.1 / 17.3; 128 bytes of a row at a time 13.4 instead of 19 at K = 7168). Columns past N repeat column N - 1 and
 * are masked at the end. */
enum { TG__ROW1_KMAX = 4096 };
/* Up to this K the groups are read one at a time (S = 1): one sequential stream of the call's rows in address order,
 * faster than 8 groups side by side (e4m3 from DRAM, 1 thread, paired medians of 11: fp8_gemm_nt 1 x 24576 x 1536
 * 1.02-1.08x, 1 x 7168 x 2048 1.07-1.18x; this routine alone in 128-row calls 1.14x / 1.23x). Longer rows read a
 * line of the scale tile (ldsb floats apart) per block of K and row, 32 of them at K = 4096 (there 1.0x), 56 at
 * K = 7168 (0.6x). */
enum { TG__ROW1_SEQ_K = 2048 };
TG__ALWAYS_INLINE void tg__row1_groups(int dt, int S, int N, int K, int kb, const uint16_t *abuf, const char *B,
                                       long ldb, float *C, const float *sa, const float *sb, long ldsb, int j0)
{
    const int es = tg__esize(dt);
    __m512 tot[8][16];
    for (int c = 0; c < 16; c++) {
        const char *b[8];
        int col[8];
        __m512 t[8];
        for (int g = 0; g < S; g++) {
            col[g] = TG__MIN(j0 + 16 * g + c, N - 1);
            b[g] = B + (long)col[g] * ldb;
            t[g] = _mm512_setzero_ps();
        }
        for (int k0 = 0, blk = 0; k0 < K; k0 += kb, blk++) {
            __m512 p[8], q[8]; /* two chains per row: alternate 64s of the block */
            for (int g = 0; g < S; g++)
                p[g] = q[g] = _mm512_setzero_ps();
            for (int k = k0; k < k0 + kb; k += 64) {
                const __m512bh *x = (const __m512bh *)(abuf + k);
                for (int g = 0; g < S; g++) {
                    __m512i x0, x1;
                    tg__load64_bf16(dt, b[g] + (long)k * es, 64, &x0, &x1);
                    if ((k - k0) % 128 == 0)
                        p[g] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(p[g], x[0], (__m512bh)x0), x[1], (__m512bh)x1);
                    else
                        q[g] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(q[g], x[0], (__m512bh)x0), x[1], (__m512bh)x1);
                }
            }
            const float s = sa[blk];
            for (int g = 0; g < S; g++)
                t[g] = _mm512_fmadd_ps(_mm512_add_ps(p[g], q[g]), _mm512_set1_ps(s * sb[(long)blk * ldsb + col[g]]), t[g]);
        }
        for (int g = 0; g < S; g++)
            tot[g][c] = t[g];
    }
    for (int g = 0; g < S; g++) {
        const int j = j0 + 16 * g;
        const __mmask16 m = tg__m16(N - j);
        _mm512_mask_storeu_ps(C + j, m, _mm512_add_ps(tg__hsum16(tot[g]), _mm512_maskz_loadu_ps(m, C + j)));
    }
}

TG__ALWAYS_INLINE void tg__dot_row1_scaled(int dt, int N, int K, int kb, const char *A, const char *B, long ldb,
                                           float *C, const float *sa, const float *sb, long ldsb)
{
    const int es = tg__esize(dt), groups = (N + 15) / 16;
    uint16_t abuf[TG__ROW1_KMAX] __attribute__((aligned(64)));
    for (int k = 0; k < K; k += 64) {
        __m512i x0, x1;
        tg__load64_bf16(dt, A + (long)k * es, 64, &x0, &x1);
        _mm512_store_si512(abuf + k, x0);
        _mm512_store_si512(abuf + k + 32, x1);
    }
    int g = 0;
    if (K <= TG__ROW1_SEQ_K) { /* one stream: the rows in address order */
        for (; g < groups; g++)
            tg__row1_groups(dt, 1, N, K, kb, abuf, B, ldb, C, sa, sb, ldsb, 16 * g);
        return;
    }
    for (; g + 8 <= groups; g += 8)
        tg__row1_groups(dt, 8, N, K, kb, abuf, B, ldb, C, sa, sb, ldsb, 16 * g);
    if (groups - g >= 4) {
        tg__row1_groups(dt, 4, N, K, kb, abuf, B, ldb, C, sa, sb, ldsb, 16 * g);
        g += 4;
    }
    if (groups - g >= 2) {
        tg__row1_groups(dt, 2, N, K, kb, abuf, B, ldb, C, sa, sb, ldsb, 16 * g);
        g += 2;
    }
    if (groups - g)
        tg__row1_groups(dt, 1, N, K, kb, abuf, B, ldb, C, sa, sb, ldsb, 16 * g);
}
#endif

/* ---- int8 quad panels (vpdpbusd) --------------------------------------------------------------- */
#ifdef __AVX512VNNI__
#define TG__HAVE_I8_QUADS 1

/* dst[r * ldd + c] = src[r * ld + c] + 128 as uint8 (A's offset), c < cols rounded up to 64 */
static inline void tg__pack_rows_u8(int8_t *dst, long ldd, const int8_t *src, long ld, int rows, int cols)
{
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c += 64)
            _mm512_storeu_si512(dst + r * ldd + c, _mm512_xor_si512(_mm512_maskz_loadu_epi8(tg__m64(cols - c), src + r * ld + c),
                                                                    _mm512_set1_epi8((char)0x80)));
}

/* Quad panel of S[k][x] = src[k * ks + x * xs] (one of ks, xs is 1): the 32-bit word at
 * dst + 4 * (q * ldd + x) holds S[4q..4q+3][x] (zero past K), or with cs == NULL (A's panel) those
 * bytes + 128 as uint8. cs gets the column sums of S added, for the unsigned-offset correction. */
static inline void tg__pack_quads(int8_t *dst, long ldd, const int8_t *src, long ks, long xs, int K, int X, int32_t *cs)
{
    const __m512i ones = _mm512_set1_epi8(1), off = _mm512_set1_epi8(cs ? 0 : (char)0x80);
    int Q = (K + 3) / 4;
    if (xs == 1) { /* rows of S are contiguous: interleave four rows, 64 columns at a time */
        for (int q = 0; q < Q; q++)
            for (int x = 0; x < X; x += 64) {
                __m512i r[4];
                for (int t = 0; t < 4; t++)
                    r[t] = 4 * q + t < K ? _mm512_maskz_loadu_epi8(tg__m64(X - x), src + (4 * q + t) * ks + x)
                                         : _mm512_setzero_si512();
                __m512i t0 = _mm512_unpacklo_epi8(r[0], r[1]), t1 = _mm512_unpackhi_epi8(r[0], r[1]);
                __m512i t2 = _mm512_unpacklo_epi8(r[2], r[3]), t3 = _mm512_unpackhi_epi8(r[2], r[3]);
                __m512i u0 = _mm512_unpacklo_epi16(t0, t2), u1 = _mm512_unpackhi_epi16(t0, t2);
                __m512i u2 = _mm512_unpacklo_epi16(t1, t3), u3 = _mm512_unpackhi_epi16(t1, t3);
                /* u_m, lane L: columns 16L + 4m .. +3; gather lane L of u0..u3 */
                __m512i a = _mm512_shuffle_i32x4(u0, u1, 0x44), b = _mm512_shuffle_i32x4(u2, u3, 0x44);
                __m512i e = _mm512_shuffle_i32x4(u0, u1, 0xee), f = _mm512_shuffle_i32x4(u2, u3, 0xee);
                __m512i o[4] = {_mm512_shuffle_i32x4(a, b, 0x88), _mm512_shuffle_i32x4(a, b, 0xdd),
                                _mm512_shuffle_i32x4(e, f, 0x88), _mm512_shuffle_i32x4(e, f, 0xdd)};
                for (int l = 0; l < 4 && x + 16 * l < X; l++) {
                    _mm512_storeu_si512(dst + 4 * (q * ldd + x + 16 * l), _mm512_xor_si512(o[l], off));
                    if (cs)
                        _mm512_storeu_si512(cs + x + 16 * l,
                                            _mm512_dpbusd_epi32(_mm512_loadu_si512(cs + x + 16 * l), ones, o[l]));
                }
            }
        return;
    }
    __m512i v[16]; /* columns of S are contiguous: each is 16 quads, transpose 16 x 16 quads */
    for (int x0 = 0; x0 < X; x0 += 16)
        for (int q0 = 0; q0 < Q; q0 += 16) {
            for (int t = 0; t < 16; t++)
                v[t] = x0 + t < X ? _mm512_maskz_loadu_epi8(tg__m64(K - 4 * q0), src + (x0 + t) * xs + 4 * q0)
                                  : _mm512_setzero_si512();
            tg__transpose16(v);
            for (int r = 0; r < 16 && q0 + r < Q; r++) {
                _mm512_storeu_si512(dst + 4 * ((q0 + r) * ldd + x0), _mm512_xor_si512(v[r], off));
                if (cs)
                    _mm512_storeu_si512(cs + x0, _mm512_dpbusd_epi32(_mm512_loadu_si512(cs + x0), ones, v[r]));
            }
        }
}
#endif

/* ---- the register-blocked kernel ----------------------------------------------------------------- */

/* One unit of row i of A, broadcast: a float, a bf16 pair, or four uint8 (A + 128, packed so). A last
 * bf16 unit may be partial (n = 1 of 2): only that element is read, the other is zero. */
TG__ALWAYS_INLINE __m512 tg__bcast(int fmt, const char *p, int n)
{
    if (fmt == TG__F32)
        return _mm512_set1_ps(*(const float *)p);
    uint32_t u = 0;
    memcpy(&u, p, n ? (size_t)n * 2 : 4);
    return _mm512_castsi512_ps(_mm512_set1_epi32((int)u));
}

TG__ALWAYS_INLINE __m512 tg__dot(int fmt, __m512 c, __m512 a, __m512 b)
{
#ifdef TG__HAVE_BF16_PAIRS
    if (fmt == TG__BF16)
        return _mm512_dpbf16_ps(c, (__m512bh)a, (__m512bh)b);
#endif
#ifdef TG__HAVE_I8_QUADS
    if (fmt == TG__I8)
        return _mm512_castsi512_ps(_mm512_dpbusd_epi32(_mm512_castps_si512(c), _mm512_castps_si512(a),
                                                       _mm512_castps_si512(b)));
#endif
    return _mm512_fmadd_ps(a, b, c);
}

/* C[ROWS x nr] (+)= A-units x B-units over `units` whole units and a last unit of `tail` elements.
 * Row i's unit u is at A + i * ars + u * aus (bytes); unit row u of B at B + u * bus, its columns
 * contiguous. ROWS is a constant at every call; nr <= 32 columns are masked. The sums start from zero
 * and C is added at the end, so that its loads (from L2 for a 64 KiB tile) overlap the products
 * instead of holding up the first ones (+6% on the README kernel in bf16). fmt TG__F32 with c_i32:
 * the fp32 sums (exact for int8 chunks) are converted and added to the int32 C. fmt TG__I8:
 * cs holds the column sums of B for the +128 offset of A. */
TG__ALWAYS_INLINE void tg__kernel(int fmt, int ROWS, int units, int tail, const char *A, long ars, long aus,
                                  const char *B, long bus, int nr, void *C, long ldc, int clear, int c_i32,
                                  const int32_t *cs)
{
    __m512 c0[TG_GEMM_MR], c1[TG_GEMM_MR];
    __mmask16 m0 = tg__m16(nr), m1 = tg__m16(nr - 16);
    int full = nr >= 32;
    for (int i = 0; i < ROWS; i++)
        c0[i] = c1[i] = _mm512_setzero_ps();
#define TG__STEP(N)                                                                          \
    {                                                                                        \
        __m512 b0 = full ? _mm512_loadu_ps(B) : _mm512_maskz_loadu_ps(m0, B);                \
        __m512 b1 = full ? _mm512_loadu_ps(B + 64) : _mm512_maskz_loadu_ps(m1, B + 64);      \
        for (int i = 0; i < ROWS; i++) {                                                     \
            __m512 a = tg__bcast(fmt, A + i * ars + u * aus, N);                             \
            c0[i] = tg__dot(fmt, c0[i], a, b0);                                              \
            c1[i] = tg__dot(fmt, c1[i], a, b1);                                              \
        }                                                                                    \
    }
    int u = 0;
    for (; u < units; u++, B += bus)
        TG__STEP(0)
    if (tail)
        TG__STEP(tail)
#undef TG__STEP
    __m512i k0 = _mm512_setzero_si512(), k1 = k0;
    if (fmt == TG__I8) {
        k0 = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(m0, cs), 7);
        k1 = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(m1, cs + 16), 7);
    }
    for (int i = 0; i < ROWS; i++) {
        __m512 v[2] = {c0[i], c1[i]};
        __m512i kk[2] = {k0, k1};
        __mmask16 m[2] = {m0, m1};
        for (int h = 0; h < 2; h++) {
            char *c = (char *)C + 4 * (i * ldc + 16 * h);
            __m512 old = clear ? _mm512_setzero_ps() : full ? _mm512_loadu_ps(c) : _mm512_maskz_loadu_ps(m[h], c);
            if (fmt == TG__I8) {
                __m512i x = _mm512_sub_epi32(_mm512_castps_si512(v[h]), kk[h]);
                v[h] = _mm512_castsi512_ps(_mm512_add_epi32(x, _mm512_castps_si512(old)));
            } else if (!c_i32) {
                v[h] = clear ? v[h] : _mm512_add_ps(v[h], old);
            } else {
                __m512i x = _mm512_cvtps_epi32(v[h]); /* integer-valued, so exact */
                v[h] = _mm512_castsi512_ps(_mm512_add_epi32(x, _mm512_castps_si512(old)));
            }
            if (full)
                _mm512_storeu_ps(c, v[h]);
            else
                _mm512_mask_storeu_ps(c, m[h], v[h]);
        }
    }
}

#endif /* TEGULA_GEMM_AVX512_H */
