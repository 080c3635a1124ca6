"""Memory-bound kernels written in T.* against torch eager and torch.compile, and the machine's bandwidth.

    python -m bench.memory [--gib 1.0] [--reps 5] [--no-compile] [--clock cpu] [--only copy,rmsnorm,...]

Every kernel reads a working set of about --gib GiB (well beyond the last-level cache). Outputs are
preallocated once and reused by tegula (its kernels take the output tensor as an argument) and by the torch.compile
peers (compiled as ``out.copy_(f(...))``, which inductor writes in place), so their first-touch page faults are not
timed; torch eager functions return fresh tensors (except copy / add, out=), as the table notes.
Bandwidth = bytes read + bytes written, per second. Every row samples tegula, torch eager, torch.compile and a plain
OpenMP copy of the same working set in turn (so the host's drift reaches all alike); "of copy BW" divides by that
row's copy ("copy GB/s").

--clock wall (default): every core, wall-clock medians. --clock cpu: tegula, torch and the reference copy each on
one thread, timed by process CPU time per call, which other load on a shared machine disturbs far less; the copy
bandwidth is then the one-thread figure.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

import tegula
import tegula.language as T
from bench.common import add_clock_option, check_gib, copy_kernels, interleaved, print_table
from bench.common import summary, timing_ms, try_compile, use_clock

FP8_MAX = 448.0


def copy_kernel(N, block=16384):
    @T.prim_func
    def copy(A: T.Tensor((N,), "float32"), B: T.Tensor((N,), "float32")):
        with T.Kernel(T.ceildiv(N, block)) as bx:
            for i in T.Parallel(block):
                B[bx * block + i] = A[bx * block + i]
    return copy


def add_kernel(N, block=16384):
    @T.prim_func
    def add(A: T.Tensor((N,), "float32"), B: T.Tensor((N,), "float32"), C: T.Tensor((N,), "float32")):
        with T.Kernel(T.ceildiv(N, block)) as bx:
            for i in T.Parallel(block):
                C[bx * block + i] = A[bx * block + i] + B[bx * block + i]
    return add


def softmax_kernel(M, N, block_M=4):
    @T.prim_func
    def softmax(X: T.Tensor((M, N), "float32"), Y: T.Tensor((M, N), "float32")):
        with T.Kernel(T.ceildiv(M, block_M)) as bx:
            x = T.alloc_fragment((block_M, N), "float32")
            mx = T.alloc_fragment((block_M,), "float32")
            sm = T.alloc_fragment((block_M,), "float32")
            T.copy(X[bx * block_M, 0], x)
            T.reduce_max(x, mx, dim=1)
            for i, j in T.Parallel(block_M, N):
                x[i, j] = T.exp(x[i, j] - mx[i])
            T.reduce_sum(x, sm, dim=1)
            for i, j in T.Parallel(block_M, N):
                x[i, j] = x[i, j] / sm[i]
            T.copy(x, Y[bx * block_M, 0])
    return softmax


def rmsnorm_kernel(M, H, eps=1e-6, block_M=2, quant=False, group=128):
    G = H // group

    @T.prim_func
    def rmsnorm(X: T.Tensor((M, H), "bfloat16"), W: T.Tensor((H,), "bfloat16"), Y: T.Tensor((M, H), "bfloat16")):
        with T.Kernel(T.ceildiv(M, block_M)) as bx:
            x = T.alloc_fragment((block_M, H), "float32")
            ss = T.alloc_fragment((block_M,), "float32")
            T.copy(X[bx * block_M, 0], x)
            sq = T.alloc_fragment((block_M, H), "float32")
            for i, j in T.Parallel(block_M, H):
                sq[i, j] = x[i, j] * x[i, j]
            T.reduce_sum(sq, ss, dim=1)
            for i in T.Parallel(block_M):
                ss[i] = T.rsqrt(ss[i] / H + eps)
            for i, j in T.Parallel(block_M, H):
                x[i, j] = x[i, j] * ss[i] * W[j]
            T.copy(x, Y[bx * block_M, 0])

    @T.prim_func
    def rmsnorm_fp8(X: T.Tensor((M, H), "bfloat16"), W: T.Tensor((H,), "bfloat16"),
                    Q: T.Tensor((M, H), "float8_e4m3fn"), S: T.Tensor((M, G), "float32")):
        with T.Kernel(T.ceildiv(M, block_M)) as bx:
            x = T.alloc_fragment((block_M, G, group), "float32")
            sq = T.alloc_fragment((block_M, G, group), "float32")
            part = T.alloc_fragment((block_M, G), "float32")
            ss = T.alloc_fragment((block_M,), "float32")
            amax = T.alloc_fragment((block_M, G), "float32")
            for i, g, k in T.Parallel(block_M, G, group):
                x[i, g, k] = X[bx * block_M + i, g * group + k]
            for i, g, k in T.Parallel(block_M, G, group):
                sq[i, g, k] = x[i, g, k] * x[i, g, k]
            T.reduce_sum(sq, part, dim=2)
            T.reduce_sum(part, ss, dim=1)
            for i in T.Parallel(block_M):
                ss[i] = T.rsqrt(ss[i] / H + eps)
            for i, g, k in T.Parallel(block_M, G, group):
                x[i, g, k] = T.cast(T.cast(x[i, g, k] * ss[i] * W[g * group + k], "bfloat16"), "float32")
            T.reduce_absmax(x, amax, dim=2)
            for i, g in T.Parallel(block_M, G):
                amax[i, g] = T.max(amax[i, g], 1e-4) / FP8_MAX
                S[bx * block_M + i, g] = amax[i, g]
            for i, g, k in T.Parallel(block_M, G, group):
                Q[bx * block_M + i, g * group + k] = x[i, g, k] / amax[i, g]
    return rmsnorm_fp8 if quant else rmsnorm


def swiglu_kernel(M, H, block_M=2):
    @T.prim_func
    def swiglu(X: T.Tensor((M, 2 * H), "bfloat16"), Y: T.Tensor((M, H), "bfloat16")):
        with T.Kernel(T.ceildiv(M, block_M)) as bx:
            for i, j in T.Parallel(block_M, H):
                a = T.cast(X[bx * block_M + i, j], "float32")
                b = T.cast(X[bx * block_M + i, H + j], "float32")
                Y[bx * block_M + i, j] = a * T.sigmoid(a) * b
    return swiglu


# torch peers ---------------------------------------------------------------------------------------

def rmsnorm_ref(x, w, eps=1e-6):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).bfloat16()


def rmsnorm_fp8_ref(x, w, eps=1e-6, group=128):
    y = rmsnorm_ref(x, w, eps).float()
    yg = y.view(y.shape[0], -1, group)
    scale = yg.abs().amax(-1).clamp(min=1e-4) / FP8_MAX
    return (yg / scale.unsqueeze(-1)).to(torch.float8_e4m3fn).view(y.shape), scale


def swiglu_ref(x):
    h = x.shape[1] // 2
    return (F.silu(x[:, :h].float()) * x[:, h:].float()).bfloat16()


def main(argv=None):
    p = argparse.ArgumentParser(description=summary(__doc__))
    p.add_argument("--gib", type=float, default=1.0, help="working set read per kernel, GiB (default 1)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile peers (slow to build)")
    add_clock_option(p)
    p.add_argument("--only", default="copy,add,softmax,rmsnorm,rmsnorm_fp8,swiglu",
                   help="comma-separated rows to run")
    args = p.parse_args(argv)
    only = set(args.only.split(","))
    if args.clock == "cpu":  # before any OpenMP runtime is loaded: it reads this then
        os.environ["OMP_NUM_THREADS"] = "1"
    clock = use_clock(args.clock)
    nthreads = 1 if args.clock == "cpu" else torch.get_num_threads()
    torch.manual_seed(0)
    nbytes = int(args.gib * (1 << 30))
    check_gib(args.gib, "kernels")
    copies = copy_kernels(nbytes, threads=1 if args.clock == "cpu" else None)
    copy_fn, copy_moved = copies["stream_copy"]
    # the reference copies on the bench's threads, timed by the same clock
    bw = {k: moved / (timing_ms(interleaved([fn], max(args.reps, 5), clock)[0]).median_ms * 1e-3) / 1e9
          for k, (fn, moved) in copies.items()}
    print(f"measured: plain copy {bw['stream_copy']:.1f} GB/s, non-temporal copy {bw['stream_copy_nt']:.1f} GB/s "
          f"({nthreads} threads, {args.gib} GiB source, {args.clock} clock); torch threads {torch.get_num_threads()}; "
          f"load average {os.getloadavg()[0]:.1f}")
    rows = []

    def bench(name, ours, eager, compiled_fn, moved_bytes, check):
        check()
        fns = {"ours": ours, "eager": eager}
        if compiled_fn is not None:
            try:
                compiled_fn()
                fns["compiled"] = compiled_fn
            except Exception as e:  # inductor failing here is a fact to report, not a crash
                print(f"  torch.compile failed for {name}: {type(e).__name__}: {str(e).splitlines()[0]}")
        # every contender and the plain copy of the same working set sampled in turn: "of copy BW" divides by the
        # copy of the same rounds (the memory's speed on a shared host moves within a run)
        fns["copy"] = copy_fn
        t = {k: timing_ms(v) for k, v in interleaved(fns, max(args.reps, 5), clock,
                                                      2e-2 if args.clock == "cpu" else 1e-3).items()}
        t_ours, t_eager, t_comp = t["ours"], t["eager"], t.get("compiled")
        gbs = moved_bytes / (t_ours.median_ms * 1e-3) / 1e9
        copy_gbs = copy_moved / (t["copy"].median_ms * 1e-3) / 1e9
        rows.append([name, t_ours.median_ms, f"{t_ours.spread:.0%}", gbs, copy_gbs, gbs / copy_gbs, t_eager.median_ms,
                     t_eager.median_ms / t_ours.median_ms,
                     "-" if t_comp is None else t_comp.median_ms,
                     "-" if t_comp is None else t_comp.median_ms / t_ours.median_ms])
        print(f"  {name}: done", flush=True)

    comp = (lambda f: None) if args.no_compile else try_compile

    n = nbytes // 4
    if only & {"copy", "add"}:
        a, b, c = torch.randn(n), torch.randn(n), torch.empty(n)
        if "copy" in only:
            k = tegula.compile(copy_kernel(n), target="c")
            bench("copy fp32", lambda: k(a, c), lambda: c.copy_(a), None, 2 * n * 4,
                  lambda: (k(a, c), torch.testing.assert_close(c, a)))
        if "add" in only:
            k = tegula.compile(add_kernel(n), target="c")
            cf = comp(lambda x, y, o: o.copy_(x + y))
            bench("add fp32", lambda: k(a, b, c), lambda: torch.add(a, b, out=c), cf and (lambda: cf(a, b, c)),
                  3 * n * 4, lambda: (k(a, b, c), torch.testing.assert_close(c, a + b)))
        del a, b, c

    if "softmax" in only:
        M, N = nbytes // 4 // 4096, 4096
        x, y = torch.randn(M, N), torch.empty(M, N)
        k = tegula.compile(softmax_kernel(M, N), target="c")
        cf = comp(lambda t, o: o.copy_(torch.softmax(t, -1)))
        bench("softmax fp32 x4096", lambda: k(x, y), lambda: torch.softmax(x, -1),
              cf and (lambda: cf(x, y)), 2 * M * N * 4,
              lambda: (k(x, y), torch.testing.assert_close(y, torch.softmax(x, -1), rtol=1e-5, atol=1e-6)))
        del x, y

    H = 7168
    M = nbytes // 2 // H
    if only & {"rmsnorm", "rmsnorm_fp8"}:
        x, w = torch.randn(M, H).bfloat16(), torch.randn(H).bfloat16()
    if "rmsnorm" in only:
        y = torch.empty(M, H, dtype=torch.bfloat16)
        k = tegula.compile(rmsnorm_kernel(M, H), target="c")
        cf = comp(lambda x, w, o: o.copy_(rmsnorm_ref(x, w)))
        bench("rmsnorm bf16 x7168", lambda: k(x, w, y), lambda: rmsnorm_ref(x, w), cf and (lambda: cf(x, w, y)),
              2 * M * H * 2, lambda: (k(x, w, y), torch.testing.assert_close(y.float(), rmsnorm_ref(x, w).float(),
                                                                              rtol=1e-2, atol=1e-2)))
        del y
    if "rmsnorm_fp8" in only:
        q = torch.empty(M, H, dtype=torch.float8_e4m3fn)
        s = torch.empty(M, H // 128)
        kq = tegula.compile(rmsnorm_kernel(M, H, quant=True), target="c")
        cf = comp(lambda x, w, q, s: tuple(o.copy_(r) for o, r in zip((q, s), rmsnorm_fp8_ref(x, w))))

        def check_q():
            kq(x, w, q, s)
            rq, rs = rmsnorm_fp8_ref(x, w)
            torch.testing.assert_close(s, rs, rtol=1e-2, atol=1e-9)  # a bf16 rounding step may differ
            torch.testing.assert_close(q.float(), rq.float(), rtol=0.13, atol=0.02)  # one e4m3 step at most
        bench("rmsnorm+fp8 quant x7168", lambda: kq(x, w, q, s), lambda: rmsnorm_fp8_ref(x, w),
              cf and (lambda: cf(x, w, q, s)), M * H * 2 + M * H + M * H // 128 * 4, check_q)
        del q, s
    if only & {"rmsnorm", "rmsnorm_fp8"}:
        del x, w

    if "swiglu" in only:
        H = 2048
        M = nbytes // 2 // (2 * H)
        x = torch.randn(M, 2 * H).bfloat16()
        y = torch.empty(M, H, dtype=torch.bfloat16)
        k = tegula.compile(swiglu_kernel(M, H), target="c")
        cf = comp(lambda x, o: o.copy_(swiglu_ref(x)))
        bench("swiglu bf16 2x2048", lambda: k(x, y), lambda: swiglu_ref(x), cf and (lambda: cf(x, y)),
              M * 2 * H * 2 + M * H * 2,
              lambda: (k(x, y), torch.testing.assert_close(y.float(), swiglu_ref(x).float(), rtol=1e-2, atol=1e-2)))

    print_table(f"memory-bound kernels, ~{args.gib} GiB working set, {nthreads} thread(s), {args.clock} clock "
                f"(medians of >= {args.reps} runs)",
                ["kernel", "tegula ms", "spread", "GB/s", "copy GB/s", "of copy BW", "eager ms", "eager/tegula",
                 "compile ms", "compile/tegula"], rows)
    print("ratios > 1: tegula is faster. tegula and the torch.compile peers (out.copy_(f(...)) compiled: inductor "
          "writes the preallocated output) reuse their outputs; torch eager allocates its outputs (except copy/add, "
          "out=), first touch of fresh memory included.")


if __name__ == "__main__":
    main()
