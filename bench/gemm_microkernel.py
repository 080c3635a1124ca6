"""GFLOP/s of the prelude's tile GEMM alone (tegula_gemm.h), one core, against that core's FMA peak.

Each case is a call with constant arguments, as in a generated kernel, repeated on the same tiles
(L1/L2 resident) and accumulating into the same C. Prints medians over repeats with the spread,
and torch's single-threaded matmul on the same tiles for reference (it pays a Python call each).

    python bench/gemm_microkernel.py [--cc cc] [--cflags "-U__AVX512F__"] [--repeats 9]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import tempfile
import time

import numpy as np

from bench.common import summary

PRELUDE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tegula", "codegen", "prelude")
CFLAGS = "-O3 -march=native -std=gnu11 -fPIC -shared -fopenmp -fwrapv -ffp-contract=off"
SHAPES = [(128, 128, 32), (64, 64, 64), (128, 256, 64), (1, 128, 128), (17, 33, 7)]
TRANS = {"nn": (0, 0), "nt": (0, 1), "tn": (1, 0)}
DTYPES = {
    "f32": ("float", "float", 4),
    "bf16": ("tg_bf16", "float", 2),
    "f8e4m3": ("tg_f8e4m3", "float", 1),
    "i8": ("int8_t", "int32_t", 1),
}
CASES = [("f32", s, t) for s in SHAPES for t in TRANS] + [
    (d, s, "nn") for d in DTYPES if d != "f32" for s in SHAPES[:3]
]

# The FMA peak: independent accumulator chains in GNU vector extensions (any target gcc supports).
PEAK = r"""
#include <time.h>
#if defined(__AVX512F__)
typedef float vf __attribute__((vector_size(64)));
#else
typedef float vf __attribute__((vector_size(32)));
#endif
volatile float sink;
double peak_gflops(long n) /* built with -ffp-contract=fast so that a * b + c is one FMA */
{
    vf c[24], a = (vf){0} + 0.999999f, b = (vf){0} + 1e-7f;
    struct timespec t0, t1;
    for (int i = 0; i < 24; i++)
        c[i] = (vf){0} + (float)i; /* distinct chains, or gcc merges them */
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long r = 0; r < n; r++) {
#pragma GCC unroll 24
        for (int i = 0; i < 24; i++)
            c[i] = c[i] * a + b;
        __asm__ volatile("" : "+x"(a));
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    for (int i = 0; i < 24; i++)
        sink += c[i][0];
    return 2.0 * 24 * n * (sizeof(vf) / 4) / ((t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec)) / 1e9;
}
"""

TIMER = r"""
#include <time.h>
#include "tegula_gemm.h"
#define TIMED(NAME, CALL, TIN, TC)                                                          \
    double NAME(const TIN *A, const TIN *B, TC *C, long reps)                              \
    {                                                                                      \
        struct timespec t0, t1;                                                            \
        clock_gettime(CLOCK_MONOTONIC, &t0);                                               \
        for (long r = 0; r < reps; r++) {                                                  \
            CALL;                                                                          \
            __asm__ volatile("" ::: "memory");                                             \
        }                                                                                  \
        clock_gettime(CLOCK_MONOTONIC, &t1);                                               \
        return (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec);                 \
    }
