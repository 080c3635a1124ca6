"""Tile ops as TileLang defines them: T.copy, T.gemm, T.fill/T.clear, T.reduce_*, T.atomic_*.

Each kernel is small and written in TileLang's dialect; each runs on every target and is
checked against torch.
"""

import pytest
import torch
from narrow import narrow_reference

import tegula
import tegula.language as T


def random_tensor(shape, dtype):
    if dtype.startswith("int"):
        return torch.randint(-100, 100, shape, dtype=getattr(torch, dtype))
    return torch.randn(shape).to(getattr(torch, dtype))


# --- T.copy ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int32", "int8"])
def test_copy_whole_buffers(target, dtype):
    M, N = 16, 8

    @T.prim_func
    def main(A: T.Tensor((M, N), dtype), B: T.Tensor((M, N), dtype)):
        with T.Kernel(1, threads=32):
            A_shared = T.alloc_shared((M, N), dtype)
            A_frag = T.alloc_fragment((M, N), dtype)
            T.copy(A, A_shared)
            T.copy(A_shared, A_frag)
            T.copy(A_frag, B)

    kernel = tegula.compile(main, out_idx=[-1], target=target)
    a = random_tensor((M, N), dtype)
    b = kernel(a)
    assert b.dtype == a.dtype and b.shape == a.shape
    assert torch.equal(b, a)


