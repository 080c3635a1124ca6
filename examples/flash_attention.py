"""Flash attention forward: O = softmax(Q K^T / sqrt(dim)) V, without materialising Q K^T.

Q, K, V and O are [batch, seq_len, heads, dim]. The grid is (query blocks, heads, batch);
each block keeps its block_M queries in shared memory and walks the keys in steps of
block_N, keeping an online softmax: the running row maximum (scores_max), the factor by
which the previous partial results shrink when the maximum grows (scores_scale), and the
running denominator (logsum). Exponentials use exp2 with log2(e) folded into the scale.

`is_causal` is a Python bool captured by the kernel: it selects the masking code and the
loop length at compile time (a causal block stops at its diagonal).

    python examples/flash_attention.py --target c --batch 1 --heads 8 --seq-len 1024 --dim 64 --causal
"""

import argparse
import math

import torch
import torch.nn.functional as F
from torch.utils import benchmark

import tegula
import tegula.language as T


def flash_attention(batch, heads, seq_len, dim, is_causal, block_M=64, block_N=64, num_stages=1,
                    threads=128, dtype="float16", accum_dtype="float32"):
    scale = math.log2(math.e) / math.sqrt(dim)
    shape = (batch, seq_len, heads, dim)
    # Keys past seq_len in the last key block read as zeros; without a causal mask (which
    # already hides them from every real query) they must be masked explicitly.
    mask_key_tail = seq_len % block_N != 0

    @T.macro
    def compute_scores(Q_shared, K, K_shared, acc_s, k, bx, by, bz):
        T.copy(K[bz, k * block_N:(k + 1) * block_N, by, :], K_shared)
        if is_causal:
            for i, j in T.Parallel(block_M, block_N):
                acc_s[i, j] = T.if_then_else(bx * block_M + i >= k * block_N + j, 0, -T.infinity(accum_dtype))
        elif mask_key_tail:
            for i, j in T.Parallel(block_M, block_N):
                acc_s[i, j] = T.if_then_else(k * block_N + j < seq_len, 0, -T.infinity(accum_dtype))
        else:
            T.clear(acc_s)
        T.gemm(Q_shared, K_shared, acc_s, transpose_B=True)

    @T.macro
    def online_softmax(acc_s, acc_s_cast, scores_max, scores_max_prev, scores_scale, scores_sum, logsum):
        T.copy(scores_max, scores_max_prev)
        # clear=False: the new maximum also covers every earlier key block.
        T.reduce_max(acc_s, scores_max, dim=1, clear=False)
        for i in T.Parallel(block_M):
            scores_scale[i] = T.exp2(scores_max_prev[i] * scale - scores_max[i] * scale)
        for i, j in T.Parallel(block_M, block_N):
            acc_s[i, j] = T.exp2(acc_s[i, j] * scale - scores_max[i] * scale)
        T.reduce_sum(acc_s, scores_sum, dim=1)
        for i in T.Parallel(block_M):
            logsum[i] = logsum[i] * scores_scale[i] + scores_sum[i]
        T.copy(acc_s, acc_s_cast)

    @T.macro
    def accumulate_output(V, V_shared, acc_s_cast, acc_o, scores_scale, k, by, bz):
        for i, j in T.Parallel(block_M, dim):
            acc_o[i, j] *= scores_scale[i]
        T.copy(V[bz, k * block_N:(k + 1) * block_N, by, :], V_shared)
        T.gemm(acc_s_cast, V_shared, acc_o)

    @T.prim_func
    def main(
        Q: T.Tensor(shape, dtype),
        K: T.Tensor(shape, dtype),
        V: T.Tensor(shape, dtype),
        Output: T.Tensor(shape, dtype),
    ):
        with T.Kernel(T.ceildiv(seq_len, block_M), heads, batch, threads=threads) as (bx, by, bz):
            Q_shared = T.alloc_shared((block_M, dim), dtype)
            K_shared = T.alloc_shared((block_N, dim), dtype)
            V_shared = T.alloc_shared((block_N, dim), dtype)
            O_shared = T.alloc_shared((block_M, dim), dtype)
            acc_s = T.alloc_fragment((block_M, block_N), accum_dtype)
            acc_s_cast = T.alloc_fragment((block_M, block_N), dtype)
            acc_o = T.alloc_fragment((block_M, dim), accum_dtype)
            scores_max = T.alloc_fragment((block_M,), accum_dtype)
            scores_max_prev = T.alloc_fragment((block_M,), accum_dtype)
            scores_scale = T.alloc_fragment((block_M,), accum_dtype)
            scores_sum = T.alloc_fragment((block_M,), accum_dtype)
            logsum = T.alloc_fragment((block_M,), accum_dtype)

            # Q[bz, rows, by, :] drops the batch and head dims: a (block_M, dim) tile.
            T.copy(Q[bz, bx * block_M:(bx + 1) * block_M, by, :], Q_shared)
            T.fill(acc_o, 0)
            T.fill(logsum, 0)
            T.fill(scores_max, -T.infinity(accum_dtype))

            num_key_blocks = (
                T.min(T.ceildiv(seq_len, block_N), T.ceildiv((bx + 1) * block_M, block_N))
                if is_causal else T.ceildiv(seq_len, block_N)
            )
            for k in T.Pipelined(num_key_blocks, num_stages=num_stages):
                compute_scores(Q_shared, K, K_shared, acc_s, k, bx, by, bz)
                online_softmax(acc_s, acc_s_cast, scores_max, scores_max_prev, scores_scale, scores_sum, logsum)
                accumulate_output(V, V_shared, acc_s_cast, acc_o, scores_scale, k, by, bz)

            for i, j in T.Parallel(block_M, dim):
                acc_o[i, j] /= logsum[i]
            T.copy(acc_o, O_shared)
            T.copy(O_shared, Output[bz, bx * block_M:(bx + 1) * block_M, by, :])

    return main


