"""tegula.ops._bf16_pairs: the word-pair macros against torch's conversions, bit for bit, on every bfloat16 bit
pattern in each half of a word (NaN, inf, subnormals, -0 included), on the c target and the interpreter."""
import pytest
import torch

import tegula
import tegula.language as T
from tegula.ops import _bf16_pairs as P

N = 1 << 16


@pytest.fixture(params=["c", "interp"])
def target(request):
    return request.param


def words():
    """uint32 words whose low halves run over every bf16 pattern and whose high halves do too, in another order."""
    lo = torch.arange(N, dtype=torch.int64)
    hi = (lo * 40503 + 12345) % N
    return ((hi << 16) | lo).to(torch.uint32), lo, hi


def as_float(h):
    """bf16 patterns (int64) as float32."""
    return h.to(torch.int16).view(torch.bfloat16).float()


def bits(f):
    return f.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def test_widen_and_absmax(target):
    w, lo, hi = words()

    @T.prim_func
    def main(X: T.Tensor((N,), "uint32"), E: T.Tensor((N,), "float32"), O: T.Tensor((N,), "float32"),
             M: T.Tensor((N,), "float32"), B: T.Tensor((N,), "uint32")):
        with T.Kernel(N // 1024) as b:
            for i in T.Parallel(1024):
                x = X[b * 1024 + i]
                E[b * 1024 + i] = P.even(x)
                O[b * 1024 + i] = P.odd(x)
                M[b * 1024 + i] = P.abs_max(x, 0.0)
                B[b * 1024 + i] = P.abs_top(x) >> 16

    e, o, m, t = tegula.compile(main, out_idx=[1, 2, 3, 4], target=target)(w)
    fe, fo = as_float(lo), as_float(hi)
    # the widening is exact, NaN payloads included (torch's own conversion may change those: compared as values)
    assert torch.equal(bits(e), lo << 16) and torch.equal(bits(o), hi << 16)
    assert torch.equal(e.nan_to_num(7.0), fe.nan_to_num(7.0))
    assert torch.equal(o.nan_to_num(7.0), fo.nan_to_num(7.0))
    # maxNum of the magnitudes: NaN ignored (0 when both are NaN)
    ref = torch.maximum(*(torch.where(f.isnan(), 0.0, f.abs()) for f in (fe, fo)))
    assert torch.equal(bits(m), bits(ref))
    # integer max of the sign-cleared patterns: the float order, NaN above inf
    assert torch.equal(t.to(torch.int64), torch.maximum(lo & 0x7FFF, hi & 0x7FFF))


def test_bf16_and_e4m3_pairs(target):
    w, lo, hi = words()
    scales = [1.0, 2.0 ** -7, 3.3, 448 / 1.0e-4]

    @T.prim_func
    def main(E: T.Tensor((N,), "float32"), O: T.Tensor((N,), "float32"), X: T.Tensor((N,), "uint32"),
             inv: T.float32, B: T.Tensor((N,), "uint32"), Q: T.Tensor((N,), "uint16"),
             F: T.Tensor((N,), "uint16")):
        with T.Kernel(N // 1024) as b:
            for i in T.Parallel(1024):
                j = b * 1024 + i
                B[j] = P.bf16_pair(E[j] * inv, O[j] * inv)
                Q[j] = P.e4m3_pair(E[j], O[j])
                F[j] = P.e4m3_pair_finite(X[j], inv)

    k = tegula.compile(main, out_idx=[4, 5, 6], target=target)
    fe, fo = as_float(lo), as_float(hi)
    for s in scales:
        # e4m3_pair: |v| < 464 or NaN; e4m3_pair_finite: finite products below 464
        ce = torch.where(fe.abs() * s < 464, fe * s, torch.nan)
        co = torch.where(fo.abs() * s < 464, fo * s, torch.nan)
        ok = ((fe * s).abs() < 464) & ((fo * s).abs() < 464)
        b, q, f = k(ce, co, w, s)
        def bf16(v):  # torch's rounding; a NaN gives 0x7fc0 (the prelude's conversion; torch's may keep the sign)
            return torch.where(v.isnan(), 0x7FC0, bits(v.bfloat16().float()) >> 16)

        rb = bf16(ce * s) | (bf16(co * s) << 16)
        assert torch.equal(b.to(torch.int64), rb)

        def e4m3(v):
            return v.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int64)

        assert torch.equal(q.to(torch.int64), e4m3(ce) | (e4m3(co) << 8))
        rf = e4m3(fe * s) | (e4m3(fo * s) << 8)
        assert ok.sum() > N // 8
        assert torch.equal(f.to(torch.int64)[ok], rf[ok])
