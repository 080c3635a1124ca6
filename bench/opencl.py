"""The examples on the opencl target (PoCL's CPU device here) beside the c target and torch, at the demo's shapes.

    python -m bench.opencl [--repeats 5] [--only gemm,softmax] [--cold]

Each row: the kernel's build time (lowering + OpenCL/C compile + first call, which is when PoCL generates the
work-group code) and, per call, the process CPU time (all threads of this process: meaningful on a machine
shared with other work, where wall time is not) and the wall time, medians over the repeats, c / opencl / torch
interleaved. `--cold` builds into a fresh cache directory (the cold-start latency a new machine sees); by default
the usual tegula cache is used, so a second run shows the cached latency.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

from bench.common import load_example, summary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = [  # label, example, prepare() keywords, reference keywords
    ("add 4096x4096 fp32", "elementwise_add", dict(M=4096, N=4096, dtype="float32"), {}),
    ("gemm 1024^3 fp32", "gemm", dict(M=1024, N=1024, K=1024, dtype="float32"), {}),
    ("gemm 1024^3 bf16", "gemm", dict(M=1024, N=1024, K=1024, dtype="bfloat16"), {}),
    ("softmax 4096x1024 fp32", "softmax", dict(M=4096, N=1024, dtype="float32"), {}),
    ("flash attn s=1024 fp32", "flash_attention", dict(batch=1, heads=8, seq_len=1024, dim=64, dtype="float32"),
     {"is_causal": False}),
    ("flash attn causal s=1024", "flash_attention",
     dict(batch=1, heads=8, seq_len=1024, dim=64, is_causal=True, dtype="float32"), {"is_causal": True}),
]


def _measure(fn, repeats):
    cpu, wall = [], []
    for _ in range(repeats):
        c0, w0 = time.process_time(), time.perf_counter()
        fn()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return statistics.median(cpu) * 1e3, statistics.median(wall) * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=summary(__doc__))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--only", default=None, help="comma-separated example names")
    p.add_argument("--cold", action="store_true", help="build into a fresh cache directory")
    args = p.parse_args(argv)
    if args.cold:
        os.environ["TEGULA_CACHE_DIR"] = tempfile.mkdtemp(prefix="tegula-bench-opencl-")
    import torch
    print(f"{'kernel':<26} {'target':<7} {'ok':<4} {'build s':>8} {'cpu ms':>9} {'wall ms':>9}   torch cpu/wall ms")
    for label, name, kw, ref_kw in CASES:
        if args.only and name not in args.only.split(","):
            continue
        ex = load_example(name)
        for target in ("c", "opencl"):
            t0 = time.perf_counter()
            kernel, inputs = ex.prepare(target, **kw)
            out = kernel(*inputs)
            build = time.perf_counter() - t0
            ok = torch.allclose(out.float(), ex.reference(*inputs, **ref_kw).float(), **ex.TOLERANCE[kw["dtype"]])
            cpu, wall = _measure(lambda: kernel(*inputs), args.repeats)
            tcpu, twall = _measure(lambda: ex.reference(*inputs, **ref_kw), args.repeats)
            print(f"{label:<26} {target:<7} {'yes' if ok else 'NO':<4} {build:>8.2f} {cpu:>9.1f} {wall:>9.1f}   "
                  f"{tcpu:.1f} / {twall:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
