"""GEMM on the c target against torch and numpy: the README kernel (examples/gemm.py) at 2048^3 and decode shapes.

    python -m bench.gemm [--threads 2] [--repeats 15] [--quick] [--threads 1 --cpu-time]

Every row is measured side by side in this process: each repeat times tegula, then torch, then numpy, one
after the other, so that load from elsewhere on the machine falls on all of them alike; a row prints the
median GFLOP/s with [min, max] over the repeats. Outputs are preallocated once and reused by every call
(tegula: the kernel compiled without out_idx and given C; torch.matmul(a, b, out=c); numpy.matmul(a, b, out=c)),
so first-touch page faults of fresh output memory are not timed. The peak is measured in the same run: a
loop of independent fp32 FMAs (and of vdpbf16ps where the compiler targets AVX512-BF16) on every thread,
compiled with the runtime's C compiler and timed in thread CPU time, so that it is the cores' own peak even
when other processes share them. bf16 and fp16 are computed in fp32 (products exact, fp32 sums) by
tegula; torch's own bf16/fp16 kernels (oneDNN) are the peers. Decode shapes use block_M = min(M, 64) and the
best of a few (block_N, block_K), printed with the row; 2048^3 uses the README tiles, 128 x 128 x 32.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time

# numpy's OpenBLAS keeps its threads spinning for a while after each call (its default timeout is 2^28 cycles);
# measured side by side, that spin took one of the 2 cores from whichever library ran next (tegula's README
# GEMM: 193 GFLOP/s alone, 140 right after np.matmul). The shortest timeout makes OpenBLAS's threads sleep at
# once, as libgomp's do under OMP_WAIT_POLICY=passive; numpy's own speed is unchanged (203 vs 200 GFLOP/s).
# Read when OpenBLAS loads, so set before anything imports numpy.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

from bench.common import interleaved, summary  # noqa: E402  (bench.common may load numpy: after that)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DECODE = [(m, n, k) for m in (1, 4, 16, 64) for n, k in ((7168, 2048), (2048, 7168))]
DECODE_TILES = [(128, 32), (256, 64), (128, 128)]  # (block_N, block_K) tried per decode shape
# (block_M, block_N, block_K) searched for 2048^3, the README's first
TUNE_TILES = [(128, 128, 32), (128, 128, 64), (128, 128, 128), (128, 256, 64), (256, 128, 64), (64, 256, 128),
              (256, 256, 32), (128, 256, 128), (256, 128, 128)]

PEAK_C = r"""
#include <omp.h>
#include <time.h>
#include <immintrin.h>
/* the thread's CPU time: the peak is what the core does while it runs this thread, whatever else shares it */
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}
/* GFLOP/s of `threads` threads each running 12 independent chains of FMAs (2 flops per lane) or, with
 * bf16 = 1, of vdpbf16ps (4 flops per fp32 lane) */
