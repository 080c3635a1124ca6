"""Row softmax: Y[i, :] = softmax(X[i, :]), block_M whole rows per block.

Each block loads its rows into a float32 fragment, takes the row maximum with
T.reduce_max, exponentiates with exp2 (folding log2(e) into one multiply-add), sums
with T.reduce_sum and scales. When M is not a multiple of block_M, the last block reads
zero rows past the edge (harmless: their softmax is finite) and its stores there are
skipped.

    python examples/softmax.py --target c --M 4096 --N 1024
"""

import argparse

import torch
from torch.utils import benchmark

import tegula
import tegula.language as T

LOG2_E = 1.4426950408889634


def softmax(M, N, block_M=8, dtype="float32", accum_dtype="float32", threads=128):
    @T.prim_func
    def main(X: T.Tensor((M, N), dtype), Y: T.Tensor((M, N), dtype)):
        with T.Kernel(T.ceildiv(M, block_M), threads=threads) as bx:
            x = T.alloc_fragment((block_M, N), accum_dtype)
            row_max = T.alloc_fragment((block_M,), accum_dtype)
            row_sum = T.alloc_fragment((block_M,), accum_dtype)

            T.copy(X[bx * block_M:(bx + 1) * block_M, :], x)
            T.reduce_max(x, row_max, dim=1)
            # exp(x - max) == exp2(x * log2(e) - max * log2(e))
            for i, j in T.Parallel(block_M, N):
                x[i, j] = T.exp2(x[i, j] * LOG2_E - row_max[i] * LOG2_E)
            T.reduce_sum(x, row_sum, dim=1)
            for i, j in T.Parallel(block_M, N):
                x[i, j] = x[i, j] / row_sum[i]
            T.copy(x, Y[bx * block_M:(bx + 1) * block_M, :])

    return main


def reference(x):
    return torch.softmax(x.float(), dim=-1).to(x.dtype)


TOLERANCE = {
    "float32": {"rtol": 1e-5, "atol": 1e-6},
    "float16": {"rtol": 1e-2, "atol": 1e-3},
    "bfloat16": {"rtol": 1e-2, "atol": 1e-3},
}


def prepare(target="c", M=1000, N=512, dtype="float32", seed=0, **config):
    """Compile for `target` and make a random input; returns (kernel, (x,))."""
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(M, N, generator=gen)).to(getattr(torch, dtype))
    kernel = tegula.compile(softmax(M, N, dtype=dtype, **config), out_idx=[-1], target=target)
    return kernel, (x,)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="c", choices=["c", "interp"])
    parser.add_argument("--M", type=int, default=4096)
    parser.add_argument("--N", type=int, default=1024)
    parser.add_argument("--dtype", default="float32", choices=list(TOLERANCE))
    args = parser.parse_args()

    kernel, inputs = prepare(args.target, args.M, args.N, args.dtype)
    out, ref = kernel(*inputs), reference(*inputs)
    torch.testing.assert_close(out, ref, **TOLERANCE[args.dtype])
    print(f"softmax {args.M}x{args.N} {args.dtype} on {args.target}: matches torch "
          f"(max abs err {(out.float() - ref.float()).abs().max().item():.3g})")

    times = {
        name: benchmark.Timer("f(*x)", globals={"f": f, "x": x}).blocked_autorange(min_run_time=0.5)
        for name, f, x in (("tegula", kernel, inputs), ("torch", reference, inputs))
    }
    gbytes = 2 * out.numel() * out.element_size() / 1e9
    for name, t in times.items():
        print(f"{name:>6}: {t.median * 1e3:.3f} ms median (IQR {t.iqr * 1e3:.3f} ms), {gbytes / t.median:.3f} GB/s")
    print(f"tegula/torch time ratio {times['tegula'].median / times['torch'].median:.2f}")


if __name__ == "__main__":
    main()
