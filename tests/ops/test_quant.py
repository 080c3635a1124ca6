"""tegula.ops.quant against plain torch references (tests/ops/_quant_ref.py): every output compared bit for bit,
with its strides; round trips pass the rounding-bias check. The c target runs TileKernels' shapes scaled down
(tokens 0, 1, 4001; hidden 576, 2048, 7168), interp tiny ones; the option combinations are spread over the cases
so that each compiled kernel is built once."""
import pytest
import torch
from _quant_ref import (
    assert_equal,
    check_bias,
    e2m1_decode,
    e2m1_encode,
    e5m6_decode,
    fma,
    layout,
    ref_cast,
    ref_cast_back,
    sigmoid,
    silu,
)

from tegula.ops import quant

torch.manual_seed(0)


@pytest.fixture(params=["c", "interp"])
def target(request, monkeypatch):
    monkeypatch.setenv("TEGULA_TARGET", request.param)
    return request.param


def rows(target, big):
    return big if target == "c" else min(big, 5)


def randn(n, h, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(n, h) * scale).to(dtype)


def sf_opts(kind):
    """TileKernels' two scale configurations, plus plain float32 (not rounded)."""
    return {"plain": dict(), "round": dict(round_sf=True),
            "ue8m0": dict(use_tma_aligned_col_major_sf=True, round_sf=True, use_packed_ue8m0=True),
            "colmajor": dict(use_tma_aligned_col_major_sf=True, round_sf=True)}[kind]


def ref_opts(kw):
    return dict(round_sf=kw.get("round_sf", False), col_major=kw.get("use_tma_aligned_col_major_sf", False),
                packed=kw.get("use_packed_ue8m0", False))


# per-token casts ---------------------------------------------------------------------------------------------------

PER_TOKEN = [  # (tokens, hidden, dtype, fmt, num_per_channels, scales)
    (4001, 576, torch.bfloat16, "e4m3", 128, "plain"),
    (4001, 2048, torch.float32, "e4m3", 32, "ue8m0"),
    (1, 7168, torch.bfloat16, "e2m1", 32, "round"),
    (257, 576, torch.float32, "e2m1", 128, "ue8m0"),
    (33, 2048, torch.bfloat16, "e4m3", 64, "colmajor"),
    (0, 576, torch.bfloat16, "e4m3", 16, "ue8m0"),
    (64, 7168, torch.bfloat16, "e4m3", 7168, "plain"),
    (129, 2048, torch.float32, "e2m1", 2048, "ue8m0"),
    (65, 7168, torch.bfloat16, "e4m3", 128, "plain"),  # blocks of 1792 columns (14 groups; quant._width)
    (65, 7168, torch.bfloat16, "e4m3", 128, "ue8m0"),  # packed scales: blocks of 1024 (8 groups, 2 words)
]


@pytest.mark.parametrize("case", PER_TOKEN, ids=lambda c: "-".join(str(v).replace("torch.", "") for v in c))
def test_per_token_cast(target, case):
    n, h, dtype, fmt, g, sfk = case
    x = randn(rows(target, n), h, dtype, scale=3.0)
    kw = sf_opts(sfk)
    q, s = quant.per_token_cast(x, fmt, g, **kw)
    rq, rs = ref_cast(x, fmt, (1, g), **ref_opts(kw))
    assert_equal(s, rs)
    assert_equal(q, rq)
    check_bias(ref_cast_back(q, s, (1, g), "fp32"), x.float())


@pytest.mark.parametrize("sfk", ["plain", "round", "ue8m0"])
def test_per_token_cast_e4m3_infinities(target, sfk):
    """Rows holding +-inf have amax inf: inv 0 (plain: zeros, NaN codes where x is inf) or -inf (round_sf: +-448,
    a NaN code where x is 0). The kernel's cast without saturation (values within 448) must not take those blocks
    under round_sf; whole 2048-column blocks on c, so both paths run."""
    x = randn(rows(target, 6), 2048, scale=3.0)
    x[1, 5], x[2, 700], x[3, 0], x[3, 1], x[4, 2047] = float("inf"), float("-inf"), 0.0, float("inf"), -1e30
    kw = sf_opts(sfk)
    q, s = quant.per_token_cast(x, "e4m3", 128, **kw)
    rq, rs = ref_cast(x, "e4m3", (1, 128), **ref_opts(kw))
    assert_equal(s, rs)
    assert_equal(q, rq)
    nan_at = (3, 1) if sfk == "plain" else (3, 0)  # inf * 0, or 0 * -inf: the cases above do arise
    assert int(q.view(torch.uint8)[nan_at]) & 0x7F == 0x7F


def test_per_token_cast_strided_rows_and_modes(target):
    n = rows(target, 401)
    base = randn(n, 2 * 2048)
    x = base[:, 100:100 + 2048]  # row stride 4096 > hidden
    assert x.stride() == (4096, 1)
    q, s = quant.per_token_cast(x, "e4m3", 128, round_sf=True)
    rq, rs = ref_cast(x.contiguous(), "e4m3", (1, 128), round_sf=True)
    assert_equal(q, rq)
    assert_equal(s, rs)
    assert_equal(quant.per_token_cast_with_sf_only(x, "e4m3", 128, round_sf=True), rs)
    plain_sf = ref_cast(x.contiguous(), "e4m3", (1, 128))[1]
    assert_equal(quant.per_token_cast_with_precomputed_sf(x, "e4m3", 128, plain_sf),
                 ref_cast(x.contiguous(), "e4m3", (1, 128), sf=plain_sf)[0])


