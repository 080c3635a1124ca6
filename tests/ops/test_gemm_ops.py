"""tegula.ops.gemm against torch references, with DeepGEMM's tests' shapes scaled down: calc_diff against the
unquantised product (< 1e-3 fp8, < 1e-5 bf16), tighter against the dequantised one, bit-identical reruns, and
ValueError / TypeError on bad input. Runs on the c target; a few tiny cases on interp."""
import random

import pytest
import torch

from tegula.ops import gemm as dg

FP8 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def _seed(monkeypatch):
    monkeypatch.setenv("TEGULA_TARGET", "c")
    torch.manual_seed(0)
    random.seed(0)


def quant(a, b, ue8m0=False, packed=False, per_row_b=False):
    """deep_gemm's test inputs: per-token A, per-block (or per-row) B."""
    qa = dg.per_token_cast_to_fp8(a, use_ue8m0=ue8m0, use_packed_ue8m0=packed)
    if per_row_b:
        qb = dg.per_token_cast_to_fp8(b, use_ue8m0=ue8m0, use_packed_ue8m0=packed)
    else:
        qb = dg.per_block_cast_to_fp8(b, use_ue8m0=ue8m0)
    return qa, qb


def dequant_a(q, sf):
    k = q.shape[1]
    return (q.float().view(q.shape[0], -1, 128) if k % 128 == 0 else _pad(q.float(), 128)) \
        .mul(sf[:, :, None]).view(q.shape[0], -1)[:, :k]


def _pad(x, g):
    k = x.shape[1]
    out = torch.zeros(x.shape[0], dg.align(k, g))
    out[:, :k] = x
    return out.view(x.shape[0], -1, g)


def dequant_b(q, sf):
    n, k = q.shape
    x = torch.zeros(dg.align(n, 128), dg.align(k, 128))
    x[:n, :k] = q.float()
    x = x.view(sf.shape[0], 128, sf.shape[1], 128) * sf[:, None, :, None]
    return x.view(dg.align(n, 128), -1)[:n, :k]


# dense FP8 ------------------------------------------------------------------------------------------------

# DeepGEMM's (N, K) list scaled down 8x (K = 896 ends in a partial 128-block... no: 7 whole ones) and 16x
# (K = 448: three whole blocks and half of one).
@pytest.mark.parametrize("m,n,k", [(1, 264, 896), (4, 264, 896), (128, 264, 896), (200, 264, 896), (1, 36, 448),
                                   (64, 132, 448), (300, 264, 896), (600, 200, 384),
                                   (512, 192, 256),  # 512- / 256-row blocks; 96 columns (n 264, 192)
                                   (1, 200, 1536),  # one row, K <= 4096: 128-column blocks, the last partial
                                   # 9-16 rows: A's rows in vector lanes, B read in place (a partial K: staged)
                                   (16, 264, 896), (12, 200, 1536), (16, 132, 448)])
def test_fp8_gemm_nt(m, n, k):
    a, b = torch.randn(m, k, dtype=torch.bfloat16), torch.randn(n, k, dtype=torch.bfloat16)
    (qa, sa), (qb, sb) = quant(a, b)
    d = torch.empty(m, n, dtype=torch.bfloat16)
    dg.fp8_gemm_nt((qa, sa), (qb, sb), d)
    assert dg.calc_diff(d, a.float() @ b.float().T) < 1e-3
    deq = dequant_a(qa, sa) @ dequant_b(qb, sb).T
    assert dg.calc_diff(d, deq) < 2e-5  # only bf16 rounding of d and summation order remain
    again = torch.empty_like(d)
    dg.fp8_gemm_nt((qa, sa), (qb, sb), again)
    assert torch.equal(d.view(torch.int16), again.view(torch.int16))


