"""GEMM: C = A @ B, tiled the way TileLang's README tiles it.

Each block owns a (block_M, block_N) tile of C, accumulated in a float32 fragment while
the loop walks K in steps of block_K; the A and B tiles pass through shared memory, and
T.Pipelined lets the copies of later steps overlap the current T.gemm. Inputs may be
float32, float16 or bfloat16; the accumulator is float32 in every case.

    python examples/gemm.py --target c --M 1024 --N 1024 --K 1024 --dtype float16
"""

import argparse

import torch
from torch.utils import benchmark

import tegula
import tegula.language as T


def matmul(M, N, K, block_M=128, block_N=128, block_K=32, dtype="float16", accum_dtype="float32",
           num_stages=3, threads=128):
    @T.prim_func
    def main(
        A: T.Tensor((M, K), dtype),
        B: T.Tensor((K, N), dtype),
        C: T.Tensor((M, N), dtype),
    ):
        # bx walks the columns of C, by its rows.
        with T.Kernel(T.ceildiv(N, block_N), T.ceildiv(M, block_M), threads=threads) as (bx, by):
            A_shared = T.alloc_shared((block_M, block_K), dtype)
            B_shared = T.alloc_shared((block_K, block_N), dtype)
            C_local = T.alloc_fragment((block_M, block_N), accum_dtype)

            T.clear(C_local)
            for k in T.Pipelined(T.ceildiv(K, block_K), num_stages=num_stages):
                # Start-index copies: the extent comes from the shared tile; reads past
                # the edge of A or B give zeros, which add nothing to C.
                T.copy(A[by * block_M, k * block_K], A_shared)
                T.copy(B[k * block_K, bx * block_N], B_shared)
                T.gemm(A_shared, B_shared, C_local)

            # float32 -> dtype on the way out; stores past the edge of C are skipped.
            T.copy(C_local, C[by * block_M, bx * block_N])

    return main


def reference(a, b):
    return (a.float() @ b.float()).to(a.dtype)


TOLERANCE = {
    "float32": {"rtol": 1e-4, "atol": 1e-4},
    "float16": {"rtol": 1e-2, "atol": 1e-2},
    "bfloat16": {"rtol": 1e-2, "atol": 1e-2},
}


def prepare(target="c", M=512, N=512, K=512, dtype="float16", seed=0, **config):
    """Compile for `target` and make random inputs; returns (kernel, (a, b))."""
    gen = torch.Generator().manual_seed(seed)
    torch_dtype = getattr(torch, dtype)
    a = torch.randn(M, K, generator=gen).to(torch_dtype)
    b = torch.randn(K, N, generator=gen).to(torch_dtype)
    kernel = tegula.compile(matmul(M, N, K, dtype=dtype, **config), out_idx=[-1], target=target)
    return kernel, (a, b)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="c", choices=["c", "interp"])
    parser.add_argument("--M", type=int, default=1024)
    parser.add_argument("--N", type=int, default=1024)
    parser.add_argument("--K", type=int, default=1024)
    parser.add_argument("--dtype", default="float16", choices=list(TOLERANCE))
    args = parser.parse_args()

    kernel, inputs = prepare(args.target, args.M, args.N, args.K, args.dtype)
    out, ref = kernel(*inputs), reference(*inputs)
    torch.testing.assert_close(out, ref, **TOLERANCE[args.dtype])
    print(f"gemm {args.M}x{args.N}x{args.K} {args.dtype} on {args.target}: matches torch "
          f"(max abs err {(out.float() - ref.float()).abs().max().item():.3g})")

    # The peer is torch.matmul on the same inputs (its CPU kernels take fp16/bf16 directly).
    times = {
        name: benchmark.Timer("f(*x)", globals={"f": f, "x": x}).blocked_autorange(min_run_time=0.5)
        for name, f, x in (("tegula", kernel, inputs), ("torch", torch.matmul, inputs))
    }
    tflops = 2 * args.M * args.N * args.K / 1e12
    for name, t in times.items():
        print(f"{name:>6}: {t.median * 1e3:.3f} ms median (IQR {t.iqr * 1e3:.3f} ms), {tflops / t.median:.3f} TFLOP/s")
    print(f"tegula/torch time ratio {times['tegula'].median / times['torch'].median:.2f}")


if __name__ == "__main__":
    main()
