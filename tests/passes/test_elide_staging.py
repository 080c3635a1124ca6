"""elide_staging (c target): a T.gemm on the prelude's dot-product path (B transposed, few rows of A) reads its
global tiles in place instead of a staged copy, versioned on one in-bounds flag where a tile may cross the
tensor's edge. It may not change a result: every kernel runs on c and interp and must agree; the lowered IR shows
which form was chosen."""
import pytest
import torch

import tegula
import tegula.language as T
from tegula.passes.verify import verify


def decode(M, N, K, block_m, block_n, block_k, dtype="bfloat16", stages=2, read_bs=False, convert=False,
           view=False):
    """C = A @ B^T walked over K in T.Pipelined steps, A and B staged (optionally: B_s also read elementwise, B
    converted from float32 by the copy, or B_s's first row zeroed through a T.reshape view of it)."""
    src = "float32" if convert else dtype

    @T.prim_func
    def main(A: T.Tensor((M, K), dtype), B: T.Tensor((N, K), src), C: T.Tensor((M, N), "float32")):
        with T.Kernel(T.ceildiv(N, block_n), T.ceildiv(M, block_m)) as (bx, by):
            A_s = T.alloc_shared((block_m, block_k), dtype)
            B_s = T.alloc_shared((block_n, block_k), dtype)
            acc = T.alloc_fragment((block_m, block_n), "float32")
            T.clear(acc)
            for k in T.Pipelined(T.ceildiv(K, block_k), num_stages=stages):
                T.copy(A[by * block_m, k * block_k], A_s)
                T.copy(B[bx * block_n, k * block_k], B_s)
                if view:
                    flat = T.reshape(B_s, (block_n * block_k,))
                    for j in T.Parallel(block_k):
                        flat[j] = T.cast(0, dtype)
                T.gemm(A_s, B_s, acc, transpose_B=True)
                if read_bs:
                    for i, j in T.Parallel(block_m, block_n):
                        acc[i, j] += T.cast(B_s[j, 0], "float32")
            T.copy(acc, C[by * block_m, bx * block_n])
    return main


def _agree(prim, M, N, K, dtype=torch.bfloat16, bdtype=None):
    torch.manual_seed(0)
    a = torch.randn(M, K).to(dtype)
    b = torch.randn(N, K).to(bdtype or dtype)
    outs = []
    for target in ("interp", "c"):
        c = torch.zeros(M, N)
        tegula.compile(prim, target=target)(a, b, c)
        outs.append(c)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-3)


def _forms(prim):
    low = tegula.lower(prim, target="c")
    verify(low.lowered)
    text = low.lowered.script()
    return text, low.kernel_source


@pytest.mark.parametrize("M,N,K", [(1, 64, 256), (3, 50, 200), (4, 33, 96)])  # edges: versioned on the flag
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_in_place_gemm_matches_interp(M, N, K, dtype):
    prim = decode(M, N, K, 4, 16, 64, dtype=dtype)
    text, src = _forms(prim)
    assert "extern_gemm(A[" in text and "B[" in text.split("extern_gemm(A[")[1].split("\n")[0]
    _agree(prim, M, N, K, dtype=getattr(torch, dtype))


@pytest.mark.parametrize("M,N,K", [(256, 256, 128), (200, 130, 192)])  # whole tiles; tiles across both edges
def test_compute_tiles_read_in_place(M, N, K):
    """128 x 128 bf16 tiles of C: the prelude packs B into panels, each serving 128 rows, so the tiles are read in
    place too (versioned on the flag where one crosses an edge); fp8 keeps its staged tiles."""
    prim = decode(M, N, K, 128, 128, 64)
    text, _ = _forms(prim)
    assert "extern_gemm(A[" in text and "B[" in text.split("extern_gemm(A[")[1].split("\n")[0]
    _agree(prim, M, N, K)
    text, _ = _forms(decode(M, N, K, 128, 128, 64, dtype="float8_e4m3fn"))
    assert all("B_s" in line for line in text.splitlines() if "extern_gemm(" in line)


def test_copies_run_only_when_a_tile_crosses_the_edge():
    text, _ = _forms(decode(4, 64, 256, 4, 16, 64))
    assert "if !tg_inside1:" in text          # the staged copies: only for a tile not inside its tensor
    assert "if tg_inside1:\n        extern_gemm(A[" in text


@pytest.mark.parametrize("case", ["packed", "read_elsewhere", "converting", "fp32", "view"])
def test_staging_is_kept(case):
    if case == "packed":  # 32 rows: the prelude packs B into panels (for few rows: faster from a staged tile)
        prim, shape, kw = decode(32, 64, 128, 32, 16, 64), (32, 64, 128), {}
    elif case == "read_elsewhere":
        prim, shape, kw = decode(2, 32, 128, 2, 16, 64, read_bs=True), (2, 32, 128), {}
    elif case == "converting":
        prim, shape, kw = decode(2, 32, 128, 2, 16, 64, convert=True), (2, 32, 128), {"bdtype": torch.float32}
    elif case == "fp32":
        prim, shape, kw = decode(2, 32, 128, 2, 16, 64, dtype="float32"), (2, 32, 128), {"dtype": torch.float32}
    else:  # written through a view after the copy: the gemm must see the zeroed row
        prim, shape, kw = decode(2, 32, 128, 2, 16, 64, view=True), (2, 32, 128), {}
    text, _ = _forms(prim)
    gemms = [line for line in text.splitlines() if "extern_gemm(" in line]
    assert gemms and all("B_s" in line for line in gemms)     # B always from its staged tile
    _agree(prim, *shape, **kw)


def test_next_tiles_are_still_prefetched():
    text, src = _forms(decode(4, 64, 256, 4, 16, 64))
    assert "extern_gemm(A[" in text                       # elided ...
    assert "prefetch(B[" in text and "__builtin_prefetch(&B[" in src   # ... and B's next tile prefetched
