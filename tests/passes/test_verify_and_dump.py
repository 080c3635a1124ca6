"""The verifier (TEGULA_DEBUG=2) and TEGULA_DUMP: every stage is text."""
import os

import pytest

import tegula
import tegula.language as T
from tegula.ir import dtypes as dt
from tegula.ir import expr as E
from tegula.ir import stmt as S
from tegula.ir.buffer import Buffer
from tegula.passes.verify import verify


def add_kernel(N=64):
    @T.prim_func
    def add(A: T.Tensor((N,), "float32"), B: T.Tensor((N,), "float32")):
        with T.Kernel(2) as bx:
            tile = T.alloc_shared((N // 2,), "float32")
            T.copy(A[bx * (N // 2)], tile)
            for i in T.Parallel(N // 2):
                tile[i] = tile[i] + 1.0
            T.copy(tile, B[bx * (N // 2)])
    return add


def test_verifier_accepts_every_stage():
    f = add_kernel()
    verify(f)
    for target in ("interp", "c"):
        verify(tegula.lower(f, target=target).lowered)


def test_verifier_rejects_undefined_variable():
    a = Buffer("A", (4,), dt.float32, "global")
    ghost = E.Var("ghost", dt.int32)
    body = S.Store(a, (ghost,), E.Const(1.0, dt.float32), loc=("k.py", 7))
    with pytest.raises(tegula.CompileError, match="ghost is used before it is defined") as e:
        verify(S.PrimFunc("f", [a], body))
    assert "k.py:7" in str(e.value)


def test_verifier_rejects_dtype_mismatch_in_store():
    a = Buffer("A", (4,), dt.float32, "global")
    body = S.Store(a, (E.Const(0, dt.int32),), E.Const(1, dt.int32))
    with pytest.raises(tegula.CompileError, match="storing int32 into float32"):
        verify(S.PrimFunc("f", [a], body))


@pytest.mark.parametrize("target,ext", [("interp", "py"), ("c", "c")])
def test_dump_writes_every_stage(tmp_path, monkeypatch, target, ext):
    monkeypatch.setenv("TEGULA_DUMP", str(tmp_path))
    low = tegula.lower(add_kernel(32), target=target)
    files = set(os.listdir(tmp_path))
    assert {"add.ir", f"add.{target}.lowered.ir", f"add.{ext}"} <= files
    assert open(tmp_path / f"add.{ext}").read() == low.kernel_source
    assert "copy(" in open(tmp_path / "add.ir").read()


def test_c_source_is_vectorisable_text():
    src = tegula.lower(add_kernel(32), target="c").kernel_source
    assert "#pragma omp simd" in src and "#pragma omp parallel" in src
    assert "void tg_add(" in src