"""


def _case_name(dt, shape, trans):
    return f"t_{dt}_{shape[0]}x{shape[1]}x{shape[2]}_{trans}"


def _source() -> str:
    lines = [TIMER]
    for dt, (m, n, k), tr in CASES:
        tin, tc, _ = DTYPES[dt]
        ta, tb = TRANS[tr]
        lda, ldb = (m if ta else k), (k if tb else n)
        call = f"tg_gemm_{dt}({m}, {n}, {k}, A, {lda}, {ta}, B, {ldb}, {tb}, C, {n}, 0)"
        lines.append(f"TIMED({_case_name(dt, (m, n, k), tr)}, {call}, {tin}, {tc})")
    return "\n".join(lines) + "\n"


def _build(cc: str, cflags: str, tmp: str) -> tuple[ctypes.CDLL, ctypes.CDLL]:
    with open(os.path.join(tmp, "gemm.c"), "w") as f:
        f.write(_source())
    with open(os.path.join(tmp, "peak.c"), "w") as f:
        f.write(PEAK)
    inc = ["-I", PRELUDE]
    for name, extra in (("gemm", []), ("peak", ["-ffp-contract=fast"])):
        cmd = [
            cc,
            *CFLAGS.split(),
            *cflags.split(),
            *extra,
            *inc,
            os.path.join(tmp, f"{name}.c"),
            "-o",
            os.path.join(tmp, f"{name}.so"),
        ]
        subprocess.run(cmd, check=True)
    return ctypes.CDLL(os.path.join(tmp, "gemm.so")), ctypes.CDLL(os.path.join(tmp, "peak.so"))


def _median_spread(samples):
    s = np.sort(np.asarray(samples))
    return float(np.median(s)), float(s[0]), float(s[-1])


def _torch_gflops(shape, trans, repeats):
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(1)
    m, n, k = shape
    a = torch.randn(k, m).t() if trans[0] else torch.randn(m, k)
    b = torch.randn(n, k).t() if trans[1] else torch.randn(k, n)
    c = torch.empty(m, n)
    reps = max(10, int(2e8 / (2 * m * n * k)))
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b, out=c)
        out.append(2 * m * n * k * reps / (time.perf_counter() - t0) / 1e9)
    return _median_spread(out)[0]


def main():
    p = argparse.ArgumentParser(description=summary(__doc__))
    p.add_argument("--cc", default=os.environ.get("TEGULA_CC", "cc"))
    p.add_argument("--cflags", default="", help="appended to the kernel flags, e.g. -U__AVX512F__ (portable path)")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--no-torch", action="store_true")
    args = p.parse_args()
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    with tempfile.TemporaryDirectory() as tmp:
        lib, peak_lib = _build(args.cc, args.cflags, tmp)
        peak_lib.peak_gflops.restype = ctypes.c_double
        peak = _median_spread([peak_lib.peak_gflops(ctypes.c_long(20_000_000)) for _ in range(args.repeats)])
        print(f"one-core FMA peak: {peak[0]:.1f} GFLOP/s (min {peak[1]:.1f}, max {peak[2]:.1f})")
        rng = np.random.default_rng(0)
        rows = []
        for dt, shape, tr in CASES:
            m, n, k = shape
            _, tc, size = DTYPES[dt]
            a = rng.integers(0, 4, m * k * size, dtype=np.uint8)  # small finite values of every narrow dtype
            b = rng.integers(0, 4, k * n * size, dtype=np.uint8)
            if dt == "f32":  # as bytes, these would be fp32 subnormals, which some paths compute slowly
                a = rng.standard_normal(m * k).astype(np.float32).view(np.uint8)
                b = rng.standard_normal(k * n).astype(np.float32).view(np.uint8)
            c = np.zeros(m * n, dtype=np.int32 if tc == "int32_t" else np.float32)
            fn = getattr(lib, _case_name(dt, shape, tr))
            fn.restype = ctypes.c_double
            ptrs = [x.ctypes.data_as(ctypes.c_void_p) for x in (a, b, c)]
            reps = max(10, int(4e8 / (2 * m * n * k)))
            fn(*ptrs, ctypes.c_long(reps // 10))
            rows.append(
                _median_spread(
                    [2 * m * n * k * reps / fn(*ptrs, ctypes.c_long(reps)) / 1e9 for _ in range(args.repeats)]
                )
            )
    # torch after all of ours: importing it starts threads that would disturb the timings
    peers = [None if args.no_torch or dt != "f32" else _torch_gflops(shape, TRANS[tr], 3) for dt, shape, tr in CASES]
    print(f"{'case':<28} {'GFLOP/s':>8} {'min':>7} {'max':>7} {'%peak':>6} {'torch':>7}")
    for (dt, shape, tr), (med, lo, hi), peer in zip(CASES, rows, peers):
        peer_s = f"{peer:7.1f}" if peer else "      -"
        print(
            f"{dt + ' ' + 'x'.join(map(str, shape)) + ' ' + tr:<28} {med:8.1f} {lo:7.1f} {hi:7.1f} "
            f"{100 * med / peak[0]:5.0f}% {peer_s}"
        )


if __name__ == "__main__":
    main()
