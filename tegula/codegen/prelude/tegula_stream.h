/* Streaming copies for the c target: what T.copy(..., eviction_policy="evict_first") of a contiguous run becomes.
 * The destination lines are written with non-temporal stores: not read first (a plain store reads a line it does
 * not own before writing it) and not kept in cache, so a copy far larger than the cache moves a third less
 * memory traffic. They are weakly ordered: a kernel that streams ends every thread with tg_store_fence(), so what
 * it wrote is visible to whoever sees the kernel finished. AVX-512, AVX2 and SSE2 paths; elsewhere memcpy.
 * tg_stream_cvt_f32_bf16 streams a float32 run rounded to bfloat16 (a converting copy), bit for bit as
 * tg_f32_to_bf16 rounds: where __AVX512BF16__, 32 values in one vcvtne2ps2bf16 (round to nearest even, as the
 * software rounding) unless one of them is a NaN or a subnormal (the instruction flushes those to zero and keeps a
 * NaN's payload), which take the integer rounding; AVX-512 BW without it, that integer rounding 32 lanes at a
 * time; AVX2 / SSE2 round into a small staging buffer streamed out; plain C stores. */
#ifndef TEGULA_STREAM_H
#define TEGULA_STREAM_H
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <immintrin.h>
#endif
#include "tegula_types.h"

#define TG_STREAM_MIN 256 /* shorter runs are plain copies: too short to gain, and they may share lines */

static inline void tg_stream_copy(void *dst, const void *src, size_t n) {
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__SSE2__)
    char *d = (char *)dst;
    const char *s = (const char *)src;
#if defined(__AVX512F__)
    const size_t V = 64;
#elif defined(__AVX2__)
    const size_t V = 32;
#else
    const size_t V = 16;
#endif
    if (n < TG_STREAM_MIN) {
        memcpy(d, s, n);
        return;
    }
    size_t head = (V - ((uintptr_t)d & (V - 1))) & (V - 1); /* up to the first aligned vector of d */
    memcpy(d, s, head);
    d += head, s += head, n -= head;
    for (; n >= V; n -= V, d += V, s += V) {
#if defined(__AVX512F__)
        _mm512_stream_si512((void *)d, _mm512_loadu_si512((const void *)s));
#elif defined(__AVX2__)
        _mm256_stream_si256((__m256i *)d, _mm256_loadu_si256((const __m256i *)s));
#else
        _mm_stream_si128((__m128i *)d, _mm_loadu_si128((const __m128i *)s));
#endif
    }
    memcpy(d, s, n);
#else
    memcpy(dst, src, n);
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* 32 float32 (a: the first 16, b: the next 16) rounded to bfloat16 as tg_f32_to_bf16 rounds: x + 0x7fff plus the
 * kept lsb, its high half; a NaN gives 0x7fc0 */
static inline __m512i tg__bf16x32_int(__m512 a, __m512 b) {
    const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7fff), qnan = _mm512_set1_epi32(0x7fc00000);
    const __m512i abs = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
    const __m512i hi = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27, 25,
                                        23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    __m512i x = _mm512_castps_si512(a), y = _mm512_castps_si512(b);
    __m512i rx = _mm512_add_epi32(_mm512_add_epi32(x, half), _mm512_and_si512(_mm512_srli_epi32(x, 16), one));
    __m512i ry = _mm512_add_epi32(_mm512_add_epi32(y, half), _mm512_and_si512(_mm512_srli_epi32(y, 16), one));
    rx = _mm512_mask_mov_epi32(rx, _mm512_cmpgt_epu32_mask(_mm512_and_si512(x, abs), inf), qnan);
    ry = _mm512_mask_mov_epi32(ry, _mm512_cmpgt_epu32_mask(_mm512_and_si512(y, abs), inf), qnan);
    return _mm512_permutex2var_epi16(rx, hi, ry);  /* the high halves, in order */
}

static inline __m512i tg__bf16x32(__m512 a, __m512 b) {
#if defined(__AVX512BF16__)
    /* fpclass 0x81 | 0x20: quiet or signalling NaN, or subnormal */
    if (__builtin_expect((_mm512_fpclass_ps_mask(a, 0xa1) | _mm512_fpclass_ps_mask(b, 0xa1)) == 0, 1))
        return (__m512i)_mm512_cvtne2ps_pbh(b, a);
#endif
    return tg__bf16x32_int(a, b);
}
#endif

static inline void tg_stream_cvt_f32_bf16(tg_bf16 *d, const float *s, size_t n) {
    size_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (n >= 64 && !((uintptr_t)d & 1)) {
        size_t head = ((64 - ((uintptr_t)d & 63)) & 63) / 2; /* values up to the first aligned line of d */
        for (; i < head; ++i) d[i] = tg_f32_to_bf16(s[i]);
        for (; i + 32 <= n; i += 32)
            _mm512_stream_si512((void *)(d + i), tg__bf16x32(_mm512_loadu_ps(s + i), _mm512_loadu_ps(s + i + 16)));
    }
#elif defined(__AVX2__) || defined(__SSE2__)
#if defined(__AVX2__)
    enum { V = 16 };
#else
    enum { V = 8 };
#endif
    if (n >= 64 && !((uintptr_t)d & 1)) {
        tg_bf16 t[V] __attribute__((aligned(32)));
        size_t head = ((2 * V - ((uintptr_t)d & (2 * V - 1))) & (2 * V - 1)) / 2;
        for (; i < head; ++i) d[i] = tg_f32_to_bf16(s[i]);
        for (; i + V <= n; i += V) {
            for (int k = 0; k < V; ++k) t[k] = tg_f32_to_bf16(s[i + k]);
#if defined(__AVX2__)
            _mm256_stream_si256((__m256i *)(d + i), _mm256_load_si256((const __m256i *)t));
#else
            _mm_stream_si128((__m128i *)(d + i), _mm_load_si128((const __m128i *)t));
#endif
        }
    }
#endif
    for (; i < n; ++i) d[i] = tg_f32_to_bf16(s[i]);
}

static inline void tg_store_fence(void) {
#if defined(__SSE2__)
    _mm_sfence();
#endif
}
#endif
