"""Loops, grids, branches and scalar variables, as TileLang kernels use them."""

import pytest
import torch

import tegula
import tegula.language as T


def test_parallel_one_to_three_dims(target):
    @T.prim_func
    def main(
        A: T.Tensor((2, 3, 4), "float32"),
        B: T.Tensor((2, 3, 4), "float32"),
        C: T.Tensor((6,), "float32"),
        D: T.Tensor((3, 4), "float32"),
    ):
        with T.Kernel(1, threads=64):
            for i, j, k in T.Parallel(2, 3, 4):
                B[i, j, k] = A[i, j, k] * 2.0 + T.cast(i * 100 + j * 10 + k, "float32")
            for i in T.Parallel(6):
                C[i] = A[i // 3, i % 3, 3]
            for i, j in T.Parallel(3, 4):
                D[i, j] = A[1, i, j] - A[0, i, j]

    a = torch.randn(2, 3, 4)
    b, c, d = tegula.compile(main, out_idx=[1, 2, 3], target=target)(a)
    index = torch.arange(2).view(2, 1, 1) * 100 + torch.arange(3).view(1, 3, 1) * 10 + torch.arange(4)
    torch.testing.assert_close(b, a * 2 + index.float(), rtol=0, atol=0)
    torch.testing.assert_close(c, a[:, :, 3].flatten(), rtol=0, atol=0)
    torch.testing.assert_close(d, a[1] - a[0], rtol=0, atol=0)


def test_nested_serial_loops_with_local_accumulator(target):
    M, N = 5, 7

    @T.prim_func
    def main(A: T.Tensor((M, N), "int32"), B: T.Tensor((M, N), "int32")):
        with T.Kernel(1):
            acc = T.alloc_local((1,), "int32")
            for i in T.serial(M):
                acc[0] = 0
                for j in T.serial(N):
                    acc[0] += A[i, j]
                    B[i, j] = acc[0]

    a = torch.randint(-50, 50, (M, N), dtype=torch.int32)
    b = tegula.compile(main, out_idx=[-1], target=target)(a)
    assert torch.equal(b, torch.cumsum(a, 1, dtype=torch.int32))


def test_loop_forms(target):
    # Each loop form marks the indices it visits with its own power of ten.
    @T.prim_func
    def main(B: T.Tensor((16,), "int32")):
        with T.Kernel(1):
            for i in T.serial(16):
                B[i] = 0
            for i in T.serial(2, 5):
                B[i] += 1
            for i in T.serial(0, 16, 4):
                B[i] += 10
            for i in range(1, 16, 3):
                B[i] += 100
            for i in range(3):
                B[i] += 1000
            for i in T.unroll(4):
                B[15 - i] += 10000
            for i, j in T.grid(2, 3):
                B[i * 3 + j] += 100000
            for i in T.Pipelined(6, 9, num_stages=2):
                B[i] += 1000000

    expected = [0] * 16
    for indices, mark in [
        (range(2, 5), 1), (range(0, 16, 4), 10), (range(1, 16, 3), 100), (range(3), 1000),
        ([15, 14, 13, 12], 10000), (range(6), 100000), (range(6, 9), 1000000),
    ]:
        for i in indices:
            expected[i] += mark
    b = tegula.compile(main, out_idx=[-1], target=target)()
    assert b.tolist() == expected


def test_loop_bounds_from_runtime_values(target):
    # Each row's trip count is read from a tensor.
    R, W = 6, 8

    @T.prim_func
    def main(Lens: T.Tensor((R,), "int32"), B: T.Tensor((R, W), "int32")):
        with T.Kernel(R) as bx:
            for j in T.Parallel(W):
                B[bx, j] = 0
            for j in T.serial(Lens[bx]):
                B[bx, j] = j + 1

    lens = torch.tensor([0, 1, 8, 3, 5, 2], dtype=torch.int32)
    b = tegula.compile(main, out_idx=[-1], target=target)(lens)
    expected = torch.tensor([[j + 1 if j < n else 0 for j in range(W)] for n in lens.tolist()], dtype=torch.int32)
    assert torch.equal(b, expected)


def test_if_elif_else_on_runtime_values(target):
    N = 64

    @T.prim_func
    def main(A: T.Tensor((N,), "float32"), B: T.Tensor((N,), "int32")):
        with T.Kernel(1):
            for i in T.Parallel(N):
                if A[i] > 1.0:
                    B[i] = 2
                elif A[i] > 0.0 and A[i] <= 0.5:
                    B[i] = 1
                elif A[i] < -1.0 or A[i] == 0.0:
                    B[i] = -1
                else:
                    B[i] = 0

    a = torch.randn(N) * 2
    a[:4] = torch.tensor([0.0, 0.5, 1.0, -1.0])
    b = tegula.compile(main, out_idx=[-1], target=target)(a)
    expected = torch.where(
        a > 1, 2, torch.where((a > 0) & (a <= 0.5), 1, torch.where((a < -1) | (a == 0), -1, 0))
    ).int()
    assert torch.equal(b, expected)


def test_while_loop_and_alloc_var(target):
    # Count how many halvings bring each value below 1.
    N = 16

    @T.prim_func
    def main(A: T.Tensor((N,), "float32"), B: T.Tensor((N,), "int32")):
        with T.Kernel(N) as bx:
            x = T.alloc_var("float32")
            n = T.alloc_var("int32")
            x = A[bx]
            n = 0
            while x >= 1.0:
                x = x * 0.5
                n += 1
            B[bx] = n

    a = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 7.9, 8.0, 1000.0, 1e6, 0.99, 2.5, 64.0, 65.0, 1e-3])
    b = tegula.compile(main, out_idx=[-1], target=target)(a)
    expected = []
    for v in a.tolist():
        count = 0
        while v >= 1.0:
            v, count = v * 0.5, count + 1
        expected.append(count)
    assert b.tolist() == expected


