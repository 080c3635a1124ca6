"""tegula.ops.norm against plain torch references: RMSNorm in float32 with the kernels' fixed summation order
(32 lanes, then pairwise), bit for bit; the fused cast as tegula.ops.quant.per_token_cast of that result."""
import pytest
import torch
from _quant_ref import align, assert_equal, check_bias, lane_sum, ref_cast, ref_cast_back

from tegula.ops import norm

torch.manual_seed(0)


@pytest.fixture(params=["c", "interp"])
def target(request, monkeypatch):
    monkeypatch.setenv("TEGULA_TARGET", request.param)
    return request.param


def rmsnorm_ref(x, w, eps):
    xf = x.float()
    h = xf.shape[1]
    ss = lane_sum(torch.nn.functional.pad(xf * xf, (0, align(h, 32) - h)))
    rstd = torch.rsqrt(ss / torch.full_like(ss, h) + eps)  # torch.rsqrt is 1 / (correctly rounded sqrt) here
    return xf * w.float() * rstd.unsqueeze(1)


@pytest.mark.parametrize("n,h,dtype,wdtype", [(4001, 576, torch.bfloat16, torch.bfloat16),
                                              (33, 7168, torch.float32, torch.float32),
                                              (1, 100, torch.float16, torch.float32),
                                              (0, 2048, torch.bfloat16, torch.bfloat16)])
