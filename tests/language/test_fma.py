"""T.fma: a * b + c rounded once, on every target, equal to an exact (rational) reference."""
from fractions import Fraction

import numpy as np
import pytest

import tegula
import tegula.language as T


def fma_kernel(n, block=64):
    @T.prim_func
    def fma(A: T.Tensor((n,), "float32"), B: T.Tensor((n,), "float32"), C: T.Tensor((n,), "float32"),
            D: T.Tensor((n,), "float32")):
        with T.Kernel(T.ceildiv(n, block)) as bx:
            for i in T.Parallel(block):
                D[bx * block + i] = T.fma(A[bx * block + i], B[bx * block + i], C[bx * block + i])
    return fma


def exact(a, b, c):
    v = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    return np.float32(float(v)) if v == 0 else _round_f32(v)


def _round_f32(v):
    """The float32 nearest to the rational v (ties to even), via float64 neighbours."""
    f = np.float32(float(v))  # float(v) rounds to float64 once; refine against the exact value
    cands = [np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))]
    return min(cands, key=lambda x: (abs(Fraction(float(x)) - v), int(np.frombuffer(x.tobytes(), np.int32)[0]) & 1))


@pytest.mark.parametrize("target", ["c", "interp"])
def test_fma_rounds_once(target):
    rng = np.random.default_rng(0)
    n = 256
    a = rng.standard_normal(n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    c = (-(a.astype(np.float64) * b)).astype(np.float32)  # cancellation: a * b + c is the product's low bits
    c[::2] = rng.standard_normal(n // 2).astype(np.float32)
    # (1 + 2^-23) + 2^-24 - 2^-70: just below a float32 tie, exactly on it once rounded to float64
    a[0], b[0], c[0] = np.float32(2.0 ** -24 * (1 + 2.0 ** -23)), np.float32(1 - 2.0 ** -23), np.float32(1 + 2.0 ** -23)
    a[1], b[1], c[1] = np.float32(3.0), np.float32(1e-30), np.float32(0.0)
    d = np.empty(n, np.float32)
    tegula.compile(fma_kernel(n), target=target)(a, b, c, d)
    want = np.array([exact(x, y, z) for x, y, z in zip(a, b, c)], np.float32)
    assert np.array_equal(d.view(np.int32), want.view(np.int32))
    assert d[0] == np.float32(1 + 2.0 ** -23)  # two roundings (float64, then float32) would give 1 + 2^-22


def test_fma_literals_and_dtypes():
    @T.prim_func
    def k(A: T.Tensor((4,), "bfloat16"), D: T.Tensor((4,), "bfloat16")):
        with T.Kernel(1) as _:
            for i in T.Parallel(4):
                D[i] = T.fma(A[i], 2.0, 1.0)
    assert "fma" in tegula.lower(k, target="c").kernel_source
    with pytest.raises(tegula.CompileError, match="float64"):
        @T.prim_func
        def bad(A: T.Tensor((4,), "float64"), D: T.Tensor((4,), "float64")):
            with T.Kernel(1) as _:
                for i in T.Parallel(4):
                    D[i] = T.fma(A[i], A[i], A[i])
