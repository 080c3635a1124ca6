"""T.clz and T.popcount: bit counts of integers in their own width (TVM's tir.clz / tir.popcount)."""
import numpy as np
import pytest
import torch

import tegula
import tegula.language as T


def _ref_clz(v: int, width: int) -> int:
    return width - (v & ((1 << width) - 1)).bit_length()


def _ref_popcount(v: int, width: int) -> int:
    return bin(v & ((1 << width) - 1)).count("1")


@pytest.mark.parametrize("target", ["interp", "c"])
@pytest.mark.parametrize("dtype,width", [("int32", 32), ("uint32", 32), ("int64", 64), ("int16", 16), ("uint8", 8)])
def test_clz_popcount_elementwise(target, dtype, width):
    N = 64

    @T.prim_func
    def bits(A: T.Tensor((N,), dtype), C: T.Tensor((N,), dtype), P: T.Tensor((N,), dtype)):
        with T.Kernel(1):
            for i in T.Parallel(N):
                C[i] = T.clz(A[i])
                P[i] = T.popcount(A[i])

    rng = np.random.default_rng(0)
    info = np.iinfo(dtype)
    a = rng.integers(info.min, info.max, N, dtype=dtype, endpoint=True)
    a[:6] = np.array([0, 1, -1 if info.min < 0 else info.max, info.min, info.max, 2], dtype=dtype)
    c, p = tegula.compile(bits, out_idx=[1, 2], target=target)(a)
    assert [int(x) for x in c] == [_ref_clz(int(v), width) for v in a]
    assert [int(x) for x in p] == [_ref_popcount(int(v), width) for v in a]


@pytest.mark.parametrize("target", ["interp", "c"])
def test_clz_walks_a_mask_in_order(target):
    # the stream-compaction idiom: bit 31 - j marks item j; T.clz finds the next set item, in a while loop
    N = 32

    @T.prim_func
    def compact(A: T.Tensor((N,), "int32"), Out: T.Tensor((N,), "int32"), Cnt: T.Tensor((1,), "int32")):
        with T.Kernel(1):
            bits = T.alloc_fragment((N,), "uint32")
            mask = T.alloc_fragment((1,), "uint32")
            for j in T.Parallel(N):
                bits[j] = T.cast(A[j] > 0, "uint32") << T.cast(31 - j, "uint32")
            T.reduce_sum(bits, mask, dim=0)  # distinct bits: the sum is the OR
            m = mask[0]
            cnt = T.cast(0, "int32")
            while m != 0:
                j = T.cast(T.clz(m), "int32")
                Out[cnt] = A[j]
                cnt = cnt + 1
                m = m ^ (T.cast(0x80000000, "uint32") >> T.cast(j, "uint32"))
            Cnt[0] = cnt

    a = torch.randint(-5, 5, (N,), dtype=torch.int32)
    out = torch.zeros(N, dtype=torch.int32)
    cnt = torch.zeros(1, dtype=torch.int32)
    tegula.compile(compact, target=target)(a, out, cnt)
    want = a[a > 0]
    assert int(cnt[0]) == len(want)
    assert torch.equal(out[:len(want)], want)


def test_clz_rejects_floats():
    with pytest.raises(tegula.CompileError, match="T.clz needs an integer"):
        @T.prim_func
        def bad(A: T.Tensor((4,), "float32")):
            with T.Kernel(1):
                for i in T.Parallel(4):
                    A[i] = T.clz(A[i])
