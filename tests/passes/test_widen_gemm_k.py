"""widen_gemm_k: on the c target a K loop of global->shared copies feeding T.gemm merges U iterations into one gemm
over U * block_K (~128) of K, with a remainder loop; anything it cannot prove safe is left alone; c agrees with
interp (the definition) for every layout, dtype and trip count."""
import sys
from pathlib import Path

import pytest
import torch

import tegula
import tegula.language as T
from tegula.passes import widen_gemm_k
from tegula.passes.verify import verify

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gemm import matmul  # noqa: E402  the README kernel

ACC = {"int8": "int32"}
TOL = {"float32": dict(rtol=1e-4, atol=1e-4), "float16": dict(rtol=1e-3, atol=1e-3),
       "bfloat16": dict(rtol=1e-3, atol=1e-3), "float8_e4m3fn": dict(rtol=1e-4, atol=1e-3),
       "float8_e5m2": dict(rtol=1e-4, atol=1e-3), "int8": dict(rtol=0, atol=0)}


def gemm(M, N, K, trans_A=False, trans_B=False, dtype="float32", bm=32, bn=32, bk=16, loop="pipelined",
         after=None, start=0):
    """C = op(A) @ op(B) over a K loop; ``after`` adds a statement after the loop (a not-applicable case)."""
    acc = ACC.get(dtype, "float32")
    A_shape, A_tile = ((K, M), (bk, bm)) if trans_A else ((M, K), (bm, bk))
    B_shape, B_tile = ((N, K), (bn, bk)) if trans_B else ((K, N), (bk, bn))

    @T.prim_func
    def main(A: T.Tensor(A_shape, dtype), B: T.Tensor(B_shape, dtype), C: T.Tensor((M, N), acc)):
        with T.Kernel(T.ceildiv(N, bn), T.ceildiv(M, bm)) as (bx, by):
            A_s = T.alloc_shared(A_tile, dtype)
            B_s = T.alloc_shared(B_tile, dtype)
            C_l = T.alloc_fragment((bm, bn), acc)
            T.clear(C_l)
            loop_k = T.Pipelined(start, T.ceildiv(K, bk), num_stages=3) if loop == "pipelined" else \
                T.serial(start, T.ceildiv(K, bk))
            for k in loop_k:
                if trans_A:
                    T.copy(A[k * bk, by * bm], A_s)
                else:
                    T.copy(A[by * bm, k * bk], A_s)
                if trans_B:
                    T.copy(B[bx * bn, k * bk], B_s)
                else:
                    T.copy(B[k * bk, bx * bn], B_s)
                T.gemm(A_s, B_s, C_l, transpose_A=trans_A, transpose_B=trans_B)
            if after == "read_staging":
                for i, j in T.Parallel(bm, bn):
                    C_l[i, j] += T.cast(A_s[i % A_tile[0], j % A_tile[1]], acc)
            T.copy(C_l, C[by * bm, bx * bn])

    return main


