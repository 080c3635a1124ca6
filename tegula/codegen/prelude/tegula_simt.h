/* tegula_simt.h: the prelude of kernels generated for the SIMT targets, OpenCL C (opencl) and CUDA C++ (cuda).
 *
 * The storage types and conversions are tegula_types.h's, the same bit-exact code the c target runs: OpenCL C
 * gets the fixed-width integer types and the C99 float function names it lacks from here first, CUDA gets
 * device functions through TG_INLINE. Then the scalar helpers of the generated code (the same as tegula_rt.h's
 * for the c target: per-op rounding of narrow floats, C division that never traps, saturating float -> int),
 * float math through the target's own built-ins (the c target has vectorisable versions instead), and atomics.
 *
 * Atomics: 32- and 64-bit integers use the target's atomic instructions; everything else (floats, 8- and
 * 16-bit types, bf16/f16) is a compare-and-swap loop on the aligned 32-bit word holding the element (64-bit for
 * double), little-endian. Float max/min ignore a NaN in memory, like the c target's.
 */
#ifndef TEGULA_SIMT_H
#define TEGULA_SIMT_H

#ifdef __OPENCL_VERSION__
#pragma OPENCL EXTENSION cl_khr_fp64 : enable
#pragma OPENCL EXTENSION cl_khr_int64_base_atomics : enable
#pragma OPENCL EXTENSION cl_khr_int64_extended_atomics : enable
#pragma OPENCL FP_CONTRACT OFF
typedef char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long int64_t;
typedef uchar uint8_t;
typedef ushort uint16_t;
typedef uint uint32_t;
typedef ulong uint64_t;
#define INT64_C(x) ((long)(x##L))
#define UINT64_C(x) ((ulong)(x##UL))
#define INT32_MIN (-2147483647 - 1)
#define INT64_MAX 9223372036854775807L
#define INT64_MIN (-INT64_MAX - 1L)
/* C99's float names, as the shared emitter writes them, are OpenCL's overloaded built-ins */
#define expf exp
#define exp2f exp2
#define logf log
#define log2f log2
#define log10f log10
#define sqrtf sqrt
#define tanhf tanh
#define erff erf
#define powf pow
#define floorf floor
#define ceilf ceil
#define fabsf fabs
#define sinf sin
#define cosf cos
#define truncf trunc
#define roundf round
#define fmodf fmod
#define fmaf fma
#define TG_INLINE static inline
#define TG__CAS32(q, o, n) atomic_cmpxchg((q), (o), (n))
#define TG__CAS64(q, o, n) atom_cmpxchg((q), (o), (n))
#define TG__F64_BITS(x) as_ulong(x)
#define TG__BITS_F64(x) as_double(x)
#define tg_popcount64(x) popcount((ulong)(x))
#define tg_clz64(x) ((int32_t)clz((ulong)(x)))
#define tg_f2bits(x) as_uint(x)
#define tg_bits2f(x) as_float(x)
#define tg_d2bits(x) as_ulong(x)
#define tg_bits2d(x) as_double(x)
#else /* CUDA */
#include <stdint.h>
#include <math.h>
#define TG_INLINE static __device__ __forceinline__
#define TG__CAS32(q, o, n) atomicCAS((unsigned int *)(q), (o), (n))
#define TG__CAS64(q, o, n) atomicCAS((unsigned long long *)(q), (unsigned long long)(o), (unsigned long long)(n))
#define TG__F64_BITS(x) ((uint64_t)__double_as_longlong(x))
#define TG__BITS_F64(x) __longlong_as_double((long long)(x))
#define tg_popcount64(x) __popcll((unsigned long long)(x))
/* two 16-bit values (fp16/bf16 bits) in one register, the first in the low half: an MMA operand pair */
TG_INLINE uint32_t tg_pack_b16(uint16_t lo, uint16_t hi) { return (uint32_t)lo | ((uint32_t)hi << 16); }
#define tg_clz64(x) __clzll((long long)(x))
#define tg_f2bits(x) __float_as_uint(x)
#define tg_bits2f(x) __uint_as_float(x)
#define tg_d2bits(x) ((uint64_t)__double_as_longlong(x))
#define tg_bits2d(x) __longlong_as_double((long long)(x))
#endif