def test_alloc_var_assign_and_update(target):
    @T.prim_func
    def main(B: T.Tensor((4,), "int32"), F: T.Tensor((3,), "float32")):
        with T.Kernel(1):
            v = T.alloc_var("int32")
            f = T.alloc_var("float32")
            v = 5
            v += 1
            B[0] = v
            v = v * 2
            B[1] = v
            v -= 20
            B[2] = v
            for i in T.serial(4):
                v += i
            B[3] = v
            f = 1.5
            f *= 3.0
            F[0] = f
            f = f / 2.0
            F[1] = f
            f = 16777216.0
            f = f + 1.0  # the variable is float32: 2**24 + 1 rounds back to 2**24
            F[2] = f - 16777216.0

    b, f = tegula.compile(main, out_idx=[0, 1], target=target)()
    assert b.tolist() == [6, 12, -8, -2]
    assert f.tolist() == [4.5, 2.25, 0.0]


def branch_kernel(flag, N=8):
    @T.prim_func
    def main(A: T.Tensor((N,), "float32"), B: T.Tensor((N,), "float32"), C: T.Tensor((N,), "float32")):
        with T.Kernel(1):
            if flag:
                for i in T.Parallel(N):
                    B[i] = A[i] + 1.0
            else:
                for i in T.Parallel(N):
                    B[i] = A[i] - 1.0
            for i in T.Parallel(N):
                C[i] = A[i] * (2.0 if flag else 3.0)

    return main


@pytest.mark.parametrize("flag", [True, False])
def test_closure_bool_selects_code_at_compile_time(target, flag):
    a = torch.randn(8)
    b, c = tegula.compile(branch_kernel(flag), out_idx=[1, 2], target=target)(a)
    torch.testing.assert_close(b, a + 1 if flag else a - 1, rtol=0, atol=0)
    torch.testing.assert_close(c, a * (2 if flag else 3), rtol=0, atol=0)


def test_branch_not_taken_is_never_compiled(target):
    # A compile-time `if` drops the other branch before checking it, as TileLang's parser does:
    # the dead branch below would be a shape error.
    use_tiles = False
    N = 8

    @T.prim_func
    def main(A: T.Tensor((N,), "float32"), B: T.Tensor((N,), "float32")):
        with T.Kernel(1):
            small = T.alloc_shared((N // 2,), "float32")
            if use_tiles:
                T.copy(A, small)
            else:
                for i in T.Parallel(N):
                    B[i] = A[i]

    a = torch.randn(N)
    assert torch.equal(tegula.compile(main, out_idx=[-1], target=target)(a), a)


def test_macro_inlined_at_each_call(target):
    N = 16

    @T.macro
    def axpy(dst, x, y, alpha):
        for i in T.Parallel(N):
            dst[i] = x[i] * alpha + y[i]

    @T.macro
    def twice_axpy(dst, x, y):
        axpy(dst, x, y, 2.0)
        axpy(dst, dst, y, 2.0)

    @T.prim_func
    def main(X: T.Tensor((N,), "float32"), Y: T.Tensor((N,), "float32"), B: T.Tensor((N,), "float32"),
             C: T.Tensor((N,), "float32")):
        with T.Kernel(1):
            x = T.alloc_fragment((N,), "float32")
            y = T.alloc_fragment((N,), "float32")
            out = T.alloc_fragment((N,), "float32")
            T.copy(X, x)
            T.copy(Y, y)
            axpy(out, x, y, 0.5)
            T.copy(out, B)
            twice_axpy(out, y, x)
            T.copy(out, C)

    x, y = torch.randn(N), torch.randn(N)
    b, c = tegula.compile(main, out_idx=[2, 3], target=target)(x, y)
    torch.testing.assert_close(b, x * 0.5 + y, rtol=0, atol=0)
    torch.testing.assert_close(c, (y * 2 + x) * 2 + x, rtol=0, atol=0)


def test_three_dim_grid(target):
    @T.prim_func
    def main(B: T.Tensor((2, 3, 4), "int32")):
        with T.Kernel(4, 3, 2, threads=(8, 4)) as (bx, by, bz):
            B[bz, by, bx] = bz * 100 + by * 10 + bx

    b = torch.as_tensor(tegula.compile(main, out_idx=[-1], target=target)())  # no input: torch or numpy out
    expected = torch.arange(2).view(2, 1, 1) * 100 + torch.arange(3).view(1, 3, 1) * 10 + torch.arange(4)
    assert torch.equal(b, expected.int())


def test_one_dim_grid_gives_scalar_index(target):
    @T.prim_func
    def main(A: T.Tensor((5, 4), "float32"), B: T.Tensor((5,), "float32")):
        with T.Kernel(5) as bx:
            row = T.alloc_fragment((4,), "float32")
            T.copy(A[bx, :], row)
            B[bx] = row[0] - row[3] + T.cast(bx, "float32")

    a = torch.randn(5, 4)
    b = tegula.compile(main, out_idx=[-1], target=target)(a)
    torch.testing.assert_close(b, a[:, 0] - a[:, 3] + torch.arange(5).float(), rtol=0, atol=0)
