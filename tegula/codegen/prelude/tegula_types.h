/* tegula_types.h: storage types, conversions and scalar helpers for generated C kernels.
 *
 * Included by every kernel, so it stays cheap: only the four standard headers below, plain C11
 * (gnu11 is what the CPU backend uses), no ISA intrinsics.  Everything is `static inline` and
 * written so that gcc/clang -O3 vectorise loops over it: no data-dependent branches (the
 * ternaries are selects), bit casts via memcpy.
 *
 * Narrow floats are kept as raw bits and never computed on directly: ops widen to float,
 * compute, and round back.  Every narrow value is exact in float, so the to_f32 direction is
 * exact and fp8 <-> bf16/f16 via float rounds once.
 *
 * The conversions are bit-exact with torch 2.13 `tensor.to(dtype)` on CPU, including the
 * places where torch and ml_dtypes disagree (torch wins):
 *   - f32 -> bf16/f16/fp8: round to nearest, ties to even, subnormals exact.
 *   - f32 -> f16, f32 -> f8e5m2: overflow gives +-inf (f8e5m2: 61440 -> inf, 57344 stays).
 *   - f32 -> f8e4m3 (float8_e4m3fn, no inf): saturates; every finite |x| >= 464 and +-inf give
 *     +-448 (ml_dtypes gives NaN instead).
 *   - f32 -> f8e8m0 (float8_e8m0fnu, unsigned power of two 2^(e-127), 0xff = NaN): the sign is
 *     dropped (-1 -> 1), |x| >= 1.5 * 2^k rounds up to 2^(k+1), overflow, inf and NaN give NaN,
 *     and 0 gives code 0 = 2^-127; see tg_f32_to_f8e8m0 (ml_dtypes gives NaN for x <= 0).
 *   - NaN: f32 -> f16 quiets the NaN and keeps the sign and the top payload bits (as F16C and
 *     aarch64 FCVT do); -> f8e4m3/f8e5m2 gives sign | 0x7f; -> f8e8m0 gives 0xff; -> bf16 gives
 *     0x7fc0 (torch's scalar path; its vectorised x86 path writes 0xffff, also a NaN).
 *     Widening: bf16 keeps the bits, f16/f8e5m2 NaN -> quiet NaN with sign and payload,
 *     f8e4m3 0x7f/0xff -> +-0x7ff00000, f8e8m0 0xff -> 0x7f800001.
 *
 * Integer `//` and `%` follow Python (floor) semantics.  A zero divisor gives 0 instead of
 * trapping, and INT_MIN // -1 wraps to INT_MIN (two's complement, what -fwrapv gives for
 * -INT_MIN) with INT_MIN % -1 == 0; neither ever raises SIGFPE.
 */
#ifndef TEGULA_TYPES_H
#define TEGULA_TYPES_H

/* The SIMT preludes (tegula_simt.h) include this file too: OpenCL C has no standard headers (the
 * prelude typedefs the fixed-width types first) and CUDA needs device functions, hence TG_INLINE. */
#ifndef TG_INLINE
#define TG_INLINE static inline
#endif
#ifndef __OPENCL_VERSION__
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>
#endif

typedef uint16_t tg_bf16;
typedef uint16_t tg_f16;
typedef uint8_t tg_f8e4m3;
typedef uint8_t tg_f8e5m2;
typedef uint8_t tg_f8e8m0;

/* ---- bit casts ------------------------------------------------------------------------- */

#ifdef __OPENCL_VERSION__
TG_INLINE uint32_t tg__f32_bits(float f) { return as_uint(f); }
TG_INLINE float tg__bits_f32(uint32_t u) { return as_float(u); }
#else
TG_INLINE uint32_t tg__f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

TG_INLINE float tg__bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
#endif

/* ---- narrow -> float32 (exact) ---------------------------------------------------------- */

TG_INLINE float tg_bf16_to_f32(tg_bf16 x) { return tg__bits_f32((uint32_t)x << 16); }