#include "tegula_types.h"

#define TG_MIN(a, b) ((a) < (b) ? (a) : (b))
#define TG_MAX(a, b) ((a) > (b) ? (a) : (b))
#define TG_ABS(a) ((a) < 0 ? -(a) : (a))

TG_INLINE float tg_round_bf16(float x) { return tg_bf16_to_f32(tg_f32_to_bf16(x)); }
TG_INLINE float tg_round_f16(float x) { return tg_f16_to_f32(tg_f32_to_f16(x)); }
TG_INLINE float tg_round_f8e4m3(float x) { return tg_f8e4m3_to_f32(tg_f32_to_f8e4m3(x)); }
TG_INLINE float tg_round_f8e5m2(float x) { return tg_f8e5m2_to_f32(tg_f32_to_f8e5m2(x)); }
TG_INLINE float tg_round_f8e8m0(float x) { return tg_f8e8m0_to_f32(tg_f32_to_f8e8m0(x)); }

TG_INLINE float tg_expf(float x) { return expf(x); }
TG_INLINE float tg_exp2f(float x) { return exp2f(x); }
TG_INLINE float tg_logf(float x) { return logf(x); }
TG_INLINE float tg_log2f(float x) { return log2f(x); }
TG_INLINE float tg_tanhf(float x) { return tanhf(x); }
TG_INLINE float tg_sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

/* integer '/' truncates as in C, but never traps: x / 0 == 0 and INT_MIN / -1 wraps */
TG_INLINE int32_t tg_truncdiv_i32(int32_t a, int32_t b) { return b == 0 ? 0 : b == -1 ? (int32_t)(0u - (uint32_t)a) : a / b; }
TG_INLINE int64_t tg_truncdiv_i64(int64_t a, int64_t b) { return b == 0 ? 0 : b == -1 ? (int64_t)((uint64_t)0 - (uint64_t)a) : a / b; }
#define tg_udiv(a, b) ((b) == 0 ? 0 : (a) / (b))
#define tg_umod(a, b) ((b) == 0 ? 0 : (a) % (b))
TG_INLINE float tg_pymodf(float a, float b) { return a - floorf(a / b) * b; }
TG_INLINE double tg_pymodd(double a, double b) { return a - floor(a / b) * b; }

/* float -> int: truncate toward zero, saturate to the type's range, NaN gives 0 */
TG_INLINE int64_t tg_f2i(double x, double lo, double hi) {
    if (x != x) return 0;
    if (x <= lo) return (int64_t)lo;
    if (x >= hi) return hi >= 9.2e18 ? INT64_MAX : (int64_t)hi;
    return (int64_t)x;
}

/* ---- atomics ------------------------------------------------------------------------------------------------ */

#define TG__ADD(a, b) ((a) + (b))
#define TG__FMAX(a, b) ((a) != (a) ? (b) : ((b) > (a) ? (b) : (a)))
#define TG__FMIN(a, b) ((a) != (a) ? (b) : ((b) < (a) ? (b) : (a)))
#define TG__ID(x) (x)

/* an element of BITS <= 32 bits, read and written as its 32-bit word */
#define TG__RMW_WORD(AS, SX, OPN, SFX, BITS, F, TO_F, FROM_F, OP)                                              \
    TG_INLINE void tg_atomic_##OPN##_##SFX##SX(AS void *p, F v) {                                               \
        volatile AS uint32_t *q = (volatile AS uint32_t *)((size_t)p & ~(size_t)3);                            \
        uint32_t sh = (uint32_t)((size_t)p & 3) * 8u;                                                          \
        uint32_t mask = (uint32_t)(((uint64_t)1 << BITS) - 1u) << sh;                                          \
        uint32_t o = *q;                                                                                       \
        for (;;) {                                                                                              \
            F cur = TO_F((o & mask) >> sh);                                                                    \
            uint32_t n = (o & ~mask) | (((uint32_t)FROM_F(OP(cur, v)) << sh) & mask);                          \
            uint32_t r = TG__CAS32(q, o, n);                                                                   \
            if (r == o) break;                                                                                 \
            o = r;                                                                                             \
        }                                                                                                      \
    }
