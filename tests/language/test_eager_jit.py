"""Eager @tegula.jit functions (TileLang's newer style): the function body is the kernel function's body, tensor
parameters are annotated inside it, T.const dimensions come from the arguments' shapes, T.empty declares outputs,
and a call compiles (once per shape and compile-time arguments) and runs."""
import pytest
import torch

import tegula
import tegula.language as T


@T.macro
def _scale_rows(X, Y, M, N, factor, block):
    with T.Kernel(T.ceildiv(M, block)) as bx:
        for i, j in T.Parallel(block, N):
            Y[bx * block + i, j] = X[bx * block + i, j] * factor


def test_matmul_shapes_from_arguments(target):
    @tegula.jit(target=target)
    def matmul(A, B, block_M: int = 32, out_dtype=T.float32):
        M, N, K = T.const("M, N, K")
        A: T.Tensor((M, K), T.float16)
        B: T.Tensor[[K, N], T.float16]
        C = T.empty((M, N), out_dtype)
        with T.Kernel(T.ceildiv(N, 32), T.ceildiv(M, block_M)) as (bx, by):
            a = T.alloc_shared((block_M, K), A.dtype)
            b = T.alloc_shared((K, 32), B.dtype)
            c = T.alloc_fragment((block_M, 32), T.float32)
            T.copy(A[by * block_M, 0], a)
            T.copy(B[0, bx * 32], b)
            T.gemm(a, b, c, clear_accum=True)
            T.copy(c, C[by * block_M, bx * 32])
        return C

    a, b = torch.randn(48, 40).half(), torch.randn(40, 64).half()
    c = matmul(a, b)
    assert c.dtype == torch.float32 and c.shape == (48, 64)
    torch.testing.assert_close(c, a.float() @ b.float(), rtol=1e-3, atol=1e-3)
    k = matmul.compile(M=48, N=64, K=40, block_M=16, out_dtype=T.float16)  # shapes as keywords, no tensors
    torch.testing.assert_close(k(a, b).float(), a.float() @ b.float(), rtol=1e-2, atol=1e-2)
    assert matmul(a, b) is not None and len(matmul.eager().kernels) == 2  # the first is reused
    assert "T.const" not in matmul.get_tir(a, b).script()
    assert matmul.get_kernel_source(a, b) == matmul.compile(a, b).get_kernel_source()


def test_dynamic_dims_one_kernel_and_macro_body(target):
    @tegula.jit(target=target)
    def scale(X, factor: float = 2.0):
        M, N = T.dynamic("M, N")
        X: T.Tensor((M, N), T.float32)
        Y = T.empty((M, N), T.float32)
        _scale_rows(X, Y, M, N, factor, 16)
        return Y

    for m in (20, 37):
        x = torch.randn(m, 8)
        assert torch.equal(scale(x), x * 2)
    assert len(scale.eager().kernels) == 1
    assert torch.equal(scale(x, factor=0.5), x * 0.5)


def test_several_outputs_scalars_and_inputs_returned(target):
    @tegula.jit(target=target)
    def stats(X, scale, bias: T.float32 = 1.0, *, rows_out: bool = True):
        M, N = T.const("M, N")
        X: T.Tensor((M, N), T.float32)
        scale: T.int32
        S = T.empty((M,), T.float32)
        P = T.empty((M, N), T.float32)
        with T.Kernel(M) as r:
            t = T.alloc_fragment((N,), T.float32)
            s = T.alloc_fragment((1,), T.float32)
            T.copy(X[r, :], t)
            T.reduce_sum(t, s, dim=0)
            S[r] = s[0] + bias
            for j in T.Parallel(N):
                P[r, j] = t[j] * scale
        if rows_out:
            return P, S, X
        return S

    x = torch.randn(5, 12)
    p, s, same = stats(x, 3, 2.0)
    assert same is x
    torch.testing.assert_close(s, x.sum(1) + 2, rtol=1e-5, atol=1e-5)
    assert torch.equal(p, x * 3)
    torch.testing.assert_close(stats(x, scale=1, rows_out=False), x.sum(1) + 1, rtol=1e-5, atol=1e-5)