/* m * 2^(1 - bias - mbits), the value of a narrow subnormal with mantissa m, as float32 bits.
 * Integer-only on purpose: under gcc's default -ftrapping-math a float op that only one side of
 * a select needs is not if-converted, and the whole loop stays scalar. */
TG_INLINE uint32_t tg__subnormal_bits(uint32_t m, uint32_t mbits, uint32_t bias) {
    uint32_t p = 0; /* floor(log2(m)) */
    for (uint32_t k = 1; k < mbits; k++)
        p += m >= (1u << k);
    uint32_t bits = ((p + 127u + 1u - bias - mbits) << 23) | ((m << (23u - p)) & 0x007fffffu);
    return m == 0u ? 0u : bits;
}

TG_INLINE float tg_f16_to_f32(tg_f16 x) {
    uint32_t sign = (uint32_t)(x & 0x8000u) << 16;
    uint32_t em = x & 0x7fffu;
    uint32_t mant = em & 0x03ffu;
    uint32_t normal = (em << 13) + ((127u - 15u) << 23);
    uint32_t special = 0x7f800000u | (mant << 13) | (mant ? 0x00400000u : 0u); /* inf, quiet NaN */
    uint32_t mag = em < 0x0400u ? tg__subnormal_bits(em, 10u, 15u) : (em >= 0x7c00u ? special : normal);
    return tg__bits_f32(sign | mag);
}

TG_INLINE float tg_f8e4m3_to_f32(tg_f8e4m3 x) {
    uint32_t sign = (uint32_t)(x & 0x80u) << 24;
    uint32_t em = x & 0x7fu;
    uint32_t normal = (em << 20) + ((127u - 7u) << 23);
    /* subnormal codes are em * 2^-9, exactly: computed unconditionally and merged by mask, so that the loop
     * vectorises (tg__subnormal_bits' select chain is slower here) */
    uint32_t sub = tg__f32_bits((float)(int32_t)em * 0.001953125f);
    uint32_t low = 0u - (uint32_t)(em < 0x08u);
    uint32_t mag = (sub & low) | (normal & ~low);
    return tg__bits_f32(sign | (em == 0x7fu ? 0x7ff00000u : mag));
}

/* f8e5m2 is the top byte of an f16. */
TG_INLINE float tg_f8e5m2_to_f32(tg_f8e5m2 x) { return tg_f16_to_f32((tg_f16)((uint32_t)x << 8)); }

TG_INLINE float tg_f8e8m0_to_f32(tg_f8e8m0 x) {
    uint32_t e = x;
    uint32_t bits = e == 0u ? 0x00400000u : (e == 0xffu ? 0x7f800001u : e << 23);
    return tg__bits_f32(bits);
}

/* ---- float32 -> narrow (round to nearest even) ------------------------------------------- */

/* Round the magnitude bits `a` of a non-NaN float32 to a narrow float with `mbits` mantissa
 * bits and exponent bias `bias`, returning the unsigned code (not clamped: anything at or above
 * the infinity code means overflow).  The arguments are constants at every call, so this
 * folds into straight-line integer code with one variable shift for the subnormal range. */
TG_INLINE uint32_t tg__round_narrow(uint32_t a, uint32_t mbits, uint32_t bias) {
    const uint32_t drop = 23u - mbits;          /* float32 mantissa bits that go away */
    const uint32_t emin = 127u - bias + 1u;     /* float32 exponent field of the smallest normal */
    uint32_t e = a >> 23;
    uint32_t normal = a - ((127u - bias) << 23);
    /* Below the normal range, align the significand to the subnormal grid and keep a sticky
     * bit for what falls off; shifts past 24 leave only the sticky bit, which rounds to 0. */
    uint32_t s = e < emin ? emin - e : 0u;
    s = s > 31u ? 31u : s;
    uint32_t m = (a & 0x007fffffu) | 0x00800000u;
    uint32_t subnormal = (m >> s) | ((m & ((1u << s) - 1u)) != 0u);
    uint32_t t = e < emin ? subnormal : normal;
    return (t + (1u << (drop - 1u)) - 1u + ((t >> drop) & 1u)) >> drop;
}

