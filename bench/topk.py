"""tegula.ops.topk against torch.topk on the sparse-attention indexer's and the sampler's shapes.

    python -m bench.topk [--reps 7] [--quick] [--threads 2] [--cpu-time] [--only "b=1 n=8192,sorted"]

Indexer rows: bf16 scores, k in {512, 2048}, batch in {1, 8, 64}, n in {8K, 32K, 128K, 1M}, unsorted. Sampler
rows: fp32 logits over a 129280-token vocabulary, k = 512, sorted by value. Both sides write into preallocated
outputs (torch.topk(out=...), topk(output_idx=...); the values tensor of topk is allocated per call, as
deep_select does). Inputs of 1 MB and more are memory-bound: each call then reads the next of a pool of copies
whose total is beyond the last-level cache; smaller inputs stay cache-resident, as they are when the indexer
has just written them. A memory-bound row's 'of read BW' divides its GB/s by a T.* kernel that only reads (a row
maximum over the same pool's bytes, as int32 in 128 KiB rows), sampled in turn with tegula and torch: the host's
memory speed moves from minute to minute, so one figure timed at the start would put its error into every row. The
start-up read over 256 MiB and the plain copy bandwidth of bench.common are printed for reference. tegula, torch
(and the read) samples alternate (ratios from one run); medians over repeats, with the spread (max - min) / median.
On a machine shared with other work, ``--threads 1 --cpu-time`` times both sides in the calling thread's CPU time.
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time

import torch

import tegula
import tegula.language as T
from bench.common import interleaved, last_level_cache, measure_bandwidth, print_table, summary
from tegula.ops.topk import topk

CLOCK = time.perf_counter   # time.thread_time with --cpu-time (kernels read TEGULA_NUM_THREADS when first loaded)

POOL_MIN_BYTES = 1 << 20
# a memory-bound row's pool: twice the last-level cache (at least 96 MiB); on an L3 of 480 MiB a pool of 96 MiB
# (this constant until then) sat in the cache, and its rows read at the cache's speed
LLC_POOL_BYTES = max(96 << 20, 2 * last_level_cache())


def rowmax_kernel(M, N, block=4096):
    """Y[r] = max(X[r, :]) for int32 X: a kernel that only reads, to measure read bandwidth."""
    @T.prim_func
    def rowmax(X: T.Tensor((M, N), "int32"), Y: T.Tensor((M,), "int32")):
        with T.Kernel(M) as r:
            acc = T.alloc_fragment((block,), "int32")
            out = T.alloc_fragment((1,), "int32")
            for i in T.Parallel(block):
                acc[i] = X[r, i]
            for c in T.serial(1, N // block):
                for i in T.Parallel(block):
                    acc[i] = T.max(acc[i], X[r, c * block + i])
            T.reduce_max(acc, out, dim=0)
            Y[r] = out[0]
    return rowmax


def side_by_side(fns: dict, reps: int, min_s: float = 0.01) -> dict:
    """{name: (median, min, max) seconds per call}; one sample of each fn in turn, each sample batched to last
    >= min_s (bench.common.interleaved)."""
    return {k: (statistics.median(v), min(v), max(v)) for k, v in interleaved(fns, reps, CLOCK, min_s).items()}


def read_bandwidth(reps: int) -> float:
    M, N = 64, 1 << 20
    x = torch.randint(-1000, 1000, (M, N), dtype=torch.int32)
    y = torch.empty(M, dtype=torch.int32)
    k = tegula.compile(rowmax_kernel(M, N), target="c")
    k(x, y)
    assert torch.equal(y, x.amax(1))
    t = side_by_side({"read": lambda: k(x, y)}, reps)["read"][0]
    return x.numel() * 4 / t / 1e9


READ_ROW = 1 << 15   # int32 elements per row of the read kernel (128 KiB)
_READ_KERNELS: dict = {}


def read_of(pool):
    """(fn, bytes per call): the row-max read kernel over the next tensor of ``pool`` each call, its bytes seen as
    int32 rows of READ_ROW (a tail shorter than a row is left out, and not counted); None below one row."""
    nbytes = pool[0].numel() * pool[0].element_size()
    rows = nbytes // 4 // READ_ROW
    if rows == 0:
        return None
    k = _READ_KERNELS.get(rows)
    if k is None:
        k = _READ_KERNELS[rows] = tegula.compile(rowmax_kernel(rows, READ_ROW), target="c")
    views = [p.reshape(-1).view(torch.int32)[:rows * READ_ROW].view(rows, READ_ROW) for p in pool]
    y = torch.empty(rows, dtype=torch.int32)
    k(views[0], y)
    assert torch.equal(y, views[0].amax(1))
    it = itertools.cycle(views)
    return (lambda: k(next(it), y)), rows * READ_ROW * 4


def pool_of(x):
    """Copies of x to cycle through so that repeated calls read from memory, not cache."""
    nbytes = x.numel() * x.element_size()
    if nbytes < POOL_MIN_BYTES:
        return [x]
    return [x] + [x.clone() for _ in range(-(-LLC_POOL_BYTES // nbytes) - 1)]


def check(x, k, values, indices, by_value):
    """No reference needed: indices unique and in range, values equal to input[indices], every selected value
    >= every unselected one, and the requested order."""
    b, n = x.shape
    idx = indices.long()
    assert bool(((idx >= 0) & (idx < n)).all()), "index out of range"
    assert bool((idx.sort(1).values.diff(1) > 0).all()), "duplicate index"
    assert torch.equal(x.gather(1, idx), values), "values differ from input[indices]"
    rest = x.float().scatter(1, idx, float("-inf"))
    assert bool((values.float().amin(1) >= rest.amax(1)).all()), "an unselected value is larger"
    if by_value:
        assert bool((values.float().diff(1) <= 0).all()), "values not in descending order"


def main(argv=None):
    global CLOCK
    p = argparse.ArgumentParser(description=summary(__doc__))
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="batch 1 and 64 only, n in {8K, 1M}")
    p.add_argument("--threads", type=int, default=None, help="threads of tegula and torch (default: all cores)")
    p.add_argument("--only", default=None,
                   help="comma-separated substrings: only the rows whose label holds one (e.g. 'b=1 n=8192,sorted')")
    p.add_argument("--cpu-time", action="store_true",
                   help="with --threads 1: time in the calling thread's CPU time, for a machine shared with other work")
    args = p.parse_args(argv)
    if args.cpu_time:
        if args.threads != 1:
            p.error("--cpu-time needs --threads 1 (both sides then compute in the calling thread)")
        CLOCK = time.thread_time
    if args.threads:
        for var in ("OMP_NUM_THREADS", "TEGULA_NUM_THREADS"):
            os.environ[var] = str(args.threads)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    read_bw = read_bandwidth(args.reps)
    copy_bw = measure_bandwidth(1 << 28, threads=args.threads)["stream_copy"]
    clock = "thread CPU time" if args.cpu_time else "wall time"
    print(f"measured: read {read_bw:.1f} GB/s (T.* row max over 256 MiB), plain copy {copy_bw:.1f} GB/s "
          f"(read + write); {torch.get_num_threads()} threads, {clock}; load average {os.getloadavg()[0]:.1f}; "
          f"last-level cache {last_level_cache() >> 20} MiB, memory-bound rows cycle through {LLC_POOL_BYTES >> 20} "
          "MiB of copies")

    batches = (1, 64) if args.quick else (1, 8, 64)
    lengths = (8192, 1 << 20) if args.quick else (8192, 32768, 131072, 1 << 20)
    cases = [("bf16", torch.bfloat16, k, b, n, False) for k in (512, 2048) for b in batches for n in lengths]
    cases += [("fp32", torch.float32, 512, b, 129280, True) for b in batches]
    label = {c: f"{c[0]} b={c[3]} n={c[4]} k={c[2]}{' sorted' if c[5] else ''}" for c in cases}
    if args.only:
        cases = [c for c in cases if any(w.strip() in label[c] for w in args.only.split(","))]
    rows = []
    for name, dtype, k, b, n, by_value in cases:
        x = torch.randn(b, n).to(dtype)
        pool = pool_of(x)
        idx = torch.empty(b, k, dtype=torch.int64)
        tv, ti = torch.empty(b, k, dtype=dtype), torch.empty(b, k, dtype=torch.int64)
        v, i = topk(x, k, sorted=by_value, output_idx=idx)
        check(x, k, v, i, by_value)
        ours_it, torch_it = itertools.cycle(pool), itertools.cycle(pool)
        reps = args.reps if b * n < (64 << 20) else max(3, args.reps // 2)
        fns = {"tegula": lambda: topk(next(ours_it), k, sorted=by_value, output_idx=idx),
               "torch": lambda: torch.topk(next(torch_it), k, dim=1, sorted=by_value, out=(tv, ti))}
        dram = x.numel() * x.element_size() >= POOL_MIN_BYTES
        read = read_of(pool) if dram else None
        if read is not None:
            fns["read"] = read[0]
        t = side_by_side(fns, reps)
        (tm, tlo, thi), (pm, plo, phi) = t["tegula"], t["torch"]
        gbs = x.numel() * x.element_size() / tm / 1e9
        rbw = read[1] / t["read"][0] / 1e9 if read is not None else read_bw
        rows.append([label[(name, dtype, k, b, n, by_value)], tm * 1e3, f"{(thi - tlo) / tm:.0%}",
                     pm * 1e3, f"{(phi - plo) / pm:.0%}", pm / tm, gbs, rbw if read is not None else "",
                     gbs / rbw, "DRAM" if dram else "cache"])
        print(f"  {rows[-1][0]}: {tm * 1e3:.4g} ms vs torch {pm * 1e3:.4g} ms", flush=True)
    print_table(f"top-k, {torch.get_num_threads()} threads, {clock} (medians of {args.reps} alternating samples, "
                "3 for the largest; spread = (max - min) / median)",
                ["shape", "tegula ms", "spread", "torch ms", "spread", "torch/tegula", "GB/s", "read GB/s",
                 "of read BW", "input"], rows)
    print("torch/tegula > 1: tegula is faster. GB/s: input bytes / tegula time; 'of read BW': against the read of "
          "the same pool sampled in turn ('read GB/s') for DRAM rows, against the start-up read "
          f"({read_bw:.1f} GB/s) for cache-resident ones. input: DRAM = a pool of copies beyond the LLC, cache = one "
          "hot copy.")


if __name__ == "__main__":
    main()