@pytest.mark.parametrize("layout", ["nn", "tn", "tt"])
def test_fp8_gemm_layouts(layout):
    m, n, k = 48, 132, 448
    a, b = torch.randn(m, k, dtype=torch.bfloat16), torch.randn(n, k, dtype=torch.bfloat16)
    qa, qb = quant(a, b)
    ta = (qa[0].T.contiguous(), qa[1].T.contiguous()) if layout[0] == "t" else qa
    tb = (qb[0].T.contiguous(), qb[1].T.contiguous()) if layout[1] == "n" else qb
    d = torch.empty(m, n, dtype=torch.bfloat16)
    getattr(dg, f"fp8_gemm_{layout}")(ta, tb, d)
    ref = torch.empty_like(d)
    dg.fp8_gemm_nt(qa, qb, ref)
    assert dg.calc_diff(d, a.float() @ b.float().T) < 1e-3
    assert dg.calc_diff(d, ref) < 1e-5
    # deep_gemm's nt also takes transposed views (MN-major operands) without a copy
    mn = torch.empty_like(d)
    dg.fp8_gemm_nt((ta[0].T, ta[1].T) if layout[0] == "t" else ta, (tb[0].T, tb[1].T) if layout[1] == "n" else tb, mn)
    assert torch.equal(mn.view(torch.int16), d.view(torch.int16))


def test_fp8_gemm_accumulate_fp32():
    m, n, k = 48, 132, 448
    a, b = torch.randn(m, k, dtype=torch.bfloat16), torch.randn(n, k, dtype=torch.bfloat16)
    qa, qb = quant(a, b)
    c = torch.randn(m, n) * 32
    ref = c + a.float() @ b.float().T
    d = c.clone()
    dg.fp8_gemm_nt(qa, qb, d, c=d)  # c is d
    assert dg.calc_diff(d, ref) < 1e-3
    d2 = torch.empty(m, n)
    dg.fp8_gemm_nt(qa, qb, d2, c=c)  # c copied into d first
    assert torch.equal(d, d2)
    assert dg.calc_diff(d, c + dequant_a(*qa) @ dequant_b(*qb).T) < 1e-9


@pytest.mark.parametrize("m", [48, 16, 1])
@pytest.mark.parametrize("scales", ["packed", "e8m0", "per_row_fp32"])
def test_fp8_gemm_scale_formats(scales, m):
    n, k = 132, 448
    a, b = torch.randn(m, k, dtype=torch.bfloat16), torch.randn(n, k, dtype=torch.bfloat16)
    qa, qb = quant(a, b, ue8m0=scales != "per_row_fp32", packed=scales == "packed", per_row_b=scales != "e8m0")
    if scales == "packed":
        assert qa[1].dtype == torch.int32 and qb[1].shape == (n, 1)
        recipe = None  # deep_gemm's default for packed scales: (1, 1, 128)
    elif scales == "e8m0":
        qa, qb = (qa[0], qa[1].to(torch.float8_e8m0fnu)), (qb[0], qb[1].to(torch.float8_e8m0fnu))
        recipe = (1, 128, 128)
    else:
        recipe = (1, 1, 128)  # deep_gemm's weight-gradient recipe: B scaled per row too
    d = torch.empty(m, n, dtype=torch.bfloat16)
    dg.fp8_gemm_nt(qa, qb, d, recipe=recipe)
    assert dg.calc_diff(d, a.float() @ b.float().T) < 1e-3


# BF16 ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout,m,out", [("nt", 1, torch.bfloat16), ("nt", 4, torch.float32),
                                          ("nt", 200, torch.float32), ("nn", 48, torch.bfloat16),
                                          ("tn", 48, torch.bfloat16), ("tt", 48, torch.bfloat16),
                                          ("nt", 300, torch.bfloat16), ("nt", 600, torch.float32),
                                          ("tn", 300, torch.bfloat16)])
def test_bf16_gemm(layout, m, out):
    n, k = 132, 448
    a, b = torch.randn(m, k, dtype=torch.bfloat16), torch.randn(n, k, dtype=torch.bfloat16)
    c = torch.randn(m, n, dtype=out)
    ref = (c.float() + a.float() @ b.float().T).to(out)
    d = torch.empty(m, n, dtype=out)
    getattr(dg, f"bf16_gemm_{layout}")(a.T.contiguous() if layout[0] == "t" else a,
                                       b.T.contiguous() if layout[1] == "n" else b, d, c=c)
    assert dg.calc_diff(d, ref) < 1e-5


# M-grouped ------------------------------------------------------------------------------------------------