def inputs(M, N, K, trans_A, trans_B, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == "int8":
        a = torch.randint(-128, 128, (K, M) if trans_A else (M, K), generator=g, dtype=torch.int8)
        b = torch.randint(-128, 128, (N, K) if trans_B else (K, N), generator=g, dtype=torch.int8)
    else:
        a = torch.randn((K, M) if trans_A else (M, K), generator=g).to(getattr(torch, dtype))
        b = torch.randn((N, K) if trans_B else (K, N), generator=g).to(getattr(torch, dtype))
    return a, b


def c_and_interp(func, M, N, K, trans_A, trans_B, dtype):
    a, b = inputs(M, N, K, trans_A, trans_B, dtype)
    out = {t: tegula.compile(func, out_idx=[-1], target=t)(a, b) for t in ("c", "interp")}
    return out["c"], out["interp"]


def merged(func) -> bool:
    return "merged_k=" in tegula.lower(func, target="c").lowered.script()


def test_readme_kernel_is_merged_to_one_gemm_per_128_of_k():
    low = tegula.lower(matmul(256, 256, 200, dtype="float32"), target="c")
    verify(low.lowered)
    text = low.lowered.script()
    assert "A_shared_k4 = alloc_shared((128, 128), float32)" in text
    assert "B_shared_k4 = alloc_shared((128, 128), float32)" in text
    assert "for ko in pipelined(0, +1, merged_k=4, num_stages=3):" in text       # 200 / 32 -> 7 trips: 1 merged
    assert "A_shared_k4[i0_1, i1_1] = A[((by * 128) + i0_1), (((ko * 4) * 32) + i1_1)]" in text
    assert ("extern_gemm(A_shared_k4[0+:128, 0+:128], B_shared_k4[0+:128, 0+:128], C_local[0+:128, 0+:128], "
            "trans_a=False, trans_b=False, clear=False)") in text
    assert "for k in pipelined(4, +3, num_stages=3):" in text                    # and 3 left in the original form
    assert "extern_gemm(A_shared[0+:128, 0+:32], B_shared[0+:32, 0+:128]" in text
    assert "tg_gemm_f32(128, 128, 128," in low.kernel_source
    # a trip count that divides: no remainder loop; a symbolic one: merged and remainder, both bounded by it
    text = tegula.lower(matmul(256, 256, 256, dtype="float32"), target="c").lowered.script()
    assert "for ko in pipelined(0, +2, merged_k=4" in text and "for k in" not in text


def test_block_k_sets_the_merge_factor():
    assert "merged_k=2" in tegula.lower(matmul(128, 128, 512, block_K=64, dtype="float32"), target="c").lowered.script()
    assert "merged_k=8" in tegula.lower(matmul(128, 128, 512, block_K=16, dtype="float32"), target="c").lowered.script()
    assert not merged(matmul(128, 128, 512, block_K=128, dtype="float32"))   # already 128 wide
    assert not merged(matmul(128, 128, 32, dtype="float32"))                 # one trip


def test_not_applicable_cases_are_left_unchanged():
    # the staging buffer is read after the loop: its last tile is part of the meaning
    assert not merged(gemm(64, 64, 128, after="read_staging"))
    assert merged(gemm(64, 64, 128))

    for case in ("strided", "paged", "clears", "extra", "sub_tile", "twice"):
        func = variant(case)
        assert not merged(func), case
        a, b, p = torch.randn(64, 256), torch.randn(256, 64), torch.randperm(16).int()
        c, i = (tegula.compile(func, out_idx=[-1], target=t)(a, b, p) for t in ("c", "interp"))
        torch.testing.assert_close(c, i, rtol=1e-4, atol=1e-4)
    assert merged(variant("plain"))


def variant(case):
    @T.prim_func
    def main(A: T.Tensor((64, 256), "float32"), B: T.Tensor((256, 64), "float32"), P: T.Tensor((16,), "int32"),
             C: T.Tensor((64, 64), "float32")):
        with T.Kernel(1):
            A_s = T.alloc_shared((64, 16), "float32")
            B_s = T.alloc_shared((16, 64), "float32")
            C_l = T.alloc_fragment((64, 64), "float32")
            T.clear(C_l)
            for k in T.Pipelined(16, num_stages=2):
                if case == "strided":  # tiles 16 wide, 32 apart: not adjacent along K
                    T.copy(A[0, (k // 2) * 32], A_s)
                    T.copy(B[(k // 2) * 32, 0], B_s)
                elif case == "paged":  # K position from a table
                    T.copy(A[0, P[k] * 16], A_s)
                    T.copy(B[P[k] * 16, 0], B_s)
                else:
                    T.copy(A[0, k * 16], A_s)
                    T.copy(B[k * 16, 0], B_s)
                if case == "extra":  # something else in the body
                    for i, j in T.Parallel(64, 16):
                        A_s[i, j] = A_s[i, j] * 2.0
                if case == "clears":  # clear_accum: only the last step counts
                    T.gemm(A_s, B_s, C_l, clear_accum=True)
                elif case == "sub_tile":  # the gemm reads part of a staging buffer
                    T.gemm(A_s[0:32, :], B_s, C_l[0:32, :])
                elif case == "twice":  # one staging buffer is the operand of two gemms
                    T.gemm(A_s, B_s, C_l)
                    T.gemm(A_s, B_s, C_l)
                else:
                    T.gemm(A_s, B_s, C_l)
            T.copy(C_l, C)
    return main


@pytest.mark.parametrize("trans_A, trans_B, dtype", [
    (False, False, "float32"), (False, True, "bfloat16"), (True, False, "float16"), (True, True, "int8"),
    (False, False, "float8_e4m3fn"), (True, True, "float32"), (False, True, "int8"), (True, False, "bfloat16"),
    (False, True, "float8_e5m2")])
def test_c_matches_interp_for_layouts_and_dtypes(trans_A, trans_B, dtype):
    M, N, K = 40, 48, 16 * 19 - 5  # 19 trips of 16: 2 merged (U = 8) + 3 left; the last tile crosses K's edge
    func = gemm(M, N, K, trans_A, trans_B, dtype)
    assert merged(func)
    c, i = c_and_interp(func, M, N, K, trans_A, trans_B, dtype)
    if dtype == "int8":
        assert torch.equal(c, i)
    else:
        torch.testing.assert_close(c, i, **TOL[dtype])


@pytest.mark.parametrize("loop, dtype", [("pipelined", "int8"), ("serial", "float32")])
def test_c_matches_interp_for_odd_trip_counts(loop, dtype):
    M, N, bk = 32, 32, 32  # U = 4
    Kd = T.dynamic("K")
    acc = ACC.get(dtype, "float32")

    @T.prim_func
    def main(A: T.Tensor((M, Kd), dtype), B: T.Tensor((Kd, N), dtype), C: T.Tensor((M, N), acc)):
        with T.Kernel(1):
            A_s = T.alloc_shared((M, bk), dtype)
            B_s = T.alloc_shared((bk, N), dtype)
            C_l = T.alloc_fragment((M, N), acc)
            T.clear(C_l)
            loop_k = T.Pipelined(T.ceildiv(Kd, bk), num_stages=3) if loop == "pipelined" else \
                T.serial(T.ceildiv(Kd, bk))
            for k in loop_k:
                T.copy(A[0, k * bk], A_s)
                T.copy(B[k * bk, 0], B_s)
                T.gemm(A_s, B_s, C_l)
            T.copy(C_l, C)

    assert merged(main)
    kc, ki = (tegula.compile(main, out_idx=[-1], target=t) for t in ("c", "interp"))
    for trips in (1, 2, 3, 4, 5, 7, 8, 9, 13):
        K = trips * bk - 7
        a, b = inputs(M, N, K, False, False, dtype, seed=trips)
        c, i = kc(a, b), ki(a, b)
        assert torch.equal(c, i) if dtype == "int8" else torch.allclose(c, i, rtol=1e-4, atol=1e-4), trips


def test_loop_start_and_runtime_trip_count():
    M, N, bk = 16, 16, 16
    Kd = T.dynamic("K")

    @T.prim_func
    def main(A: T.Tensor((M, Kd), "int8"), B: T.Tensor((Kd, N), "int8"), C: T.Tensor((M, N), "int32")):
        with T.Kernel(1):
            A_s = T.alloc_shared((M, bk), "int8")
            B_s = T.alloc_shared((bk, N), "int8")
            C_l = T.alloc_fragment((M, N), "int32")
            T.clear(C_l)
            for k in T.Pipelined(1, T.ceildiv(Kd, bk), num_stages=3):  # skips the first tile
                T.copy(A[0, k * bk], A_s)
                T.copy(B[k * bk, 0], B_s)
                T.gemm(A_s, B_s, C_l)
            T.copy(C_l, C)

    assert merged(main)
    kc, ki = (tegula.compile(main, out_idx=[-1], target=t) for t in ("c", "interp"))
    for k in (0, 8, 16, 40, 16 * 9, 16 * 17 + 3):
        a, b = inputs(M, N, k, False, False, "int8", seed=k)
        assert torch.equal(kc(a, b), ki(a, b)), k


def test_wide_buffers_are_capped(monkeypatch):
    # the README fp32 tiles stage 2 x 16 KiB per step: 4 steps pass a 64 KiB cap, so U shrinks to 2
    monkeypatch.setattr(widen_gemm_k, "MAX_WIDE_BYTES", 64 * 1024)
    assert "merged_k=2" in tegula.lower(matmul(256, 256, 512, dtype="float32"), target="c").lowered.script()


def test_tiles_of_a_three_d_tensor():
    # A[g, rows, k-slice]: the K axis of the tile is the tensor's last dimension, the batch index is dropped
    G, M, N, K, bk = 3, 32, 48, 16 * 10 + 3, 16

    @T.prim_func
    def main(A: T.Tensor((G, M, K), "float32"), B: T.Tensor((G, K, N), "float32"), C: T.Tensor((G, M, N), "float32")):
        with T.Kernel(G) as g:
            A_s = T.alloc_shared((M, bk), "float32")
            B_s = T.alloc_shared((bk, N), "float32")
            C_l = T.alloc_fragment((M, N), "float32")
            T.clear(C_l)
            for k in T.Pipelined(T.ceildiv(K, bk), num_stages=2):
                T.copy(A[g, 0:M, k * bk:k * bk + bk], A_s)
                T.copy(B[g, k * bk:k * bk + bk, 0:N], B_s)
                T.gemm(A_s, B_s, C_l)
            T.copy(C_l, C[g, 0:M, 0:N])

    assert "merged_k=8" in tegula.lower(main, target="c").lowered.script()
    a, b = torch.randn(G, M, K), torch.randn(G, K, N)
    c, i = (tegula.compile(main, out_idx=[-1], target=t)(a, b) for t in ("c", "interp"))
    torch.testing.assert_close(c, i, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(c, a @ b, rtol=1e-4, atol=1e-4)
