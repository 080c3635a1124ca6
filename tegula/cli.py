"""The ``tegula`` command: ``info`` (targets usable here), ``demo`` (examples vs torch)."""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

DEMO_CASES = [  # (example file, label, prepare() keywords for the c target, for interp)
    ("elementwise_add", "add 4096x4096 fp32", dict(M=4096, N=4096, dtype="float32"), dict(M=500, N=300)),
    ("gemm", "gemm 1024^3 fp32", dict(M=1024, N=1024, K=1024, dtype="float32"), dict(M=256, N=256, K=128,
                                                                                        dtype="float32")),
    ("gemm", "gemm 1024^3 bf16", dict(M=1024, N=1024, K=1024, dtype="bfloat16"), dict(M=256, N=256, K=128,
                                                                                         dtype="bfloat16")),
    ("softmax", "softmax 4096x1024 fp32", dict(M=4096, N=1024, dtype="float32"), dict(M=200, N=256)),
    ("flash_attention", "flash attn s=1024 fp32", dict(batch=1, heads=8, seq_len=1024, dim=64, dtype="float32"),
     dict(batch=1, heads=2, seq_len=128, dim=32, dtype="float32")),
    ("flash_attention", "flash attn causal s=1024", dict(batch=1, heads=8, seq_len=1024, dim=64, is_causal=True,
                                                         dtype="float32"),
     dict(batch=1, heads=2, seq_len=128, dim=32, is_causal=True, dtype="float32")),
]


def _examples_dir(given: str | None) -> str:
    if given:
        return given
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.join(here, "examples")


def _load_example(d: str, name: str):
    path = os.path.join(d, name + ".py")
    if not os.path.exists(path):
        raise SystemExit(f"tegula demo: example {path} not found (run from a checkout, or pass --examples DIR)")
    spec = importlib.util.spec_from_file_location(f"tegula_example_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cmd_info(args) -> int:
    import platform

    import tegula
    from tegula import config, runtime
    from tegula.jit.targets import TARGETS, default_target
    cfg = config.get()
    print(f"tegula {tegula.__version__}  python {platform.python_version()}  {platform.machine()}  "
          f"{os.cpu_count()} cpus")
    print(f"cache dir: {cfg.cache_dir}   default target: {cfg.target or default_target()}")
    print("targets:")
    for name, t in TARGETS.items():
        try:
            rt = runtime.get(t.runtime)
            ok, why = rt.available() if hasattr(rt, "available") else (True, "always available (numpy)")
        except Exception as e:  # a backend that cannot even be imported is simply unusable
            ok, why = False, f"{type(e).__name__}: {e}"
        print(f"  {name:<8} {'usable' if ok else 'unusable':<9} {why}")
        for dev in (rt.devices() if ok and hasattr(rt, "devices") else []):
            print(f"           device: {dev}")
    return 0


def _median_ms(fn, reps):
    from tegula.jit.profiler import do_bench
    return do_bench(fn, warmup=1, rep=reps, min_time_s=0.2)


def cmd_demo(args) -> int:
    import torch
    d = _examples_dir(args.examples)
    targets = [t.strip() for t in args.target.split(",") if t.strip()]
    rows = []
    header = f"{'kernel':<26} {'target':<7} {'correct':<8} {'tegula ms':>10} {'torch ms':>10} {'torch/tegula':>12}"
    print(header)
    print("-" * len(header))
    failures = 0
    for name, label, c_kw, interp_kw in DEMO_CASES:
        mod = _load_example(d, name)
        for tgt in targets:
            kw = dict(c_kw if tgt != "interp" else interp_kw)
            t0 = time.perf_counter()
            try:
                kernel, inputs = mod.prepare(tgt, **kw)
                extra = {"is_causal": kw["is_causal"]} if "is_causal" in kw else (
                    {"is_causal": False} if name == "flash_attention" else {})
                out = kernel(*inputs)
                ref = mod.reference(*inputs, **extra)
                tol = mod.TOLERANCE[kw.get("dtype", "float32")]
                correct = torch.allclose(out.float(), ref.float(), **tol)
            except Exception as e:  # report and go on with the other rows
                print(f"{label:<26} {tgt:<7} ERROR    {type(e).__name__}: {str(e).splitlines()[0]}")
                failures += 1
                continue
            compile_s = time.perf_counter() - t0
            reps = 3 if tgt == "interp" else args.reps
            ours = _median_ms(lambda: kernel(*inputs), reps)
            theirs = _median_ms(lambda: mod.reference(*inputs, **extra), reps)
            failures += not correct
            rows.append((label, tgt, correct, ours.median_ms, theirs.median_ms))
            print(f"{label:<26} {tgt:<7} {'yes' if correct else 'NO':<8} {ours.median_ms:>10.3f} "
                  f"{theirs.median_ms:>10.3f} {theirs.median_ms / ours.median_ms:>12.2f}"
                  f"   (prepare+compile {compile_s:.2f} s)")
            sys.stdout.flush()
    print(f"\ntorch threads: {torch.get_num_threads()}; torch/tegula > 1 means tegula is faster. interp rows use small "
          "shapes (it is the reference, not a fast path); outputs are allocated per call on both sides.")
    return 1 if failures else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="tegula", description="tegula: a hardware-neutral tile language and compiler")
    p.add_argument("--version", action="store_true", help="print the version and exit")
    sub = p.add_subparsers(dest="cmd")
    sub.add_parser("info", help="targets usable on this machine, and why the others are not")
    demo = sub.add_parser("demo", help="compile and run the examples, check them against torch, time both")
    demo.add_argument("--target", default="c,interp", help="comma-separated targets (default: c,interp)")
    demo.add_argument("--examples", default=None, help="directory holding the example scripts")
    demo.add_argument("--reps", type=int, default=10, help="timed repeats per row (median is reported)")
    args = p.parse_args(argv)
    if args.version:
        import tegula
        print(tegula.__version__)
        return 0
    if args.cmd == "info":
        return cmd_info(args)
    if args.cmd == "demo":
        return cmd_demo(args)
    p.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
