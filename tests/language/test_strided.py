"""Strided tensor parameters: T.Tensor(..., strides=...) / T.StridedTensor, with symbolic strides bound at call
time (a row stride larger than the row, as in a slice of a wider tensor)."""
import pytest
import torch

import tegula
import tegula.language as T


def row_scale(block=4, N=8):
    m = T.dynamic("m")
    ld = T.dynamic("ld")

    @T.prim_func
    def main(X: T.StridedTensor((m, N), (ld, 1), "bfloat16"), Y: T.Tensor((m, N), "float32")):
        with T.Kernel(T.ceildiv(m, block)) as bx:
            tile = T.alloc_fragment((block, N), "float32")
            T.copy(X[bx * block, 0], tile)
            for i, j in T.Parallel(block, N):
                tile[i, j] = tile[i, j] * 2.0
            T.copy(tile, Y[bx * block, 0])
    return main


def test_strided_input(target):
    k = tegula.compile(row_scale(), out_idx=[1], target=target)
    wide = torch.randn(6, 20).bfloat16()
    x = wide[:, 3:11]  # row stride 20 > row length 8
    assert not x.is_contiguous()
    y = k(x)
    torch.testing.assert_close(y, x.float() * 2, rtol=0, atol=0)
    y2 = k(torch.randn(5, 8).bfloat16().contiguous())  # contiguous is one stride value among others
    assert y2.shape == (5, 8)


def test_constant_strides_are_checked(target):
    @T.prim_func
    def main(X: T.Tensor((4, 4), "float32", strides=(8, 1)), Y: T.Tensor((4, 4), "float32")):
        with T.Kernel(1):
            for i, j in T.Parallel(4, 4):
                Y[i, j] = X[i, j] + 1.0

    k = tegula.compile(main, out_idx=[1], target=target)
    base = torch.randn(4, 8)
    torch.testing.assert_close(k(base[:, :4]), base[:, :4] + 1, rtol=0, atol=0)
    with pytest.raises(ValueError, match="strides"):
        k(torch.randn(4, 4))


def test_strided_output_cannot_be_allocated():
    @T.prim_func
    def main(X: T.Tensor((4,), "float32"), Y: T.Tensor((4,), "float32", strides=(2,))):
        with T.Kernel(1):
            for i in T.Parallel(4):
                Y[i] = X[i]

    with pytest.raises(ValueError, match="strided"):
        tegula.compile(main, out_idx=[1], target="c")


def test_stride_count_must_match():
    with pytest.raises(tegula.CompileError, match="strides"):
        @T.prim_func
        def main(X: T.Tensor((4, 4), "float32", strides=(4,))):
            with T.Kernel(1):
                pass


def test_strided_call_fast_path_checks_as_the_binder_does():
    """On the c target a kernel with strided parameters is called through the fast path (its strides read and its
    stride symbols bound there); any mismatch goes to the generic binder and its error."""
    m, ld = T.dynamic("m"), T.dynamic("ld")

    @T.prim_func
    def add(X: T.StridedTensor((m, 8), (ld, 1), "float32"), Z: T.StridedTensor((m, 8), (ld, 1), "float32"),
            Y: T.Tensor((m, 8), "float32")):
        with T.Kernel(m) as b:
            for j in T.Parallel(8):
                Y[b, j] = X[b, j] + Z[b, j]

    k = tegula.compile(add, target="c")
    assert k._fast is not None and "st = " in k._fast.__tegula_source__
    wide = torch.randn(6, 20)
    x, z, y = wide[:, 3:11], wide[:, 10:18], torch.empty(6, 8)
    k(x, z, y)
    torch.testing.assert_close(y, x + z, rtol=0, atol=0)
    with pytest.raises(ValueError, match="stride 0 is 8, but the symbol ld was bound to 20"):
        k(x, torch.randn(6, 8), y)
    with pytest.raises(ValueError, match="must have strides"):
        k(torch.randn(6, 16)[:, ::2], torch.randn(6, 16)[:, ::2], y)
    with pytest.raises(ValueError, match="dimension 0 is 5"):
        k(x, z, torch.empty(5, 8))
    one = torch.randn(1, 8)
    k(one, one, y[:1])  # a one-row view: any row stride binds ld
    torch.testing.assert_close(y[:1], one + one, rtol=0, atol=0)