double peak(int threads, long n, int bf16) {
    double total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
#if defined(__AVX512F__)
        typedef __m512 V;
#define SET1 _mm512_set1_ps
#define FMA(c, a, b) _mm512_fmadd_ps(a, b, c)
#elif defined(__AVX2__) && defined(__FMA__)
        typedef __m256 V;
#define SET1 _mm256_set1_ps
#define FMA(c, a, b) _mm256_fmadd_ps(a, b, c)
#else
        typedef float V __attribute__((vector_size(16)));
#define SET1(x) ((V){x, x, x, x})
#define FMA(c, a, b) ((c) + (a) * (b))
#endif
        V c[12], a = SET1(0.999999f), b = SET1(1e-7f);
        for (int i = 0; i < 12; i++) c[i] = SET1((float)i);
        double t0 = now();
        for (long r = 0; r < n; r++) {
#if defined(__AVX512BF16__)
            if (bf16) {
                for (int i = 0; i < 12; i++) c[i] = _mm512_dpbf16_ps(c[i], (__m512bh)a, (__m512bh)b);
            } else
#endif
            for (int i = 0; i < 12; i++) c[i] = FMA(c[i], a, b);
            __asm__ volatile("" : "+x"(a));
        }
        double t = now() - t0;
        volatile float sink = 0;
        for (int i = 0; i < 12; i++) sink += c[i][0];
        total += (bf16 ? 4.0 : 2.0) * 12 * n * (sizeof(V) / 4) / t / 1e9;
    }
    return total;
}
"""


def measure_peak(threads: int) -> dict:
    """{'fp32': GFLOP/s, 'bf16': GFLOP/s or None} over `threads` threads, medians of 5."""
    from tegula.runtime import cpu

    d = tempfile.mkdtemp(prefix="tegula-peak-")
    src, so = os.path.join(d, "peak.c"), os.path.join(d, "peak.so")
    with open(src, "w") as f:
        f.write(PEAK_C)
    subprocess.run([cpu.compiler(), "-O3", "-march=native", "-fopenmp", "-ffp-contract=fast", "-shared", "-fPIC", src,
                    "-o", so], check=True)
    lib = ctypes.CDLL(so)
    lib.peak.restype = ctypes.c_double
    lib.peak.argtypes = [ctypes.c_int, ctypes.c_long, ctypes.c_int]
    out = subprocess.run([cpu.compiler(), "-march=native", "-dM", "-E", "-"], input="", capture_output=True, text=True)
    has_bf16 = "__AVX512BF16__" in out.stdout
    res = {}
    for name, flag in (("fp32", 0), ("bf16", 1)):
        if flag and not has_bf16:
            res[name] = None
            continue
        res[name] = statistics.median(lib.peak(threads, 4_000_000, flag) for _ in range(5))
    return res


CLOCK = time.perf_counter  # time.thread_time with --cpu-time
compile_s = []  # (wall, C compiler CPU seconds) of every compile


def side_by_side(fns: dict, repeats: int, min_s: float) -> dict:
    """{name: (median, min, max) seconds per call}, the samples of every fn interleaved (bench.common.interleaved);
    a peer whose one call takes over a second (torch fp16 on a CPU without AVX512-FP16) is timed once."""
    fns = {k: f for k, f in fns.items() if f is not None}
    return {k: (statistics.median(v), min(v), max(v))
            for k, v in interleaved(fns, repeats, CLOCK, min_s, once_s=1.0).items()}


def _compile(tegula, matmul, m, n, k, dtype, bm, bn, bk):
    """(kernel, wall seconds, CPU seconds of the C compiler) of one cold compile"""
    import resource

    from tegula.jit import cache

    cache._MEMORY.clear()  # every compile is cold (the disk cache is off)
    c0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    kern = tegula.compile(matmul(m, n, k, block_M=bm, block_N=bn, block_K=bk, dtype=dtype), target="c")
    c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return kern, time.perf_counter() - t0, c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime


def main() -> None:
    p = argparse.ArgumentParser(description=summary(__doc__))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--quick", action="store_true", help="fewer repeats, decode shapes with one tile config")
    p.add_argument("--cpu-time", action="store_true",
                   help="with --threads 1: time in the calling thread's CPU time, for a machine shared with other work")
    p.add_argument("--tuned-only", action="store_true",
                   help="only the README tiles against the best of a tile search (the issue's 'within 10%%' row)")
    p.add_argument("--no-widen-k", action="store_true",
                   help="compile without the widen_gemm_k pass (one gemm call per block_K), to measure what it gives")
    args = p.parse_args()
    if args.cpu_time:
        if args.threads != 1:
            p.error("--cpu-time needs --threads 1 (every library then computes in the calling thread)")
        global CLOCK
        CLOCK = time.thread_time
    th = str(args.threads)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "TEGULA_NUM_THREADS"):
        os.environ[var] = th
    os.environ["TEGULA_DISK_CACHE"] = "0"  # every compile below is cold, and its time is reported
    # a fresh cache directory: the first GEMM compile also builds the prelude's precompiled header (runtime/cpu.py)
    os.environ["TEGULA_CACHE_DIR"] = tempfile.mkdtemp(prefix="tegula-bench-gemm-")
    import numpy as np
    import torch

    import tegula

    if args.no_widen_k:
        from tegula.passes import pipeline, widen_gemm_k
        pipeline.PIPELINES["cpu"] = [p for p in pipeline.PIPELINES["cpu"] if p is not widen_gemm_k.run]
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from gemm import matmul

    torch.set_num_threads(args.threads)
    repeats = 5 if args.quick else args.repeats
    min_s = 0.02
    peak = measure_peak(args.threads)
    clock = "thread CPU time" if args.cpu_time else "wall time"
    print(f"GEMM, {args.threads} threads, {repeats} repeats, {clock}; outputs preallocated and reused; "
          f"load average before: {os.getloadavg()[0]:.2f}")
    bf16_peak = f", vdpbf16ps {peak['bf16']:.0f}" if peak["bf16"] else ""
    print(f"measured peak: fp32 FMA {peak['fp32']:.0f} GFLOP/s{bf16_peak}")
    gen = torch.Generator().manual_seed(0)

    def cell(g):
        return f"{g[0]:7.1f} [{g[2]:.0f}-{g[1]:.0f}]" if g else "-"

    head = f"{'shape':<16} {'dtype':<9} {'tiles':<10} {'tegula GFLOP/s':>20} {'torch':>20} {'x torch':>8} " \
           f"{'numpy':>20} {'x numpy':>8} {'%peak':>6}"
    print(head)
    print("-" * len(head))

    def show(label, dtype, tile, gf, pk):
        tg, to, nu = gf["tegula"], gf.get("torch"), gf.get("numpy")
        print(f"{label:<16} {dtype:<9} {tile:<10} {cell(tg):>20} {cell(to):>20} {tg[0] / to[0]:8.2f} "
              f"{cell(nu):>20} {(f'{tg[0] / nu[0]:8.2f}' if nu else '       -')} {100 * tg[0] / pk:5.0f}%", flush=True)

    def tuned(m, n, k, dtype):
        """The README tiles against the best of TUNE_TILES (each timed 3 times, the best one then side by side)."""
        td = getattr(torch, dtype)
        a = torch.randn(m, k, generator=gen).to(td)
        b = torch.randn(k, n, generator=gen).to(td)
        c = torch.empty(m, n, dtype=td)
        ref = a.float() @ b.float()
        kerns, quick = {}, {}
        for bm, bn, bk in TUNE_TILES:
            kern, wall, cc = _compile(tegula, matmul, m, n, k, dtype, bm, bn, bk)
            compile_s.append((wall, cc))
            kern(a, b, c)
            err = ((c.float() - ref).abs().max() / ref.abs().max()).item()
            assert err < 1e-2, f"{dtype} {bm}x{bn}x{bk}: relative error {err}"
            kerns[(bm, bn, bk)] = kern
            quick[(bm, bn, bk)] = side_by_side({"t": lambda: kern(a, b, c)}, 3, min_s)["t"][0]
        best = min(quick, key=quick.get)
        readme = TUNE_TILES[0]
        fns = {"readme": lambda: kerns[readme](a, b, c), "best": lambda: kerns[best](a, b, c)}
        res = side_by_side(fns, repeats, min_s)
        gf = {name: tuple(2 * m * n * k / s / 1e9 for s in r) for name, r in res.items()}
        order = ", ".join(f"{x[0]}x{x[1]}x{x[2]} {2 * m * n * k / quick[x] / 1e9:.0f}"
                          for x in sorted(quick, key=quick.get))
        print(f"{m}x{n}x{k} {dtype:<9} README {readme[0]}x{readme[1]}x{readme[2]} {cell(gf['readme'])}  best "
              f"{best[0]}x{best[1]}x{best[2]} {cell(gf['best'])}  README/best {gf['readme'][0] / gf['best'][0]:.3f}",
              flush=True)
        print(f"  search (GFLOP/s, 3 samples each): {order}", flush=True)

    if args.tuned_only:
        print("README tiles against the best tiles of a search (GFLOP/s median [min-max])")
        for dtype in ("float32", "bfloat16"):
            tuned(2048, 2048, 2048, dtype)
        report_compiles()
        return

    def run(label, m, n, k, dtype, tiles):
        td = getattr(torch, dtype)
        a = torch.randn(m, k, generator=gen).to(td)
        b = torch.randn(k, n, generator=gen).to(td)
        c, ct = torch.empty(m, n, dtype=td), torch.empty(m, n, dtype=td)
        ref = a.float() @ b.float()
        best = None
        for bn, bk in tiles:
            kern, wall, cc = _compile(tegula, matmul, m, n, k, dtype, min(m, 64) if m < 128 else 128, bn, bk)
            compile_s.append((wall, cc))
            kern(a, b, c)
            err = ((c.float() - ref).abs().max() / ref.abs().max()).item()
            assert err < 1e-2, f"{label} {dtype}: relative error {err}"
            t = side_by_side({"tegula": lambda: kern(a, b, c)}, 3, min_s)["tegula"][0]
            if best is None or t < best[0]:
                best = (t, kern, f"{min(m, 64) if m < 128 else 128}x{bn}x{bk}")
        kern = best[1]
        fns = {"tegula": lambda: kern(a, b, c), "torch": lambda: torch.matmul(a, b, out=ct)}
        if dtype == "float32":
            an, bnp, cn = a.numpy(), b.numpy(), np.empty((m, n), np.float32)
            fns["numpy"] = lambda: np.matmul(an, bnp, out=cn)
        res = side_by_side(fns, repeats, min_s)
        gf = {name: tuple(2 * m * n * k / s / 1e9 for s in r) for name, r in res.items()}
        pk = peak["bf16"] if dtype == "bfloat16" and peak["bf16"] else peak["fp32"]
        show(label, dtype, best[2], gf, pk)

    run("2048^3", 2048, 2048, 2048, "float32", [(128, 32)])
    run("2048^3", 2048, 2048, 2048, "bfloat16", [(128, 32)])
    run("2048^3", 2048, 2048, 2048, "float16", [(128, 32)])
    tiles = DECODE_TILES[:1] if args.quick else DECODE_TILES
    for m, n, k in DECODE:
        for dtype in ("float32", "bfloat16"):
            run(f"{m}x{n}x{k}", m, n, k, dtype, tiles)

    print("README tiles against the best tiles of a search (GFLOP/s median [min-max])")
    for dtype in ("float32", "bfloat16"):
        tuned(2048, 2048, 2048, dtype)

    report_compiles()
    print("%peak: of the fp32 FMA peak, bf16 rows of the vdpbf16ps peak where the target has it; "
          f"load average after: {os.getloadavg()[0]:.2f} (other processes on {os.cpu_count()} cores)")


def report_compiles():
    wall, cc = zip(*compile_s)
    print(f"cold compile (TEGULA_DISK_CACHE=0) of {len(wall)} kernels: wall median {statistics.median(wall):.2f} s "
          f"(max {max(wall):.2f}), of which the C compiler's CPU time median {statistics.median(cc):.2f} s (first "
          f"{cc[0]:.2f} s: it also precompiles the prelude headers, which later compiles reuse)")


if __name__ == "__main__":
    main()
