"""Shared pieces of the benchmarks: timing, the machine's measured bandwidth, tables."""
from __future__ import annotations

import ctypes
import importlib.util
import os
import statistics
import tempfile
import time

from tegula.jit.profiler import Timing, do_bench

__all__ = ["CLOCKS", "Timing", "add_clock_option", "copy_kernels", "do_bench", "interleaved", "measure_bandwidth",
           "load_example", "print_table", "side_by_side", "summary", "timing_ms", "try_compile", "use_clock"]

# --clock: wall (every core, wall-clock time) or cpu (one thread each side, process CPU time per call, which other
# load on a shared machine disturbs far less)
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
CLOCK_HELP = "wall: every core, wall-clock time (default); cpu: one thread each, process CPU time per call"


EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def load_example(name: str):
    """examples/<name>.py of this checkout imported as a module (the benchmarks time the examples' kernel text
    unchanged)."""
    spec = importlib.util.spec_from_file_location(f"tegula_example_{name}", os.path.join(EXAMPLES, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def summary(doc: str) -> str:
    """A module docstring's first paragraph as one line: what a benchmark's ``--help`` says it does (its first line
    alone may stop mid-sentence)."""
    return " ".join(doc.strip().split("\n\n")[0].split())


def add_clock_option(parser, help: str = CLOCK_HELP) -> None:
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall", help=help)


def use_clock(name: str):
    """The timer of ``--clock name``. "cpu" first puts tegula's kernels and torch on one thread: call it before any
    kernel is loaded (the c runtime reads TEGULA_NUM_THREADS then)."""
    if name == "cpu":
        import torch

        os.environ["TEGULA_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    return CLOCKS[name]

_STREAM = r"""
#include <stdint.h>
#include <stddef.h>
#include <immintrin.h>
void stream_copy(const float *restrict a, float *restrict b, int64_t n) {
  #pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) b[i] = a[i];
}
void stream_copy_nt(const float *restrict a, float *restrict b, int64_t n) {
#ifdef __AVX512F__
  #pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; i += 16) _mm512_stream_ps(b + i, _mm512_loadu_ps(a + i));
  _mm_sfence();
#else
  stream_copy(a, b, n);
#endif
}
"""


def copy_kernels(nbytes: int = 1 << 30, threads: int | None = None) -> dict:
    """{name: (fn, bytes moved per call)} for a plain OpenMP copy ("stream_copy") and a non-temporal-store copy
    ("stream_copy_nt") of ``nbytes`` of source, built now with the machine's C compiler: the bandwidth reference a
    bench can time once (measure_bandwidth) or sample in turn with each of its rows (bench.common.interleaved)."""
    from tegula.runtime import cpu
    d = tempfile.mkdtemp(prefix="tegula-bench-")
    src, lib = os.path.join(d, "stream.c"), os.path.join(d, "stream.so")
    with open(src, "w") as f:
        f.write(_STREAM)
    import subprocess
    subprocess.run([cpu.compiler(), "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", src, "-o", lib],
                   check=True)
    so = ctypes.CDLL(lib)
    n = nbytes // 4 // 16 * 16
    a = _aligned(n, 1.0)
    b = _aligned(n, 0.0)
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(threads)
        so.omp_set_num_threads(threads)  # the OpenMP runtime may already have started (torch's)
    out = {}
    for name in ("stream_copy", "stream_copy_nt"):
        fn = getattr(so, name)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        # the closure keeps the arrays and the library alive as long as the callable
        out[name] = ((lambda fn=fn, a=a, b=b: fn(a.ctypes.data, b.ctypes.data, n)), 2 * n * 4)
    return out


LLC_DEFAULT = 32 << 20  # what last_level_cache() answers where the system does not say


def last_level_cache() -> int:
    """The size in bytes of this machine's largest CPU cache, as Linux reports it (sysconf, then sysfs; under a
    hypervisor, what the virtual CPU declares), or LLC_DEFAULT where neither says. Benchmarks of memory-bound work
    size their working sets from it: some machines here have an L3 of hundreds of MB."""
    for name in ("SC_LEVEL4_CACHE_SIZE", "SC_LEVEL3_CACHE_SIZE", "SC_LEVEL2_CACHE_SIZE"):
        try:
            v = os.sysconf(name)
        except (ValueError, OSError, AttributeError):
            continue
        if v and v > 0:
            return int(v)
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        entries = os.listdir(base)
    except OSError:
        entries = []
    for e in entries:
        try:
            with open(os.path.join(base, e, "size")) as f:
                best = max(best, cache_size_bytes(f.read()))
        except OSError:
            continue
    return best or LLC_DEFAULT


def check_gib(gib: float, what: str) -> None:
    """Print a warning when a --gib working set of ``gib`` GiB is under twice the last-level cache (``what``: the
    rows or kernels that read it)."""
    llc = last_level_cache()
    if gib * (1 << 30) < 2 * llc:
        print(f"warning: --gib {gib} is under twice the last-level cache ({llc >> 20} MiB): the {what} may read "
              f"partly from the cache (use --gib {-(-2 * llc // (1 << 30))} or more)")


def cache_size_bytes(text: str) -> int:
    """Bytes of a sysfs cache size ("491520K", "32M", "1024"); 0 where the text is not one."""
    text = text.strip()
    unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    digits = text[:-1] if unit > 1 else text
    return int(digits) * unit if digits.isdigit() else 0


def measure_bandwidth(nbytes: int = 1 << 30, threads: int | None = None, bench=None) -> dict:
    """GB/s (read + write bytes / time) of a plain OpenMP copy and of a non-temporal-store copy over ``nbytes``
    of source, measured now, in this process (copy_kernels). ``bench``: the timing function (do_bench's
    signature; default do_bench, wall clock)."""
    out = {}
    for name, (fn, moved) in copy_kernels(nbytes, threads).items():
        t = (bench or do_bench)(fn, warmup=2, rep=5)
        out[name] = moved / (t.median_ms * 1e-3) / 1e9
    return out


def _aligned(n, value):
    import numpy as np
    raw = np.full(n + 16, value, np.float32)
    off = (-raw.ctypes.data // 4) % 16  # non-temporal stores need 64-byte alignment
    return raw[off:off + n]


def try_compile(fn):
    """torch.compile(fn), or None when inductor cannot build here."""
    try:
        import torch
        return torch.compile(fn, dynamic=False)
    except Exception:  # a missing toolchain: the row says so
        return None


def print_table(title: str, header: list[str], rows: list[list]) -> None:
    widths = [max(len(str(h)), *(len(_fmt(r[i])) for r in rows)) for i, h in enumerate(header)]
    print(f"\n{title}")
    print("  ".join(str(h).rjust(w) if i else str(h).ljust(w) for i, (h, w) in enumerate(zip(header, widths))))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(_fmt(c).rjust(w) if i else _fmt(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths))))


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"
    return str(x)


def interleaved(fns, reps: int, clock=time.perf_counter, min_s: float = 0.0, min_total_s: float = 0.0,
                max_total_s: float = 5.0, once_s: float | None = None):
    """Seconds per call of each of ``fns`` (a dict of name -> fn, or a list), sampled in turn: one sample of every
    fn per round, so that every side sees the same machine load (timing one side after the other lets the host's
    speed drift into the ratios). Each fn is called once to warm up and once more to size its samples: a sample
    batches calls to last >= ``min_s`` (one call when 0). Rounds go on until there are ``reps`` and every fn has
    been timed for ``min_total_s`` seconds, or for ``max_total_s`` in all. A fn whose sizing call took longer than
    ``once_s`` keeps that call as its only sample. Returns lists of seconds per call, keyed as ``fns``."""
    items = list(fns.items()) if isinstance(fns, dict) else list(enumerate(fns))
    inner, samples, spent = {}, {}, {}
    for k, fn in items:
        fn()
        t0 = clock()
        fn()
        one = clock() - t0
        samples[k], spent[k] = [], 0.0
        if once_s is not None and one > once_s:
            samples[k].append(one)
            spent[k] = float("inf")
            continue
        inner[k] = max(1, int(min_s / max(one, 1e-9))) if min_s > 0 else 1
    start, rounds = clock(), 0
    while inner and (rounds < reps or (min(spent[k] for k in inner) < min_total_s
                                       and clock() - start < max_total_s)):
        for k, fn in items:
            if k not in inner:
                continue
            n = inner[k]
            t = clock()
            for _ in range(n):
                fn()
            dt = clock() - t
            spent[k] += dt
            samples[k].append(dt / n)
        rounds += 1
    return samples if isinstance(fns, dict) else [samples[i] for i in range(len(items))]


def timing_ms(seconds) -> Timing:
    """The Timing (milliseconds: median, min, max, count) of a list of seconds."""
    return Timing(statistics.median(seconds) * 1e3, min(seconds) * 1e3, max(seconds) * 1e3, len(seconds))


def side_by_side(fns, reps: int, clock) -> list[Timing]:
    """Timings (ms) of each of ``fns``, one call of each per round (see interleaved). ``clock``:
    time.perf_counter (wall) or time.process_time."""
    return [timing_ms(s) for s in interleaved(list(fns), reps, clock)]
