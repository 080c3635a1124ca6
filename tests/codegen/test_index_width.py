"""Global-memory indices are emitted in 64-bit arithmetic with each summand widened on its own, so that under
-fwrapv a loop variable stays an affine term of the address (contiguous vector loads, not gathers)."""
import numpy as np
import pytest

import tegula
import tegula.language as T


def copy_rows(W=64):
    M, N = T.dynamic("m"), T.dynamic("n")

    @T.prim_func
    def copy_rows(X: T.Tensor((M, N), "float32"), Y: T.Tensor((M, N), "float32")):
        with T.Kernel(T.ceildiv(N, W), M) as (bx, by):
            for j in T.Parallel(W):
                if bx * W + j < N:
                    Y[by, bx * W + j] = X[by, bx * W + j]
    return copy_rows


def test_loop_variable_is_its_own_64bit_term():
    src = tegula.lower(copy_rows(), target="c").kernel_source
    assert "(int64_t)j" in src
    assert "(int64_t)(bx * 64)" in src


@pytest.mark.parametrize("target", ["c", "interp"])
def test_dynamic_copy_values(target):
    k = tegula.compile(copy_rows(), target=target)
    x = np.arange(3 * 100, dtype=np.float32).reshape(3, 100)
    y = np.zeros_like(x)
    k(x, y)
    np.testing.assert_array_equal(x, y)