#define TG__RMW_F64(AS, SX, OPN, OP)                                                                           \
    TG_INLINE void tg_atomic_##OPN##_f64##SX(AS double *p, double v) {                                         \
        volatile AS uint64_t *q = (volatile AS uint64_t *)p;                                                   \
        uint64_t o = *q;                                                                                       \
        for (;;) {                                                                                              \
            uint64_t n = TG__F64_BITS(OP(TG__BITS_F64(o), v));                                                 \
            uint64_t r = TG__CAS64(q, o, n);                                                                   \
            if (r == o) break;                                                                                 \
            o = r;                                                                                             \
        }                                                                                                      \
    }

#define TG__I8(c) ((int8_t)(c))
#define TG__I16(c) ((int16_t)(c))
#define TG__U8(x) ((uint8_t)(x))
#define TG__U16(x) ((uint16_t)(x))
#define TG__BF16_TO_F(c) tg_bf16_to_f32((tg_bf16)(c))
#define TG__F16_TO_F(c) tg_f16_to_f32((tg_f16)(c))

#define TG__WORD_ATOMICS(AS, SX, OPN, IOP, FOP)                                                                 \
    TG__RMW_WORD(AS, SX, OPN, i8, 8, int8_t, TG__I8, TG__U8, IOP)                                              \
    TG__RMW_WORD(AS, SX, OPN, u8, 8, uint8_t, TG__U8, TG__ID, IOP)                                             \
    TG__RMW_WORD(AS, SX, OPN, i16, 16, int16_t, TG__I16, TG__U16, IOP)                                         \
    TG__RMW_WORD(AS, SX, OPN, u16, 16, uint16_t, TG__U16, TG__ID, IOP)                                         \
    TG__RMW_WORD(AS, SX, OPN, bf16, 16, float, TG__BF16_TO_F, tg_f32_to_bf16, FOP)                            \
    TG__RMW_WORD(AS, SX, OPN, f16, 16, float, TG__F16_TO_F, tg_f32_to_f16, FOP)

#ifdef __OPENCL_VERSION__
#define TG__NATIVE_ATOMICS(AS, SX)                                                                              \
    TG_INLINE void tg_atomic_add_i32##SX(AS int32_t *p, int32_t v) { atomic_add((volatile AS int *)p, v); }     \
    TG_INLINE void tg_atomic_max_i32##SX(AS int32_t *p, int32_t v) { atomic_max((volatile AS int *)p, v); }     \
    TG_INLINE void tg_atomic_min_i32##SX(AS int32_t *p, int32_t v) { atomic_min((volatile AS int *)p, v); }     \
    TG_INLINE void tg_atomic_add_u32##SX(AS uint32_t *p, uint32_t v) { atomic_add((volatile AS uint *)p, v); }  \
    TG_INLINE void tg_atomic_max_u32##SX(AS uint32_t *p, uint32_t v) { atomic_max((volatile AS uint *)p, v); }  \
    TG_INLINE void tg_atomic_min_u32##SX(AS uint32_t *p, uint32_t v) { atomic_min((volatile AS uint *)p, v); }  \
    TG_INLINE void tg_atomic_add_i64##SX(AS int64_t *p, int64_t v) { atom_add((volatile AS long *)p, v); }      \
    TG_INLINE void tg_atomic_max_i64##SX(AS int64_t *p, int64_t v) { atom_max((volatile AS long *)p, v); }      \
    TG_INLINE void tg_atomic_min_i64##SX(AS int64_t *p, int64_t v) { atom_min((volatile AS long *)p, v); }      \
    TG_INLINE void tg_atomic_add_u64##SX(AS uint64_t *p, uint64_t v) { atom_add((volatile AS ulong *)p, v); }   \
    TG_INLINE void tg_atomic_max_u64##SX(AS uint64_t *p, uint64_t v) { atom_max((volatile AS ulong *)p, v); }   \
    TG_INLINE void tg_atomic_min_u64##SX(AS uint64_t *p, uint64_t v) { atom_min((volatile AS ulong *)p, v); }   \
    TG__RMW_WORD(AS, SX, add, f32, 32, float, tg__bits_f32, tg__f32_bits, TG__ADD)                             \
    TG__RMW_F64(AS, SX, add, TG__ADD)
