"""Spellings and idioms found in kernels written for TileLang, beyond the core tile ops: C type names, TVM's
argument orders, views declared over another buffer's data, layout objects, function-wide workspaces, slice
bounds held in locals."""
import pytest
import torch

import tegula
import tegula.language as T


def test_c_type_names_and_dtype_helpers():
    assert T.float == T.float32 and T.double == T.float64 and T.int == T.int32 and T.long == T.int64
    assert T.short == T.int16 and T.uint == T.uint32 and T.ulong == T.uint64
    assert T.dtype("long") == T.int64 and T.dtype("short") == "int16"
    assert T.float16.as_torch() is torch.float16 and T.dtype("bool").as_torch() is torch.bool
    assert T.bfloat16.bytes == 2 and T.float.bytes == 4
    assert T.tfloat32 == T.float32 and T.dtype("tfloat32") == "float32"  # TF32 operands are stored as float32


def test_tvm_cast_takes_the_dtype_first(target):
    @T.prim_func
    def main(X: T.Tensor((8,), "bfloat16"), Y: T.Tensor((8,), "float32"), Z: T.Tensor((8,), "int32")):
        with T.Kernel(1):
            for i in T.Parallel(8):
                Y[i] = T.Cast("float", X[i]) * 2.0
                Z[i] = T.Cast(Y[i], T.int32)  # the other order is accepted too

    x = (torch.randn(8) * 5).bfloat16()
    y, z = tegula.compile(main, out_idx=[1, 2], target=target)(x)
    assert torch.equal(y, x.float() * 2)
    assert torch.equal(z, (x.float() * 2).to(torch.int32))


def test_tensor_over_another_buffers_data(target):
    # an im2col-style kernel sees a 4-D weight as the 2-D matrix it is in memory
    @T.prim_func
    def main(W: T.Tensor((3, 3, 4, 8), "float32"), Out: T.Tensor((8, 36), "float32")):
        with T.Kernel(1):
            flat = T.Tensor((36, 8), "float32", W.data)
            tile = T.alloc_shared((36, 8), "float32")
            T.copy(flat[0, 0], tile)
            for i, j in T.Parallel(8, 36):
                Out[i, j] = tile[j, i]

    w = torch.randn(3, 3, 4, 8)
    out = tegula.compile(main, out_idx=[1], target=target)(w)
    assert torch.equal(out, w.reshape(36, 8).T)


def test_tensor_over_data_needs_the_same_dtype():
    with pytest.raises(tegula.CompileError, match="reinterpreting"):
        @T.prim_func
        def main(W: T.Tensor((4, 8), "float32")):
            with T.Kernel(1):
                T.Tensor((32,), "int32", W.data)


