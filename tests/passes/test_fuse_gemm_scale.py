"""fuse_gemm_scale (c target): DeepGEMM's block-scaled K loop (a T.gemm per block of K into a cleared blk, then
acc += blk * (sa[i, s] * sb[s, j])) becomes one block-scaled prelude call where the gemm is on the dot-product
path. It may not change a result beyond fp32 summation order: every kernel runs on c and interp and must agree;
the generated source shows which form was chosen."""
import pytest
import torch

import tegula
import tegula.language as T
from tegula.passes.verify import verify


def scaled(M, N, K, block_m, block_n, kb, dtype="float8_e4m3fn", variant=None):
    """D = sum over blocks s of kb: (A_s . B_s) * SA[i, s] * SB[s, j], A and B staged whole along K."""
    nb = K // kb
    sb_shape = (block_n, nb) if variant == "sb_by_column" else (nb, block_n)

    @T.prim_func
    def main(A: T.Tensor((M, K), dtype), B: T.Tensor((N, K), dtype), SA: T.Tensor((M, nb), "float32"),
             SB: T.Tensor((nb, N), "float32"), D: T.Tensor((M, N), "float32")):
        with T.Kernel(T.ceildiv(N, block_n), T.ceildiv(M, block_m)) as (bx, by):
            A_s = T.alloc_shared((block_m, K), dtype)
            B_s = T.alloc_shared((block_n, K), dtype)
            acc = T.alloc_fragment((block_m, block_n), "float32")
            blk = T.alloc_fragment((block_m, block_n), "float32")
            sa = T.alloc_fragment((block_m, nb), "float32")
            sb = T.alloc_fragment(sb_shape, "float32")
            T.clear(acc)
            if variant == "accumulating":
                T.clear(blk)
            T.copy(A[by * block_m, 0], A_s)
            T.copy(B[bx * block_n, 0], B_s)
            for i, t in T.Parallel(block_m, nb):
                sa[i, t] = SA[T.min(by * block_m + i, M - 1), t]
            for t, j in T.Parallel(nb, block_n):
                if variant == "sb_by_column":
                    sb[j, t] = SB[t, T.min(bx * block_n + j, N - 1)]
                else:
                    sb[t, j] = SB[t, T.min(bx * block_n + j, N - 1)]
            for s in T.serial(nb):
                T.gemm(A_s[0:block_m, s * kb:s * kb + kb], B_s[0:block_n, s * kb:s * kb + kb], blk,
                       transpose_B=True, clear_accum=variant != "accumulating")
                for i, j in T.Parallel(block_m, block_n):
                    if variant == "sb_by_column":
                        acc[i, j] += blk[i, j] * (sa[i, s] * sb[j, s])
                    else:
                        acc[i, j] += blk[i, j] * (sa[i, s] * sb[s, j])
            if variant == "blk_read_after":
                for i, j in T.Parallel(block_m, block_n):
                    acc[i, j] += blk[i, j]
            T.copy(acc, D[by * block_m, bx * block_n])
    return main


def _agree(prim, M, N, K, kb, dtype=torch.float8_e4m3fn):
    torch.manual_seed(0)
    a = torch.randn(M, K).to(dtype)
    b = torch.randn(N, K).to(dtype)
    sa = torch.rand(M, K // kb) + 0.5
    sb = torch.rand(K // kb, N) + 0.5
    outs = []
    for target in ("interp", "c"):
        d = torch.zeros(M, N)
        tegula.compile(prim, target=target)(a, b, sa, sb, d)
        outs.append(d)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-3)
    return outs[1]


def _source(prim):
    low = tegula.lower(prim, target="c")
    verify(low.lowered)
    return low.kernel_source


@pytest.mark.parametrize("M,N,K,block_m,block_n", [(2, 32, 2048, 2, 16), (4, 40, 2048, 4, 16),
                                                   (3, 70, 2304, 4, 64), (8, 16, 2048, 8, 16), (4, 70, 1536, 4, 64),
                                                   (2, 20, 1536, 2, 16),
                                                   # one row, K <= 4096: whole rows of B, one stream (K <= 2048),
                                                   # else 8 / 4 / 2 / 1 groups of 16 side by side
                                                   (1, 200, 1536, 1, 128), (1, 40, 2048, 1, 64), (1, 16, 4096, 1, 16),
                                                   (1, 200, 3072, 1, 128)])
@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "bfloat16"])
def test_fused_matches_interp(M, N, K, block_m, block_n, dtype):
    prim = scaled(M, N, K, block_m, block_n, 128, dtype=dtype)
    src = _source(prim)
    name = "f8e4m3" if dtype == "float8_e4m3fn" else "bf16"
    assert f"tg_gemm_{name}_bscaled(" in src and "for (int32_t s = 0" not in src
    _agree(prim, M, N, K, 128, dtype=getattr(torch, dtype))


@pytest.mark.parametrize("M,N,K,block_m,block_n", [(256, 128, 512, 256, 128), (300, 150, 384, 128, 128)])
@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "bfloat16"])
def test_fused_on_panels_matches_interp(M, N, K, block_m, block_n, dtype):
    """128 rows or more: the prelude's panel path scales each register block's product into C (tiles across
    both edges in the second shape)."""
    prim = scaled(M, N, K, block_m, block_n, 128, dtype=dtype)
    src = _source(prim)
    name = "f8e4m3" if dtype == "float8_e4m3fn" else "bf16"
    assert f"tg_gemm_{name}_bscaled({block_m}, {block_n}, " in src and "for (int32_t s = 0" not in src
    _agree(prim, M, N, K, 128, dtype=getattr(torch, dtype))


def test_fused_is_deterministic():
    prim = scaled(4, 48, 2048, 4, 16, 128)
    torch.manual_seed(1)
    a = torch.randn(4, 2048).to(torch.float8_e4m3fn)
    b = torch.randn(48, 2048).to(torch.float8_e4m3fn)
    sa, sb = torch.rand(4, 16) + 0.5, torch.rand(16, 48) + 0.5
    k = tegula.compile(prim, target="c")
    outs = []
    for _ in range(3):
        d = torch.zeros(4, 48)
        k(a, b, sa, sb, d)
        outs.append(d)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("case", ["blk_read_after", "sb_by_column", "accumulating", "packed", "one_row", "short_k"])
def test_loop_is_kept(case):
    """blk read after the loop; a scale indexed otherwise than the prelude reads it; a gemm that accumulates
    across blocks (not DeepGEMM's per-block scaling); 32 rows (panels, not the dot path, and under 128 rows); one
    row of A with K > 4096, or 8 rows at K = 1536 (a gemm per block measured faster there)."""
    M, N, K, bm = {"packed": (32, 32, 2048, 32), "one_row": (1, 32, 4224, 1), "short_k": (8, 32, 1536, 8)}.get(
        case, (4, 32, 2048, 4))
    prim = scaled(M, N, K, bm, 16, 128, variant=None if case in ("packed", "one_row", "short_k") else case)
    src = _source(prim)
    assert "_bscaled(" not in src and "for (int32_t s = 0" in src
    _agree(prim, M, N, K, 128)