def test_rmsnorm(target, n, h, dtype, wdtype):
    n = n if target == "c" else min(n, 3)
    x = (torch.randn(n, h) * 2).to(dtype)
    w = torch.randn(h).to(wdtype)
    assert_equal(norm.rmsnorm(x, w, 1e-6), rmsnorm_ref(x, w, 1e-6).to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rmsnorm_streamed_output(dtype):
    """Outputs of >= norm.STREAM_MIN values are written by streaming copies of float32 chunks (bfloat16: rounded
    by tegula_stream.h's converting copy, vcvtne2ps2bf16 where the host has it); a row count that is not a multiple
    of the 4-row blocks, a partial last chunk of each row, and weights that make subnormal and tie outputs."""
    h = 7168 + 100
    n = -(-norm.STREAM_MIN // h) + 3
    x = torch.randn(n, h).to(dtype)
    w = torch.randn(h)
    w[::97] = 3e-39  # subnormal products: the hardware conversion would flush them to zero
    w[5::89] = 1e-45
    w = w.to(dtype)
    assert_equal(norm.rmsnorm(x, w, 1e-6), rmsnorm_ref(x, w, 1e-6).to(dtype))


@pytest.mark.parametrize("groups", [8, 32])
def test_rmsnorm_kernel_row_groups(target, groups):
    """The kernel's pipelined blocks (8 or 32 groups of 4 rows, whole chunks summed from X behind a copy nothing
    reads) on an output below the streaming size: rows past the last group's end, a partial chunk, a row stride."""
    from tegula.ops import _tk
    n = 37 + 4 * groups if target == "c" else 5
    x = torch.randn(n, 3 * 1000).bfloat16()[:, 1000:2000]
    w = torch.randn(1000).bfloat16()
    y = torch.empty(n, 1000, dtype=torch.bfloat16)
    _tk.kernel(norm.rmsnorm_kernel, "bfloat16", "bfloat16", 256, 4, groups)(x, w, y, 1e-6)
    assert_equal(y, rmsnorm_ref(x, w, 1e-6).bfloat16())


def test_rmsnorm_streamed_32_groups(monkeypatch):
    """Large outputs take blocks of 32 groups (norm._groups): a streamed output with more rows than that needs
    on one thread, rows past the last block's end, a row stride."""
    monkeypatch.setenv("TEGULA_NUM_THREADS", "1")  # norm._groups reads it (tegula.config)
    h = 1024
    n = max(-(-norm.STREAM_MIN // h), 4 * 32 * 8) + 5
    assert norm._groups(n) == 32
    x = torch.randn(n, 2 * h).bfloat16()[:, 7:7 + h]
    w = torch.randn(h).bfloat16()
    assert_equal(norm.rmsnorm(x, w, 1e-6), rmsnorm_ref(x, w, 1e-6).bfloat16())


def test_rmsnorm_strided_rows(target):
    n = 257 if target == "c" else 3
    base = torch.randn(n, 3 * 2048).bfloat16()
    x = base[:, 2048:4096]  # row stride 3 * hidden
    w = torch.randn(2048).bfloat16()
    assert_equal(norm.rmsnorm(x, w, 1e-5), rmsnorm_ref(x, w, 1e-5).bfloat16())


@pytest.mark.parametrize("n,h,fmt,g,opts", [
    (4001, 2048, "e4m3", 128, {}),
    (300, 576, "e2m1", 32, dict(round_sf=True, use_tma_aligned_col_major_sf=True, use_packed_ue8m0=True)),
    (65, 7168, "e4m3", 7168, dict(round_sf=True)),
    (37, 1600, "e4m3", 64, {}),  # whole 1024-column chunks and a partial one in a row
])
def test_rmsnorm_forward_and_per_token_cast(target, n, h, fmt, g, opts):
    n = n if target == "c" else min(n, 3)
    x = torch.randn(n, h).bfloat16()
    w = torch.randn(h).bfloat16()
    q, s = norm.rmsnorm_forward_and_per_token_cast(x, w, 1e-6, fmt, g, **opts)
    y = rmsnorm_ref(x, w, 1e-6)
    rq, rs = ref_cast(y, fmt, (1, g), round_sf=opts.get("round_sf", False),
                      col_major=opts.get("use_tma_aligned_col_major_sf", False),
                      packed=opts.get("use_packed_ue8m0", False))
    assert_equal(s, rs)
    assert_equal(q, rq)
    check_bias(ref_cast_back(q, s, (1, g), "fp32"), y)


@pytest.mark.parametrize("g,round_sf", [(128, False), (128, True), (2048, False), (2048, True)])
def test_rmsnorm_forward_and_per_token_cast_infinities(target, g, round_sf):
    """Normalised values of +-inf (x * w overflows float32) and NaN rows: amax inf gives inv 0 (plain: zeros, NaN
    codes where y is inf) or -inf (round_sf: +-448, a NaN code where y is 0): the kernel's cast without saturation
    (values within 448) must not take those chunks under round_sf. Whole 1024-column chunks, so both paths run."""
    n, h = (6 if target == "c" else 4), 2048
    x = torch.randn(n, h).bfloat16()
    w = torch.randn(h).bfloat16()
    w[5] = 1e38
    x[:, 5] = 0.0
    x[1, 5], x[2, 5], x[3, 0] = 1e19, -1e19, float("nan")
    x[2, 9] = 0.0
    q, s = norm.rmsnorm_forward_and_per_token_cast(x, w, 1e-6, "e4m3", g, round_sf=round_sf)
    y = rmsnorm_ref(x, w, 1e-6)
    assert torch.isinf(y[1, 5]) and torch.isinf(y[2, 5]) and torch.isnan(y[3]).all()
    rq, rs = ref_cast(y, "e4m3", (1, g), round_sf=round_sf)
    keep = torch.arange(n) != 3  # the NaN row's amax: the kernels' max skips NaN (the clamp's scale), torch's is NaN
    assert_equal(s[keep], rs[keep])
    assert_equal(q, rq)
    assert (q.view(torch.uint8)[3] & 0x7F == 0x7F).all()
    assert int(q.view(torch.uint8)[2, 9 if round_sf else 5]) & 0x7F == 0x7F  # 0 * -inf, or -inf * 0
    if round_sf:
        assert int(q.view(torch.uint8)[1, 0]) & 0x7F in (0x7E, 0x00)  # +-448 or a zero: saturated, not wrapped


@pytest.mark.parametrize("g,opts,h", [(128, {}, 1600), (16, dict(round_sf=True), 1600), (64, dict(
    use_packed_ue8m0=True, round_sf=True, use_tma_aligned_col_major_sf=True), 1600), (32, dict(
        use_packed_ue8m0=True, round_sf=True, use_tma_aligned_col_major_sf=True), 3072), (128, dict(round_sf=True),
                                                                                         2048)])
def test_rmsnorm_cast_pairs_match_the_element_path(target, monkeypatch, g, opts, h):
    """bfloat16 rows read as uint32 words (norm._pairs) give the bits of the element-wise kernel: NaN, +-inf and
    overflowing products (chunks that leave the integer amax), subnormal products, a partial last chunk (hidden
    1600 = 1024 + 576), rows with a row stride; a view at an odd element offset takes the element path. Hidden
    3072 / 2048 (whole chunks): the finite rows take the fused cast (_fused_cast), the others the chunk loop."""
    n = 9 if target == "c" else 4
    base = torch.randn(n, h + 2).bfloat16()
    x = base[:, 2:]  # row stride h + 2, start 4-byte aligned
    w = torch.randn(h).bfloat16()
    w[7::97] = 3e-39
    w[5] = 1e38
    x[1, 5], x[2, 1100], x[3, 0] = 1e19, float("inf"), float("nan")
    x[0, 300], x[0, 301] = -float("inf"), 1.0
    assert norm._pairs(x, w) and not norm._pairs(base[:, 1:h + 1], w)
    got = norm.rmsnorm_forward_and_per_token_cast(x, w, 1e-6, "e4m3", g, **opts)
    monkeypatch.setattr(norm, "_pairs", lambda x, weight: False)
    want = norm.rmsnorm_forward_and_per_token_cast(x, w, 1e-6, "e4m3", g, **opts)
    assert_equal(got[0], want[0])
    assert_equal(got[1], want[1])
    monkeypatch.undo()
    odd = base[:, 1:h + 1]
    y = rmsnorm_ref(odd, w, 1e-6)
    q, s = norm.rmsnorm_forward_and_per_token_cast(odd, w, 1e-6, "e4m3", g, **opts)
    rq, rs = ref_cast(y, "e4m3", (1, g), round_sf=opts.get("round_sf", False),
                      col_major=opts.get("use_tma_aligned_col_major_sf", False),
                      packed=opts.get("use_packed_ue8m0", False))
    keep = torch.isfinite(y).all(1)
    assert_equal(s[keep], rs[keep])
    assert_equal(q[keep], rq[keep])


def test_rmsnorm_cast_fused_zero_rows(target, monkeypatch):
    """eps 0 and a row of zeros: rstd is inf and every product NaN (0 * inf): that row must not take the fused cast
    (its amax, max |x * w| * rstd, would be NaN); the bits of the element path."""
    n, h = (5 if target == "c" else 3), 2048
    x = torch.randn(n, h).bfloat16()
    x[1] = 0.0
    w = torch.randn(h).bfloat16()
    got = norm.rmsnorm_forward_and_per_token_cast(x, w, 0.0, "e4m3", 128)
    monkeypatch.setattr(norm, "_pairs", lambda x, weight: False)
    want = norm.rmsnorm_forward_and_per_token_cast(x, w, 0.0, "e4m3", 128)
    assert_equal(got[0], want[0])
    assert_equal(got[1], want[1])


@pytest.mark.parametrize("rb", [4, 32])
def test_rmsnorm_cast_pairs_kernel_row_blocks(target, rb):
    """The pair kernel's pipelined blocks of rb rows (the next row's chunks prefetched behind a copy nothing reads):
    rows past the last block's end, a row stride, a partial chunk; the bits of rmsnorm_cast_kernel."""
    from tegula.ops import _tk
    n, h = (rb + 37 if target == "c" else 5), 1600
    x = torch.randn(n, h + 64).bfloat16()[:, 64:]
    w = torch.randn(h).bfloat16()
    x[2, 17] = float("nan")
    got = (torch.empty(n, h, dtype=torch.float8_e4m3fn), torch.empty(n, h // 64))
    want = (torch.empty(n, h, dtype=torch.float8_e4m3fn), torch.empty(n, h // 64))
    _tk.kernel(norm.rmsnorm_cast_pairs_kernel, 64, rb)(x.view(torch.uint32), w.view(torch.uint32),
                                                       got[0].view(torch.uint16), got[1].view(torch.int32), 1e-6, 0)
    _tk.kernel(norm.rmsnorm_cast_kernel, "bfloat16", "bfloat16", "e4m3", 64)(x, w, want[0], want[1].view(torch.int32),
                                                                             1e-6, 0)
    assert_equal(got[0], want[0])
    assert_equal(got[1], want[1])


def test_bad_input_names_the_argument():
    x, w = torch.randn(4, 64), torch.randn(64)
    for fn, exc, name in [
        (lambda: norm.rmsnorm(x, w[:32]), ValueError, "weight"),
        (lambda: norm.rmsnorm(x.double(), w), TypeError, "x"),
        (lambda: norm.rmsnorm(x, w, eps="1"), TypeError, "eps"),
        (lambda: norm.rmsnorm(x, w.view(8, 8)), ValueError, "weight"),
        (lambda: norm.rmsnorm_forward_and_per_token_cast(x, w, fmt="e5m2"), ValueError, "fmt"),
        (lambda: norm.rmsnorm_forward_and_per_token_cast(x, w, num_per_channels=48), ValueError,
         "num_per_channels"),
    ]:
        with pytest.raises(exc, match=name):
            fn()