def test_copy_slices(target):
    # A[a:b, c:d] on both sides of the copy, one 4x5 tile per block.
    M, N, bm, bn = 12, 10, 4, 5

    @T.prim_func
    def main(A: T.Tensor((M, N), "float32"), B: T.Tensor((M, N), "float32")):
        with T.Kernel(N // bn, M // bm) as (bx, by):
            tile = T.alloc_shared((bm, bn), "float32")
            T.copy(A[by * bm:(by + 1) * bm, bx * bn:(bx + 1) * bn], tile)
            for i, j in T.Parallel(bm, bn):
                tile[i, j] = tile[i, j] * 2.0
            T.copy(tile, B[by * bm:(by + 1) * bm, bx * bn:(bx + 1) * bn])

    a = torch.randn(M, N)
    torch.testing.assert_close(tegula.compile(main, out_idx=[-1], target=target)(a), a * 2, rtol=0, atol=0)


def test_copy_start_index_form(target):
    # A[r, c] as a copy endpoint means "the region starting at (r, c)" with the other side's extent.
    M, N, bm, bn = 8, 12, 4, 6

    @T.prim_func
    def main(A: T.Tensor((M, N), "float32"), B: T.Tensor((N, M), "float32")):
        with T.Kernel(N // bn, M // bm) as (bx, by):
            tile = T.alloc_fragment((bm, bn), "float32")
            tile_t = T.alloc_fragment((bn, bm), "float32")
            T.copy(A[by * bm, bx * bn], tile)
            for i, j in T.Parallel(bn, bm):
                tile_t[i, j] = tile[j, i]
            T.copy(tile_t, B[bx * bn, by * bm])

    a = torch.randn(M, N)
    torch.testing.assert_close(tegula.compile(main, out_idx=[-1], target=target)(a), a.T, rtol=0, atol=0)


def test_copy_drops_scalar_indexed_dims(target):
    # Q[bz, rows, h, :] is a 2-D (rows, dim) tile; a row of a 2-D tensor is a 1-D tile.
    batch, seq, heads, dim, bm = 2, 8, 3, 4, 4

    @T.prim_func
    def main(
        Q: T.Tensor((batch, seq, heads, dim), "float32"),
        O: T.Tensor((batch, seq, heads, dim), "float32"),
        RowSums: T.Tensor((batch * heads, seq), "float32"),
    ):
        with T.Kernel(seq // bm, heads, batch) as (bx, by, bz):
            q = T.alloc_shared((bm, dim), "float32")
            sums = T.alloc_fragment((bm,), "float32")
            T.copy(Q[bz, bx * bm:(bx + 1) * bm, by, :], q)
            T.reduce_sum(q, sums, dim=1)
            for i, j in T.Parallel(bm, dim):
                q[i, j] = q[i, j] + 1.0
            T.copy(q, O[bz, bx * bm:(bx + 1) * bm, by, :])
            T.copy(sums, RowSums[bz * heads + by, bx * bm:(bx + 1) * bm])

    q = torch.randn(batch, seq, heads, dim)
    o, row_sums = tegula.compile(main, out_idx=[1, 2], target=target)(q)
    torch.testing.assert_close(o, q + 1, rtol=0, atol=0)
    expected_sums = q.sum(-1).permute(0, 2, 1).reshape(batch * heads, seq)
    torch.testing.assert_close(row_sums, expected_sums, rtol=1e-6, atol=1e-6)


def test_copy_row_at_runtime_index(target):
    # A gather: the copied row is chosen by a value read from another tensor.
    rows, N, picks = 10, 16, 6

    @T.prim_func
    def main(A: T.Tensor((rows, N), "float32"), Idx: T.Tensor((picks,), "int32"), B: T.Tensor((picks, N), "float32")):
        with T.Kernel(picks) as bx:
            row = T.alloc_shared((N,), "float32")
            T.copy(A[Idx[bx], :], row)
            T.copy(row, B[bx, :])

    a = torch.randn(rows, N)
    idx = torch.tensor([3, 0, 9, 3, 5, 1], dtype=torch.int32)
    b = tegula.compile(main, out_idx=[-1], target=target)(a, idx)
    torch.testing.assert_close(b, a[idx.long()], rtol=0, atol=0)


def test_copy_out_of_bounds_reads_zero_and_drops_writes(target):
    # A 10x6 tensor covered by 8x4 tiles: the last tile row and column hang over the edge.
    M, N, bm, bn = 10, 6, 8, 4
    gm, gn = -(-M // bm), -(-N // bn)

    @T.prim_func
    def main(
        A: T.Tensor((M, N), "float32"),
        Tiles: T.Tensor((gm, gn, bm, bn), "float32"),
        B: T.Tensor((M, N), "float32"),
    ):
        with T.Kernel(gn, gm) as (bx, by):
            tile = T.alloc_fragment((bm, bn), "float32")
            T.copy(A[by * bm:(by + 1) * bm, bx * bn:(bx + 1) * bn], tile)
            T.copy(tile, Tiles[by, bx, :, :])
            for i, j in T.Parallel(bm, bn):
                tile[i, j] = tile[i, j] + 1.0
            T.copy(tile, B[by * bm, bx * bn])

    a = torch.randn(M, N)
    # B sits at the front of a larger buffer: a store past B's end would land on the sentinel.
    storage = torch.full((M * N + 64,), -7.0)
    b = storage[: M * N].view(M, N)
    kernel = tegula.compile(main, out_idx=[1], target=target)
    tiles = kernel(a, b)

    padded = torch.zeros(gm * bm, gn * bn)
    padded[:M, :N] = a
    expected_tiles = padded.view(gm, bm, gn, bn).permute(0, 2, 1, 3)
    torch.testing.assert_close(tiles, expected_tiles, rtol=0, atol=0)
    torch.testing.assert_close(b, a + 1, rtol=0, atol=0)
    assert torch.all(storage[M * N:] == -7.0)


def test_copy_tile_entirely_past_the_end(target):
    # The grid has one block more than the data needs: its tile reads all zeros and stores nothing.
    N, block, grid = 10, 4, 4

    @T.prim_func
    def main(A: T.Tensor((N,), "float32"), Tiles: T.Tensor((grid, block), "float32"), B: T.Tensor((N,), "float32")):
        with T.Kernel(grid) as bx:
            tile = T.alloc_fragment((block,), "float32")
            T.copy(A[bx * block], tile)
            T.copy(tile, Tiles[bx, :])
            for i in T.Parallel(block):
                tile[i] = tile[i] * 2.0
            T.copy(tile, B[bx * block])

    a = torch.randn(N)
    storage = torch.full((N + 2 * block,), -7.0)
    b = storage[:N]
    tiles = tegula.compile(main, out_idx=[1], target=target)(a, b)
    assert torch.equal(tiles, torch.cat([a, torch.zeros(grid * block - N)]).view(grid, block))
    assert torch.equal(b, a * 2)
    assert torch.all(storage[N:] == -7.0)


def conversion_probe_values():
    """float32 values that exercise rounding to narrow floats: ties, overflow, subnormals."""
    special = torch.tensor(
        [
            0.0, -0.0, 1.0, -1.0,
            1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -(1.0 + 2.0**-8),  # bfloat16 ties (to even)
            1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11,  # float16 ties
            65504.0, 65519.0, 65520.0, 1e6, -1e6,  # float16 max, last value rounding down, overflow
            3.3e38, 3.4028235e38, float("inf"), float("-inf"),
            1e-40, -1e-40, 6e-8, 3e-8, 1e-8,  # subnormals (bfloat16 / float16)
        ],
        dtype=torch.float32,
    )
    scaled = torch.randn(12, 16) * torch.logspace(-6, 6, 16)
    return torch.cat([special, scaled.flatten()])[: 12 * 16].view(12, 16)


@pytest.mark.parametrize("low", ["bfloat16", "float16", "float8_e4m3fn"])
def test_copy_converts_float32_to_narrow_bit_exact(target, low):
    M, N = 12, 16

    @T.prim_func
    def main(A: T.Tensor((M, N), "float32"), B: T.Tensor((M, N), low), C: T.Tensor((M, N), "float32")):
        with T.Kernel(1):
            a_frag = T.alloc_fragment((M, N), "float32")
            a_low = T.alloc_shared((M, N), low)
            T.copy(A, a_frag)
            T.copy(a_frag, B)  # fragment float32 -> global narrow
            T.copy(A, a_low)  # global float32 -> shared narrow
            T.copy(a_low, C)  # shared narrow -> global float32 (exact widening)

    a = conversion_probe_values()
    b, c = tegula.compile(main, out_idx=[1, 2], target=target)(a)
    expected = narrow_reference(a, getattr(torch, low))
    bits = torch.int16 if expected.element_size() == 2 else torch.uint8
    assert b.dtype == expected.dtype
    assert torch.equal(b.view(bits), expected.view(bits))
    assert torch.equal(c.view(torch.int32), expected.float().view(torch.int32))


def test_copy_converts_bfloat16_to_float32_exact(target):
    N = 256

    @T.prim_func
    def main(A: T.Tensor((N,), "bfloat16"), B: T.Tensor((N,), "float32")):
        with T.Kernel(1):
            wide = T.alloc_fragment((N,), "float32")
            T.copy(A, wide)
            T.copy(wide, B)

    a = (torch.randn(N) * torch.logspace(-30, 30, N)).to(torch.bfloat16)
    b = tegula.compile(main, out_idx=[-1], target=target)(a)
    assert torch.equal(b.view(torch.int32), a.float().view(torch.int32))


# --- T.gemm ---------------------------------------------------------------------------------


def gemm_kernel(M, N, K, trans_A, trans_B, dtype, block_K=16):
    A_shape, A_tile = ((K, M), (block_K, M)) if trans_A else ((M, K), (M, block_K))
    B_shape, B_tile = ((N, K), (N, block_K)) if trans_B else ((K, N), (block_K, N))

    @T.prim_func
    def main(A: T.Tensor(A_shape, dtype), B: T.Tensor(B_shape, dtype), C: T.Tensor((M, N), "float32")):
        with T.Kernel(1, threads=128):
            A_shared = T.alloc_shared(A_tile, dtype)
            B_shared = T.alloc_shared(B_tile, dtype)
            C_local = T.alloc_fragment((M, N), "float32")
            T.clear(C_local)
            for k in T.Pipelined(K // block_K, num_stages=2):
                if trans_A:
                    T.copy(A[k * block_K, 0], A_shared)
                else:
                    T.copy(A[0, k * block_K], A_shared)
                if trans_B:
                    T.copy(B[0, k * block_K], B_shared)
                else:
                    T.copy(B[k * block_K, 0], B_shared)
                T.gemm(A_shared, B_shared, C_local, transpose_A=trans_A, transpose_B=trans_B)
            T.copy(C_local, C)

    return main


GEMM_TOLERANCE = {
    "float32": {"rtol": 1e-4, "atol": 1e-4},
    "float16": {"rtol": 1e-2, "atol": 1e-2},
    "bfloat16": {"rtol": 1e-2, "atol": 1e-2},
}


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("trans_A, trans_B", [(False, False), (False, True), (True, False), (True, True)])
def test_gemm_transposes_and_dtypes(target, trans_A, trans_B, dtype):
    M, N, K = 32, 16, 64
    a = torch.randn((K, M) if trans_A else (M, K)).to(getattr(torch, dtype))
    b = torch.randn((N, K) if trans_B else (K, N)).to(getattr(torch, dtype))
    kernel = tegula.compile(gemm_kernel(M, N, K, trans_A, trans_B, dtype), out_idx=[-1], target=target)
    c = kernel(a, b)
    a_ref = a.float().T if trans_A else a.float()
    b_ref = b.float().T if trans_B else b.float()
    assert c.dtype == torch.float32
    torch.testing.assert_close(c, a_ref @ b_ref, **GEMM_TOLERANCE[dtype])


def test_gemm_pipelined_over_a_runtime_k(target):
    # K is bound at call time, so the pipelined loop's trip count is a runtime value, here
    # also smaller than num_stages; tiles past K read zeros.
    M, N, block_K = 16, 16, 16
    K = T.dynamic("K")

    @T.prim_func
    def main(A: T.Tensor((M, K), "float32"), B: T.Tensor((K, N), "float32"), C: T.Tensor((M, N), "float32")):
        with T.Kernel(1):
            A_shared = T.alloc_shared((M, block_K), "float32")
            B_shared = T.alloc_shared((block_K, N), "float32")
            C_local = T.alloc_fragment((M, N), "float32")
            T.clear(C_local)
            for k in T.Pipelined(T.ceildiv(K, block_K), num_stages=3):
                T.copy(A[0, k * block_K], A_shared)
                T.copy(B[k * block_K, 0], B_shared)
                T.gemm(A_shared, B_shared, C_local)
            T.copy(C_local, C)

    kernel = tegula.compile(main, out_idx=[-1], target=target)
    for k in (16, 32, 40, 80):
        a, b = torch.randn(M, k), torch.randn(k, N)
        torch.testing.assert_close(kernel(a, b), a @ b, **GEMM_TOLERANCE["float32"])


def test_gemm_fragment_A_and_clear_accum(target):
    M, N, K = 16, 32, 16

    @T.prim_func
    def main(
        A: T.Tensor((M, K), "float32"),
        A2: T.Tensor((M, K), "float32"),
        B: T.Tensor((K, N), "float32"),
        C: T.Tensor((M, N), "float32"),
    ):
        with T.Kernel(1):
            A_frag = T.alloc_fragment((M, K), "float32")
            B_shared = T.alloc_shared((K, N), "float32")
            C_local = T.alloc_fragment((M, N), "float32")
            T.copy(B, B_shared)
            T.fill(C_local, 100.0)  # clear_accum must discard this
            T.copy(A, A_frag)
            T.gemm(A_frag, B_shared, C_local, clear_accum=True)
            T.copy(A2, A_frag)
            T.gemm(A_frag, B_shared, C_local)  # accumulates onto A @ B
            T.copy(C_local, C)

    a, a2, b = torch.randn(M, K), torch.randn(M, K), torch.randn(K, N)
    c = tegula.compile(main, out_idx=[-1], target=target)(a, a2, b)
    torch.testing.assert_close(c, a @ b + a2 @ b, **GEMM_TOLERANCE["float32"])


def test_gemm_accepts_performance_hints(target):
    # k_pack, wg_wait and policy only steer how a GPU schedules the MMA; every target accepts them.
    M, N, K = 16, 16, 32

    @T.prim_func
    def main(A: T.Tensor((M, K), "float16"), B: T.Tensor((N, K), "float16"), C: T.Tensor((M, N), "float32")):
        with T.Kernel(1, threads=128):
            A_shared = T.alloc_shared((M, K), "float16")
            B_shared = T.alloc_shared((N, K), "float16")
            C_local = T.alloc_fragment((M, N), "float32")
            T.copy(A, A_shared)
            T.copy(B, B_shared)
            T.gemm(A_shared, B_shared, C_local, transpose_B=True, clear_accum=True, k_pack=1, wg_wait=0,
                   policy=T.GemmWarpPolicy.FullRow)
            T.copy(C_local, C)

    a, b = torch.randn(M, K).half(), torch.randn(N, K).half()
    c = tegula.compile(main, out_idx=[-1], target=target)(a, b)
    torch.testing.assert_close(c, a.float() @ b.float().T, **GEMM_TOLERANCE["float16"])


# --- T.fill / T.clear -----------------------------------------------------------------------


def test_fill_and_clear(target):
    @T.prim_func
    def main(F: T.Tensor((4, 8), "float32"), Z: T.Tensor((4, 8), "float32"), I: T.Tensor((6,), "int32")):
        with T.Kernel(1):
            frag = T.alloc_fragment((4, 8), "float32")
            shared = T.alloc_shared((4, 8), "float32")
            local = T.alloc_local((6,), "int32")
            T.fill(frag, 2.5)
            T.fill(shared, 7.0)
            T.clear(shared)
            T.fill(local, -3)
            T.copy(frag, F)
            T.copy(shared, Z)
            T.copy(local, I)

    # No tensor goes in, so nothing says whether torch or numpy comes out: accept either.
    f, z, i = (torch.as_tensor(x) for x in tegula.compile(main, out_idx=[0, 1, 2], target=target)())
    assert torch.equal(f, torch.full((4, 8), 2.5))
    assert torch.equal(z, torch.zeros(4, 8))
    assert torch.equal(i, torch.full((6,), -3, dtype=torch.int32))


# --- T.reduce_* -----------------------------------------------------------------------------


def reduce_kernel(kind, dim, clear, M=8, N=16):
    out_len = N if dim == 0 else M

    @T.prim_func
    def main(A: T.Tensor((M, N), "float32"), Init: T.Tensor((out_len,), "float32"), B: T.Tensor((out_len,), "float32")):
        with T.Kernel(1, threads=128):
            A_frag = T.alloc_fragment((M, N), "float32")
            B_frag = T.alloc_fragment((out_len,), "float32")
            T.copy(A, A_frag)
            T.copy(Init, B_frag)
            if kind == "sum":
                T.reduce_sum(A_frag, B_frag, dim=dim, clear=clear)
            elif kind == "max":
                T.reduce_max(A_frag, B_frag, dim=dim, clear=clear)
            elif kind == "min":
                T.reduce_min(A_frag, B_frag, dim=dim, clear=clear)
            elif kind == "absmax":
                T.reduce_absmax(A_frag, B_frag, dim=dim, clear=clear)
            else:  # TileLang's reduce_abssum has no `clear` argument: it always clears.
                T.reduce_abssum(A_frag, B_frag, dim=dim)
            T.copy(B_frag, B)

    return main


REDUCE_REFERENCE = {
    # kind: (reduce over `dim`, combine with the old value when clear=False)
    "sum": (lambda a, d: a.sum(d), torch.add),
    "max": (lambda a, d: a.amax(d), torch.maximum),
    "min": (lambda a, d: a.amin(d), torch.minimum),
    "abssum": (lambda a, d: a.abs().sum(d), torch.add),
    "absmax": (lambda a, d: a.abs().amax(d), torch.maximum),
}


@pytest.mark.parametrize(
    "kind, clear",
    [("sum", True), ("sum", False), ("max", True), ("max", False), ("min", True), ("min", False),
     ("abssum", True), ("absmax", True), ("absmax", False)],
)
@pytest.mark.parametrize("dim", [0, 1])
def test_reduce(target, kind, dim, clear):
    M, N = 8, 16
    a = torch.randn(M, N)
    init = 2 * torch.randn(N if dim == 0 else M)  # beats the reduction in some lanes, not in others
    b = tegula.compile(reduce_kernel(kind, dim, clear), out_idx=[-1], target=target)(a, init)
    reduce, combine = REDUCE_REFERENCE[kind]
    expected = reduce(a, dim) if clear else combine(init, reduce(a, dim))
    torch.testing.assert_close(b, expected, rtol=1e-6, atol=1e-6)


def test_reduce_default_dim_is_last_and_shared_source(target):
    M, N = 4, 32

    @T.prim_func
    def main(A: T.Tensor((M, N), "float32"), Mx: T.Tensor((M,), "float32"), S: T.Tensor((M,), "float32")):
        with T.Kernel(1):
            A_shared = T.alloc_shared((M, N), "float32")
            row_max = T.alloc_fragment((M,), "float32")
            row_sum = T.alloc_fragment((M,), "float32")
            T.copy(A, A_shared)
            T.reduce_max(A_shared, row_max)
            T.reduce_sum(A_shared, row_sum)
            T.copy(row_max, Mx)
            T.copy(row_sum, S)

    a = torch.randn(M, N)
    mx, s = tegula.compile(main, out_idx=[1, 2], target=target)(a)
    torch.testing.assert_close(mx, a.amax(1), rtol=0, atol=0)
    torch.testing.assert_close(s, a.sum(1), rtol=1e-6, atol=1e-6)


def test_reduce_int32(target):
    M, N = 4, 16

    @T.prim_func
    def main(A: T.Tensor((M, N), "int32"), S: T.Tensor((M,), "int32"), Mx: T.Tensor((N,), "int32")):
        with T.Kernel(1):
            a = T.alloc_fragment((M, N), "int32")
            row_sums = T.alloc_fragment((M,), "int32")
            col_max = T.alloc_fragment((N,), "int32")
            T.copy(A, a)
            T.reduce_sum(a, row_sums, dim=1)
            T.reduce_max(a, col_max, dim=0)
            T.copy(row_sums, S)
            T.copy(col_max, Mx)

    a = torch.randint(-1000, 1000, (M, N), dtype=torch.int32)
    s, mx = tegula.compile(main, out_idx=[1, 2], target=target)(a)
    assert torch.equal(s, a.sum(1, dtype=torch.int32))
    assert torch.equal(mx, a.amax(0))


def test_reduce_keeps_reduced_dim_as_one(target):
    # TileLang also takes dst with the reduced dim kept at extent 1: (M, N) -> (M, 1), (N,) -> (1,).
    M, N = 4, 8

    @T.prim_func
    def main(A: T.Tensor((M, N), "float32"), S: T.Tensor((M, 1), "float32"), Total: T.Tensor((1,), "float32")):
        with T.Kernel(1):
            a = T.alloc_fragment((M, N), "float32")
            row_sums = T.alloc_fragment((M, 1), "float32")
            col = T.alloc_fragment((M,), "float32")
            total = T.alloc_fragment((1,), "float32")
            T.copy(A, a)
            T.reduce_sum(a, row_sums, dim=1)
            for i in T.Parallel(M):
                col[i] = row_sums[i, 0]
            T.reduce_sum(col, total, dim=0)
            T.copy(row_sums, S)
            T.copy(total, Total)

    a = torch.randn(M, N)
    s, total = tegula.compile(main, out_idx=[1, 2], target=target)(a)
    torch.testing.assert_close(s, a.sum(1, keepdim=True), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(total, a.sum().view(1), rtol=1e-5, atol=1e-5)


# --- T.atomic_* -----------------------------------------------------------------------------


def test_atomics_from_many_blocks_int32(target):
    G, W = 256, 16  # enough colliding updates that a lost one shows up on a multi-core run

    @T.prim_func
    def main(
        A: T.Tensor((G, W), "int32"),
        Total: T.Tensor((1,), "int32"),
        Hist: T.Tensor((4,), "int32"),
        Hi: T.Tensor((1,), "int32"),
        Lo: T.Tensor((1,), "int32"),
    ):
        with T.Kernel(G, threads=32) as bx:
            for j in T.serial(W):
                T.atomic_add(Total[0], A[bx, j])
                T.atomic_max(Hi[0], A[bx, j])
                T.atomic_min(Lo[0], A[bx, j])
            for j in T.Parallel(W):  # several lanes of one block hit the same bin
                T.atomic_add(Hist[(A[bx, j] + 1000) % 4], 1)

    a = torch.randint(-1000, 1000, (G, W), dtype=torch.int32)
    total = torch.zeros(1, dtype=torch.int32)
    hist = torch.zeros(4, dtype=torch.int32)
    hi = torch.full((1,), -(2**31), dtype=torch.int32)
    lo = torch.full((1,), 2**31 - 1, dtype=torch.int32)
    kernel = tegula.compile(main, target=target)
    assert kernel(a, total, hist, hi, lo) is None
    assert total.item() == a.sum().item()
    assert hist.tolist() == torch.bincount(((a.long() + 1000) % 4).flatten(), minlength=4).tolist()
    assert hi.item() == a.max().item()
    assert lo.item() == a.min().item()


def test_atomic_add_tile_region(target):
    # Whole tiles added into global memory; small integers in float32 make every order exact.
    G, M, N = 16, 4, 8

    @T.prim_func
    def main(
        A: T.Tensor((G, M, N), "float32"),
        Acc: T.Tensor((M, N), "float32"),
        Halves: T.Tensor((2 * M, N), "float32"),
    ):
        with T.Kernel(G) as bx:
            tile = T.alloc_fragment((M, N), "float32")
            T.copy(A[bx, :, :], tile)
            T.atomic_add(Acc, tile)
            T.atomic_add(Halves[(bx % 2) * M:(bx % 2 + 1) * M, :], tile)

    a = torch.randint(-8, 8, (G, M, N)).float()
    acc, halves = torch.zeros(M, N), torch.zeros(2 * M, N)
    tegula.compile(main, target=target)(a, acc, halves)
    assert torch.equal(acc, a.sum(0))
    assert torch.equal(halves, torch.cat([a[0::2].sum(0), a[1::2].sum(0)]))