def grouped_inputs(groups, expected_m, n, k, psum):
    al = dg.get_mk_alignment_for_contiguous_layout()
    ms = [max(1, int(expected_m * random.uniform(0.7, 1.3))) for _ in range(groups)]
    ms[1] = 0  # an empty expert
    m = sum(dg.align(x, al) for x in ms)
    a = torch.randn(m, k, dtype=torch.bfloat16)
    b = torch.randn(groups, n, k, dtype=torch.bfloat16)
    layout = torch.empty(groups if psum else m, dtype=torch.int32)
    ref = torch.zeros(m, n)
    start = 0
    for g, x in enumerate(ms):
        end = start + dg.align(x, al)
        if psum:
            layout[g] = start + x
        else:
            layout[start:start + x], layout[start + x:end] = g, -1
        a[start + x:end] = 0
        ref[start:start + x] = a[start:start + x].float() @ b[g].float().T
        start = end
    return a, b, layout, ref


@pytest.mark.parametrize("groups,psum", [(4, False), (8, False), (4, True)])
def test_m_grouped_fp8_contiguous(groups, psum):
    n, k = 132, 448
    a, b, layout, ref = grouped_inputs(groups, 100, n, k, psum)
    qa = dg.per_token_cast_to_fp8(a, False)
    qb = (torch.empty(groups, n, k, dtype=FP8), torch.empty(groups, 2, 4))
    for g in range(groups):
        qb[0][g], qb[1][g] = dg.per_block_cast_to_fp8(b[g], False)
    d = torch.full((a.shape[0], n), float("nan"), dtype=torch.bfloat16)
    dg.m_grouped_fp8_gemm_nt_contiguous(qa, qb, d, layout, use_psum_layout=psum)
    assert not bool(d.isnan().any())  # padding rows are written too (as zeros)
    assert dg.calc_diff(d, ref) < 1e-3
    if not psum:
        assert bool((d[layout == -1] == 0).all())
        nn = torch.empty_like(d)
        dg.m_grouped_fp8_gemm_nn_contiguous(qa, (qb[0].mT.contiguous(), qb[1].mT.contiguous()), nn, m_indices=layout)
        assert torch.equal(nn.view(torch.int16), d.view(torch.int16))


def test_m_grouped_bf16_contiguous():
    n, k = 132, 448
    a, b, layout, ref = grouped_inputs(4, 100, n, k, False)
    d = torch.empty(a.shape[0], n, dtype=torch.bfloat16)
    dg.m_grouped_bf16_gemm_nt_contiguous(a, b, d, layout)
    assert dg.calc_diff(d, ref) < 1e-5


@pytest.mark.parametrize("fp8", [True, False])
def test_m_grouped_masked(fp8):
    groups, max_m, n, k = 4, 48, 132, 448
    a = torch.randn(groups, max_m, k, dtype=torch.bfloat16)
    b = torch.randn(groups, n, k, dtype=torch.bfloat16)
    masked_m = torch.tensor([0, 1, 30, max_m], dtype=torch.int32)  # empty, one row, some, full
    d = torch.full((groups, max_m, n), float("nan"), dtype=torch.bfloat16)
    if fp8:
        qa = (torch.empty(groups, max_m, k, dtype=FP8), torch.empty(groups, max_m, 4))
        qb = (torch.empty(groups, n, k, dtype=FP8), torch.empty(groups, 2, 4))
        for g in range(groups):
            qa[0][g], qa[1][g] = dg.per_token_cast_to_fp8(a[g], False)
            qb[0][g], qb[1][g] = dg.per_block_cast_to_fp8(b[g], False)
        dg.m_grouped_fp8_gemm_nt_masked(qa, qb, d, masked_m, 32)
    else:
        dg.m_grouped_bf16_gemm_nt_masked(a, b, d, masked_m, 32)
    ref = torch.einsum("gmk,gnk->gmn", a.float(), b.float())
    for g, rows in enumerate(masked_m.tolist()):
        assert bool(d[g, rows:].isnan().all())  # rows past masked_m are untouched
        if rows:
            assert dg.calc_diff(d[g, :rows], ref[g, :rows]) < (1e-3 if fp8 else 1e-5)