def reference(q, k, v, is_causal):
    # SDPA wants [batch, heads, seq, dim]; compute in float32.
    q, k, v = (t.float().transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    return out.transpose(1, 2).contiguous()


TOLERANCE = {
    "float32": {"rtol": 1e-4, "atol": 1e-4},
    "float16": {"rtol": 1e-2, "atol": 1e-2},
    "bfloat16": {"rtol": 2e-2, "atol": 2e-2},
}


def prepare(target="c", batch=1, heads=4, seq_len=256, dim=64, is_causal=False, dtype="float16", seed=0, **config):
    """Compile for `target` and make random q, k, v; returns (kernel, (q, k, v))."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, seq_len, heads, dim, generator=gen).to(getattr(torch, dtype)) for _ in range(3))
    func = flash_attention(batch, heads, seq_len, dim, is_causal, dtype=dtype, **config)
    kernel = tegula.compile(func, out_idx=[3], target=target)
    return kernel, (q, k, v)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="c", choices=["c", "interp"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--dtype", default="float16", choices=list(TOLERANCE))
    args = parser.parse_args()

    kernel, inputs = prepare(args.target, args.batch, args.heads, args.seq_len, args.dim, args.causal, args.dtype)
    out, ref = kernel(*inputs), reference(*inputs, is_causal=args.causal)
    torch.testing.assert_close(out.float(), ref, **TOLERANCE[args.dtype])
    print(f"flash attention b={args.batch} h={args.heads} s={args.seq_len} d={args.dim} causal={args.causal} "
          f"{args.dtype} on {args.target}: matches torch (max abs err {(out.float() - ref).abs().max().item():.3g})")

    # The peer is torch's fused SDPA on the same [batch, heads, seq, dim] data, in the input dtype.
    q, k, v = (t.transpose(1, 2) for t in inputs)
    peers = (("tegula", kernel, inputs),
             ("torch", lambda *x: F.scaled_dot_product_attention(*x, is_causal=args.causal), (q, k, v)))
    times = {
        name: benchmark.Timer("f(*x)", globals={"f": f, "x": x}).blocked_autorange(min_run_time=0.5)
        for name, f, x in peers
    }
    causal_fraction = 0.5 if args.causal else 1.0
    tflops = 4 * args.batch * args.heads * args.seq_len**2 * args.dim * causal_fraction / 1e12
    for name, t in times.items():
        print(f"{name:>6}: {t.median * 1e3:.3f} ms median (IQR {t.iqr * 1e3:.3f} ms), {tflops / t.median:.3f} TFLOP/s")
    print(f"tegula/torch time ratio {times['tegula'].median / times['torch'].median:.2f}")


if __name__ == "__main__":
    main()
