"""JITKernel.bind: checked once like a call, then unchecked launches with new tensors in the ``vary`` positions
and the bound values everywhere else; the same results as an ordinary call on every target."""
import pytest
import torch

import tegula
import tegula.language as T
from tegula.runtime import cpu

TARGETS = ["interp"] + (["c"] if cpu.available()[0] else [])


def axpb_kernel():
    n = T.dynamic("n")

    @T.prim_func
    def axpb(X: T.Tensor((n,), "float32"), Y: T.Tensor((n,), "float32"), a: T.float32, b: T.int32):
        with T.Kernel(1):
            for i in T.Parallel(n):
                Y[i] = X[i] * a + T.cast(b, "float32")
    return axpb


def copy_bits_kernel():
    n = T.dynamic("n")

    @T.prim_func
    def copy_bits(X: T.Tensor((n,), "int16"), Y: T.Tensor((n,), "int16")):
        with T.Kernel(1):
            for i in T.Parallel(n):
                Y[i] = X[i]
    return copy_bits


@pytest.mark.parametrize("target", TARGETS)
def test_bound_launch_matches_a_call(target):
    k = tegula.compile(axpb_kernel(), target=target)
    x, y = torch.randn(37), torch.empty(37)
    launch = k.bind(x, y, 2.5, 3)
    for _ in range(3):
        x2, y2, want = torch.randn(37), torch.empty(37), torch.empty(37)
        launch(x2, y2)
        k(x2, want, 2.5, 3)
        assert torch.equal(y2, want) and torch.equal(want, x2 * 2.5 + 3)


@pytest.mark.parametrize("target", TARGETS)
def test_bind_launches_nothing_and_keeps_fixed_tensors(target):
    k = tegula.compile(axpb_kernel(), target=target)
    y = torch.full((20,), 7.0)
    launch = k.bind(torch.arange(20, dtype=torch.float32), y, -1.0, 1, vary=[1])  # X only lives in the launcher
    assert bool((y == 7.0).all())
    out = torch.empty(20)
    launch(out)
    assert torch.equal(out, 1 - torch.arange(20, dtype=torch.float32))


@pytest.mark.parametrize("target", TARGETS)
def test_bound_launch_reads_bits_of_the_same_width(target):
    k = tegula.compile(copy_bits_kernel(), target=target)
    src = torch.randn(50).to(torch.bfloat16)
    dst = torch.empty(50, dtype=torch.bfloat16)
    launch = k.bind(src.view(torch.int16), dst.view(torch.int16))
    launch(src, dst)
    assert torch.equal(dst.view(torch.int16), src.view(torch.int16))


@pytest.mark.parametrize("target", TARGETS)
def test_bind_checks_like_a_call(target):
    k = tegula.compile(axpb_kernel(), target=target)
    x, y = torch.randn(8), torch.empty(8)
    with pytest.raises(TypeError, match="dtype"):
        k.bind(x.double(), y, 1.0, 0)
    with pytest.raises(ValueError, match="symbolic dim n"):
        k.bind(x, torch.empty(9), 1.0, 0)
    with pytest.raises(TypeError, match="argument b"):
        k.bind(x, y, 1.0, 0.5)
    with pytest.raises(TypeError, match="takes 4 argument"):
        k.bind(x, y)
    with pytest.raises(ValueError, match="vary"):
        k.bind(x, y, 1.0, 0, vary=[2])
    with pytest.raises(ValueError, match="vary"):
        k.bind(x, y, 1.0, 0, vary=[0, 0])


def test_kernels_with_created_outputs_cannot_be_bound():
    k = tegula.compile(axpb_kernel(), out_idx=[1], target=TARGETS[-1])
    with pytest.raises(ValueError, match="out_idx"):
        k.bind(torch.randn(4), 1.0, 0)
