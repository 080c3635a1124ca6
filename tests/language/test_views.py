"""T.reshape / T.view (a view of a tile's storage) and T.reinterpret (bit casts), on every target."""
import numpy as np
import pytest
import torch

import tegula
import tegula.language as T


def test_reshape_fragment_and_reduce(target):
    @T.prim_func
    def main(A: T.Tensor((4, 12), "float32"), S: T.Tensor((4, 3), "float32")):
        with T.Kernel(1):
            s = T.alloc_fragment((4, 12), "float32")
            s3 = T.reshape(s, (4, 3, 4))
            out = T.alloc_fragment((4, 3), "float32")
            T.copy(A, s)
            T.reduce_sum(s3, out, dim=2)
            T.copy(out, S)

    a = torch.randn(4, 12)
    s = tegula.compile(main, out_idx=[1], target=target)(a)
    torch.testing.assert_close(s, a.view(4, 3, 4).sum(-1), rtol=1e-5, atol=1e-5)


def test_view_writes_through(target):
    @T.prim_func
    def main(B: T.Tensor((2, 6), "int32")):
        with T.Kernel(1):
            t = T.alloc_shared((12,), "int32")
            v = T.view(t, shape=(2, 6))
            for i in T.Parallel(12):
                t[i] = i
            for i, j in T.Parallel(2, 6):
                v[i, j] = v[i, j] * 10
            T.copy(v, B)

    b = tegula.compile(main, out_idx=[0], target=target)()
    assert torch.equal(torch.as_tensor(np.asarray(b)), torch.arange(12, dtype=torch.int32).view(2, 6) * 10)


def test_reshape_needs_same_size():
    with pytest.raises(tegula.CompileError, match="12 elements"):
        @T.prim_func
        def main(B: T.Tensor((2, 6), "int32")):
            with T.Kernel(1):
                t = T.alloc_shared((12,), "int32")
                T.reshape(t, (5, 2))


def test_reinterpret_roundtrip(target):
    @T.prim_func
    def main(X: T.Tensor((8,), "float32"), U: T.Tensor((8,), "uint32"), H: T.Tensor((8,), "bfloat16"),
             HB: T.Tensor((8,), "uint16"), Y: T.Tensor((8,), "float32")):
        with T.Kernel(1):
            for i in T.Parallel(8):
                U[i] = T.reinterpret(X[i], T.uint32)
                HB[i] = T.reinterpret(H[i], "uint16")
                Y[i] = T.reinterpret(T.reinterpret(X[i], T.uint32) & 0x7FFFFFFF, T.float32)  # |x| by bits

    x = torch.randn(8)
    h = torch.randn(8).bfloat16()
    u, hb, y = tegula.compile(main, out_idx=[1, 3, 4], target=target)(x, h)
    assert torch.equal(u.view(torch.int32), x.view(torch.int32))
    assert torch.equal(hb.view(torch.int16), h.view(torch.int16))
    assert torch.equal(y, x.abs())


def test_reinterpret_width_mismatch():
    with pytest.raises(tegula.CompileError, match="different widths"):
        @T.prim_func
        def main(X: T.Tensor((8,), "float32"), U: T.Tensor((8,), "uint16")):
            with T.Kernel(1):
                for i in T.Parallel(8):
                    U[i] = T.reinterpret(X[i], T.uint16)