TG_INLINE tg_bf16 tg_f32_to_bf16(float f) {
    uint32_t x = tg__f32_bits(f);
    uint32_t r = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
    return (tg_bf16)((x & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : r);
}

TG_INLINE tg_f16 tg_f32_to_f16(float f) {
    uint32_t x = tg__f32_bits(f);
    uint32_t a = x & 0x7fffffffu;
    uint32_t r = tg__round_narrow(a, 10u, 15u);
    r = r > 0x7c00u ? 0x7c00u : r;
    uint32_t nan = 0x7e00u | ((a >> 13) & 0x03ffu);
    return (tg_f16)(((x >> 16) & 0x8000u) | (a > 0x7f800000u ? nan : r));
}

TG_INLINE tg_f8e4m3 tg_f32_to_f8e4m3(float f) {
    uint32_t x = tg__f32_bits(f);
    uint32_t a = x & 0x7fffffffu;
    /* |f| >= 448 (inf too) saturates to 448 = 0x7e (0x7f is NaN, handled last) */
    uint32_t c = a < 0x43e00000u ? a : 0x43e00000u;
    /* e: |f|'s binade, at least 2^-6 (the subnormal codes share 2^-6's spacing, 2^-9). Adding the float 2^20 * e
     * rounds |f| to nearest even at e's code spacing 2^-3 * e in hardware: the sum s is 2^20 * e plus k steps of
     * one unit of its last place (k = 8..16 for normals, a carry into the next binade included; 0..8 below 2^-6),
     * and its exponent field is e's + 20 whatever k. The code is 8 * (log2(e) + 6) + k = k + 8 * (s's exponent
     * field) - 1128, of which only the low byte counts: s + (s >> 20) has k + 8 * (s's field) there once the
     * magic carries 152 = -1128 mod 256 in its low bits (152 more steps of the same grid: the rounding does not
     * move, and k + 152 stays far below the exponent). Identical to the reference rounding for all 2^32 inputs
     * (tests/codegen/test_prelude_types.py, slow), ~13 unconditional integer / float ops that gcc vectorises. */
    uint32_t e = c & 0x7f800000u;
    e = e > 0x3c800000u ? e : 0x3c800000u;
    uint32_t s = tg__f32_bits(tg__bits_f32(c) + tg__bits_f32(e + ((20u << 23) + 152u)));
    uint32_t r = s + (s >> 20);
    return (tg_f8e4m3)(((x >> 24) & 0x80u) | (a > 0x7f800000u ? 0x7fu : r));
}

TG_INLINE tg_f8e5m2 tg_f32_to_f8e5m2(float f) {
    uint32_t x = tg__f32_bits(f);
    uint32_t a = x & 0x7fffffffu;
    uint32_t r = tg__round_narrow(a, 2u, 15u);
    r = r > 0x7cu ? 0x7cu : r;
    return (tg_f8e5m2)(((x >> 24) & 0x80u) | (a > 0x7f800000u ? 0x7fu : r));
}

/* torch's rule (matched over all 2^32 inputs): drop the sign, then round to nearest even as if
 * the result kept one significand bit, the implicit one.  So the float32 exponent field e goes up
 * by one when the top mantissa bit is set and another mantissa bit is set or e > 0 (the implicit
 * bit is odd): for normal x that is round half up in the linear value (1.5 -> 2, 1.4999 -> 1,
 * 3 -> 4, 5 -> 4, 6 -> 8); subnormals up to 2^-127 give code 0, those above it code 1 (2^-126).
 * 254 rounding up gives 255 = NaN, as do inf and NaN. */
TG_INLINE tg_f8e8m0 tg_f32_to_f8e8m0(float f) {
    uint32_t x = tg__f32_bits(f);
    uint32_t e = (x >> 23) & 0xffu;
    uint32_t up = (x & 0x00400000u) != 0u && ((x & 0x003fffffu) != 0u || e != 0u);
    return (tg_f8e8m0)(e == 0xffu ? 0xffu : e + up);
}

/* ---- between narrow types, through float32 (exact widening, so one rounding) ------------ */

#define TG__CONVERT_VIA_F32(from, to) \
    TG_INLINE tg_##to tg_##from##_to_##to(tg_##from x) { return tg_f32_to_##to(tg_##from##_to_f32(x)); }

TG__CONVERT_VIA_F32(bf16, f16)
TG__CONVERT_VIA_F32(f16, bf16)
TG__CONVERT_VIA_F32(f8e4m3, bf16)
TG__CONVERT_VIA_F32(f8e4m3, f16)
TG__CONVERT_VIA_F32(f8e5m2, bf16)
TG__CONVERT_VIA_F32(f8e5m2, f16)
TG__CONVERT_VIA_F32(f8e8m0, bf16)
TG__CONVERT_VIA_F32(f8e8m0, f16)
TG__CONVERT_VIA_F32(bf16, f8e4m3)
TG__CONVERT_VIA_F32(bf16, f8e5m2)
TG__CONVERT_VIA_F32(bf16, f8e8m0)
TG__CONVERT_VIA_F32(f16, f8e4m3)
TG__CONVERT_VIA_F32(f16, f8e5m2)
TG__CONVERT_VIA_F32(f16, f8e8m0)

#undef TG__CONVERT_VIA_F32

/* ---- integers: Python floor division ------------------------------------------------------ */

/* The divisor is replaced before dividing so no input reaches a trapping idiv: b == 0 returns 0,
 * and b == -1 divides by 1 and negates in unsigned arithmetic (INT_MIN // -1 == INT_MIN). */
#define TG__FLOOR_INT(bits)                                                              \
    TG_INLINE int##bits##_t tg_floordiv_i##bits(int##bits##_t a, int##bits##_t b) {  \
        int##bits##_t d = (b == 0 || b == -1) ? 1 : b;                                    \
        int##bits##_t q = a / d, r = a % d;                                               \
        q -= (r != 0) & ((r ^ d) < 0);                                                    \
        q = b == -1 ? (int##bits##_t)(0u - (uint##bits##_t)a) : q;                        \
        return b == 0 ? 0 : q;                                                            \
    }                                                                                     \
    TG_INLINE int##bits##_t tg_floormod_i##bits(int##bits##_t a, int##bits##_t b) {  \
        int##bits##_t d = (b == 0 || b == -1) ? 1 : b;                                    \
        int##bits##_t r = a % d;                                                          \
        r += ((r != 0) & ((r ^ d) < 0)) ? d : 0;                                          \
        return b == 0 ? 0 : r;                                                            \
    }                                                                                     \
    TG_INLINE int##bits##_t tg_ceildiv_i##bits(int##bits##_t a, int##bits##_t b) {   \
        int##bits##_t d = (b == 0 || b == -1) ? 1 : b;                                    \
        int##bits##_t q = a / d, r = a % d;                                               \
        q += (r != 0) & ((r ^ d) >= 0);                                                   \
        q = b == -1 ? (int##bits##_t)(0u - (uint##bits##_t)a) : q;                        \
        return b == 0 ? 0 : q;                                                            \
    }

TG__FLOOR_INT(32)
TG__FLOOR_INT(64)

#undef TG__FLOOR_INT

/* ---- float helpers ------------------------------------------------------------------------ */

TG_INLINE float tg_rsqrtf(float x) { return 1.0f / sqrtf(x); }
/* tg_expf, tg_exp2f, tg_logf, tg_sigmoidf, tg_tanhf (vectorisable) live in tegula_rt.h */

/* C99 fmaxf/fminf: a NaN operand is ignored.  Written as selects, which vectorise where a
 * libm call would not. */
TG_INLINE float tg_fmaxf(float a, float b) { return a > b ? a : (b == b ? b : a); }
TG_INLINE float tg_fminf(float a, float b) { return a < b ? a : (b == b ? b : a); }

/* torch.maximum/minimum: a NaN operand propagates. */
TG_INLINE float tg_maxf(float a, float b) { return (a > b || a != a) ? a : b; }
TG_INLINE float tg_minf(float a, float b) { return (a < b || a != a) ? a : b; }

#endif /* TEGULA_TYPES_H */
