/* Streaming copies for the c target: what T.copy(..., eviction_policy="evict_first") of a contiguous run becomes.
 * The destination lines are written with non-temporal stores: not read first (a plain store reads a line it does
 * not own before writing it) and not kept in cache, so a copy far larger than the cache moves a third less
 * memory traffic. They are weakly ordered: a kernel that streams ends every thread with tg_store_fence(), so what
 * it wrote is visible to whoever sees the kernel finished. AVX-512, AVX2 and SSE2 paths; elsewhere memcpy. */
#ifndef TEGULA_STREAM_H
#define TEGULA_STREAM_H
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

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

static inline void tg_store_fence(void) {
#if defined(__SSE2__)
    _mm_sfence();
#endif
}
#endif
