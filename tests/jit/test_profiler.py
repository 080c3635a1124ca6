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
