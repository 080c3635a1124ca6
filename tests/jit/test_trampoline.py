"""The c runtime's trampoline (tegula.runtime.cpu.trampoline): kernels whose arguments are all pointers and int32 /
uint32 / int64 scalars launch through it, from a call's fast path and from a bound launcher; the results equal a
launch through ctypes, arguments past the six argument registers (stack slots) included."""
import ctypes

import pytest
import torch

import tegula
import tegula.language as T
from tegula.jit.kernel import _pointer_launcher
from tegula.runtime import cpu

pytestmark = pytest.mark.skipif(not cpu.available()[0] or cpu.trampoline() is None,
                                reason="needs the c target and the trampoline (x86-64 System V, Python headers)")


def mixed_kernel():
    n = T.dynamic("n")

    @T.prim_func
    def mixed(X: T.Tensor((n,), "int64"), I: T.Tensor((n,), "int32"), Y: T.Tensor((n,), "int64"), a: T.int32,
              b: T.int64, c: T.uint32, d: T.int32, e: T.int64):
        with T.Kernel(1):
            for i in T.Parallel(n):
                Y[i] = (X[i] * T.cast(a, "int64") + b + T.cast(c, "int64") * T.cast(I[i], "int64")
                        - T.cast(d, "int64") * 3 + e)
    return mixed


def want(x, i, a, b, c, d, e):
    return x * a + b + c * i.long() - d * 3 + e


ARGS = (-7, -(2**40) + 5, 2**32 - 3, -2**31, 2**62)


def test_fast_call_goes_through_the_trampoline():
    k = tegula.compile(mixed_kernel(), target="c")
    assert k.program.direct is not None and k._fast is not None
    assert "_call(_address" in k._fast.__tegula_source__
    for n in (1, 37, 300):
        x, i = torch.randint(-1000, 1000, (n,)), torch.randint(-5, 5, (n,), dtype=torch.int32)
        y, y_ctypes = torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.int64)
        k(x, i, y, *ARGS)
        k.program.launch(x.data_ptr(), i.data_ptr(), y_ctypes.data_ptr(), *ARGS, n)   # through ctypes
        assert torch.equal(y, y_ctypes) and torch.equal(y, want(x, i, *ARGS))


def test_bound_launch_through_the_trampoline_matches_ctypes():
    k = tegula.compile(mixed_kernel(), target="c")
    n = 50
    x, i = torch.randint(-1000, 1000, (n,)), torch.randint(-5, 5, (n,), dtype=torch.int32)
    y1, y2 = torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.int64)
    launch = k.bind(x, i, y1, *ARGS, vary=[0, 2])   # I fixed: only the launcher holds it
    raw = k.program.lib[k.program.fn.__name__]
    via_ctypes = _pointer_launcher(raw, k.program.fn.argtypes, [x, i, y1, *ARGS, n], [0, 2], "t", None)
    for _ in range(2):
        x = torch.randint(-1000, 1000, (n,))
        launch(x, y1)
        via_ctypes(x, y2)
        assert torch.equal(y1, y2) and torch.equal(y1, want(x, i, *ARGS))


def test_bound_launch_direct_ints_call_the_kernel():
    """launch.direct: (call, ints), the address and every fixed argument as an int, None where a varying tensor's
    address goes; a caller's own call through it equals the launch."""
    k = tegula.compile(mixed_kernel(), target="c")
    n = 40
    x, i = torch.randint(-1000, 1000, (n,)), torch.randint(-5, 5, (n,), dtype=torch.int32)
    y1, y2 = torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.int64)
    launch = k.bind(x, i, y1, *ARGS, vary=[2, 0])
    call, ints = launch.direct
    assert ints[0] == k.program.direct[1] and [j - 1 for j, a in enumerate(ints) if a is None] == [0, 2]
    assert ints[2] == i.data_ptr() and ints[4:9] == (-7, -(2**40) + 5, 2**32 - 3, -2**31, 2**62) and ints[9] == n
    x = torch.randint(-1000, 1000, (n,))
    launch(y1, x)
    call(*[{1: x.data_ptr(), 3: y2.data_ptr()}.get(j, a) for j, a in enumerate(ints)])
    assert torch.equal(y1, y2) and torch.equal(y1, want(x, i, *ARGS))


def test_float_scalars_launch_through_ctypes():
    n = T.dynamic("n")

    @T.prim_func
    def scale(X: T.Tensor((n,), "float32"), Y: T.Tensor((n,), "float32"), a: T.float32):
        with T.Kernel(1):
            for j in T.Parallel(n):
                Y[j] = X[j] * a
    k = tegula.compile(scale, target="c")
    assert k.program.direct is None
    x, y = torch.randn(9), torch.empty(9)
    k(x, y, 2.0)
    assert torch.equal(y, x * 2.0)


def test_direct_call_only_for_pointer_and_wide_int_signatures():
    f = ctypes.CFUNCTYPE(None)(lambda: None)
    f.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_uint32]
    assert cpu.direct_call(f) is not None
    for t in (ctypes.c_float, ctypes.c_double, ctypes.c_bool, ctypes.c_int8, ctypes.c_uint64):
        f.argtypes = [ctypes.c_void_p, t]
        assert cpu.direct_call(f) is None
    f.argtypes = [ctypes.c_int32] * (cpu.TRAMPOLINE_MAX_ARGS + 1)
    assert cpu.direct_call(f) is None


def test_trampoline_off_by_environment(monkeypatch):
    monkeypatch.setenv("TEGULA_TRAMPOLINE", "0")
    assert cpu._build_trampoline() is None
