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
#include <pthread.h>
#include "tegula_types.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#define TG_EXPORT __attribute__((visibility("default")))
/* each operand evaluated once, in a temporary: the plain ((a) > (b) ? (a) : (b)) doubled its operands' text at
 * every level, so a chain of n nested maxima (T.max over the unrolled k of a row) came out 2^n times as long */
#define TG_MIN(a, b) ({ __auto_type tg_a_ = (a); __auto_type tg_b_ = (b); tg_a_ < tg_b_ ? tg_a_ : tg_b_; })
#define TG_MAX(a, b) ({ __auto_type tg_a_ = (a); __auto_type tg_b_ = (b); tg_a_ > tg_b_ ? tg_a_ : tg_b_; })
#define TG_ABS(a) ((a) < 0 ? -(a) : (a))

static inline float tg_round_bf16(float x) { return tg_bf16_to_f32(tg_f32_to_bf16(x)); }
static inline float tg_round_f16(float x) { return tg_f16_to_f32(tg_f32_to_f16(x)); }
static inline float tg_round_f8e4m3(float x) { return tg_f8e4m3_to_f32(tg_f32_to_f8e4m3(x)); }
static inline float tg_round_f8e5m2(float x) { return tg_f8e5m2_to_f32(tg_f32_to_f8e5m2(x)); }
static inline float tg_round_f8e8m0(float x) { return tg_f8e8m0_to_f32(tg_f32_to_f8e8m0(x)); }

/* Vectorisable float32 exp / exp2 / log: branch-free C that gcc turns into SIMD code in `omp simd` loops (libm's
 * expf is a scalar call). Measured against float64 references over [-103, 88] (exp), [-149, 128] (exp2) and
 * (0, FLT_MAX] (log): at most 2 ulp for exp/exp2, 3 for log, 4 for log2 and tanh (tests/codegen/test_prelude_math.py); inf, NaN, overflow and underflow to
 * denormals/zero behave as in libm. */