def test_eager_mistakes_are_reported():
    @tegula.jit(target="interp")
    def unbound(A):
        M, N = T.const("M, N")
        A: T.Tensor((M * 2,), T.float32)
        with T.Kernel(1):
            A[0] = 0.0

    with pytest.raises(TypeError, match="no value for T.const M, N"):
        unbound(torch.zeros(4))

    @tegula.jit(target="interp")
    def shapes_disagree(A, B):
        M = T.const("M")
        A: T.Tensor((M,), T.float32)
        B: T.Tensor((M,), T.float32)
        with T.Kernel(1):
            B[0] = A[0]

    with pytest.raises(ValueError, match="T.const M"):
        shapes_disagree(torch.zeros(4), torch.zeros(5))

    @tegula.jit(target="interp", out_idx=[0])
    def with_out_idx(A):
        A: T.Tensor((4,), T.float32)
        with T.Kernel(1):
            A[0] = 1.0

    with pytest.raises(ValueError, match="T.empty"):
        with_out_idx(torch.zeros(4))


def test_im2col_matches_a_convolution(target):
    @tegula.jit(target=target)
    def conv(data, weight, S: int = 1, D: int = 1, P: int = 1, block_M: int = 32, block_K: int = 16):
        N, H, W, C, KH, KW, F = T.const("N, H, W, C, KH, KW, F")
        data: T.Tensor((N, H, W, C), T.float32)
        weight: T.Tensor((KH, KW, C, F), T.float32)
        OH = (H + 2 * P - D * (KH - 1) - 1) // S + 1
        OW = (W + 2 * P - D * (KW - 1) - 1) // S + 1
        out = T.empty((N, OH, OW, F), T.float32)
        with T.Kernel(T.ceildiv(N * OH * OW, block_M)) as by:
            cols = T.alloc_shared((block_M, block_K), T.float32)
            w = T.alloc_shared((block_K, F), T.float32)
            acc = T.alloc_fragment((block_M, F), T.float32)
            w_flat = T.Tensor((KH * KW * C, F), T.float32, weight.data)
            out_flat = T.Tensor((N * OH * OW, F), T.float32, out.data)
            T.clear(acc)
            for k in T.serial(T.ceildiv(KH * KW * C, block_K)):
                T.im2col(data, cols, by, k, KH, S, D, P)
                T.copy(w_flat[k * block_K, 0], w)
                T.gemm(cols, w, acc)
            T.copy(acc, out_flat[by * block_M, 0])
        return out

    x, wt = torch.randn(2, 7, 6, 4), torch.randn(3, 3, 4, 8)
    for s, d, p in ((1, 1, 1), (2, 2, 2)):
        ref = torch.conv2d(x.permute(0, 3, 1, 2), wt.permute(3, 2, 0, 1), stride=s, padding=p, dilation=d)
        torch.testing.assert_close(conv(x, wt, s, d, p), ref.permute(0, 2, 3, 1), rtol=1e-4, atol=1e-4)


def test_strided_tensor_annotation(target):
    @tegula.jit(target=target)
    def as_contiguous(A):
        M, N, sM, sN = T.dynamic("M, N, sM, sN")
        A: T.StridedTensor[[M, N], [sM, sN], T.float32]
        B = T.empty((M, N), A.dtype)
        with T.Kernel(T.ceildiv(M, 8)) as bx:
            T.copy(A[bx * 8:(bx + 1) * 8, 0:16], B[bx * 8:(bx + 1) * 8, 0:16])
        return B

    x = torch.randn(16, 20).T  # (20, 16), strides (1, 20)
    assert torch.equal(as_contiguous(x), x.contiguous())
