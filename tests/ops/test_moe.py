"""tegula.ops.moe against plain torch references: top-k as a stable descending sort, DeepSeek's group-limited
routing written out in torch (sigmoid weights bit for bit; softmax / sqrt-softplus weights to 2e-6, their exp and
log1p not being torch's), the per-expert contiguous layout checked entry by entry, expand / reduce bit for bit
(reduce's multiply-adds fused, as on the GPU)."""
import pytest
import torch
import torch.nn.functional as F
from _quant_ref import assert_equal, fma, sigmoid

from tegula.ops import moe

torch.manual_seed(0)


@pytest.fixture(params=["c", "interp"])
def target(request, monkeypatch):
    monkeypatch.setenv("TEGULA_TARGET", request.param)
    return request.param


def tokens(target):
    return 4001 if target == "c" else 7


def stable_topk(s, k):
    return torch.sort(s, dim=1, descending=True, stable=True)[1][:, :k].contiguous()


@pytest.mark.parametrize("e,k", [(72, 6), (256, 8), (36, 2)])
def test_topk_gate(target, e, k):
    s = torch.randn(tokens(target), e)
    s[:, 3] = s[:, 5]  # ties go to the lower index
    s[0] = 0.0
    s[1] = 0.0
    s[1, ::2] = -0.0  # equal to 0.0: still the lower index first
    s[2] = float("-inf")
    s[2, e - 1] = 1.0
    assert_equal(moe.topk_gate(s, k), stable_topk(s, k))