# K-grouped ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fp8,psum", [(True, False), (False, False), (True, True)])
def test_k_grouped_tn(fp8, psum):
    groups, m, n = 4, 96, 132
    real_ks = [256, 0, 384, 100 if psum else 128]
    al = dg.get_mk_alignment_for_contiguous_layout()
    starts, ends, pos = [], [], 0
    for x in real_ks:
        starts.append(pos)
        ends.append(pos + x)
        pos = dg.align(pos + x, al) if psum else pos + x
    total = dg.align(ends[-1], al) if psum else pos
    a = torch.zeros(total, m, dtype=torch.bfloat16)
    b = torch.zeros(total, n, dtype=torch.bfloat16)
    c = torch.randn(groups, m, n) * 32
    ref = c.clone()
    for g, (s, e) in enumerate(zip(starts, ends)):
        a[s:e], b[s:e] = torch.randn(e - s, m), torch.randn(e - s, n)
        ref[g] += a[s:e].float().T @ b[s:e].float()
    layout = torch.tensor(ends if psum else real_ks, dtype=torch.int32)
    ks = None if psum else real_ks
    d = c.clone()
    if fp8:
        def cast(x):
            q, sfs = torch.zeros_like(x, dtype=FP8), []
            for s, e in zip(starts, ends):
                if e > s:
                    blk = torch.zeros(dg.align(e - s, 128), x.shape[1], dtype=x.dtype)
                    blk[:e - s] = x[s:e]
                    qq, sf = dg.per_channel_cast_to_fp8(blk, False)
                    q[s:e] = qq[:e - s]
                    sfs.append(sf)
            return q, torch.cat(sfs)
        dg.k_grouped_fp8_gemm_tn_contiguous(cast(a), cast(b), d, ks, layout, d, use_psum_layout=psum)
    else:
        dg.k_grouped_bf16_gemm_tn_contiguous(a, b, d, ks, layout, d, use_psum_layout=psum)
    assert dg.calc_diff(d, ref) < (1e-3 if fp8 else 1e-5)
    assert torch.equal(d[1], c[1])  # an empty group leaves c


# helpers --------------------------------------------------------------------------------------------------

def test_quantisers_numerics():
    x = torch.randn(5, 300, dtype=torch.bfloat16)
    x[1] = 0  # amax floor
    q, sf = dg.per_token_cast_to_fp8(x, use_ue8m0=False)
    assert q.shape == (5, 300) and sf.shape == (5, 3) and q.dtype == FP8
    pad = torch.zeros(5, 384)
    pad[:, :300] = x.float()
    amax = pad.view(5, 3, 128).abs().amax(-1).clamp(min=1e-4)
    assert torch.equal(sf, amax / 448.0)
    assert torch.equal(q.float(), (pad.view(5, 3, 128) * (1.0 / sf[..., None])).to(FP8).float().view(5, -1)[:, :300])
    q8, sf8 = dg.per_token_cast_to_fp8(x, use_ue8m0=True)
    bits = sf8.view(torch.int32)
    assert bool(((bits & 0x7FFFFF) == 0).all()) and bool((sf8 >= amax / 448.0).all())
    assert bool((sf8 < 2 * amax / 448.0).all())
    qp, packed = dg.per_token_cast_to_fp8(x, use_ue8m0=True, use_packed_ue8m0=True)
    assert packed.dtype == torch.int32 and packed.shape == (5, 1) and torch.equal(qp, q8)
    assert torch.equal(dg.unpack_ue8m0_from_int(packed)[:, :3], sf8)
    qb, sfb = dg.per_block_cast_to_fp8(x, use_ue8m0=False)
    assert sfb.shape == (1, 3)
    assert torch.equal(sfb[0], amax.amax(0) / 448.0)
    assert dg.calc_diff(dequant_b(qb, sfb), x.float()) < 1e-3


def test_layout_helpers():
    assert dg.get_mk_alignment_for_contiguous_layout() == 128
    assert dg.get_tma_aligned_size(5, 4) == 8
    sf = torch.randn(2, 5, 3)
    t = dg.get_mn_major_tma_aligned_tensor(sf)
    assert torch.equal(t, sf) and t.stride() == (24, 1, 8)
    assert dg.get_mn_major_tma_aligned_tensor(t) is t
    r = dg.transform_sf_into_required_layout(sf[0], mn=5, k=384, recipe=(1, 128, 128), is_sfa=True)
    assert torch.equal(r, sf[0]) and r.stride(0) == 1
    with pytest.raises(ValueError, match="sf"):
        dg.transform_sf_into_required_layout(sf[0], mn=5, k=512, recipe=(1, 128, 128), is_sfa=True)
    p = dg.get_mn_major_tma_aligned_packed_ue8m0_tensor(dg.ceil_to_ue8m0(sf[0].abs() + 0.1))
    assert p.dtype == torch.int32 and p.shape == (5, 1) and p.stride() == (1, 8)
    assert dg.calc_diff(torch.ones(3), torch.ones(3)) == 0.0 and dg.calc_diff(torch.zeros(3), torch.zeros(3)) == 0.0


