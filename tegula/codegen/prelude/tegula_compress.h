/* Compressing stores for the c target: what a serial loop of the form
 *     for j: if cond: buf[n] = v; n = n + 1
 * becomes (the emitter's compress idiom, tegula/codegen/c.py). Its iterations run in groups of 16: a vector
 * loop computes the 16 conditions and values into small arrays, tg_mask16 turns the conditions into a bit mask
 * and tg_compress16_32 appends the values whose bit is set, in lane order, at dst (it writes exactly popcount
 * elements: nothing past them). 32-bit elements (16-bit integers: below); the emitter keeps the plain loop for
 * other widths.
 * AVX-512: vpcompressd into a register and a masked store (the memory form of vpcompressd is slow on Zen 4);
 * AVX2 + BMI2: a permutation of each 8-lane half built from the mask (pdep / pext) and a masked store;
 * elsewhere plain C that walks the set bits.
 * 16-bit integers go 32 per group (tg_mask32_16, tg_compress32_16): vpcompressw where AVX-512 VBMI2 is, else
 * plain C.
 * The masks take lanes that are 0 or -1 (the emitter writes -(condition)): AVX-512 reads their sign bits
 * (vpmovd2m / vpmovw2m, a port-0 uop on Intel, where vptestm took port 5 beside the compares and compresses).
 * Their 32 lanes are read by one 512-bit load: in the emitter's loops gcc keeps the lanes in registers and drops
 * the store and load (read as two 256-bit halves, it joined two extracted halves again: an extract and an insert
 * per operand and group, 3% of the b1 8K k2048 top-k kernel). */
#ifndef TEGULA_COMPRESS_H
#define TEGULA_COMPRESS_H
#include <stdint.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__BMI2__))
#include <immintrin.h>
#endif

/* the plain-C paths, for lanes of any integer width: TG__MASK_LOOP sets bit l of r when m[l] != 0 (n lanes);
 * TG__COMPRESS_WALK appends the elements of type T of src whose bit is set in mask, in order, at dst */
#define TG__MASK_LOOP(r, m, n)                   \
    for (int l_ = 0; l_ < (n); ++l_)            \
        (r) |= (uint32_t)((m)[l_] != 0) << l_
#define TG__COMPRESS_WALK(T, dst, src, mask)     \
    do {                                         \
        T *d_ = (T *)(dst);                      \
        const T *s_ = (const T *)(src);          \
        uint32_t m_ = (mask);                    \
        while (m_) {                             \
            *d_++ = s_[__builtin_ctz(m_)];       \
            m_ &= m_ - 1u;                       \
        }                                        \
    } while (0)

/* bit l of the result is set when m[l] != 0 (m[l] is 0 or -1) */
static inline uint32_t tg_mask16(const int32_t *m) {
#if defined(__AVX512F__) && defined(__AVX512DQ__)
    return (uint32_t)_mm512_movepi32_mask(_mm512_loadu_si512((const void *)m));
#elif defined(__AVX512F__)
    __m512i v = _mm512_loadu_si512((const void *)m);
    return (uint32_t)_mm512_test_epi32_mask(v, v);
#elif defined(__AVX2__) && defined(__BMI2__)
    __m256i z = _mm256_setzero_si256();
    __m256i lo = _mm256_cmpeq_epi32(_mm256_loadu_si256((const __m256i *)m), z);
    __m256i hi = _mm256_cmpeq_epi32(_mm256_loadu_si256((const __m256i *)(m + 8)), z);
    uint32_t eq = (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(lo)) |
                  ((uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(hi)) << 8);
    return ~eq & 0xFFFFu;
#else
    uint32_t r = 0;
    TG__MASK_LOOP(r, m, 16);
    return r;
#endif
}

/* bit l of the result is set when m[l] != 0 (0 or -1), for 16 lanes of 16 bits (conditions on 16-bit operands:
 * their vector compare gives 16-bit lanes, twice as many per register as 32-bit ones) */
static inline uint32_t tg_mask16_16(const int16_t *m) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    return (uint32_t)_mm256_movepi16_mask(_mm256_loadu_si256((const __m256i *)m));
#elif defined(__AVX2__) && defined(__BMI2__)
    __m256i v = _mm256_loadu_si256((const __m256i *)m);
    __m128i b = _mm_packs_epi16(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));   /* lanes in order */
    return (uint32_t)_mm_movemask_epi8(_mm_cmpeq_epi8(b, _mm_setzero_si128())) ^ 0xFFFFu;
#else
    uint32_t r = 0;
    TG__MASK_LOOP(r, m, 16);
    return r;
#endif
}

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__BMI2__)
/* the set lanes of the 8 in src (bits of mask8) to the front of dst, then their count */
static inline int tg__compress8_32(int32_t *dst, const int32_t *src, uint32_t mask8) {
    /* one byte 0xFF per set bit, then the lane numbers (bytes 0..7) of those bytes, packed to the front */
    uint64_t sel = _pdep_u64(mask8, 0x0101010101010101ull) * 0xFFu;
    uint64_t lanes = _pext_u64(0x0706050403020100ull, sel);
    __m256i perm = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)lanes));
    __m256i v = _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)src), perm);
    int n = __builtin_popcount(mask8);
    __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    _mm256_maskstore_epi32((int *)dst, keep, v);
    return n;
}
#endif

/* append the 32-bit elements src[l] with bit l of mask set, in order, at dst: popcount(mask) stores */
static inline void tg_compress16_32(void *dst, const void *src, uint32_t mask) {
#if defined(__AVX512F__)
    __m512i c = _mm512_maskz_compress_epi32((__mmask16)mask, _mm512_loadu_si512(src));
    _mm512_mask_storeu_epi32(dst, (__mmask16)((1u << __builtin_popcount(mask)) - 1u), c);
#elif defined(__AVX2__) && defined(__BMI2__)
    int n = tg__compress8_32((int32_t *)dst, (const int32_t *)src, mask & 0xFFu);
    tg__compress8_32((int32_t *)dst + n, (const int32_t *)src + 8, (mask >> 8) & 0xFFu);
#else
    TG__COMPRESS_WALK(uint32_t, dst, src, mask);
#endif
}

/* bit l of the result is set when m[l] != 0 (0 or -1), for 32 lanes of 16 bits */
static inline uint32_t tg_mask32_16(const int16_t *m) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    return (uint32_t)_mm512_movepi16_mask(_mm512_loadu_si512((const void *)m));
#else
    return tg_mask16_16(m) | (tg_mask16_16(m + 16) << 16);
#endif
}

/* append the 16-bit elements src[l] with bit l of mask set, in order, at dst: popcount(mask) stores */
static inline void tg_compress32_16(void *dst, const void *src, uint32_t mask) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VBMI2__)
    __m512i v = _mm512_loadu_si512(src);
    __m512i c = _mm512_maskz_compress_epi16((__mmask32)mask, v);
    uint32_t n = (uint32_t)__builtin_popcount(mask);
#if defined(__BMI2__)
    _mm512_mask_storeu_epi16(dst, (__mmask32)_bzhi_u32(0xFFFFFFFFu, n), c);
#else
    _mm512_mask_storeu_epi16(dst, (__mmask32)(n == 32 ? 0xFFFFFFFFu : (1u << n) - 1u), c);
#endif
#else
    TG__COMPRESS_WALK(uint16_t, dst, src, mask);
#endif
}
#endif
