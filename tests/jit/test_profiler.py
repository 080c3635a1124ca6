"""kernel.get_profiler(): do_bench and assert_allclose, as TileLang users call them."""
import pytest
import torch

import tegula
import tegula.language as T


def double(N=64):
    @T.prim_func
    def main(A: T.Tensor((N,), "float32"), B: T.Tensor((N,), "float32")):
        with T.Kernel(1):
            for i in T.Parallel(N):
                B[i] = A[i] * 2.0
    return main


@pytest.mark.parametrize("target", ["interp", "c"])
def test_profiler(target):
    k = tegula.compile(double(), out_idx=[-1], target=target)
    prof = k.get_profiler()
    prof.assert_allclose(lambda a: a * 2)
    with pytest.raises(AssertionError):
        prof.assert_allclose(lambda a: a * 3)
    assert prof.do_bench(rep=3) > 0


def test_profiler_needs_symbolic_dims():
    m = T.dynamic("m")

    @T.prim_func
    def main(A: T.Tensor((m,), "float32"), B: T.Tensor((m,), "float32")):
        with T.Kernel(1):
            for i in T.serial(m):
                B[i] = A[i]

    k = tegula.compile(main, out_idx=[-1], target="interp")
    with pytest.raises(ValueError, match="symbolic dim m"):
        k.get_profiler().do_bench()
    k.get_profiler(m=5).assert_allclose(lambda a: a.clone(), rtol=0, atol=0)
    assert torch.equal(k(torch.arange(3.0)), torch.arange(3.0))


def test_profiler_supplies_inputs_as_tilelang_does():
    from tegula.ir import dtypes as dt
    from tegula.jit.profiler import TensorSupplyType, supply_tensor
    u = supply_tensor((1000,), dt.float16)  # Auto: uniform in [-1, 1)
    assert u.dtype == torch.float16 and u.abs().max() <= 1 and u.std() > 0.3
    i = supply_tensor((1000,), dt.float32, TensorSupplyType.Integer)
    assert torch.equal(i, i.round()) and i.min() >= -2 and i.max() <= 2
    assert supply_tensor((4,), dt.uint8).max() <= 2
    assert torch.equal(supply_tensor((3,), dt.float32, "One"), torch.ones(3))


def test_assert_allclose_allows_a_few_mismatches():
    k = tegula.compile(double(200), out_idx=[-1], target="interp")
    prof = k.get_profiler(tegula.TensorSupplyType.Randn)  # positionally, as TileLang allows
    a = torch.randn(200)

    def off_by_one_element(x):
        r = x * 2
        r[0] += 1
        return r
    prof.assert_allclose(off_by_one_element, input_tensors=[a])  # 0.5% < the default 1%
    with pytest.raises(AssertionError):
        prof.assert_allclose(off_by_one_element, input_tensors=[a], max_mismatched_ratio=0.0)
