"""One prepared run on a machine with an NVIDIA GPU: does every kernel work on cuda (and opencl), and how fast are
GEMM and flash attention against torch there (about a minute on a 16-core H200 host).

    python -m bench.gpu_check [--skip-tests] [--quick] [--json out.json]

1. `tegula info` (the devices found, the arch kernels are built for).
2. Every language test and example on the `cuda` target (pytest tests/language -k cuda): on a machine with a
   GPU the cuda column builds each kernel for the device and runs it there, checking it as the test does
   against torch (tests/language/cuda_build.py). Where pyopencl finds an OpenCL device (`tegula info` lists it;
   for NVIDIA's, an ICD file naming libnvidia-opencl.so.1, e.g. through OCL_ICD_VENDORS), the opencl column
   runs too. With pytest-xdist installed the tests run on every core.
3. GEMM C = A @ B at 4096^3 in fp16 and bf16 (fp32 accumulation, examples/gemm.py with 128x128x32 tiles)
   against torch.matmul (cuBLAS), and flash attention (examples/flash_attention.py; batch 4, 32 heads,
   seq 4096, dim 128, fp16; causal and not) against torch's scaled_dot_product_attention (FlashAttention /
   cuDNN), each checked against the peer's output first. Times are CUDA-event medians over `--repeats`
   calls after warm-up, tegula and torch interleaved; the ratio is torch time / tegula time (> 1: tegula faster).

Nothing here runs without a CUDA device except `--help`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

from bench.common import load_example, summary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _time_pair(torch, ours, theirs, repeats):
    """Median ms of each, interleaved call by call, timed with CUDA events on the current stream."""
    for _ in range(3):
        ours()
        theirs()
    times = {"tegula": [], "torch": []}
    for _ in range(repeats):
        for name, fn in (("tegula", ours), ("torch", theirs)):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end))
    return {k: statistics.median(v) for k, v in times.items()}, {k: (min(v), max(v)) for k, v in times.items()}


def run_tests(timeout_s: int) -> dict:
    from tegula import runtime
    columns = "cuda or opencl" if runtime.get("opencl").available()[0] else "cuda"
    cmd = [sys.executable, "-m", "pytest", "-q", "tests/language", "-k", columns, "-p", "no:cacheprovider", "-rf",
           "--maxfail=40"]
    if importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", str(min(os.cpu_count() or 1, 16))]
    print(f"$ {' '.join(cmd)}", flush=True)
    t0 = time.time()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    tail = r.stdout.strip().splitlines()[-15:]
    print("\n".join(tail), flush=True)
    return {"returncode": r.returncode, "seconds": round(time.time() - t0, 1), "summary": tail[-1] if tail else ""}


def gemm_rows(torch, tegula, size, repeats) -> list:
    ex = load_example("gemm")
    rows = []
    for dtype in ("float16", "bfloat16"):
        t0 = time.time()
        kernel = tegula.compile(ex.matmul(size, size, size, dtype=dtype), out_idx=[-1], target="cuda")
        compile_s = time.time() - t0
        tdt = getattr(torch, dtype)
        a = torch.randn(size, size, device="cuda").to(tdt)
        b = torch.randn(size, size, device="cuda").to(tdt)
        c = kernel(a, b)
        ref = torch.matmul(a, b)
        err = ((c.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        med, spread = _time_pair(torch, lambda: kernel(a, b), lambda: torch.matmul(a, b), repeats)
        flops = 2 * size ** 3
        rows.append({"kernel": f"gemm {size}^3 {dtype}", "compile_s": round(compile_s, 1), "max_rel_err": err,
                     "tegula_ms": med["tegula"], "torch_ms": med["torch"], "spread_ms": spread,
                     "tegula_tflops": flops / med["tegula"] / 1e9, "torch_tflops": flops / med["torch"] / 1e9,
                     "torch/tegula": med["torch"] / med["tegula"]})
    return rows


def attention_rows(torch, tegula, batch, heads, seq, dim, repeats) -> list:
    import torch.nn.functional as F
    ex = load_example("flash_attention")
    rows = []
    for causal in (False, True):
        t0 = time.time()
        func = ex.flash_attention(batch, heads, seq, dim, causal, block_M=128, block_N=64, threads=256,
                                  dtype="float16")
        kernel = tegula.compile(func, out_idx=[3], target="cuda")
        compile_s = time.time() - t0
        q, k, v = (torch.randn(batch, seq, heads, dim, device="cuda", dtype=torch.float16) for _ in range(3))
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

        def peer():
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

        out = kernel(q, k, v)
        ref = peer().transpose(1, 2)
        err = (out.float() - ref.float()).abs().max().item()
        med, spread = _time_pair(torch, lambda: kernel(q, k, v), peer, repeats)
        flops = 4 * batch * heads * seq * seq * dim * (0.5 if causal else 1.0)
        rows.append({"kernel": f"flash attn b={batch} h={heads} s={seq} d={dim} fp16{' causal' if causal else ''}",
                     "compile_s": round(compile_s, 1), "max_abs_err": err, "tegula_ms": med["tegula"],
                     "torch_ms": med["torch"], "spread_ms": spread, "tegula_tflops": flops / med["tegula"] / 1e9,
                     "torch_tflops": flops / med["torch"] / 1e9, "torch/tegula": med["torch"] / med["tegula"]})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=summary(__doc__))
    p.add_argument("--skip-tests", action="store_true", help="only the timings")
    p.add_argument("--quick", action="store_true", help="smaller shapes (GEMM 2048^3, attention seq 2048)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--tests-timeout", type=int, default=330, help="seconds for the test run")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)

    import torch
    if not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device; nothing to do here", file=sys.stderr)
        return 2
    import tegula
    from tegula import cli
    cli.main(["info"])
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if not args.skip_tests:
        results["tests"] = run_tests(args.tests_timeout)
    size = 2048 if args.quick else 4096
    seq = 2048 if args.quick else 4096
    rows = gemm_rows(torch, tegula, size, args.repeats) + attention_rows(torch, tegula, 4, 32, seq, 128, args.repeats)
    results["rows"] = rows
    print(f"\n{'kernel':<44} {'tegula ms':>10} {'torch ms':>10} {'TFLOP/s':>9} {'torch/tegula':>13} {'err':>9}")
    for r in rows:
        err = r.get("max_rel_err", r.get("max_abs_err"))
        print(f"{r['kernel']:<44} {r['tegula_ms']:>10.3f} {r['torch_ms']:>10.3f} {r['tegula_tflops']:>9.1f} "
              f"{r['torch/tegula']:>13.3f} {err:>9.2e}   (compile {r['compile_s']} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    failed = not args.skip_tests and results["tests"]["returncode"] != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