def test_layout_objects_are_accepted_hints(target):
    @T.prim_func
    def main(A: T.Tensor((4, 16), "float32"), B: T.Tensor((4, 16), "float32")):
        with T.Kernel(1):
            s = T.alloc_shared((4, 16), "float32")
            f = T.alloc_fragment((4, 16), "float32")
            T.annotate_layout({A: T.Layout(A.shape, lambda i, j: [j // 8, i, j % 8]),
                               f: T.Fragment(f.shape, forward_thread_fn=lambda i, j: i)})
            T.copy(A, s)
            T.copy(s, f)
            T.copy(f, B)

    a = torch.randn(4, 16)
    assert torch.equal(tegula.compile(main, out_idx=[1], target=target)(a), a)


def test_lambda_is_a_compile_time_function(target):
    @T.prim_func
    def main(A: T.Tensor((16,), "float32"), B: T.Tensor((16,), "float32")):
        with T.Kernel(1):
            scale = 3.0
            axpy = lambda x, y: x * scale + y  # noqa: E731
            for i in T.Parallel(16):
                B[i] = axpy(A[i], 1.0)

    a = torch.randn(16)
    assert torch.equal(tegula.compile(main, out_idx=[1], target=target)(a), a * 3 + 1)


def test_alloc_global_workspace_between_two_kernels(target):
    # split the rows of a reduction over blocks, keep partial sums in a workspace, combine in a second grid
    @T.prim_func
    def main(A: T.Tensor((6, 32), "float32"), S: T.Tensor((6,), "float32")):
        part = T.alloc_global((6, 4), "float32")
        with T.Kernel(6, 4) as (row, split):
            t = T.alloc_fragment((8,), "float32")
            acc = T.alloc_fragment((1,), "float32")
            T.copy(A[row, split * 8:(split + 1) * 8], t)
            T.reduce_sum(t, acc, dim=0)
            part[row, split] = acc[0]
        with T.Kernel(6) as row:
            total = T.alloc_var("float32")
            total = 0.0
            for k in T.serial(4):
                total += part[row, k]
            S[row] = total

    a = torch.randn(6, 32)
    s = tegula.compile(main, out_idx=[1], target=target)(a)
    torch.testing.assert_close(s, a.sum(1), rtol=1e-5, atol=1e-5)


def test_alloc_global_belongs_outside_the_kernels():
    with pytest.raises(tegula.CompileError, match="before"):
        @T.prim_func
        def main(A: T.Tensor((8,), "float32")):
            with T.Kernel(1):
                T.alloc_global((8,), "float32")


def test_slice_bounds_held_in_locals(target):
    # start and end are computed into locals; their difference is still the constant 8
    @T.prim_func
    def main(A: T.Tensor((4, 32), "float32"), B: T.Tensor((4, 32), "float32")):
        with T.Kernel(4, 4) as (bx, by):
            t = T.alloc_shared((8,), "float32")
            start = by * 8
            end = start + 8
            T.copy(A[bx, start:end], t)
            for i in T.Parallel(8):
                t[i] = t[i] + 1.0
            T.copy(t, B[bx, start:end])

    a = torch.randn(4, 32)
    assert torch.equal(tegula.compile(main, out_idx=[1], target=target)(a), a + 1)


def test_slice_bound_locals_may_not_change_afterwards():
    with pytest.raises(tegula.CompileError, match="keeps its value"):
        @T.prim_func
        def main(A: T.Tensor((64,), "float32")):
            with T.Kernel(1):
                t = T.alloc_shared((8,), "float32")
                s = T.alloc_var("int32")
                s = 0
                for k in T.serial(4):
                    lo = s * 8
                    hi = lo + 8
                    T.copy(A[lo:hi], t)
                    lo = lo + 1


def test_host_side_helpers_of_kernel_factories():
    import tegula.math
    assert tegula.cdiv(7, 2) == 4 and tegula.next_power_of_2(300) == 512 and tegula.math.next_power_of_2(64) == 64
    assert tegula.math.cdiv(8, 2) == 4
    assert isinstance(tegula.PassConfigKey.TL_ENABLE_FAST_MATH, str)  # accepted and ignored
    k = tegula.compile(_copy_kernel(), out_idx=[1], target="interp",
                       pass_configs={tegula.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True})
    assert torch.equal(k(torch.ones(4)), torch.ones(4))


def _copy_kernel():
    @T.prim_func
    def main(A: T.Tensor((4,), "float32"), B: T.Tensor((4,), "float32")):
        with T.Kernel(1):
            for i in T.Parallel(4):
                B[i] = A[i]
    return main


def test_atomic_addx4_adds_four_consecutive_values(target):
    @T.prim_func
    def main(Src: T.Tensor((4, 16), "float32"), Acc: T.Tensor((8, 16), "float32")):
        with T.Kernel(2) as bx:
            s = T.alloc_shared((4, 16), "float32")
            T.copy(Src, s)
            for i, j in T.Parallel(4, 4):
                T.atomic_addx4(Acc[bx * 4 + i, j * 4], s[i, j * 4])

    src, acc = torch.randn(4, 16), torch.ones(8, 16)
    tegula.compile(main, target=target)(src, acc)
    assert torch.equal(acc, 1 + torch.cat([src, src]))


def test_comprehensions_over_compile_time_values(target):
    sizes = [5, 9, 13]

    @T.prim_func
    def main(A: T.Tensor((8,), "int32")):
        with T.Kernel(1):
            blocks = sum((n + 3) // 4 for n in sizes)
            offsets = [sum(sizes[:k]) for k in range(len(sizes)) if k > 0]
            table = {n: n * 2 for n in sizes}
            A[0] = blocks
            A[1] = offsets[0] + offsets[1]
            A[2] = table[9] + len({n % 2 for n in sizes})

    a = torch.zeros(8, dtype=torch.int32)
    tegula.compile(main, target=target)(a)
    assert a[:3].tolist() == [2 + 3 + 4, 5 + 14, 18 + 1]


def test_assert_on_compile_time_values():
    def make(n):
        @T.prim_func
        def main(A: T.Tensor((n,), "float32")):
            assert n % 4 == 0, f"n={n} must be a multiple of 4"
            with T.Kernel(1):
                assert A[0] >= 0  # a runtime condition: an assumption, not checked
                A[0] = 1.0
        return main

    make(8)
    with pytest.raises(tegula.CompileError, match="n=6 must be a multiple of 4"):
        make(6)


def test_persistent_loop_visits_every_tile_once(target):
    # 5 x 3 tiles shared by a wave of 4 blocks, panels of 2 along the last dimension
    @T.prim_func
    def main(Visits: T.Tensor((5, 3), "int32")):
        with T.Kernel(4) as b:
            for tm, tn in T.Persistent([5, 3], 4, b, group_size=2):
                T.atomic_add(Visits[tm, tn], 1)

    v = torch.zeros(5, 3, dtype=torch.int32)
    tegula.compile(main, target=target)(v)
    assert torch.equal(v, torch.ones(5, 3, dtype=torch.int32))


def test_cumsum_forward_and_reverse(target):
    @T.prim_func
    def main(X: T.Tensor((4, 8), "float32"), F: T.Tensor((4, 8), "float32"), R: T.Tensor((8, 4), "float32")):
        with T.Kernel(1):
            f = T.alloc_fragment((4, 8), "float32")
            s = T.alloc_shared((8, 4), "float32")
            T.copy(X, f)
            for i, j in T.Parallel(8, 4):
                s[i, j] = X[j, i]
            T.cumsum(f, dim=1)
            T.cumsum(s, dim=0, reverse=True)
            T.copy(f, F)
            T.copy(s, R)

    x = torch.randn(4, 8)
    f, r = tegula.compile(main, out_idx=[1, 2], target=target)(x)
    torch.testing.assert_close(f, x.cumsum(1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r, x.T.flip(0).cumsum(0).flip(0), rtol=1e-5, atol=1e-5)


def test_block_binding_shifts_and_coordinates(target):
    @T.prim_func
    def main(A: T.Tensor((3, 4), "int32")):
        with T.Kernel(3, 1) as (bx, by):
            row = T.get_block_binding(0)
            for j in T.Parallel(4):
                r, c = T.index_to_coordinates(row * 4 + j, (3, 4))
                A[r, c] = T.shift_left(1, j) + T.shift_right(64, r) + by

    a = torch.zeros(3, 4, dtype=torch.int32)
    tegula.compile(main, target=target)(a)
    ref = torch.tensor([[(1 << j) + (64 >> i) for j in range(4)] for i in range(3)], dtype=torch.int32)
    assert torch.equal(a, ref)


def test_dtypes_are_strings_and_tvm_spellings(target):
    assert isinstance(T.float16, str) and getattr(torch, T.bfloat16) is torch.bfloat16 and f"{T.int8}" == "int8"
    assert T.float8_e4m3 == "float8_e4m3fn" and not (T.float32 != "float")

    @T.prim_func
    def main(A: T.Tensor((8,), "float16"), B: T.Tensor((8,), "float32")):
        part = T.alloc_buffer((8,), "float32")  # TVM's spelling of a global workspace
        with T.Kernel(1):
            s = T.alloc_buffer((8,), "float32", scope="shared")
            for i in T.Parallel(8):
                s[i] = A[i].astype("float32") * 2.0
            T.copy(s, part)
        with T.Kernel(1):
            T.copy(part, B)

    a = torch.randn(8).half()
    assert torch.equal(tegula.compile(main, out_idx=[1], target=target)(a), a.float() * 2)
