/* tegula's C runtime prelude for the c target: included by every generated kernel.
 * Dtype conversions come from tegula_types.h; this adds per-op rounding of narrow floats, Python-semantics
 * integer helpers, saturating float->int, atomics and the OpenMP glue. No ISA-specific code. */
#ifndef TEGULA_RT_H
#define TEGULA_RT_H
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <stdbool.h>
#include <math.h>
#include "tegula_types.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#define TG_EXPORT __attribute__((visibility("default")))
#define TG_MIN(a, b) ((a) < (b) ? (a) : (b))
#define TG_MAX(a, b) ((a) > (b) ? (a) : (b))
#define TG_ABS(a) ((a) < 0 ? -(a) : (a))

static inline float tg_round_bf16(float x) { return tg_bf16_to_f32(tg_f32_to_bf16(x)); }
static inline float tg_round_f16(float x) { return tg_f16_to_f32(tg_f32_to_f16(x)); }
static inline float tg_round_f8e4m3(float x) { return tg_f8e4m3_to_f32(tg_f32_to_f8e4m3(x)); }
static inline float tg_round_f8e5m2(float x) { return tg_f8e5m2_to_f32(tg_f32_to_f8e5m2(x)); }
static inline float tg_round_f8e8m0(float x) { return tg_f8e8m0_to_f32(tg_f32_to_f8e8m0(x)); }

/* integer '/' truncates as in C, but never traps: x / 0 == 0 and INT_MIN / -1 wraps */
static inline int32_t tg_truncdiv_i32(int32_t a, int32_t b) { return b == 0 ? 0 : b == -1 ? (int32_t)(0u - (uint32_t)a) : a / b; }
static inline int64_t tg_truncdiv_i64(int64_t a, int64_t b) { return b == 0 ? 0 : b == -1 ? (int64_t)(0ull - (uint64_t)a) : a / b; }
#define tg_udiv(a, b) ((b) == 0 ? 0 : (a) / (b))
#define tg_umod(a, b) ((b) == 0 ? 0 : (a) % (b))
static inline float tg_pymodf(float a, float b) { return a - floorf(a / b) * b; }
static inline double tg_pymodd(double a, double b) { return a - floor(a / b) * b; }

/* float -> int: truncate toward zero, saturate to the type's range, NaN gives 0 */
static inline int64_t tg_f2i(double x, double lo, double hi) {
  if (x != x) return 0;
  if (x <= lo) return (int64_t)lo;
  if (x >= hi) return hi >= 9.2e18 ? INT64_MAX : (int64_t)hi;
  return (int64_t)x;
}

/* atomics: integers through the compiler's builtins, floats through compare-and-swap on their bits */
#define TG_ATOMIC_INT(sfx, T) \
  static inline void tg_atomic_add_##sfx(T *p, T v) { __atomic_fetch_add(p, v, __ATOMIC_RELAXED); } \
  static inline void tg_atomic_max_##sfx(T *p, T v) { T o = __atomic_load_n(p, __ATOMIC_RELAXED); \
    while (o < v && !__atomic_compare_exchange_n(p, &o, v, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {} } \
  static inline void tg_atomic_min_##sfx(T *p, T v) { T o = __atomic_load_n(p, __ATOMIC_RELAXED); \
    while (o > v && !__atomic_compare_exchange_n(p, &o, v, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {} }
TG_ATOMIC_INT(i8, int8_t) TG_ATOMIC_INT(i16, int16_t) TG_ATOMIC_INT(i32, int32_t) TG_ATOMIC_INT(i64, int64_t)
TG_ATOMIC_INT(u8, uint8_t) TG_ATOMIC_INT(u16, uint16_t) TG_ATOMIC_INT(u32, uint32_t) TG_ATOMIC_INT(u64, uint64_t)

#define TG_ATOMIC_FLOAT(sfx, T, B, TO_F, FROM_F, F) \
  static inline F tg_op_add_##sfx(F a, F b) { return a + b; } \
  static inline F tg_op_max_##sfx(F a, F b) { return a != a ? b : (b > a ? b : a); } \
  static inline F tg_op_min_##sfx(F a, F b) { return a != a ? b : (b < a ? b : a); } \
  static inline void tg_atomic_rmw_##sfx(T *p, F v, F (*op)(F, F)) { \
    B *q = (B *)p; B o = __atomic_load_n(q, __ATOMIC_RELAXED), n; \
    do { T cur, nxt; memcpy(&cur, &o, sizeof(T)); nxt = FROM_F(op(TO_F(cur), v)); memcpy(&n, &nxt, sizeof(T)); } \
    while (!__atomic_compare_exchange_n(q, &o, n, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)); } \
  static inline void tg_atomic_add_##sfx(T *p, F v) { tg_atomic_rmw_##sfx(p, v, tg_op_add_##sfx); } \
  static inline void tg_atomic_max_##sfx(T *p, F v) { tg_atomic_rmw_##sfx(p, v, tg_op_max_##sfx); } \
  static inline void tg_atomic_min_##sfx(T *p, F v) { tg_atomic_rmw_##sfx(p, v, tg_op_min_##sfx); }
#define TG_ID(x) (x)
TG_ATOMIC_FLOAT(f32, float, uint32_t, TG_ID, TG_ID, float)
TG_ATOMIC_FLOAT(f64, double, uint64_t, TG_ID, TG_ID, double)
TG_ATOMIC_FLOAT(bf16, tg_bf16, uint16_t, tg_bf16_to_f32, tg_f32_to_bf16, float)
TG_ATOMIC_FLOAT(f16, tg_f16, uint16_t, tg_f16_to_f32, tg_f32_to_f16, float)

/* threads: the host sets a cap (TEGULA_NUM_THREADS, or the cores); a grid never gets more threads than blocks */
static int tg_max_threads = 0;
TG_EXPORT void tg_set_num_threads(int n) { tg_max_threads = n; }
static inline int tg_threads_for(int64_t nblocks) {
#ifdef _OPENMP
  int cap = tg_max_threads > 0 ? tg_max_threads : omp_get_max_threads();
#else
  int cap = 1;
#endif
  return nblocks < cap ? (nblocks < 1 ? 1 : (int)nblocks) : cap;
}

static inline void *tg_aligned_alloc(size_t bytes) {
  void *p = NULL;
  if (posix_memalign(&p, 64, bytes ? bytes : 64) != 0) abort();
  return p;
}
#endif