def test_normalize_weight(target):
    w = torch.rand(tokens(target), 6)
    w[0] = 0.0  # denominator 1e-20
    w[1, :2] = torch.tensor([1e-21, -1e-20])  # sums to exactly 0 and on: 0 / 0 and x / 0
    w[2, 3] = float("inf")
    w[3, 0] = float("nan")
    w[4] = torch.tensor([1e-45, 3e-39, -2e-38, 1e-44, 5e-40, 1e-30])  # subnormal quotients
    den, out = moe.normalize_weight(w)
    ref = torch.full((w.shape[0],), 1e-20)
    for k in range(6):
        ref = ref + w[:, k]
    assert_equal(den, ref)
    assert_equal(out, w / ref.unsqueeze(1))
    # a shape seen before takes the bound launcher only for contiguous float32 weights
    wt = torch.rand(6, w.shape[0]).T
    assert_equal(moe.normalize_weight(wt)[1], moe.normalize_weight(wt.contiguous())[1])
    with pytest.raises(TypeError, match="topk_weights"):
        moe.normalize_weight(w.double())
    if target == "c":  # above moe._NORMALIZE_SERIAL_MAX values: the grid kernel (below it, one thread's)
        big = torch.rand(moe._NORMALIZE_SERIAL_MAX // 4 + 1001, 4)
        den, out = moe.normalize_weight(big)
        ref = 1e-20 + big[:, 0] + big[:, 1] + big[:, 2] + big[:, 3]
        assert_equal(den, ref)
        assert_equal(out, big / ref.unsqueeze(1))


def test_normalize_weight_by_reciprocal_keeps_the_quotients_bits(target):
    # whole blocks of 256 rows divide by one reciprocal a row and an fma correction where every |d| and nonzero
    # |w| lies in [2^-40, 2^40]: magnitudes across that range, both signs, zeros of both signs; blocks 1 and 3
    # hold one value outside it each (the block divides), and the last rows form a partial block
    n, k = 4 * 256 + 77, 8
    g = torch.Generator().manual_seed(3)
    w = (torch.rand(n, k, generator=g) + 0.5) * torch.pow(2.0, torch.randint(-38, 38, (n, k), generator=g).float())
    w = torch.where(torch.rand(n, k, generator=g) < 0.3, -w, w)
    w[torch.rand(n, k, generator=g) < 0.05] = 0.0
    w[torch.rand(n, k, generator=g) < 0.05] = -0.0
    w[300, 2] = 1e-30
    w[800, 5] = 3e15
    w[1030] = torch.tensor([2.0, -2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])   # d = 1e-20
    den, out = moe.normalize_weight(w)
    ref = torch.full((n,), 1e-20)
    for j in range(k):
        ref = ref + w[:, j]
    assert_equal(den, ref)
    assert_equal(out, w / ref.unsqueeze(1))   # (bytes: a zero's sign too)


# DeepSeek's routing ------------------------------------------------------------------------------------------------

def top2_sum_gate_ref(logits, bias, k, ntg, ng, shared, ns, scale, ep_rank, ep_ranks, tp_rank, tp_ranks, scoring,
                      mask=None, fix=None, pmap=None, lcount=None, unmapped=None):
    n, e = logits.shape
    ns = ns if shared else 0
    s = {"sigmoid": lambda: sigmoid(logits), "sqrtsoftplus": lambda: F.softplus(logits).sqrt(),
         "softmax": lambda: torch.softmax(logits, -1)}[scoring]()
    b = (logits if scoring == "softmax" else s) + bias
    if ng != ntg:
        groups = b.view(n, ng, e // ng).topk(2, -1).values.sum(-1)
        keep = torch.zeros(n, ng, dtype=torch.bool).scatter_(1, stable_topk(groups, ntg), True)
        b = b.masked_fill(~keep.repeat_interleave(e // ng, 1), float("-inf"))
    sel = stable_topk(b, k)
    if fix is not None:
        sel = torch.where(fix.unsqueeze(1), unmapped, sel)
    w = s.gather(1, sel)
    total = torch.full((n,), 1e-20)
    for j in range(k):
        total = total + w[:, j]
    w = w / total.unsqueeze(1) * scale
    active = mask if mask is not None else torch.ones(n, dtype=torch.bool)
    if unmapped is not None:
        unmapped.copy_(torch.where(active.unsqueeze(1), sel, -1))
    idx = torch.cat([sel, (e + torch.arange(ns)).expand(n, ns)], 1)
    wt = torch.cat([w, torch.ones(n, ns)], 1)
    extra = 0
    if pmap is not None:
        extra = pmap.shape[1] - 1
        dup = (ep_rank + torch.arange(n).unsqueeze(1) * 23333) % lcount[idx].long()
        idx = pmap[idx, dup].long()
    per_rank = (e + extra) // ep_ranks
    per_dp = per_rank * tp_ranks
    local = idx - tp_rank * per_rank
    dp = local // per_dp
    local = local - dp * per_dp + dp * per_rank
    local = torch.where((idx // per_rank % tp_ranks != tp_rank) | (local < 0), -1, local)
    return torch.where(active.unsqueeze(1), local, -1), torch.where(active.unsqueeze(1), wt, 0.0)


GATES = [  # (groups, top groups, experts, shared, top-k, scoring, shared-as-routed, mask, fix, tp rank)
    (0, 0, 72, 1, 6, "sigmoid", False, False, False, 0),
    (8, 4, 256, 2, 8, "sigmoid", True, True, True, 1),
    (8, 4, 256, 2, 8, "softmax", False, True, False, 0),
    (0, 0, 144, 2, 6, "sqrtsoftplus", True, False, True, 1),
    (8, 8, 256, 2, 8, "sigmoid", False, False, False, 0),
]


@pytest.mark.parametrize("case", GATES, ids=lambda c: "-".join(map(str, c)))
def test_top2_sum_gate(target, case):
    ng, ntg, e, ns, k, scoring, shared, masked, fixed, tp_rank = case
    n = tokens(target) if target == "interp" else 1001
    logits, bias = torch.randn(n, e), torch.randn(e) * 0.1
    if scoring != "sigmoid":  # the ranking must not hinge on the last ulp, where tegula's softmax may differ
        s = F.softplus(logits).sqrt() if scoring == "sqrtsoftplus" else torch.softmax(logits, -1)
        b = ((logits if scoring == "softmax" else s) + bias).sort(-1, descending=True).values
        keep = (b[:, :k] - b[:, 1:k + 1] > 1e-5).all(1)
        logits = logits[keep]
        n = logits.shape[0]
    mask = torch.ones(n, dtype=torch.bool) if masked else None
    if masked:
        mask[-3:] = False
    fix = unmapped = None
    unmapped = torch.zeros(n, k, dtype=torch.int64)
    if fixed:
        fix = torch.zeros(n, dtype=torch.bool)
        fix[::3] = True
        unmapped = torch.stack([torch.randperm(e)[:k] for _ in range(n)])
    unmapped_ref = unmapped.clone()
    pmap = lcount = None
    if shared:
        pmap = torch.arange(e + ns, dtype=torch.int32).view(-1, 1).expand(-1, 33).contiguous()
        pmap[:, 1], pmap[:, 2] = (pmap[:, 0] + 7) % (e + 32), (pmap[:, 0] + 13) % (e + 32)
        lcount = torch.ones(e + ns, dtype=torch.int32)
        lcount[::5] = 3
    args = (logits, bias, k, ntg, ng, shared, ns, 1.5, 0, 4, tp_rank, 2, scoring)
    idx, w = moe.top2_sum_gate(*args, mask=mask, fix_routing_mask=fix, to_physical_map=pmap, logical_count=lcount,
                               unmapped_topk_idx=unmapped)
    ridx, rw = top2_sum_gate_ref(*args, mask=mask, fix=fix, pmap=pmap, lcount=lcount, unmapped=unmapped_ref)
    assert_equal(idx, ridx)
    assert_equal(unmapped, unmapped_ref)
    if scoring == "sigmoid":
        assert_equal(w, rw)
    else:
        torch.testing.assert_close(w, rw, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("ng,ntg,e,k,finite", [(8, 4, 256, 8, 32), (8, 2, 64, 8, 3), (8, 2, 64, 6, 3),
                                                (4, 1, 16, 6, 4), (8, 1, 16, 4, 2)])
def test_top2_sum_gate_kept_groups(target, ng, ntg, e, k, finite):
    """The experts are chosen among the kept groups' only; where the k-th of them is -inf (here: `finite` experts
    per group have a finite bias), a dropped group's expert (-inf after the group mask, lower index first) may rank
    instead; ties everywhere. (NaN scores are not pinned down: torch ranks NaN groups first, tegula last.)"""
    n = 25  # (not a multiple of the rows per block)
    logits, bias = torch.randn(n, e), torch.randn(e) * 0.1
    bias.view(ng, -1)[:, finite:] = float("-inf")
    logits[:8] = 0.0  # all scores equal: ties everywhere
    bias[:4] = 0.0
    logits[12:16] = float("-inf")  # sigmoid 0: the bias decides
    logits[20] = -0.0
    args = (logits, bias, k, ntg, ng, False, 0, 1.5, 0, 1, 0, 1, "sigmoid")
    idx, w = moe.top2_sum_gate(*args)
    ridx, rw = top2_sum_gate_ref(*args)
    assert_equal(idx, ridx)
    assert_equal(w, rw)


def test_top2_sum_gate_candidate_list(target):
    """top-8 of 4 kept groups of 32 (2 x 4 >= 8): a block selects among the keys at or above the smallest second
    best of its kept groups where every row has 8 to 32 of them, else among all 128. Rows here: random (about 10
    pass), 33 or 64 tied at the top (a list too long: the block falls back), all tied, and just 32 tied."""
    n, e = (24 if target == "interp" else 64), 256
    logits, bias = torch.randn(n, e), torch.randn(e) * 0.1
    bias[:] = 0.0
    logits[1, :64] = 4.0              # groups 0 and 1 entirely tied: 64 candidates
    logits[2, 32:65] = 4.0            # 33 tied across groups 1 and 2
    logits[9] = 1.0                   # everything tied
    for g in (0, 2, 5, 7):            # 8 tied in each of 4 groups: exactly 32 candidates, in a block of its own
        logits[20, g * 32:g * 32 + 8] = 4.0
    args = (logits, bias, 8, 4, 8, False, 0, 2.5, 0, 1, 0, 1, "sigmoid")
    idx, w = moe.top2_sum_gate(*args)
    ridx, rw = top2_sum_gate_ref(*args)
    assert_equal(idx, ridx)
    assert_equal(w, rw)


# the per-expert contiguous layout ---------------------------------------------------------------------------------

def random_topk_idx(n, e, k):
    idx = torch.argsort(torch.rand(n, e), dim=1)[:, :k]
    idx[torch.rand(n, k) < 0.1] = -1
    return idx.contiguous()


def check_mapping(idx, e, a, result):
    p2e, p2t, p2tt, ttp, start, end, count, counts = result
    n, k = idx.shape
    sizes = torch.bincount(idx[idx >= 0], minlength=e)
    aligned = (sizes + a - 1) // a * a
    assert counts == aligned.tolist()
    assert_equal(count, aligned.int())
    assert_equal(start, (torch.cumsum(aligned, 0) - aligned).int())
    assert_equal(end, torch.cumsum(aligned, 0).int())
    ref_p2tt = torch.full((int(aligned.sum()),), -1, dtype=torch.int32)
    ref_p2e = ref_p2tt.clone()
    flat = idx.view(-1)
    for x in range(e):  # within an expert, rows follow the flat (token, k) order
        entries = (flat == x).nonzero().flatten()
        ref_p2e[start[x]:start[x] + entries.numel()] = x
        ref_p2tt[start[x]:start[x] + entries.numel()] = entries.int()
    assert_equal(p2e, ref_p2e)
    assert_equal(p2tt, ref_p2tt)
    assert_equal(p2t, torch.where(ref_p2tt >= 0, ref_p2tt // k, -1).int())
    ref_ttp = torch.full((n * k,), -1, dtype=torch.int32)
    valid = ref_p2tt >= 0
    ref_ttp[ref_p2tt[valid].long()] = torch.arange(ref_p2tt.numel(), dtype=torch.int32)[valid]
    assert_equal(ttp, ref_ttp.view(n, k))


@pytest.mark.parametrize("e,k,a", [(72, 6, 64), (256, 8, 128), (72, 2, 16)])
def test_get_fused_mapping(target, e, k, a):
    idx = random_topk_idx(tokens(target), e, k)
    check_mapping(idx, e, a, moe.get_fused_mapping(idx, e, 0, a))
    if e == 72 and k == 6:  # a given size (larger than needed): the same layout, padded with -1
        r = moe.get_fused_mapping(idx, e, 4096 * 8, a)
        assert r[0].shape == (4096 * 8,) and r[7] == []
        used = int(r[5][-1])
        assert (r[0][used:] == -1).all() and (r[1][used:] == -1).all()


@pytest.mark.parametrize("serial_max", [-1, 1 << 40])
def test_get_fused_mapping_both_walks(target, monkeypatch, serial_max):
    """Small inputs walk their chunks in one block (no OpenMP region), large ones take a grid: both give the
    same layout over several chunks, and both find a bad entry in a later chunk."""
    monkeypatch.setattr(moe, "_MAPPING_SERIAL_MAX", serial_max)
    n = 3 * moe._CHUNK // 8 + 5 if target == "c" else 7
    idx = random_topk_idx(n, 72, 8)
    check_mapping(idx, 72, 64, moe.get_fused_mapping(idx, 72, 0, 64))
    bad = idx.clone()
    bad.view(-1)[-1] = 72
    with pytest.raises(ValueError, match="topk_idx"):
        moe.get_fused_mapping(bad, 72, 0, 64)


def test_results_reuse_memory_only_once_let_go(target):
    """get_fused_mapping and normalize_weight hand out their last result's memory again only where the caller
    holds none of it (a view, a numpy array of it): a kept result stays as it was."""
    n = tokens(target)
    idx1, idx2 = random_topk_idx(n, 72, 6), random_topk_idx(n, 72, 6)
    r1 = moe.get_fused_mapping(idx1, 72, 4096 * 8, 64)
    kept = r1[3][1:]   # a view of a view: the block stays referenced
    copy = kept.clone()
    addr = r1[0].data_ptr()
    del r1
    r2 = moe.get_fused_mapping(idx2, 72, 4096 * 8, 64)
    assert r2[0].data_ptr() != addr and torch.equal(kept, copy)
    addr = r2[0].data_ptr()
    del r2, kept
    r3 = moe.get_fused_mapping(idx1, 72, 4096 * 8, 64)
    assert r3[0].data_ptr() == addr   # nothing held it: the same memory, rewritten
    ref = moe.get_fused_mapping(idx1.clone(), 72, 4096 * 8, 64)
    assert all(torch.equal(a, b) for a, b in zip(r3[:7], ref[:7]))
    w1, w2 = torch.rand(n, 8), torch.rand(n, 8)
    den1, out1 = moe.normalize_weight(w1)
    held = out1.numpy()
    expect = held.copy()
    del out1
    moe.normalize_weight(w2)
    assert (held == expect).all() and torch.equal(torch.from_numpy(held), w1 / den1.unsqueeze(1))
    den3, out3 = moe.normalize_weight(w1)
    addr = out3.data_ptr(), den3.data_ptr()
    del den3, out3
    den4, out4 = moe.normalize_weight(w2)
    assert (out4.data_ptr(), den4.data_ptr()) == addr and torch.equal(out4, w2 / den4.unsqueeze(1))


def test_recycled_holds_no_large_result(monkeypatch):
    from tegula.ops import _tk
    r = _tk.Recycled()
    monkeypatch.setattr(_tk.Recycled, "MAX_BYTES", 4096)
    a = r.take((1024,), torch.int32)   # 4 KiB: held, and handed out again once let go
    addr = a.data_ptr()
    del a
    assert r.take((1024,), torch.int32).data_ptr() == addr
    big = r.take((1025,), torch.int32)   # over the bound: new memory, the slot emptied
    assert big.shape == (1025,) and r._local.block is None


@pytest.mark.parametrize("n", [0, 5])
def test_get_fused_mapping_without_entries(target, n):
    """No token, or every entry -1: every position of a given size is padding (-1 in all three arrays)."""
    idx = torch.full((n, 4), -1, dtype=torch.int64)
    check_mapping(idx, 8, 16, moe.get_fused_mapping(idx, 8, 0, 16))
    r = moe.get_fused_mapping(idx, 8, 64, 16)
    assert all(x.shape == (64,) and (x == -1).all() for x in r[:3])
    assert (r[3] == -1).all() and r[3].shape == (n, 4)


def test_expand_and_reduce_fused(target):
    n, e, k, h = tokens(target), 72, 6, 576
    idx = random_topk_idx(n, e, k)
    p2e, p2t, _, ttp, *_ = moe.get_fused_mapping(idx, e, 0, 64)
    x = torch.randn(n, h).bfloat16()
    out = moe.expand_to_fused(x, ttp, p2e)
    ref = torch.zeros(p2e.numel(), h, dtype=torch.bfloat16)
    valid = p2t >= 0
    ref[valid] = x[p2t[valid].long()]
    assert_equal(out, ref)
    w = torch.rand(n, k)
    acc = torch.zeros(n, h)
    for j in range(k):  # x * w + acc rounded once per step, as the GPU's FMA
        pos = ttp[:, j]
        acc = torch.where((pos >= 0).unsqueeze(1), fma(out[pos.clamp(min=0).long()].float(), w[:, j:j + 1], acc), acc)
    assert_equal(moe.reduce_fused(out, w, ttp), acc.bfloat16())
    # FP8 rows with a scale per row, an FP8 result scaled by sf
    q = out.float().to(torch.float8_e4m3fn)
    xs, sf = torch.rand(out.shape[0]) + 0.5, torch.tensor([0.75])
    acc = torch.zeros(n, h)
    for j in range(k):
        pos = ttp[:, j].clamp(min=0).long()
        acc = torch.where((ttp[:, j] >= 0).unsqueeze(1), fma(q[pos].float(), (w[:, j] * xs[pos]).unsqueeze(1), acc),
                          acc)
    ref8 = (acc * sf[0].item()).to(torch.float8_e4m3fn)
    prealloc = torch.empty(n, h, dtype=torch.float8_e4m3fn)
    assert moe.reduce_fused((q, xs), w, ttp, "e4m3", sf, out=prealloc) is prealloc
    assert_equal(prealloc, ref8)
    # scale rows expanded with the data, column-major and TMA-aligned
    packed = torch.randint(0, 2 ** 31 - 1, (n, 2), dtype=torch.int32)
    data, sfe = moe.expand_to_fused_with_sf((q[:n], packed), 128, ttp, p2e, True)
    ref_sf = torch.zeros(p2e.numel(), 2, dtype=torch.int32)
    ref_sf[valid] = packed[p2t[valid].long()]
    assert sfe.stride() == (1, (p2e.numel() + 3) // 4 * 4)
    assert torch.equal(sfe, ref_sf)


def test_bad_input_names_the_argument():
    s = torch.randn(4, 16)
    idx = torch.zeros(4, 2, dtype=torch.int64)
    args = (s, torch.zeros(16), 2, 0, 0, False, 0, 1.0, 0, 1, 0, 1, "sigmoid")
    pm = torch.arange(16, dtype=torch.int32).view(-1, 1).repeat(1, 2)
    for fn, exc, name in [
        (lambda: moe.topk_gate(s, 17), ValueError, "num_topk"),
        (lambda: moe.topk_gate(s.double(), 2), TypeError, "scores"),
        (lambda: moe.top2_sum_gate(*args[:-1], "relu"), ValueError, "scoring_func"),
        (lambda: moe.top2_sum_gate(s, torch.zeros(15), *args[2:]), ValueError, "bias"),
        (lambda: moe.top2_sum_gate(*args[:3], 2, 0, *args[5:]), ValueError, "num_topk_groups"),
        (lambda: moe.top2_sum_gate(*args, fix_routing_mask=torch.ones(4, dtype=torch.bool)), ValueError,
         "unmapped_topk_idx"),
        (lambda: moe.top2_sum_gate(*args, mask=torch.ones(3, dtype=torch.bool)), ValueError, "mask"),
        (lambda: moe.top2_sum_gate(*args, to_physical_map=pm, logical_count=torch.zeros(16, dtype=torch.int32)),
         ValueError, "logical_count"),
        (lambda: moe.top2_sum_gate(*args, to_physical_map=pm + 17, logical_count=torch.ones(16, dtype=torch.int32)),
         ValueError, "to_physical_map"),
        (lambda: moe.get_fused_mapping(idx + 16, 16, 0, 8), ValueError, "topk_idx"),
        (lambda: moe.get_fused_mapping(idx - 2, 16, 0, 8), ValueError, "topk_idx"),
        (lambda: moe.get_fused_mapping(torch.cat([idx] * 3000).index_fill(0, torch.tensor([9000]), 99), 16, 0, 8),
         ValueError, "topk_idx"),   # one bad entry in a later chunk of the histogram
        (lambda: moe.get_fused_mapping(idx, 16, 8, 16), ValueError, "num_expanded_tokens"),
        (lambda: moe.get_fused_mapping(idx.int(), 16, 0, 8), TypeError, "topk_idx"),
        (lambda: moe.expand_to_fused(s, idx.int() + 5, torch.zeros(1, dtype=torch.int32)), ValueError,
         "token_topk_to_pos"),
        (lambda: moe.reduce_fused(s, None, idx.int(), fp8_format="e5m2"), ValueError, "fp8_format"),
        (lambda: moe.reduce_fused(s, None, idx.int(), sf=torch.ones(1)), ValueError, "sf"),
        (lambda: moe.reduce_fused(s, torch.ones(4, 3), idx.int()), ValueError, "topk_weights"),
    ]:
        with pytest.raises(exc, match=name):
            fn()
