"""tegula.ops.topk against torch.topk on the sparse-attention indexer's and the sampler's shapes.

    python -m bench.topk [--reps 5] [--quick]

Indexer rows: bf16 scores, k in {512, 2048}, batch in {1, 8, 64}, n in {8K, 32K, 128K, 1M}, unsorted. Sampler
rows: fp32 logits over a 129280-token vocabulary, k = 512, sorted by value. Both sides write into preallocated
outputs (torch.topk(out=...), topk(output_idx=...); the values tensor of topk is allocated per call, as
deep_select does). Inputs of 1 MB and more are memory-bound: each call then reads the next of a pool of copies
whose total is beyond the last-level cache; smaller inputs stay cache-resident, as they are when the indexer
has just written them. The read bandwidth that the largest rows are compared with is measured here, by a T.*
kernel that reads a 256 MiB tensor once (a row maximum), and the plain copy bandwidth of bench.common is shown
beside it. Medians over repeats, with the spread (max - min) / median.
"""
from __future__ import annotations

import argparse
import itertools

import torch

import tegula
import tegula.language as T
from bench.common import do_bench, measure_bandwidth, print_table
from tegula.ops.topk import topk

LLC_POOL_BYTES = 96 << 20
POOL_MIN_BYTES = 1 << 20


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


def read_bandwidth(reps: int) -> float:
    M, N = 64, 1 << 20
    x = torch.randint(-1000, 1000, (M, N), dtype=torch.int32)
    y = torch.empty(M, dtype=torch.int32)
    k = tegula.compile(rowmax_kernel(M, N), target="c")
    k(x, y)
    assert torch.equal(y, x.amax(1))
    t = do_bench(lambda: k(x, y), rep=reps)
    return x.numel() * 4 / (t.median_ms * 1e-3) / 1e9


def pool_of(x):
    """Copies of x to cycle through so that repeated calls read from memory, not cache."""
    nbytes = x.numel() * x.element_size()
    if nbytes < POOL_MIN_BYTES:
        return [x]
    return [x] + [x.clone() for _ in range(min(63, -(-LLC_POOL_BYTES // nbytes) - 1))]


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
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="batch 1 and 64 only, n in {8K, 1M}")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    read_bw = read_bandwidth(args.reps)
    copy_bw = measure_bandwidth(1 << 28)["stream_copy"]
    print(f"measured: read {read_bw:.1f} GB/s (T.* row max over 256 MiB), plain copy {copy_bw:.1f} GB/s "
          f"(read + write); torch threads {torch.get_num_threads()}")

    batches = (1, 64) if args.quick else (1, 8, 64)
    lengths = (8192, 1 << 20) if args.quick else (8192, 32768, 131072, 1 << 20)
    cases = [("bf16", torch.bfloat16, k, b, n, False) for k in (512, 2048) for b in batches for n in lengths]
    cases += [("fp32", torch.float32, 512, b, 129280, True) for b in batches]
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
        t_ours = do_bench(lambda: topk(next(ours_it), k, sorted=by_value, output_idx=idx), rep=reps)
        t_torch = do_bench(lambda: torch.topk(next(torch_it), k, dim=1, sorted=by_value, out=(tv, ti)), rep=reps,
                           warmup=1)
        gbs = x.numel() * x.element_size() / (t_ours.median_ms * 1e-3) / 1e9
        rows.append([f"{name} b={b} n={n} k={k}{' sorted' if by_value else ''}", t_ours.median_ms,
                     f"{t_ours.spread:.0%}", t_torch.median_ms, f"{t_torch.spread:.0%}",
                     t_torch.median_ms / t_ours.median_ms, gbs, gbs / read_bw,
                     "DRAM" if x.numel() * x.element_size() >= POOL_MIN_BYTES else "cache"])
        print(f"  {rows[-1][0]}: {t_ours.median_ms:.4g} ms vs torch {t_torch.median_ms:.4g} ms", flush=True)
    print_table(f"top-k, {torch.get_num_threads()} threads (medians of >= 3-{args.reps} runs; spread = (max - min) "
                "/ median)", ["shape", "tegula ms", "spread", "torch ms", "spread", "torch/tegula", "GB/s",
                              "of read BW", "input"], rows)
    print("torch/tegula > 1: tegula is faster. GB/s: input bytes / tegula time; 'of read BW' against the "
          f"measured {read_bw:.1f} GB/s. input: DRAM = a pool of copies beyond the LLC, cache = one hot copy.")


if __name__ == "__main__":
    main()
