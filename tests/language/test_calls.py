"""Compiling and calling kernels: out_idx, tegula.jit, symbolic dims, argument checks, sources."""

import numpy as np
import pytest
import torch

import tegula
import tegula.language as T


def add_one(N=16, dtype="float32"):
    @T.prim_func
    def main(A: T.Tensor((N,), dtype), B: T.Tensor((N,), dtype)):
        with T.Kernel(1):
            for i in T.Parallel(N):
                B[i] = A[i] + 1

    return main


def split_kernel(N=8):
    # One input, two results: B = A * 2 and C = A - 1.
    @T.prim_func
    def main(A: T.Tensor((N,), "float32"), B: T.Tensor((N,), "float32"), C: T.Tensor((N,), "float32")):
        with T.Kernel(1):
            for i in T.Parallel(N):
                B[i] = A[i] * 2.0
                C[i] = A[i] - 1.0

    return main


@pytest.mark.parametrize("out_idx", [-1, [-1], 1, [1]])
def test_out_idx_single_output(target, out_idx):
    kernel = tegula.compile(add_one(), out_idx=out_idx, target=target)
    a = torch.randn(16)
    b = kernel(a)
    assert isinstance(b, torch.Tensor)
    assert b.shape == (16,) and b.dtype == torch.float32
    assert torch.equal(b, a + 1)


def test_out_idx_several_outputs_return_a_list(target):
    kernel = tegula.compile(split_kernel(), out_idx=[1, 2], target=target)
    a = torch.randn(8)
    b, c = kernel(a)
    assert torch.equal(b, a * 2) and torch.equal(c, a - 1)


def test_out_idx_may_skip_a_middle_parameter(target):
    # out_idx=[1]: A and C are passed in (C updated in place), B is allocated and returned.
    kernel = tegula.compile(split_kernel(), out_idx=[1], target=target)
    a, c = torch.randn(8), torch.zeros(8)
    b = kernel(a, c)
    assert torch.equal(b, a * 2) and torch.equal(c, a - 1)


def test_without_out_idx_every_tensor_is_passed_and_the_call_returns_none(target):
    kernel = tegula.compile(add_one(), target=target)
    a, b = torch.randn(16), torch.zeros(16)
    assert kernel(a, b) is None
    assert torch.equal(b, a + 1)


def test_outputs_are_fresh_per_call(target):
    kernel = tegula.compile(add_one(), out_idx=[-1], target=target)
    a1, a2 = torch.randn(16), torch.randn(16)
    b1 = kernel(a1)
    b2 = kernel(a2)
    assert torch.equal(b1, a1 + 1) and torch.equal(b2, a2 + 1)


def test_tensor_views_with_a_storage_offset(target):
    # Contiguous views that start inside a larger storage: the kernel sees the view, not the storage.
    kernel = tegula.compile(add_one(), target=target)
    storage_in, storage_out = torch.randn(40), torch.zeros(40)
    a, b = storage_in[5:21], storage_out[7:23]
    kernel(a, b)
    assert torch.equal(b, a + 1)
    assert torch.all(storage_out[:7] == 0) and torch.all(storage_out[23:] == 0)


def test_numpy_arrays_in(target):
    kernel = tegula.compile(split_kernel(), out_idx=[1, 2], target=target)
    a = np.arange(8, dtype=np.float32) - 3.5
    b, c = kernel(a)
    np.testing.assert_array_equal(np.asarray(b), a * 2)
    np.testing.assert_array_equal(np.asarray(c), a - 1)


def test_numpy_array_updated_in_place(target):
    kernel = tegula.compile(add_one(), target=target)
    a, b = np.linspace(-1, 1, 16, dtype=np.float32), np.zeros(16, dtype=np.float32)
    kernel(a, b)
    np.testing.assert_array_equal(b, a + 1)


def test_jit_factory_compiles_once_per_argument_tuple(target):
    calls = []

    @tegula.jit(out_idx=[-1], target=target)
    def scale(N, factor):
        calls.append((N, factor))

        @T.prim_func
        def main(A: T.Tensor((N,), "float32"), B: T.Tensor((N,), "float32")):
            with T.Kernel(1):
                for i in T.Parallel(N):
                    B[i] = A[i] * factor

        return main

    k1 = scale(8, 2.0)
    k2 = scale(8, 2.0)
    k3 = scale(4, 3.0)
    assert k1 is k2
    assert calls == [(8, 2.0), (4, 3.0)]
    a8, a4 = torch.randn(8), torch.randn(4)
    assert torch.equal(k1(a8), a8 * 2.0)
    assert torch.equal(k3(a4), a4 * 3.0)