@pytest.mark.parametrize("fmt,g,sfk,h", [("e4m3", 128, "plain", 2048), ("e4m3", 128, "round", 1000),
                                         ("e4m3", 64, "ue8m0", 2048), ("e4m3", 16, "colmajor", 1000),
                                         ("e2m1", 32, "round", 2048), ("e2m1", 16, "plain", 1000),
                                         ("e4m3", 16, "ue8m0", 16384), ("e2m1", 32, "colmajor", 2048)])
def test_per_token_cast_bf16_pairs_and_elementwise_agree(target, monkeypatch, fmt, g, sfk, h):
    """bf16 rows are read as uint32 words of two elements (K.per_token_pairs) where that view exists, element by
    element (K.per_token_cast) where it does not: here a start 2 bytes off 4-byte alignment. Both give the same
    bits on rows holding NaN, +-inf, bf16 subnormals and -0 (tiles with neither NaN nor inf take the integer amax
    and, for e4m3, the cast without the NaN select; the others the full path), and the reference's where it is
    defined (it spreads a NaN into its row's scale). 1000 columns: the last tile of each row is partial.
    Column-major scales take blocks of 16 rows (9 rows: one partial block) that stage their scales, or write them
    per tile where a row has more groups than they stage (16384 / 16)."""
    from tegula.ops import _tk

    used = []
    kernel = _tk.kernel
    monkeypatch.setattr(_tk, "kernel", lambda f, *a: used.append(f.__name__) or kernel(f, *a))
    n = rows(target, 9)
    x = randn(n, h, scale=3.0)
    x[0, 5], x[0, h - 2], x[1, 7], x[2, h - 1], x[3, 3] = float("nan"), -float("nan"), float("inf"), -float("inf"), -0.0
    x[3, 64:300] = torch.linspace(-1e-39, 1e-39, 236)  # bf16 subnormals (and a few zeros)
    x[4, :g] = 2.0 ** -133  # a group of subnormals only: its amax clamps
    buf = torch.empty(n, h + 2, dtype=torch.bfloat16)
    buf[:, 1:h + 1] = x
    odd = buf[:, 1:h + 1]  # starts 2 bytes into a 4-byte word
    kw = sf_opts(sfk)
    q, s = quant.per_token_cast(x, fmt, g, **kw)
    q2, s2 = quant.per_token_cast(odd, fmt, g, **kw)
    assert used == ["per_token_pairs", "per_token_cast"]
    assert_equal(q, q2)
    assert_equal(s, s2)
    rq, rs = ref_cast(x[1:], fmt, (1, g), **ref_opts(kw))
    assert_equal(q[1:], rq)
    if sfk in ("plain", "round"):
        assert_equal(s[1:], rs)


REQUANT = [  # (input fmt, input block, input scales, output fmt, num_per_channels)
    ("e4m3", (128, 128), "round", "e4m3", 128),
    ("e2m1", (32, 32), "ue8m0", "e4m3", 128),
    ("e4m3", (32, 32), "colmajor", "e2m1", 32),
    ("e4m3", (1, 128), "plain", "e4m3", 32),  # an input scale spans 4 output groups
]


@pytest.mark.parametrize("case", REQUANT, ids=lambda c: "-".join(map(str, c)))
def test_per_token_cast_requantises(target, case):
    in_fmt, xb, sfk, fmt, g = case
    x = randn(rows(target, 300), 576)
    kw = sf_opts(sfk)
    qin = ref_cast(x, in_fmt, xb, **ref_opts(kw))
    q, s = quant.per_token_cast(qin, fmt, g, x_block_size=xb, round_sf=True)
    rq, rs = ref_cast(qin, fmt, (1, g), x_block=xb, round_sf=True)
    assert_equal(s, rs)
    assert_equal(q, rq)


@pytest.mark.parametrize("daz", [False, True], ids=["plain", "flush_denormal"])
def test_per_token_cast_requantises_every_e4m3_code(target, daz):
    # every e4m3 code but NaN (0 in their place) in whole 512-column tiles, decoded by a multiply
    # (_quant_kernels.e4m3_value); flush_denormal: the thread reads subnormal operands as zero, so the kernel must
    # take the plain decode (512 rows: this thread runs some of the blocks whatever the thread count)
    n = rows(target, 512)
    codes = torch.arange(256, dtype=torch.int32).repeat(2 * n).view(n, 512)[:, torch.randperm(512)]
    codes[(codes & 0x7F) == 0x7F] = 0
    q = codes.to(torch.uint8).view(torch.float8_e4m3fn)
    s = torch.tensor([1.0, 0.125, 3.0, 2.0 ** -20])[torch.randint(0, 4, (n, 4))]
    rq, rs = ref_cast((q, s), "e4m3", (1, 128), x_block=(1, 128))
    if daz and not torch.set_flush_denormal(True):
        pytest.skip("no flush-denormal mode on this CPU")
    try:
        q2, s2 = quant.per_token_cast((q, s), "e4m3", 128, x_block_size=(1, 128))
    finally:
        torch.set_flush_denormal(False)
    assert_equal(s2, rs)
    assert_equal(q2, rq)


def test_e2m1_codes_round_to_nearest_even(target):
    # the ties between neighbouring codes, just below and above them, and specials
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    v = torch.cat([ties, ties.nextafter(torch.tensor(0.0)), ties.nextafter(torch.tensor(9.0)), -ties,
                   torch.tensor([0.0, -0.0, 6.0, -6.0, 1e-40, -1e-40])])
    x = torch.zeros(2, 128)
    x[0, :v.numel()] = v
    x[0, -1] = 6.0  # amax 6: the scale is 1, the values are cast as they are
    q, s = quant.per_token_cast(x, "e2m1", 128)
    assert s[0, 0] == 1.0
    codes = torch.stack([q.view(torch.uint8) & 15, q.view(torch.uint8) >> 4], -1).view(2, 128)
    assert torch.equal(codes[0], e2m1_encode(x[0]).to(torch.uint8))
    assert torch.equal(e2m1_decode(q)[0, :7], torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]))