# bad input ------------------------------------------------------------------------------------------------

def test_bad_input_raises():
    m, n, k = 4, 132, 448
    a, b = torch.randn(m, k, dtype=torch.bfloat16), torch.randn(n, k, dtype=torch.bfloat16)
    qa, qb = quant(a, b)
    d = torch.empty(m, n, dtype=torch.bfloat16)
    cases = [
        (lambda: dg.fp8_gemm_nt((qa[0], qa[1][:, :3]), qb, d), "sfa"),             # scale shape
        (lambda: dg.fp8_gemm_nt(qa, (qb[0], qb[1].T.contiguous()), d), "sfb"),
        (lambda: dg.fp8_gemm_nt((a, qa[1]), qb, d), "a"),                           # dtype
        (lambda: dg.fp8_gemm_nt(qa, qb, d.half()), "d"),
        (lambda: dg.fp8_gemm_nt(qa, (qb[0][:, :384], qb[1][:, :3]), d), "b"),       # K mismatch
        (lambda: dg.fp8_gemm_nt(qa, qb, torch.empty(m, n + 1, dtype=torch.bfloat16)), "d"),
        (lambda: dg.fp8_gemm_nt(qa, qb, d, recipe=(1, 128, 32)), "recipe"),
        (lambda: dg.fp8_gemm_nt(qa, qb, d, c=torch.empty(m, n)), "c"),
        (lambda: dg.fp8_gemm_nt(qa, qb, torch.empty(n, m, dtype=torch.bfloat16).T), "d"),  # strided output
        (lambda: dg.bf16_gemm_nt(a, b[:, ::2], torch.empty(m, n)), "b"),
        (lambda: dg.fp8_gemm_nt(qa, (torch.empty(n, 2 * k, dtype=FP8)[:, ::2], qb[1]), d), "b"),  # strides
    ]
    qg = (qb[0].unsqueeze(0).repeat(2, 1, 1), qb[1].unsqueeze(0).repeat(2, 1, 1))
    a2 = dg.per_token_cast_to_fp8(torch.randn(256, k, dtype=torch.bfloat16), False)
    d2 = torch.empty(256, n, dtype=torch.bfloat16)
    mi = torch.zeros(256, dtype=torch.int32)
    bad_range, split = mi.clone(), mi.clone()
    bad_range[0] = 2
    split[64:128] = 1  # two groups inside one 128-row block
    cases += [
        (lambda: dg.m_grouped_fp8_gemm_nt_contiguous(a2, qg, d2, bad_range), "m_indices"),
        (lambda: dg.m_grouped_fp8_gemm_nt_contiguous(a2, qg, d2, split), "m_indices"),
        (lambda: dg.m_grouped_fp8_gemm_nt_contiguous(a2, qg, d2, mi[:100]), "m_indices"),
        (lambda: dg.m_grouped_fp8_gemm_nt_contiguous(a2, qg, d2, mi.long()), "grouped_layout"),
        (lambda: dg.m_grouped_fp8_gemm_nt_contiguous(a2, qg, d2, torch.tensor([200, 100], dtype=torch.int32),
                                                     use_psum_layout=True), "grouped_layout"),
        (lambda: dg.m_grouped_fp8_gemm_nt_masked((qa[0][None], qa[1][None]), qg, d[None],
                                                 torch.tensor([1], dtype=torch.int32), 4), "groups"),
        (lambda: dg.m_grouped_fp8_gemm_nt_masked((qa[0][None].repeat(2, 1, 1), qa[1][None].repeat(2, 1, 1)), qg,
                                                 d[None].repeat(2, 1, 1), torch.tensor([1, 5], dtype=torch.int32),
                                                 4), "masked_m"),
        (lambda: dg.k_grouped_fp8_gemm_tn_contiguous((a2[0][:200].T.contiguous().T, a2[1]), qb, torch.empty(1, 4, 4),
                                                     [200], torch.tensor([200], dtype=torch.int32)), "a"),
        (lambda: dg.k_grouped_bf16_gemm_tn_contiguous(torch.randn(200, 4, dtype=torch.bfloat16),
                                                      torch.randn(200, 4, dtype=torch.bfloat16),
                                                      torch.empty(1, 4, 4), [200],
                                                      torch.tensor([200], dtype=torch.int32)), "ks_cpu"),
    ]
    for fn, word in cases:
        with pytest.raises(ValueError, match=word):
            fn()
    with pytest.raises(TypeError):
        dg.fp8_gemm_nt(qa, qb, d.numpy() if False else "d")
    with pytest.raises(TypeError):
        dg.fp8_gemm_nt(qa[0], qb, d)