#define TG__ALL_ATOMICS(AS, SX)                                                                                 \
    TG__NATIVE_ATOMICS(AS, SX)                                                                                  \
    TG__WORD_ATOMICS(AS, SX, add, TG__ADD, TG__ADD)                                                             \
    TG__WORD_ATOMICS(AS, SX, max, TG_MAX, TG__FMAX)                                                             \
    TG__WORD_ATOMICS(AS, SX, min, TG_MIN, TG__FMIN)                                                             \
    TG__RMW_WORD(AS, SX, max, f32, 32, float, tg__bits_f32, tg__f32_bits, TG__FMAX)                            \
    TG__RMW_WORD(AS, SX, min, f32, 32, float, tg__bits_f32, tg__f32_bits, TG__FMIN)                            \
    TG__RMW_F64(AS, SX, max, TG__FMAX)                                                                          \
    TG__RMW_F64(AS, SX, min, TG__FMIN)
TG__ALL_ATOMICS(__global, )
TG__ALL_ATOMICS(__local, _local)
#else
TG_INLINE void tg_atomic_add_i32(int32_t *p, int32_t v) { atomicAdd((int *)p, v); }
TG_INLINE void tg_atomic_max_i32(int32_t *p, int32_t v) { atomicMax((int *)p, v); }
TG_INLINE void tg_atomic_min_i32(int32_t *p, int32_t v) { atomicMin((int *)p, v); }
TG_INLINE void tg_atomic_add_u32(uint32_t *p, uint32_t v) { atomicAdd((unsigned int *)p, v); }
TG_INLINE void tg_atomic_max_u32(uint32_t *p, uint32_t v) { atomicMax((unsigned int *)p, v); }
TG_INLINE void tg_atomic_min_u32(uint32_t *p, uint32_t v) { atomicMin((unsigned int *)p, v); }
TG_INLINE void tg_atomic_add_i64(int64_t *p, int64_t v) { atomicAdd((unsigned long long *)p, (unsigned long long)v); }
TG_INLINE void tg_atomic_max_i64(int64_t *p, int64_t v) { atomicMax((long long *)p, (long long)v); }
TG_INLINE void tg_atomic_min_i64(int64_t *p, int64_t v) { atomicMin((long long *)p, (long long)v); }
TG_INLINE void tg_atomic_add_u64(uint64_t *p, uint64_t v) { atomicAdd((unsigned long long *)p, (unsigned long long)v); }
TG_INLINE void tg_atomic_max_u64(uint64_t *p, uint64_t v) { atomicMax((unsigned long long *)p, (unsigned long long)v); }
TG_INLINE void tg_atomic_min_u64(uint64_t *p, uint64_t v) { atomicMin((unsigned long long *)p, (unsigned long long)v); }
TG_INLINE void tg_atomic_add_f32(float *p, float v) { atomicAdd(p, v); }
TG_INLINE void tg_atomic_add_f64(double *p, double v) { atomicAdd(p, v); }
TG__WORD_ATOMICS(, , add, TG__ADD, TG__ADD)
TG__WORD_ATOMICS(, , max, TG_MAX, TG__FMAX)
TG__WORD_ATOMICS(, , min, TG_MIN, TG__FMIN)
TG__RMW_WORD(, , max, f32, 32, float, tg__bits_f32, tg__f32_bits, TG__FMAX)
TG__RMW_WORD(, , min, f32, 32, float, tg__bits_f32, tg__f32_bits, TG__FMIN)
TG__RMW_F64(, , max, TG__FMAX)
TG__RMW_F64(, , min, TG__FMIN)
#endif

#endif /* TEGULA_SIMT_H */