def dynamic_rows_kernel(spelling, N=8, block=4):
    m = T.dynamic("m") if spelling == "dynamic" else T.symbolic("m")

    @T.prim_func
    def main(A: T.Tensor((m, N), "float32"), B: T.Tensor((m, N), "float32"), S: T.Tensor((m,), "float32")):
        with T.Kernel(T.ceildiv(m, block)) as bx:
            tile = T.alloc_fragment((block, N), "float32")
            sums = T.alloc_fragment((block,), "float32")
            T.copy(A[bx * block, 0], tile)
            for i, j in T.Parallel(block, N):
                tile[i, j] = tile[i, j] * 3.0
            T.reduce_sum(tile, sums, dim=1)
            T.copy(tile, B[bx * block, 0])
            for i in T.Parallel(block):
                if bx * block + i < m:
                    S[bx * block + i] = sums[i]

    return main


@pytest.mark.parametrize("spelling", ["dynamic", "symbolic"])
def test_symbolic_dim_bound_at_call_time(target, spelling):
    kernel = tegula.compile(dynamic_rows_kernel(spelling), out_idx=[1, 2], target=target)
    for m in (1, 4, 7, 13):  # one compiled kernel serves every row count, tails included
        a = torch.randn(m, 8)
        b, s = kernel(a)
        assert b.shape == (m, 8) and s.shape == (m,)
        torch.testing.assert_close(b, a * 3, rtol=0, atol=0)
        torch.testing.assert_close(s, (a * 3).sum(1), rtol=1e-6, atol=1e-5)


def test_kernel_source_is_inspectable(target):
    kernel = tegula.compile(add_one(), out_idx=[-1], target=target)
    source = kernel.get_kernel_source()
    assert isinstance(source, str) and source.strip()


def test_lower_gives_c_source():
    lowered = tegula.lower(add_one(), target="c")
    assert isinstance(lowered.kernel_source, str) and lowered.kernel_source.strip()


# --- wrong arguments: TypeError / ValueError before anything runs -------------------------


def two_inputs(N=16):
    @T.prim_func
    def main(A: T.Tensor((N,), "float32"), B: T.Tensor((N,), "float32"), C: T.Tensor((N,), "float32")):
        with T.Kernel(1):
            for i in T.Parallel(N):
                C[i] = A[i] + B[i]

    return main


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(lambda: (torch.randn(16),), id="too-few"),
        pytest.param(lambda: (torch.randn(16), torch.randn(16), torch.randn(16)), id="too-many"),
    ],
)
def test_wrong_tensor_count_is_a_type_error(target, args):
    kernel = tegula.compile(two_inputs(), out_idx=[-1], target=target)
    with pytest.raises(TypeError):
        kernel(*args())


@pytest.mark.parametrize(
    "make_b",
    [
        pytest.param(lambda: torch.randn(16, dtype=torch.float64), id="dtype-float64"),
        pytest.param(lambda: torch.randn(16).half(), id="dtype-float16"),
        pytest.param(lambda: torch.arange(16, dtype=torch.int32), id="dtype-int32"),
        pytest.param(lambda: torch.randn(15), id="shape-short"),
        pytest.param(lambda: torch.randn(16, 1), id="shape-rank"),
        pytest.param(lambda: torch.randn(32)[::2], id="non-contiguous"),
        pytest.param(lambda: 3.0, id="not-a-tensor"),
    ],
)
def test_bad_tensor_is_rejected(target, make_b):
    kernel = tegula.compile(two_inputs(), out_idx=[-1], target=target)
    # The message names the offending parameter.
    with pytest.raises((TypeError, ValueError), match=r"\bB\b"):
        kernel(torch.randn(16), make_b())


def test_bad_argument_leaves_in_place_outputs_untouched(target):
    kernel = tegula.compile(two_inputs(), target=target)
    c = torch.full((16,), 5.0)
    with pytest.raises((TypeError, ValueError)):
        kernel(torch.randn(16), torch.randn(8), c)
    assert torch.all(c == 5.0)


def test_symbolic_dims_must_agree(target):
    kernel = tegula.compile(dynamic_rows_kernel("dynamic"), target=target)
    with pytest.raises(ValueError, match=r"\bm\b"):
        kernel(torch.randn(4, 8), torch.randn(5, 8), torch.randn(4))
    with pytest.raises(ValueError):
        kernel(torch.randn(4, 8), torch.randn(4, 8), torch.randn(3))
    with pytest.raises(ValueError):
        kernel(torch.randn(4, 7), torch.randn(4, 7), torch.randn(4))  # the static dim is still checked
