"""Names assigned inside runtime loops and branches: accumulators declared as runtime values update across
iterations; rebinding an outer compile-time value inside a runtime block is an error, not a silent no-op."""
import pytest
import torch

import tegula
import tegula.language as T


def test_runtime_accumulator_across_iterations(target):
    @T.prim_func
    def main(A: T.Tensor((8,), "float32"), S: T.Tensor((1,), "float32")):
        with T.Kernel(1):
            acc = T.float32(0)
            for k in T.serial(8):
                acc = acc + A[k]
            S[0] = acc

    a = torch.arange(8.0)
    s = tegula.compile(main, out_idx=[1], target=target)(a)
    assert s.item() == 28.0


def test_compile_time_value_rebound_in_loop_is_an_error():
    with pytest.raises(tegula.CompileError, match="compile-time value 0") as e:
        @T.prim_func
        def main(A: T.Tensor((8,), "float32"), S: T.Tensor((1,), "float32")):
            with T.Kernel(1):
                acc = 0
                for k in T.serial(8):
                    acc = acc + A[k]  # error: line below the loop head
                S[0] = acc
    assert "test_scoping.py" in str(e.value)


def test_compile_time_rebinding_at_same_level_is_fine(target):
    @T.prim_func
    def main(S: T.Tensor((3,), "int32")):
        with T.Kernel(1):
            n = 1
            n = n + 1  # still compile time
            for i in [0, 1, 2]:  # a Python iterable: unrolled, same scope
                S[i] = n * i

    s = tegula.compile(main, out_idx=[0], target=target)()
    assert torch.equal(torch.as_tensor(s), torch.tensor([0, 2, 4], dtype=torch.int32))
