"""read_gathered_rows (c target): gemms read a tile gathered one row copy at a time from where the rows lie (a table of
row addresses, tg_gemm_<dt>_rows), the copy kept for rows outside the tensor and the zeroed rows read from the
tile. It may not change a result: each kernel runs on c with and without the pass (bit for bit: the same packed
panels) and on interp; the generated source shows which form was chosen."""
import pytest
import torch

import tegula
import tegula.language as T
import tegula.passes.pipeline as pipeline
from tegula.passes import read_gathered_rows
from tegula.passes.verify import verify


def gathered(M, R, W, dv, variant=None):
    """S = Q K^T and O = S K[:, :dv] over a tile K of R rows X[Idx[i]] (zeros where Idx[i] < 0), as a sparse
    attention step gathers its keys; variants break one condition of the pass each."""

    @T.prim_func
    def main(X: T.Tensor((T.dynamic("n"), W), "bfloat16"), Idx: T.Tensor((R,), "int32"),
             Q: T.Tensor((M, W), "bfloat16"), S: T.Tensor((M, R), "float32"), O: T.Tensor((M, dv), "float32")):
        with T.Kernel(1) as bx:
            Q_s = T.alloc_shared((M, W), "bfloat16")
            K_s = T.alloc_shared((R, W), "bfloat16")
            P_s = T.alloc_shared((M, R), "bfloat16")
            s = T.alloc_fragment((M, R), "float32")
            o = T.alloc_fragment((M, dv), "float32")
            T.copy(Q, Q_s)
            for i in T.serial(R):
                r = Idx[i]
                if r >= 0:
                    T.copy(X[r, 0:W], K_s[i, :])
                else:
                    for j in T.Parallel(W):
                        K_s[i, j] = T.cast(0, "bfloat16")
            if variant == "zero_after":   # a store to the tile after the gather: the tile is not the rows
                K_s[0, 0] = T.cast(0, "bfloat16")
            if variant == "as_a":
                T.gemm(K_s, Q_s, s[0:R, 0:M], transpose_B=True, clear_accum=True)
            else:
                T.gemm(Q_s, K_s, s, transpose_B=True, clear_accum=True)
            T.copy(s, P_s)
            T.gemm(P_s, K_s[:, 0:dv], o, clear_accum=True)
            if variant == "read":   # the tile read elementwise too
                for a, b in T.Parallel(M, dv):
                    o[a, b] += T.cast(K_s[0, b], "float32")
            T.copy(s, S)
            T.copy(o, O)
    return main


def _run(prim, target, x, idx, q, M, R, dv):
    s, o = torch.zeros(M, R), torch.zeros(M, dv)
    tegula.compile(prim, target=target)(x, idx, q, s, o)
    return s, o


def _without_pass(monkeypatch):
    cpu = [p for p in pipeline.PIPELINES["cpu"] if p is not read_gathered_rows.run]
    monkeypatch.setitem(pipeline.PIPELINES, "cpu", cpu)


@pytest.mark.parametrize("M,R,W,dv", [(16, 64, 96, 64), (40, 32, 200, 130), (64, 64, 576, 512)])
def test_rows_read_in_place_agree(M, R, W, dv, monkeypatch):
    prim = gathered(M, R, W, dv)
    low = tegula.lower(prim, target="c")
    verify(low.lowered)
    assert low.kernel_source.count("tg_gemm_bf16_rows(") == 2
    torch.manual_seed(0)
    n = 300
    x = torch.randn(n, W).bfloat16()
    x[7] = float("nan")   # never named: a row read in place is only the rows Idx names
    idx = torch.randint(0, n, (R,), dtype=torch.int32)
    idx[idx == 7] = 8
    idx[3], idx[5] = -1, n + 4   # a zeroed row; a row past the tensor (the copy's zeros)
    q = torch.randn(M, W).bfloat16()
    with_pass = _run(prim, "c", x, idx, q, M, R, dv)
    ref = _run(prim, "interp", x, idx, q, M, R, dv)
    _without_pass(monkeypatch)
    staged = _run(gathered(M, R, W, dv), "c", x, idx, q, M, R, dv)
    for a, b, c in zip(with_pass, staged, ref):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-3)
    assert (with_pass[0][:, 5] == 0).all() and (with_pass[0][:, 3] == 0).all()


@pytest.mark.parametrize("variant", ["zero_after", "as_a", "read"])
def test_tile_kept_when_not_only_the_rows(variant):
    prim = gathered(64, 64, 96, 64, variant)
    src = tegula.lower(prim, target="c").kernel_source
    assert "_rows(" not in src
    torch.manual_seed(1)
    x = torch.randn(100, 96).bfloat16()
    idx = torch.randint(-1, 100, (64,), dtype=torch.int32)
    q = torch.randn(64, 96).bfloat16()
    for a, b in zip(_run(prim, "c", x, idx, q, 64, 64, 64), _run(prim, "interp", x, idx, q, 64, 64, 64)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-3)


def test_tile_kept_for_many_rows_and_the_dot_path():
    """128 rows of C (measured slower in place) and 8 rows (the dot path reads its B in place already)."""
    for m in (128, 8):
        assert "_rows(" not in tegula.lower(gathered(m, 64, 576, 64), target="c").kernel_source