def test_per_token_cast_bf16_odd_columns_or_row_stride(target, monkeypatch):
    """No words view (an odd column count, an odd row stride): the element-wise kernel, equal to the reference."""
    from tegula.ops import _tk

    used = []
    kernel = _tk.kernel
    monkeypatch.setattr(_tk, "kernel", lambda f, *a: used.append(f.__name__) or kernel(f, *a))
    n = rows(target, 9)
    base = randn(n, 1000, scale=3.0)
    for x in (base[:, :999], base[:, 1:]):  # 999 columns (row stride 1000); 999 columns starting one element in
        q, s = quant.per_token_cast(x, "e4m3", 128, round_sf=True)
        rq, rs = ref_cast(x.contiguous(), "e4m3", (1, 128), round_sf=True)
        assert_equal(q, rq)
        assert_equal(s, rs)
    x = randn(n, 1001)[:, :1000]  # even columns, odd row stride (1001 elements)
    assert x.stride(0) % 2 == 1
    q, s = quant.per_token_cast(x, "e4m3", 128)
    assert_equal(q, ref_cast(x.contiguous(), "e4m3", (1, 128))[0])
    assert used == ["per_token_cast"] * 3


def test_e2m1_pair_finite_equals_the_code_pair(target):
    """_quant_pairs._e2m1_pair_finite (the pair kernel's e2m1 byte for tiles with neither NaN nor inf: signs taken
    from the bf16 word, odd's code shifted by a sum) against e2m1_code of each product, on every finite bf16 in
    each half of a word and several positive scales (ties, subnormals, -0, saturation)."""
    import tegula
    import tegula.language as T
    from tegula.ops._quant_kernels import e2m1_code
    from tegula.ops._quant_pairs import _e2m1_pair_finite

    n = 1 << 16
    lo = torch.arange(n, dtype=torch.int64)
    hi = (lo * 40503 + 12345) % n
    w = ((hi << 16) | lo).to(torch.uint32)

    @T.prim_func
    def main(X: T.Tensor((n,), "uint32"), inv: T.float32, A: T.Tensor((n,), "uint32"), B: T.Tensor((n,), "uint32")):
        with T.Kernel(n // 1024) as b:
            for i in T.Parallel(1024):
                x = X[b * 1024 + i]
                A[b * 1024 + i] = _e2m1_pair_finite(x, inv)
                B[b * 1024 + i] = T.cast(e2m1_code(T.reinterpret(x << 16, "float32") * inv)
                                         | (e2m1_code(T.reinterpret(x & 0xFFFF0000, "float32") * inv) << 4), "uint32")

    finite = ((lo & 0x7F80) != 0x7F80) & ((hi & 0x7F80) != 0x7F80)
    k = tegula.compile(main, out_idx=[2, 3], target=target)
    for inv in (1.0, 2.0 ** -7, 3.3, 6.0 / 1e-30):
        a, b = k(w, inv)
        assert torch.equal(a[finite], b[finite])


# e5m6 --------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,sfk", [(torch.float32, "plain"), (torch.bfloat16, "ue8m0")])
def test_e5m6_round_trip(target, dtype, sfk):
    n, h = rows(target, 129), 576
    kw = sf_opts(sfk)
    specials = (None, 2.0 ** -20, 2.0 ** -14 * 63 / 64, 2.0 ** -14, "sub")  # min / max subnormal, min normal
    for v in specials:
        if v == "sub":  # the whole float16 subnormal range, rounding on bits that truncation drops
            x = (randn(n, h, torch.float32) * 2.0 ** -18).to(dtype)
            x[:, -1] = 65024.0
            xi = x.clone()  # rows with +-inf: a scale of inf, NaN codes (not dequantised: NaN's bf16 bits differ)
            xi[1, 5], xi[2, 7] = float("inf"), float("-inf")
            q, s = quant.per_token_cast(xi, "e5m6", h, **kw)
            rq, rs = ref_cast(xi, "e5m6", (1, h), **ref_opts(kw))
            assert_equal(q, rq)
            assert_equal(s, rs)
        else:
            x = randn(n, h, dtype) if v is None else torch.full((n, h), v, dtype=dtype)
        if v is not None and v != "sub":
            x[:, -1] = 65024.0
        q, s = quant.per_token_cast(x, "e5m6", h, **kw)
        rq, rs = ref_cast(x, "e5m6", (1, h), **ref_opts(kw))
        assert_equal(q, rq)
        assert_equal(s, rs)
        for fmt in ("bf16", "fp32"):
            assert_equal(quant.cast_back((q, s), fmt, (1, h), x_special_fmt="e5m6"),
                         ref_cast_back(q, s, (1, h), fmt, e5m6=True))
    back = e5m6_decode(q) * (s.float() if s.dtype == torch.float32 else 1.0)
    assert back.shape == (n, h)


@pytest.mark.parametrize("fmt", ["e5m6", "e4m3"])
def test_row_scale_cast_skips_nan(target, fmt):
    """One scale per row: the row's amax skips NaN (the kernels' max; NaNs in whole 128-column chunks and in the
    partial last one), so a row with NaNs gets the scale and the other codes of the same row with those zeroed."""
    n, h = 4, 576
    x = randn(n, h, scale=3.0)
    x[1, 5], x[2, 570], x[3, 0] = float("nan"), float("nan"), float("nan")
    x[3, 1:] = float("nan")
    x[0, 9], x[0, 128 + 9] = 1000.0, float("nan")  # a NaN after the row's largest value, in its column of a chunk
    z = torch.nan_to_num(x, nan=0.0)
    q, s = quant.per_token_cast(x, fmt, h)
    qz, sz = quant.per_token_cast(z, fmt, h)
    assert_equal(s, sz)
    rq, rs = ref_cast(z, fmt, (1, h))
    assert_equal(sz, rs)
    assert_equal(qz, rq)
    if fmt == "e5m6":
        codes, codes_z = e5m6_decode(q), e5m6_decode(qz)
        nan = torch.isnan(x)
        assert torch.isnan(codes[nan]).all()
        assert_equal(codes[~nan], codes_z[~nan])
    else:
        nan = torch.isnan(x)
        qb, qzb = q.view(torch.uint8), qz.view(torch.uint8)
        assert ((qb[nan] & 0x7F) == 0x7F).all()
        assert_equal(qb[~nan], qzb[~nan])


# per-block and per-channel --------------------------------------------------------------------------------------

PER_BLOCK = [  # (tokens, hidden, dtype, fmt, block, scales)
    (4001, 576, torch.bfloat16, "e4m3", (128, 128), "plain"),
    (300, 2048, torch.float32, "e2m1", (32, 32), "ue8m0"),
    (257, 576, torch.bfloat16, "e4m3", (32, 128), "colmajor"),
    (70, 200, torch.float32, "e2m1", (32, 32), "plain"),  # a partial last group and a masked last vector
    (300, 1024, torch.bfloat16, "e4m3", (128, 128), "plain"),  # whole bands cast in place, and a partial one
    (96, 2048, torch.bfloat16, "e4m3", (32, 32), "round"),  # whole bands of 32 x 32 blocks cast in place
]


@pytest.mark.parametrize("case", PER_BLOCK, ids=lambda c: "-".join(str(v).replace("torch.", "") for v in c))
def test_per_block_cast(target, case):
    n, h, dtype, fmt, block, sfk = case
    x = randn(rows(target, n), h, dtype)
    kw = sf_opts(sfk)
    q, s = quant.per_block_cast(x, fmt, block, **kw)
    rq, rs = ref_cast(x, fmt, block, **ref_opts(kw))
    assert_equal(s, rs)
    assert_equal(q, rq)
    check_bias(ref_cast_back(q, s, block, "fp32"), x.float())
    if sfk == "plain":
        assert_equal(quant.per_block_cast_with_sf_only(x, fmt, block), rs)
        assert_equal(quant.per_block_cast_with_precomputed_sf(x, fmt, block, rs), ref_cast(x, fmt, block, sf=rs)[0])


@pytest.mark.parametrize("block,sfk,shape", [((128, 128), "plain", (300, 1024)), ((32, 128), "round", (96, 576)),
                                             ((32, 32), "ue8m0", (70, 2048))])
def test_per_block_cast_bf16_pairs_and_elementwise_agree(target, monkeypatch, block, sfk, shape):
    """As for per_token_cast: K.per_block_pairs where the bf16 words view exists, K.per_block_cast where it does
    not (a start 2 bytes off 4-byte alignment), bit-equal on bands holding NaN, +-inf, subnormals and -0, whole
    and partial (rows past the last whole band; 576 columns: a partial last group), and equal to the reference
    away from the NaN's band."""
    from tegula.ops import _tk

    used = []
    kernel = _tk.kernel
    monkeypatch.setattr(_tk, "kernel", lambda f, *a: used.append(f.__name__) or kernel(f, *a))
    n, h = shape
    x = randn(n, h, scale=3.0)
    bt = block[0]
    x[0, 5], x[bt, 7], x[bt + 1, h - 1], x[n - 1, 3] = float("nan"), float("inf"), -float("inf"), -0.0
    x[n - 1, 64:300] = torch.linspace(-1e-39, 1e-39, 236)
    flat = torch.empty(n * h + 1, dtype=torch.bfloat16)
    odd = flat[1:].view(n, h)  # contiguous, 2 bytes off a 4-byte word
    odd.copy_(x)
    kw = sf_opts(sfk)
    q, s = quant.per_block_cast(x, "e4m3", block, **kw)
    q2, s2 = quant.per_block_cast(odd, "e4m3", block, **kw)
    assert used == ["per_block_pairs", "per_block_cast"]
    assert_equal(q, q2)
    assert_equal(s, s2)
    rq = ref_cast(x[bt:], "e4m3", block, **ref_opts(kw))[0]
    assert_equal(q[bt:], rq)


@pytest.mark.parametrize("round_sf,hidden", [(False, 576), (True, 128)])
def test_per_channel_cast_bf16_pairs_and_elementwise_agree(target, monkeypatch, round_sf, hidden):
    """K.per_channel_pairs where the bf16 words view exists (hidden a multiple of 64), K.per_channel_cast where it
    does not (a start 2 bytes off 4-byte alignment): bit-equal on a band holding NaN, +-inf, subnormals and -0 and
    on clean bands, and equal to the reference away from the NaN's band."""
    from tegula.ops import _tk

    used = []
    kernel = _tk.kernel
    monkeypatch.setattr(_tk, "kernel", lambda f, *a: used.append(f.__name__) or kernel(f, *a))
    n = 384 if target == "c" else 256
    x = randn(n, hidden, scale=3.0)
    x[0, 5], x[130, 7], x[131, hidden - 1], x[n - 1, 3] = float("nan"), float("inf"), -float("inf"), -0.0
    x[n - 1, 10:100] = torch.linspace(-1e-39, 1e-39, 90)
    flat = torch.empty(n * hidden + 1, dtype=torch.bfloat16)
    odd = flat[1:].view(n, hidden)  # contiguous, 2 bytes off a 4-byte word
    odd.copy_(x)
    q, s = quant.per_channel_cast(x, "e4m3", 128, round_sf=round_sf)
    q2, s2 = quant.per_channel_cast(odd, "e4m3", 128, round_sf=round_sf)
    assert used == ["per_channel_pairs", "per_channel_cast"]
    assert_equal(q, q2)
    assert_equal(s, s2)
    rq, rs = ref_cast(x[128:], "e4m3", (128, 1), round_sf=round_sf)
    assert_equal(q[128:], rq)
    assert_equal(s[1:], rs)


@pytest.mark.parametrize("round_sf,hidden,dtype", [(False, 576, torch.bfloat16), (True, 576, torch.bfloat16),
                                                   (False, 200, torch.float32),  # 200: a partly masked last row
                                                   (True, 256, torch.float32)])
def test_per_channel_cast(target, round_sf, hidden, dtype):
    x = randn(128 * (2 if target == "c" else 1), hidden if target == "c" else 130, dtype)
    q, s = quant.per_channel_cast(x, "e4m3", 128, round_sf)
    rq, rs = ref_cast(x, "e4m3", (128, 1), round_sf=round_sf)
    assert_equal(s, rs)
    assert_equal(q, rq)
    check_bias(ref_cast_back(q, s, (128, 1), "fp32"), x.float())


@pytest.mark.parametrize("kind", ["block plain", "block round", "channel plain", "channel round"])
def test_block_and_channel_cast_infinities(target, kind):
    """+-inf in a scaling block: inv 0 (plain) or -inf (round_sf, where the c kernels must keep the full cast:
    +-448, and a NaN code for 0 * -inf); whole 128-row bands on c."""
    op, sfk = kind.split()
    x = randn(256 if target == "c" else (128 if op == "channel" else 5), 256 if target == "c" else 130, scale=3.0)
    x[1, 5], x[2, 9], x[3, 5], x[4, 120] = float("inf"), float("-inf"), 0.0, 1e30
    if op == "block":
        q, s = quant.per_block_cast(x, "e4m3", (128, 128), **sf_opts(sfk))
        rq, rs = ref_cast(x, "e4m3", (128, 128), **ref_opts(sf_opts(sfk)))
    else:
        q, s = quant.per_channel_cast(x, "e4m3", 128, sfk == "round")
        rq, rs = ref_cast(x, "e4m3", (128, 1), round_sf=sfk == "round")
    assert_equal(s, rs)
    assert_equal(q, rq)


def test_e4m3_in_range_equals_the_full_cast():
    # _quant_kernels.e4m3_in_range against the prelude's saturating cast on every float32 with the low 12 bits in
    # {0, 1, 0x7ff, 0x800, 0x801, 0xfff} (ties, sticky bits, every exponent and sign) below 464 in magnitude, NaN
    # included (c target: the emitted narrowing is what it is about)
    import tegula
    import tegula.language as T
    from tegula.ops._quant_kernels import e4m3_in_range

    hi = torch.arange(1 << 20, dtype=torch.int64) << 12
    bits = (hi[:, None] | torch.tensor([0, 1, 0x7FF, 0x800, 0x801, 0xFFF])).flatten()
    v = (bits - ((bits >= 1 << 31).long() << 32)).to(torch.int32).view(torch.float32)
    v = v[~(v.abs() >= 464)]  # keeps NaN
    n = v.numel()

    @T.prim_func
    def main(X: T.Tensor((n,), "float32"), A: T.Tensor((n,), "float8_e4m3fn"), B: T.Tensor((n,), "float8_e4m3fn")):
        with T.Kernel(T.ceildiv(n, 4096)) as b:
            for i in T.Parallel(4096):
                if b * 4096 + i < n:
                    A[b * 4096 + i] = e4m3_in_range(X[b * 4096 + i])
                    B[b * 4096 + i] = T.cast(X[b * 4096 + i], "float8_e4m3fn")

    a, b = tegula.compile(main, out_idx=[1, 2], target="c")(v)
    assert_equal(a, b)


# back to floats -------------------------------------------------------------------------------------------------

CAST_BACK = [  # (fmt, out, block, scales)
    ("e4m3", "bf16", (1, 128), "plain"),
    ("e2m1", "fp32", (1, 32), "ue8m0"),
    ("e4m3", "fp32", (128, 128), "round"),
    ("e4m3", "bf16", (128, 1), "plain"),
    ("e4m3", "fp32", (1, 2048), "ue8m0"),
]


@pytest.mark.parametrize("case", CAST_BACK, ids=lambda c: "-".join(map(str, c)))
def test_cast_back(target, case):
    fmt, out, block, sfk = case
    x = randn(rows(target, 1000), 2048)
    q, s = ref_cast(x, fmt, block, **ref_opts(sf_opts(sfk)))
    y = quant.cast_back((q, s), out, block)
    assert_equal(y, ref_cast_back(q, s, block, out))
    if block[0] == 1:
        assert_equal(quant.per_token_cast_back((q, s), out, block[1]), y)


def test_cast_back_partial_tile(target):
    # hidden 640: a whole 512-column tile (cast in one pass) and a partial one (masked) in each row
    x = randn(rows(target, 37), 640)
    q, s = ref_cast(x, "e4m3", (1, 128))
    assert_equal(quant.cast_back((q, s), "bf16", (1, 128)), ref_cast_back(q, s, (1, 128), "bf16"))


def _cast_back_flushing(q, s, out, daz):
    """quant.cast_back((q, s), out, (1, 128)), this thread flushing subnormal operands (DAZ) where ``daz`` (the test
    skipped where the CPU has no such mode)."""
    if daz and not torch.set_flush_denormal(True):
        pytest.skip("no flush-denormal mode on this CPU")
    try:
        return quant.cast_back((q, s), out, (1, 128))
    finally:
        torch.set_flush_denormal(False)


@pytest.mark.parametrize("out", ["bf16", "fp32"])
@pytest.mark.parametrize("daz", [False, True], ids=["plain", "flush_denormal"])
def test_cast_back_every_e4m3_code(target, out, daz):
    # every e4m3 code (subnormals, +-0, NaN 0x7f / 0xff) in whole 512-column tiles, scales whose products stay
    # normal. flush_denormal: this thread treats subnormal operands as zero (DAZ), where the decode by a multiply
    # (_quant_kernels.e4m3_value) reads the subnormal codes as 0: the kernel must see it and take the plain decode
    # (512 rows: this thread runs some of the blocks whatever the thread count)
    n = rows(target, 512)
    codes = torch.arange(256, dtype=torch.int32).repeat(2 * n).view(n, 512)
    codes = codes[:, torch.randperm(512)].to(torch.uint8)
    q = codes.view(torch.float8_e4m3fn)
    s = torch.tensor([1.0, 0.125, 0.7, 3000.0, 2.0 ** -20, 1.5e30])[torch.randint(0, 6, (n, 4))]
    ref = ref_cast_back(q, s, (1, 128), out)
    y = _cast_back_flushing(q, s, out, daz)
    nan = (codes & 0x7F) == 0x7F
    assert_equal(y[~nan], ref[~nan])
    assert y[nan].isnan().all()
    if target == "c":  # the prelude's NaNs: bf16 0x7fc0 (tg_f32_to_bf16), float32 +-0x7ff00000 (tg_f8e4m3_to_f32)
        bits = y.view(torch.int16 if out == "bf16" else torch.int32)[nan]
        want = torch.where(codes[nan] >= 128, -0x100000, 0x7FF00000) if out == "fp32" else torch.full_like(bits, 0x7FC0)
        assert torch.equal(bits, want.to(bits.dtype))


@pytest.mark.parametrize("out", ["bf16", "fp32"])
@pytest.mark.parametrize("daz", [False, True], ids=["plain", "flush_denormal"])
def test_cast_back_nan_free_tiles(target, out, daz):
    # whole 512-column tiles of every non-NaN e4m3 code: _quant_kernels.e4m3_scaled decodes a tile whose scales
    # times 2^120 are finite (here < 2^8 in magnitude: 255.9, -0.3, a subnormal 1e-40, products below float32's
    # normal range), the others (256 = 2^8, 3000, 1.5e30) and every tile under flush-denormal take e4m3_value;
    # every value equals the reference (fails with a code's sign or magnitude bits misplaced, or the one-multiply
    # decode taken where 2^120 sf overflows)
    n = rows(target, 256)
    codes = torch.cat([torch.arange(0, 127), torch.arange(128, 255)]).to(torch.int32)
    codes = codes[torch.randint(0, codes.numel(), (n, 1024))].to(torch.uint8)
    q = codes.view(torch.float8_e4m3fn)
    sc = torch.tensor([1.0, 0.125, 255.9, -0.3, 1e-40, 3 * 2.0 ** -126, 2.0 ** -20, 256.0, 3000.0, 1.5e30])
    s = sc[torch.randint(0, 7, (n, 8))]
    s[: n // 2, 5] = sc[torch.randint(7, 10, (n // 2,))]  # half the rows: one scale in their second tile too big
    ref = ref_cast_back(q, s, (1, 128), out)
    y = _cast_back_flushing(q, s, out, daz)
    if daz:  # the reference did not flush: compare where neither the code, the scale nor the product is subnormal
        keep = ((codes & 0x78) != 0) & (ref.float().abs() >= 2.0 ** -126)
        keep &= s.repeat_interleave(128, dim=1).abs() >= 2.0 ** -126
        assert_equal(y[keep], ref[keep])
    else:
        assert_equal(y, ref)


def test_unpack_from_e2m1fn_x2(target):
    q, _ = ref_cast(randn(rows(target, 64), 576), "e2m1", (1, 32))
    assert_equal(quant.unpack_from_e2m1fn_x2(q), e2m1_decode(q))
    assert quant.unpack_from_e2m1fn_x2(q.view(torch.uint8)[:3], torch.bfloat16).dtype == torch.bfloat16


# SwiGLU --------------------------------------------------------------------------------------------------------

def swiglu_ref(x, p2t=None, tw=None, p2e=None, clamp=None, counts=None):
    h = x.shape[1] // 2
    left, right = x[:, :h].float(), x[:, h:].float()
    valid = (p2e >= 0).unsqueeze(1) if p2e is not None else torch.ones(x.shape[0], 1, dtype=torch.bool)
    if clamp is not None:
        if counts is not None:
            counts += torch.stack([((left > clamp) & valid).sum(), ((right > clamp) & valid).sum(),
                                   ((right < -clamp) & valid).sum()])
        left = torch.where(left > clamp, clamp, left)
        right = torch.where(right > clamp, clamp, torch.where(right < -clamp, -clamp, right))
    out = silu(left) * right
    if p2t is not None:
        out = out * torch.where(p2t >= 0, tw.view(-1)[p2t.clamp(min=0).long()], 0.0).unsqueeze(1)
    return torch.where(valid, out, 0.0)


SWIGLU = [  # (tokens, hidden, num_per_channels, with weights / pos_to_expert, clamp, count, scales)
    (4001, 1024, 128, True, 0.5, True, "round"),
    (300, 1024, 1024, False, 10.0, False, "ue8m0"),
    (33, 3584, 128, True, None, False, "plain"),
]


@pytest.mark.parametrize("case", SWIGLU, ids=lambda c: "-".join(map(str, c)))
def test_swiglu_forward_and_per_token_cast(target, case):
    n, h, g, routed, clamp, count, sfk = case
    n = rows(target, n)
    x = randn(n, 2 * h, scale=2.0)
    if not routed:  # a strided view: rows 2 * hidden + 64 apart
        x = torch.cat([x, randn(n, 64)], 1)[:, :2 * h]
    p2t = torch.randint(-1, 2 * n, (n,), dtype=torch.int32) if routed else None
    tw = torch.randn(n, 2) if routed else None
    p2e = torch.randint(-1, 8, (n,), dtype=torch.int32) if routed else None
    counts = torch.zeros(3, dtype=torch.int64) if count else None
    counts_ref = torch.zeros(3, dtype=torch.int64) if count else None
    kw = sf_opts(sfk)
    q, s = quant.swiglu_forward_and_per_token_cast(x, "e4m3", g, p2t, tw, p2e, swiglu_clamp_value=clamp,
                                                   clamped_count=counts, **kw)
    rq, rs = ref_cast(swiglu_ref(x, p2t, tw, p2e, clamp, counts_ref), "e4m3", (1, g), **ref_opts(kw))
    assert_equal(s, rs)
    assert_equal(q, rq)
    if count:
        assert_equal(counts, counts_ref)


def test_swiglu_forward_odd_row_stride(target):
    """A bfloat16 x whose rows cannot be read as uint32 words (odd row stride) takes the element kernel: the same
    bits as the word kernel on a contiguous copy."""
    n, h = rows(target, 9), 256
    x = torch.cat([randn(n, 2 * h, scale=2.0), randn(n, 1)], 1)[:, :2 * h]
    assert x.stride(0) % 2 == 1
    q, s = quant.swiglu_forward_and_per_token_cast(x, "e4m3", 128)
    rq, rs = ref_cast(swiglu_ref(x), "e4m3", (1, 128))
    assert_equal(s, rs)
    assert_equal(q, rq)
    q2, s2 = quant.swiglu_forward_and_per_token_cast(x.contiguous(), "e4m3", 128)
    assert_equal(q2, q)
    assert_equal(s2, s)


@pytest.mark.parametrize("clamp,round_sf", [(None, False), (None, True), (50.0, False)])
def test_swiglu_forward_large_left_values(target, clamp, round_sf):
    """Rows whose |left| (clamped) reaches _swiglu.MID take exp_f32, the others exp_mid. left -88.5 has exp(88.5)
    finite where exp_mid's power of two overflows (silu -3.3e-37, made visible by right = 1e37, unclamped): the
    output differs if such a row takes exp_mid. Rows with +inf and NaN on the left (not -inf: silu(-inf) = -inf / inf
    is the default NaN here, sign bit set, 0xff after the cast, where torch's is 0x7f; as before exp_mid). The +inf
    row's amax is inf: under round_sf its cast must not take e4m3_in_range (no saturation)."""
    n, h = (7 if target == "c" else 5), 256
    x = randn(n, 2 * h, scale=2.0)
    x[0, 3], x[0, h + 3] = -88.5, 1e37
    x[1, 5], x[1, h + 5] = -88.5, 1e37
    x[1, 7] = 87.0  # a row at the bound
    x[2, 9] = float("inf")
    x[3, :h] = float("nan")  # a NaN row (a NaN among finite values: torch's amax is NaN, the kernels' skips it)
    x[4, 0:4] = torch.tensor([-104.5, 100.5, -87.0, 86.9])
    q, s = quant.swiglu_forward_and_per_token_cast(x, "e4m3", 128, swiglu_clamp_value=clamp, round_sf=round_sf)
    y = swiglu_ref(x, clamp=clamp)
    if clamp is None:
        assert -10.0 < y[0, 3] < -1.0 and torch.isinf(y[2, 9])
    rq, rs = ref_cast(y, "e4m3", (1, 128), round_sf=round_sf)
    keep = torch.arange(n) != 3  # the NaN row's amax: the kernels' max skips NaN (the clamp's scale), torch's is NaN
    assert_equal(s[keep], rs[keep])
    assert_equal(q, rq)


def test_silu_table_every_bfloat16(target):
    """_swiglu.silu_table (what the bfloat16 forward gathers silu from) holds torch's silu of every bfloat16 left
    value at entry int16(bits) + 2^15, bit for bit; NaN where torch's is NaN (its sign aside)."""
    from tegula.ops import _swiglu
    tb = _swiglu._silu_table()
    bits = (torch.arange(1 << 16, dtype=torch.int32) ^ 0x8000).to(torch.int16)  # entry e: bits e ^ 0x8000
    ref = silu(bits.view(torch.bfloat16).float())
    nan = ref.isnan()
    assert_equal(tb.isnan(), nan)
    assert_equal(tb[~nan], ref[~nan])
    assert tb[(1 << 15) + 0x3F80].item() == ref[(1 << 15) + 0x3F80].item() == silu(torch.tensor(1.0)).item()


def test_swiglu_exp_mid(target):
    """exp_mid equals exp_f32 on every bfloat16 value of magnitude below MID and on random float32 ones there (C
    checked all float32 there), and differs from it just past: at 88.5 (2^128) and -88 (2^-127), where the rows
    must take exp_f32."""
    import tegula.language as T
    from tegula.ops import _swiglu, _tk
    from tegula.ops._tk_math import exp_f32
    b = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    x = torch.cat([b[b.abs() < _swiglu.MID], (torch.rand(1 << 14) * 2 - 1) * 86.99])
    if target == "interp":
        x = x[torch.randperm(x.numel())[:2048]]
    x = torch.cat([x, torch.tensor([88.5, -88.0])])

    def kernel():
        N = T.dynamic("n")

        @T.prim_func
        def exps(X: T.Tensor((N,), "float32"), Y: T.Tensor((N, 2), "float32")):
            with T.Kernel(T.ceildiv(N, 256)) as b:
                for i in T.Parallel(256):
                    if b * 256 + i < N:
                        Y[b * 256 + i, 0] = _swiglu.exp_mid(X[b * 256 + i])
                        Y[b * 256 + i, 1] = exp_f32(X[b * 256 + i])
        return exps

    y = torch.empty(x.numel(), 2)
    _tk.kernel(kernel)(x, y)
    assert_equal(y[:-2, 0], y[:-2, 1])
    assert (y[-2:, 0] != y[-2:, 1]).all()


@pytest.mark.parametrize("g,round_sf,clamp", [(128, False, 0.5), (32, True, None)])
def test_swiglu_backward_and_per_token_cast(target, g, round_sf, clamp):
    n, h, tokens, k = rows(target, 400), 1024, rows(target, 400) // 2, 3
    xq, xs = ref_cast(randn(n, 2 * h), "e4m3", (1, g))
    grad_out = randn(n, h)
    weight = torch.rand(tokens, k)
    p2t = torch.randperm(n).to(torch.int32)
    p2t[p2t >= tokens * k] = -1
    ttp = torch.full((tokens * k,), -1, dtype=torch.int32)
    ok = p2t >= 0
    ttp[p2t[ok].long()] = torch.arange(n, dtype=torch.int32)[ok]
    out, (gq, gs), xg, wg = quant.swiglu_backward_and_per_token_cast((xq, xs), grad_out, weight, p2t,
                                                                      ttp.view(tokens, k), g, round_sf, clamp)
    xd = xq.float() * xs.repeat_interleave(g, 1)
    a, b = xd[:, :h], xd[:, h:]
    if clamp is not None:
        ca, cb = a > clamp, (b > clamp) | (b < -clamp)
        a = torch.where(a > clamp, clamp, a)
        b = torch.where(b > clamp, clamp, torch.where(b < -clamp, -clamp, b))
    s, act = sigmoid(a), silu(a) * b
    w = torch.where(ok, weight.view(-1)[p2t.clamp(min=0).long()], 0.0).unsqueeze(1)
    gws = grad_out.float() * w * s
    ga, gb = gws * b * fma(a, 1.0 - s, torch.ones_like(a)), gws * a
    if clamp is not None:
        ga, gb = torch.where(ca, 0.0, ga), torch.where(cb, 0.0, gb)
    grad = torch.cat([ga, gb], 1)
    assert_equal(out, (act * w).bfloat16())
    assert_equal(xg, grad.bfloat16())
    rq, rs = ref_cast(grad, "e4m3", (1, g), round_sf=round_sf)
    assert_equal(gs, rs)
    assert_equal(gq, rq)
    from _quant_ref import lane_sum
    wref = torch.zeros(tokens * k)
    wref[p2t[ok].long()] = lane_sum(grad_out.float() * act)[ok]
    assert_equal(wg, wref.view(tokens, k))


# bad input ---------------------------------------------------------------------------------------------------------

def test_bad_input_names_the_argument():
    x = randn(4, 256)
    cases = [
        (lambda: quant.per_token_cast(x, "e3m4", 128), ValueError, "fmt"),
        (lambda: quant.per_token_cast(x, "e4m3", 100), ValueError, "num_per_channels"),
        (lambda: quant.per_token_cast(x.half(), "e4m3", 128), TypeError, "x"),
        (lambda: quant.per_token_cast(x[0], "e4m3", 128), ValueError, "x"),
        (lambda: quant.per_token_cast(x, "e4m3", 128, use_packed_ue8m0=True), ValueError, "use_packed_ue8m0"),
        (lambda: quant.per_token_cast(x, "e4m3", 128, x_block_size=(1, 128)), ValueError, "x_block_size"),
        (lambda: quant.per_token_cast((x.to(torch.float8_e4m3fn), torch.ones(4, 2)), "e4m3", 128), ValueError,
         "x_block_size"),
        (lambda: quant.per_token_cast((x.to(torch.float8_e4m3fn), torch.ones(4, 3)), "e4m3", 128,
                                      x_block_size=(1, 128)), ValueError, "x[1]"),
        (lambda: quant.per_token_cast_with_precomputed_sf(x, "e4m3", 128, torch.ones(4, 3)), ValueError, "sf"),
        (lambda: quant.per_block_cast(x, "e4m3", (64, 128)), ValueError, "block_size"),
        (lambda: quant.per_channel_cast(x, "e4m3", 128), ValueError, "num_tokens"),
        (lambda: quant.cast_back((x.to(torch.float8_e4m3fn), torch.ones(4, 2)), "fp16", (1, 128)), ValueError,
         "fmt"),
        (lambda: quant.per_token_cast_to_e5m6(x, 128), ValueError, "num_per_channels"),
        (lambda: quant.swiglu_forward_and_per_token_cast(x, "e4m3", 128, clamped_count=torch.zeros(3)), ValueError,
         "clamped_count"),
        (lambda: quant.swiglu_forward_and_per_token_cast(randn(4, 512), "e4m3", 64), ValueError,
         "num_per_channels"),
    ]
    for fn, exc, name in cases:
        with pytest.raises(exc, match=name.replace("[", r"\[").replace("]", r"\]")):
            fn()


def test_layouts_and_empty_inputs():
    q, s = quant.per_token_cast(randn(0, 2048), "e2m1", 128, **sf_opts("ue8m0"))
    assert q.shape == (0, 1024) and q.dtype == torch.int8
    assert s.shape == (0, 4) and s.dtype == torch.int32
    q, s = quant.per_token_cast(randn(5, 2048), "e4m3", 128, use_tma_aligned_col_major_sf=True)
    assert s.shape == (5, 16) and s.stride() == (1, 8)
    assert layout(torch.ones(5, 16), col_major=True).stride() == s.stride()
