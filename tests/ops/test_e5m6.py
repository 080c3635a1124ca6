"""The e5m6 kernels (tegula/ops/_e5m6_kernels.py) against the torch references in _quant_ref, bit for bit. The
cast: the codings of a row (e5m6_code_normal, with or without zeros, where every nonzero value scales to at least
2^-14 and the row is finite; e5m6_code elsewhere), the rounding ties at the code's last place, whole chunks and a
partial last one, inputs without a pair-word view. The cast back: every code, both decodes."""
import pytest
import torch
from _quant_ref import assert_equal, ref_cast

from tegula.ops import quant

torch.manual_seed(0)


@pytest.fixture(params=["c", "interp"])
def target(request, monkeypatch):
    monkeypatch.setenv("TEGULA_TARGET", request.param)
    return request.param


def check(x, **kw):
    q, s = quant.per_token_cast_to_e5m6(x, x.shape[1], **kw)
    rq, rs = ref_cast(x, "e5m6", (1, x.shape[1]), round_sf=kw.get("round_sf", False),
                      col_major=kw.get("use_tma_aligned_col_major_sf", False), packed=kw.get("use_packed_ue8m0", False))
    assert_equal(s, rs)
    assert_equal(q, rq)


def float_bits(bits):
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def test_e5m6_float32_bits_and_ties(target):
    # amax 65024 with round_sf: the scale is 1, so the codes are those of the float32 values themselves. Random bit
    # patterns over the normal float16 range, and values exactly at, just below and just above a tie at bit 17 for
    # both parities of the kept bit; rows 0-2 take the normal coding, row 3 (a value below 2^-14) the exact one
    h = 1024 if target == "c" else 64
    lo, hi = 0x38800000, 0x477E0000
    bits = torch.randint(lo, hi, (4, h), dtype=torch.int64)
    ties = torch.randint(lo >> 17, hi >> 17, (h // 8,), dtype=torch.int64) << 17
    bits[1, : h // 8 * 6] = torch.cat([ties + 0x10000, ties + 0xFFFF, ties + 0x10001,
                                       ties + 0x30000, ties + 0x2FFFF, ties + 0x30001]).clamp(max=hi)
    bits[:, 1::3] |= 1 << 31
    bits[2, 5::7] = 0
    bits[2, 6::7] = 1 << 31  # -0
    bits[3] = bits[0]
    bits[3, 9] = 0x387FFFFF  # just below 2^-14: this row codes every value exactly
    x = float_bits(bits.flatten().tolist()).view(4, h)
    x[:, -1] = 65024.0
    check(x, round_sf=True)
    check(x)  # inv = 65024 / 65024 rounded: 1, through the division


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_e5m6_row_kinds(target, dtype):
    # one row of each kind: random; zeros and -0 among them; all zero; all -0; a value 2^-30 below the amax (the
    # exact coding; and its neighbour, whose scaled value is the smallest normal float16: still the normal one);
    # subnormal inputs; inf and -inf; a row of huge values; hidden 520 = one whole 512-value chunk and a partial one
    # (rows with NaN: test_quant.test_row_scale_cast_skips_nan)
    n, h = 10, (520 if target == "c" else 24)
    x = torch.randn(n, h).to(dtype)
    x[1, ::5] = 0.0
    x[1, 1::5] = -0.0
    x[2] = 0.0
    x[3] = -0.0
    x[4, 3], x[4, 7] = 2.0 ** -31, -(2.0 ** -31)  # scaled by 65024 / |x|max (= 2): below 2^-14
    x[4, 0] = 2.0
    x[5, 3], x[5, 0] = 2.0 ** -30, 2.0  # scaled: 2^-30 * 32512 = 2^-15 * 1.984: below 2^-14 too
    x[6, 3], x[6, 0] = 2.0 ** -29 * 1.25, -2.0
    x[7] *= 2.0 ** -130
    x[8, 4], x[8, 9] = float("inf"), float("-inf")
    x[9] *= 2.0 ** 100 if dtype == torch.float32 else 2.0 ** 60
    check(x)
    check(x, round_sf=True)
    check(x, use_tma_aligned_col_major_sf=True, round_sf=True, use_packed_ue8m0=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_e5m6_inputs_without_a_pair_view(target, dtype):
    # an odd row stride, and a start off the pair word's alignment: copied first; an even row stride wider than the
    # row: read in place
    h = 1032 if target == "c" else 16
    big = torch.randn(6, h + 9).to(dtype)
    check(big[:, :h])
    check(big.flatten()[1:1 + 5 * h].view(5, h))
    wide = torch.randn(5, h + 8).to(dtype)
    check(wide[:, 8:])
    check(torch.randn(3, 8).to(dtype))


@pytest.mark.parametrize("daz", [False, True], ids=["plain", "flush_denormal"])
def test_e5m6_cast_back_every_code(target, daz):
    # every 12-bit code (float16 subnormals, inf and NaN included) in rows of 520 (a whole 512-value chunk and a
    # partial one) and 576 values (one chunk), scales from 2^-100 to 2^120 (times 2^112 past float32: the float16
    # decode), one scale per 2 rows; flush_denormal: the thread reads subnormal operands as zero, so every row must
    # take the float16 decode. bf16 NaN is 0x7fc0 (tg_f32_to_bf16's; torch's conversion differs by path)
    from _quant_ref import e5m6_pack, ref_cast_back
    codes = torch.cat([torch.arange(4096), torch.randperm(4096)])
    for h in (520, 576) if target == "c" else (24,):
        n = 2 * (codes.numel() // h // 2 + 1)
        c = codes.repeat(n * h // codes.numel() + 1)[: n * h].view(n, h)
        q = e5m6_pack(c)
        s = torch.tensor([1.0, 2.0 ** -100, 3.7, 2.0 ** 100, 65024.0, 2.0 ** 120])[torch.randint(0, 6, (n // 2, 1))]
        for fmt in ("bf16", "fp32"):
            ref = ref_cast_back(q, s, (2, h), fmt, e5m6=True)
            if daz and not torch.set_flush_denormal(True):
                pytest.skip("no flush-denormal mode on this CPU")
            try:
                out = quant.cast_back_e5m6((q, s), fmt, (2, h))
            finally:
                torch.set_flush_denormal(False)
            nan = torch.isnan(ref)
            assert nan.any() and torch.isnan(out[nan]).all()
            if fmt == "bf16":
                assert (out.view(torch.int16)[nan] == 0x7FC0).all()
                out[nan], ref[nan] = 0.0, 0.0
            assert_equal(out, ref)
