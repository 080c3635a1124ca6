"""Elementwise add: C = A + B on 2-D tensors, one (block_M, block_N) tile per block.

The tile loads and stores are plain T.copy calls: where M or N is not a multiple of the
block, the copy reads zeros past the tensor's edge and skips the stores there, so the
kernel needs no explicit masking.

    python examples/elementwise_add.py --target c --M 4000 --N 3000
"""

import argparse

import torch
from torch.utils import benchmark

import tegula
import tegula.language as T


def elementwise_add(M, N, block_M=32, block_N=128, dtype="float32", threads=128):
    @T.prim_func
    def main(
        A: T.Tensor((M, N), dtype),
        B: T.Tensor((M, N), dtype),
        C: T.Tensor((M, N), dtype),
    ):
        with T.Kernel(T.ceildiv(N, block_N), T.ceildiv(M, block_M), threads=threads) as (bx, by):
            A_tile = T.alloc_fragment((block_M, block_N), dtype)
            B_tile = T.alloc_fragment((block_M, block_N), dtype)
            C_tile = T.alloc_fragment((block_M, block_N), dtype)

            # Start-index form: the region at (row, col) with the tile's extent.
            T.copy(A[by * block_M, bx * block_N], A_tile)
            T.copy(B[by * block_M, bx * block_N], B_tile)
            for i, j in T.Parallel(block_M, block_N):
                C_tile[i, j] = A_tile[i, j] + B_tile[i, j]
            T.copy(C_tile, C[by * block_M, bx * block_N])

    return main


def reference(a, b):
    return a + b


TOLERANCE = {
    "float32": {"rtol": 0, "atol": 0},
    "float16": {"rtol": 0, "atol": 0},
    "bfloat16": {"rtol": 0, "atol": 0},
}


def prepare(target="c", M=1000, N=700, dtype="float32", seed=0, **config):
    """Compile for `target` and make random inputs; returns (kernel, (a, b))."""
    gen = torch.Generator().manual_seed(seed)
    torch_dtype = getattr(torch, dtype)
    a = torch.randn(M, N, generator=gen).to(torch_dtype)
    b = torch.randn(M, N, generator=gen).to(torch_dtype)
    kernel = tegula.compile(elementwise_add(M, N, dtype=dtype, **config), out_idx=[-1], target=target)
    return kernel, (a, b)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="c", choices=["c", "interp"])
    parser.add_argument("--M", type=int, default=4000)
    parser.add_argument("--N", type=int, default=3000)
    parser.add_argument("--dtype", default="float32", choices=list(TOLERANCE))
    args = parser.parse_args()

    kernel, inputs = prepare(args.target, args.M, args.N, args.dtype)
    out, ref = kernel(*inputs), reference(*inputs)
    torch.testing.assert_close(out, ref, **TOLERANCE[args.dtype])
    print(f"elementwise_add {args.M}x{args.N} {args.dtype} on {args.target}: matches torch "
          f"(max abs err {(out.float() - ref.float()).abs().max().item():.3g})")

    times = {
        name: benchmark.Timer("f(*x)", globals={"f": f, "x": x}).blocked_autorange(min_run_time=0.5)
        for name, f, x in (("tegula", kernel, inputs), ("torch", reference, inputs))
    }
    gbytes = 3 * out.numel() * out.element_size() / 1e9
    for name, t in times.items():
        print(f"{name:>6}: {t.median * 1e3:.3f} ms median (IQR {t.iqr * 1e3:.3f} ms), {gbytes / t.median:.3f} GB/s")
    print(f"tegula/torch time ratio {times['tegula'].median / times['torch'].median:.2f}")


if __name__ == "__main__":
    main()