# the reference interpreter --------------------------------------------------------------------------------

def test_interp_matches_c(monkeypatch):
    m, n, k, groups = 3, 40, 200, 2
    a, b = torch.randn(m, k, dtype=torch.bfloat16), torch.randn(n, k, dtype=torch.bfloat16)
    qa, qb = quant(a, b)
    ag = dg.per_token_cast_to_fp8(torch.randn(256, k, dtype=torch.bfloat16), False)
    bg = [dg.per_block_cast_to_fp8(torch.randn(n, k, dtype=torch.bfloat16), False) for _ in range(groups)]
    bg = (torch.stack([x[0] for x in bg]), torch.stack([x[1] for x in bg]))
    mi = torch.cat([torch.zeros(100, dtype=torch.int32), -torch.ones(28, dtype=torch.int32),
                    torch.ones(128, dtype=torch.int32)])
    outs = {}
    for target in ("c", "interp"):
        monkeypatch.setenv("TEGULA_TARGET", target)
        d = torch.empty(m, n, dtype=torch.bfloat16)
        dg.fp8_gemm_nt(qa, qb, d)
        dgr = torch.empty(256, n, dtype=torch.bfloat16)
        dg.m_grouped_fp8_gemm_nt_contiguous(ag, bg, dgr, mi)
        db = torch.empty(m, n)
        dg.bf16_gemm_nt(a, b, db)
        outs[target] = (d, dgr, db)
    for x, y in zip(outs["c"], outs["interp"]):
        assert dg.calc_diff(x, y) < 1e-6
    assert dg.calc_diff(outs["interp"][0], a.float() @ b.float().T) < 1e-3


def test_interp_grouped_and_indexer(monkeypatch):
    """The masked, K-grouped and indexer kernels on the reference interpreter agree with the c target."""
    k, n, groups = 256, 40, 2
    qa = (torch.randn(groups, 8, k, dtype=torch.bfloat16).to(FP8), torch.rand(groups, 8, 2) + 0.5)
    qb = (torch.randn(groups, n, k, dtype=torch.bfloat16).to(FP8), torch.rand(groups, 1, 2) + 0.5)
    masked_m = torch.tensor([3, 8], dtype=torch.int32)
    ks = [128, 256]
    ka = (torch.randn(384, 16, dtype=torch.bfloat16).to(FP8), torch.rand(3, 16) + 0.5)
    kb = (torch.randn(384, n, dtype=torch.bfloat16).to(FP8), torch.rand(3, n) + 0.5)
    q = torch.randn(6, 4, 32, dtype=torch.bfloat16).to(FP8)
    kv = (torch.randn(50, 32, dtype=torch.bfloat16).to(FP8), torch.rand(50) + 0.5)
    w = torch.randn(6, 4)
    kst = torch.tensor([0, 3, 10, 20, 0, 49], dtype=torch.int32)
    ken = torch.tensor([5, 3, 40, 50, 50, 50], dtype=torch.int32)
    outs = {}
    for target in ("c", "interp"):
        monkeypatch.setenv("TEGULA_TARGET", target)
        d = torch.zeros(groups, 8, n, dtype=torch.bfloat16)
        dg.m_grouped_fp8_gemm_nt_masked(qa, qb, d, masked_m, 4)
        dk = torch.ones(groups, 16, n)
        dg.k_grouped_fp8_gemm_tn_contiguous(ka, kb, dk, ks, torch.tensor(ks, dtype=torch.int32), dk)
        logits = dg.fp8_mqa_logits(q, kv, w, kst, ken)
        outs[target] = (d, dk, logits)
    for x, y in zip(outs["c"], outs["interp"]):
        assert torch.equal(x == float("-inf"), y == float("-inf"))
        inf = x == float("-inf")
        assert dg.calc_diff(x.masked_fill(inf, 0), y.masked_fill(inf, 0)) < 1e-6