static inline float tg_bits2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t tg_f2bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline double tg_bits2d(uint64_t u) { double f; memcpy(&f, &u, 8); return f; }
static inline uint64_t tg_d2bits(double f) { uint64_t u; memcpy(&u, &f, 8); return u; }
static inline int32_t tg_clz64(uint64_t x) { return x ? __builtin_clzll(x) : 64; }  /* T.clz */
static inline float tg_exp2f(float x) {
  float xc = x < -151.0f ? -151.0f : (x > 129.0f ? 129.0f : x);  /* a NaN passes the clamp, and every op below */
  float t = xc + 12582912.0f;  /* 1.5 * 2^23: rounds to the nearest integer n, kept in t's low mantissa bits */
  float n = t - 12582912.0f;
  int32_t ni = (int32_t)(tg_f2bits(t) - 0x4b400000u);
  float f = xc - n;  /* exact, in [-0.5, 0.5] */
  /* 2^f: degree-6 polynomial fitted as in tg_expf over |f| <= 0.5: 1.9e-9 relative, <= 1 ulp measured */
  float p = 1.534558105e-04f;
  p = fmaf(p, f, 1.340019517e-03f);
  p = fmaf(p, f, 9.618491866e-03f);
  p = fmaf(p, f, 5.550328270e-02f);
  p = fmaf(p, f, 2.402264625e-01f);
  p = fmaf(p, f, 6.931471825e-01f);
  p = fmaf(p, f, 1.0f);
  int32_t n1 = ni >> 1, n2 = ni - n1;  /* p * 2^n in two exact power-of-two steps */
  return p * tg_bits2f((uint32_t)(n1 + 127) << 23) * tg_bits2f((uint32_t)(n2 + 127) << 23);
}
static inline float tg_expf(float x) {
  float xc = x < -104.0f ? -104.0f : (x > 89.0f ? 89.0f : x);  /* a NaN passes the clamp, and every op below */
  /* n = rint(xc / ln 2): adding 1.5 * 2^23 (one rounding, in the fma) leaves n in t's low mantissa bits */
  float t = fmaf(xc, 1.4426950408889634f, 12582912.0f);
  float n = t - 12582912.0f;
  int32_t ni = (int32_t)(tg_f2bits(t) - 0x4b400000u);
  float r = fmaf(n, -6.93145752e-1f, xc);  /* Cody-Waite: ln 2 = hi + lo, |r| <= 0.347 */
  r = fmaf(n, -1.42860677e-6f, r);
  /* e^r: degree-6 polynomial fitted (least squares of the relative error on Chebyshev nodes, reweighted towards
   * minimax) over |r| <= 0.347: 1.9e-9 relative in exact arithmetic, <= 1.1 ulp measured in float32 */
  float p = 1.383654540e-03f;
  p = fmaf(p, r, 8.375054225e-03f);
  p = fmaf(p, r, 4.166824371e-02f);
  p = fmaf(p, r, 1.666641682e-01f);
  p = fmaf(p, r, 4.999999106e-01f);
  p = fmaf(p, r, 1.0f);
  p = fmaf(p, r, 1.0f);
  /* p * 2^n in two exact power-of-two steps (n in [-151, 129]: each half is a normal scale) */
  int32_t n1 = ni >> 1, n2 = ni - n1;
  return p * tg_bits2f((uint32_t)(n1 + 127) << 23) * tg_bits2f((uint32_t)(n2 + 127) << 23);
}
static inline float tg_logf(float x) {
  uint32_t u = tg_f2bits(x);
  int32_t sub = (u >> 23) == 0;            /* denormal (or zero): scale by 2^23 first */
  float xs = sub ? x * 8388608.0f : x;
  u = tg_f2bits(xs);
  int32_t e = (int32_t)((u >> 23) & 0xff) - 127 - (sub ? 23 : 0);
  float m = tg_bits2f((u & 0x7fffff) | 0x3f800000u);   /* [1, 2) */
  int32_t big = m > 1.41421356f;
  m = big ? m * 0.5f : m;
  e += big;
  float s = (m - 1.0f) / (m + 1.0f), s2 = s * s;     /* log m = 2 atanh(s), |s| <= 0.172 */
  float p = 1.0f / 11.0f;
  p = fmaf(p, s2, 1.0f / 9.0f);
  p = fmaf(p, s2, 1.0f / 7.0f);
  p = fmaf(p, s2, 1.0f / 5.0f);
  p = fmaf(p, s2, 1.0f / 3.0f);
  p = fmaf(p, s2, 1.0f);
  float r = fmaf((float)e, 6.93145752e-1f, fmaf((float)e, 1.42860677e-6f, 2.0f * s * p));
  r = x == 0.0f ? -INFINITY : r;
  r = x < 0.0f || x != x ? NAN : r;
  return x == INFINITY ? x : r;
}
static inline float tg_log2f(float x) { return tg_logf(x) * 1.4426950408889634f; }
static inline float tg_sigmoidf(float x) { return 1.0f / (1.0f + tg_expf(-x)); }
static inline float tg_tanhf(float x) {
  float ax = fabsf(x), e = tg_expf(-2.0f * ax);
  float a2 = ax * ax;  /* odd Taylor series below 0.25, where (1 - e) / (1 + e) would cancel */
  float q = fmaf(a2, 62.0f / 2835.0f, -17.0f / 315.0f);
  q = fmaf(q, a2, 2.0f / 15.0f);
  q = fmaf(q, a2, -1.0f / 3.0f);
  float t = ax < 0.25f ? fmaf(ax * a2, q, ax) : (1.0f - e) / (1.0f + e);
  return copysignf(t, x);
}

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

/* blocks a thread takes per grab of the dynamic schedule: 1 while a grid has fewer than 64 blocks per thread
 * (uneven blocks, such as GEMM or causal attention tiles, stay balanced), else 1/64 of a thread's share, so that
 * grids of many small blocks (a memory-bound kernel's row tiles, 10^5 and more) do not take the shared counter's
 * cache line in turn for every block (2 threads: per-block grabs made such kernels slower than one thread) */
