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


def table_lookup():
    N = T.dynamic("n")

    @T.prim_func
    def table_lookup(X: T.Tensor((N,), "int16"), TB: T.Tensor((65536,), "float32"), Y: T.Tensor((N,), "float32")):
        with T.Kernel(T.ceildiv(N, 64)) as b:
            for j in T.Parallel(64):
                if b * 64 + j < N:
                    Y[b * 64 + j] = TB[T.cast(X[b * 64 + j], "int32") + 32768]
    return table_lookup


def test_table_index_from_memory_is_widened_whole():
    """An index that reads memory (a table lookup) is widened after its 32-bit sum, the form gcc 12 gathers from;
    an int16 widened to int32 is known to lie in [-32768, 32767], so the lookup needs no bounds guard."""
    src = tegula.lower(table_lookup(), target="c").kernel_source
    line = next(x for x in src.splitlines() if "TB[" in x)
    assert "TB[(int64_t)((" in line and "+ 32768)]" in line, line
    assert "?" not in line.split("=", 1)[1], line  # no guard select around the load


@pytest.mark.parametrize("target", ["c", "interp"])
def test_table_lookup_values(target):
    x = np.array([-32768, -1, 0, 1, 32767, 5, -7], dtype=np.int16)
    tb = np.arange(65536, dtype=np.float32) * 0.5
    y = np.zeros(x.shape, dtype=np.float32)
    tegula.compile(table_lookup(), target=target)(x, tb, y)
    np.testing.assert_array_equal(y, (x.astype(np.int64) + 32768) * 0.5)


def word_halves_lookup():
    N = T.dynamic("n")

    @T.prim_func
    def word_halves_lookup(X: T.Tensor((N,), "uint32"), TB: T.Tensor((65536,), "float32"),
                           Y: T.Tensor((N, 2), "float32")):
        with T.Kernel(T.ceildiv(N, 64)) as b:
            for j in T.Parallel(64):
                if b * 64 + j < N:
                    w = X[b * 64 + j]
                    Y[b * 64 + j, 0] = TB[(T.reinterpret(w << 16, "int32") >> 16) + 32768]
                    Y[b * 64 + j, 1] = TB[(T.reinterpret(w, "int32") >> 16) + 32768]
    return word_halves_lookup


@pytest.mark.parametrize("target", ["c", "interp"])
def test_word_halves_lookup(target):
    """The halves of a word sign-extended by shifts (an int32 >> 16 lies in [-32768, 32767]) index a table with no
    guard, through a local assigned from a load (widened whole as a load would be)."""
    if target == "c":
        src = tegula.lower(word_halves_lookup(), target="c").kernel_source
        lines = [x for x in src.splitlines() if "TB[" in x]
        assert len(lines) == 2 and all("TB[(int64_t)((" in x and "?" not in x.split("=", 1)[1] for x in lines), lines
    x = np.array([0x00000000, 0xFFFF8000, 0x7FFF0001, 0x80001234], dtype=np.uint32)
    tb = np.arange(65536, dtype=np.float32)
    y = np.zeros((4, 2), dtype=np.float32)
    tegula.compile(word_halves_lookup(), target=target)(x, tb, y)
    lo, hi = (x & 0xFFFF).astype(np.int64), (x >> 16).astype(np.int64)
    np.testing.assert_array_equal(y, np.stack([(lo ^ 0x8000), (hi ^ 0x8000)], 1).astype(np.float32))


def rows_at_loaded_offsets():
    N, M = T.dynamic("n"), T.dynamic("m")

    @T.prim_func
    def rows_at_loaded_offsets(X: T.Tensor((N,), "float32"), Off: T.Tensor((M,), "int32"),
                               Y: T.Tensor((M, 64), "float32")):
        with T.Kernel(M) as b:
            base = Off[b]
            for j in T.Parallel(64):
                Y[b, j] = X[base + j]
    return rows_at_loaded_offsets


def test_loaded_base_plus_loop_variable_stays_split():
    """A row read from a loaded offset (``X[base + j]``) keeps j its own 64-bit term (contiguous vector loads; the
    whole-widened form of a table lookup made gcc gather it element by element: topk's 1M-key rows took 10x)."""
    src = tegula.lower(rows_at_loaded_offsets(), target="c").kernel_source
    line = next(x for x in src.splitlines() if "Y[" in x and "X[" in x)
    assert "X[((int64_t)base + (int64_t)j)]" in line, line