static inline int64_t tg_chunk_for(int64_t nblocks, int threads) {
  int64_t c = nblocks / ((int64_t)threads * 64);
  return c < 1 ? 1 : c;
}

/* a grid's blocks are handed out from one counter shared by its threads: tg_grab takes the next chunk of them,
 * [*lo, *hi), and is false once none is left. A grid run by its caller's thread alone (solo) takes them with a
 * plain load and store: a locked add on x86 first waits for every earlier store to leave the store buffer (the
 * caller's Python and torch stores just before the call: 5% of a b1 8K k2048 topk kernel's samples on an Intel
 * Xeon sat on its two lock xadd). */
static inline bool tg_grab(int64_t *next, int64_t chunk, int64_t nblocks, int solo, int64_t *lo, int64_t *hi) {
  int64_t l;
  if (solo) {
    l = *next;
    *next = l + chunk;
  } else {
    l = __atomic_fetch_add(next, chunk, __ATOMIC_RELAXED);
  }
  *lo = l;
  *hi = l + chunk < nblocks ? l + chunk : nblocks;
  return l < nblocks;
}

static inline void *tg_aligned_alloc(size_t bytes) {
  void *p = NULL;
  if (posix_memalign(&p, 64, bytes ? bytes : 64) != 0) abort();
  return p;
}

/* One thread's on-chip buffers of more than 64 KiB (codegen/c.py: the heap path): a block kept per thread (per
 * kernel library) between calls, up to TG_SCRATCH_MAX bytes, freed when the thread exits. A posix_memalign + free
 * of a few hundred KiB per call cost ~0.1-0.3 us in a topk call (glibc consolidates its fast bins for every such
 * request), much of a small kernel's fixed cost. Larger requests, or no thread key left, take the heap each call.
 * The kept block starts on a page (TG_SCRATCH_ALIGN; its capacity in the page before), so a kernel's buffers sit
 * at the same offsets within their pages in every process: where the heap put it at any 64-byte offset, the
 * b1 8K k512 topk kernel's unaligned masked stores into its k16 / p16 crossed a page boundary for 3 of the 64
 * offsets (3.1 -> 3.2-5.2 us, in that process only). */
#define TG_SCRATCH_MAX ((size_t)1 << 20)
#define TG_SCRATCH_ALIGN ((size_t)4096)
static pthread_key_t tg_scratch_key __attribute__((unused));
static int tg_scratch_ok __attribute__((unused));
static pthread_once_t tg_scratch_once __attribute__((unused)) = PTHREAD_ONCE_INIT;
static __attribute__((unused)) void tg_scratch_init(void) {
  tg_scratch_ok = pthread_key_create(&tg_scratch_key, free) == 0;
}
static inline void *tg_scratch(size_t bytes) {   /* a block of >= bytes, 64-byte aligned (the kept one: page
                                                    * aligned); see tg_scratch_done */
  if (bytes > TG_SCRATCH_MAX) return tg_aligned_alloc(bytes);
  pthread_once(&tg_scratch_once, tg_scratch_init);
  if (!tg_scratch_ok) return tg_aligned_alloc(bytes);
  size_t *p = (size_t *)pthread_getspecific(tg_scratch_key);   /* [capacity, ... one page][the block] */
  if (p == NULL || p[0] < bytes) {   /* the first call on this thread, or a larger grid than before */
    void *v = NULL;
    if (posix_memalign(&v, TG_SCRATCH_ALIGN, bytes + TG_SCRATCH_ALIGN) != 0) abort();
    size_t *q = (size_t *)v;
    q[0] = bytes;
    if (pthread_setspecific(tg_scratch_key, q) != 0) { free(q); return tg_aligned_alloc(bytes); }
    free(p);
    p = q;
  }
  return (char *)p + TG_SCRATCH_ALIGN;
}
static inline void tg_scratch_done(void *block, size_t bytes) {   /* after tg_scratch(bytes) returned block */
  if (bytes > TG_SCRATCH_MAX || !tg_scratch_ok ||
      (char *)pthread_getspecific(tg_scratch_key) + TG_SCRATCH_ALIGN != block)
    free(block);
}
#endif
