"""tegula.ops.attention against fp32 torch references (over the dequantised cache), with FlashMLA's tests'
tolerances: out within atol or rtol per element plus a cosine-difference bound, lse tighter, inf/NaN at the same
places. FlashMLA's shapes scaled down: uneven cache lengths (0, 1, partial pages, long enough to split), NaN in
unused cache rows and garbage block-table entries past each sequence, invalid sparse indices. Runs on the c
target; tiny cases on interp."""
import math
import random

import pytest
import torch

from tegula.ops import attention as A

NAN_PAGE = 2147480000  # FlashMLA's tests: block-table entries past a sequence hold garbage


@pytest.fixture(autouse=True)
def _seed(monkeypatch):
    monkeypatch.setenv("TEGULA_TARGET", "c")
    torch.manual_seed(0)
    random.seed(0)


@pytest.fixture
def interp(monkeypatch):
    monkeypatch.setenv("TEGULA_TARGET", "interp")


def check(name, ans, ref, abs_tol, rel_tol, cos_tol=1e-7):
    """FlashMLA's acceptance rule: the same inf/NaN positions, then every element within abs_tol or rel_tol,
    and 1 - cosine similarity within cos_tol."""
    assert ans.shape == ref.shape, f"{name}: shape {tuple(ans.shape)} vs {tuple(ref.shape)}"
    ans, ref = ans.double().clone(), ref.double().clone()
    for special in (math.inf, -math.inf, math.nan):
        ma = ans.isnan() if special != special else ans == special
        mr = ref.isnan() if special != special else ref == special
        assert torch.equal(ma, mr), f"{name}: {special} at {int(ma.sum())} places, reference {int(mr.sum())}"
        ans[ma], ref[mr] = 0, 0
    err = (ans - ref).abs()
    ok = (err < abs_tol) | (err / (ref.abs() + 1e-6) < rel_tol)
    assert ok.all(), f"{name}: {int((~ok).sum())} of {ok.numel()} elements off, max abs err {float(err.max()):.3g}"
    denom = float((ans * ans + ref * ref).sum())
    if float((ref * ref).sum()) >= 1e-12 and denom > 0:
        cos_diff = 1 - 2 * float((ans * ref).sum()) / denom
        assert cos_diff <= cos_tol, f"{name}: cosine difference {cos_diff:.3g} > {cos_tol}"


# references ---------------------------------------------------------------------------------------------------

def attend(q, kv, dv, scale, mask):
    """q [h, s, d], kv [n, d], mask [s, n] (True: attend) -> out [h, s, dv], lse [h, s], fp32; rows without keys give
    out 0 and lse +inf."""
    s = (q.float() @ kv.float().T) * scale
    s = s.masked_fill(~mask, -math.inf)
    lse = s.logsumexp(-1)
    out = torch.softmax(s, -1).nan_to_num(0) @ kv[:, :dv].float()
    lonely = lse == -math.inf
    out[lonely] = 0
    lse[lonely] = math.inf
    return out, lse


def ref_dense(q, cache, block_table, lens, dv, causal, scale):
    b, s_q, h_q, d = q.shape
    ps, h_kv = cache.shape[1], cache.shape[2]
    out, lse = torch.empty(b, s_q, h_q, dv), torch.empty(b, h_q, s_q)
    for i in range(b):
        n = int(lens[i])
        kv = cache[block_table[i, :-(-n // ps)].long()].reshape(-1, h_kv, d)[:n]
        mask = torch.ones(s_q, n, dtype=torch.bool)
        if causal:
            mask = mask.tril(n - s_q)
        for hk in range(h_kv):
            heads = slice(hk * (h_q // h_kv), (hk + 1) * (h_q // h_kv))
            o, l = attend(q[i, :, heads].transpose(0, 1), kv[:, hk], dv, scale, mask)
            out[i, :, heads], lse[i, heads] = o.transpose(0, 1), l
    return out, lse


def ref_sparse(q, cache, indices, topk_length, dv, scale, sink, n_valid):
    """q [t, h, d] queries, each with its own key rows indices[t] of ``cache`` [n, d]; returns out [t, h, dv],
    lse [t, h] and the largest valid scaled score [t, h] (-inf without keys)."""
    t, h, d = q.shape
    topk = indices.shape[1]
    ok = (indices >= 0) & (indices < n_valid)
    if topk_length is not None:
        ok &= torch.arange(topk)[None, :] < topk_length[:, None]
    kv = cache[indices.clamp(0, n_valid - 1).long()].float()          # [t, topk, d]
    kv = torch.where(ok[..., None], kv, 0.0)
    s = (q.float() @ kv.transpose(1, 2)) * scale                         # [t, h, topk]
    s = s.masked_fill(~ok[:, None, :], -math.inf)
    lse = s.logsumexp(-1)
    out = torch.softmax(s, -1).nan_to_num(0) @ kv[..., :dv]
    lonely = lse == -math.inf
    out[lonely] = 0
    lse[lonely] = math.inf
    if sink is not None:
        out *= (1 / (1 + torch.exp(sink[None, :] - lse)))[:, :, None].nan_to_num(0)
    return out, lse, s.amax(-1)


def paged_cache(b, max_len, lens, ps, h_kv, d, dtype):
    """FlashMLA's test data: a shuffled block table, NaN in every cache row past a sequence's end, garbage page
    numbers in the block table past it."""
    pages = -(-max_len // ps)
    block_table = torch.randperm(b * pages).int().view(b, pages)
    cache = (torch.randn(b * pages, ps, h_kv, d) / 10).clamp(-1, 1).to(dtype)
    for i in range(b):
        n = int(lens[i])
        used = -(-n // ps)
        cache[block_table[i, used:].long()] = math.nan
        if n % ps:
            cache[block_table[i, used - 1].long(), n % ps:] = math.nan
        block_table[i, used:] = NAN_PAGE
    return cache, block_table


def query(shape, dtype):
    return (torch.randn(shape) / 10).clamp(-1, 1).to(dtype)


# dense decode ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("b,s_q,h_q,h_kv,lens,causal,dtype", [
    (4, 2, 16, 1, [1, 140, 0, 3000], False, torch.bfloat16),   # 3000 keys: split over cores, then combined
    (3, 2, 128, 1, [70, 2, 1], True, torch.bfloat16),          # 256 query rows: two row blocks; rows with no key
    (2, 1, 8, 2, [1500, 64], False, torch.float16),             # grouped kv heads
])
def test_dense_decode(b, s_q, h_q, h_kv, lens, causal, dtype):
    d, dv, ps = 576, 512, 64
    lens = torch.tensor(lens, dtype=torch.int32)
    cache, block_table = paged_cache(b, int(lens.max()), lens, ps, h_kv, d, dtype)
    q = query((b, s_q, h_q, d), dtype)
    meta, splits = A.get_mla_metadata()
    assert splits is None
    out, lse = A.flash_mla_with_kvcache(q, cache, block_table, lens, dv, meta, causal=causal)
    ro, rl = ref_dense(q, cache, block_table, lens, dv, causal, d ** -0.5)
    assert out.dtype == dtype and out.shape == (b, s_q, h_q, dv) and lse.shape == (b, h_q, s_q)
    check("out", out, ro.to(dtype), 8e-4, 2.01 / 128, 5e-6)
    check("lse", lse, rl, 1e-6, 8.01 / 65536)
    # the schedule is reused (FlashMLA's contract); the old get_mla_metadata form gives the same results
    again, _ = A.flash_mla_with_kvcache(q, cache, block_table, lens, dv, meta, causal=causal)
    assert torch.equal(again, out)
    sched, splits = A.get_mla_metadata(lens, s_q * h_q // h_kv, h_kv)
    old, old_lse = A.flash_mla_with_kvcache(q, cache, block_table, lens, dv, sched, splits, causal=causal)
    check("out (old metadata form)", old, ro.to(dtype), 8e-4, 2.01 / 128, 5e-6)
    check("lse (old metadata form)", old_lse, rl, 1e-6, 8.01 / 65536)


def test_dense_decode_fp8_cache_and_scale():
    b, s_q, h_q, d, dv, ps = 2, 1, 16, 576, 512, 32      # pages of 32: two copies per 64-key tile
    lens = torch.tensor([700, 33], dtype=torch.int32)
    cache, block_table = paged_cache(b, 700, lens, ps, 1, d, torch.bfloat16)
    fp8 = A.quantize_kv_cache_fp8(cache.nan_to_num(0))
    deq = A.dequantize_kv_cache_fp8(fp8)
    q = query((b, s_q, h_q, d), torch.bfloat16)
    out, lse = A.flash_mla_with_kvcache(q, fp8, block_table, lens, dv, None, softmax_scale=0.07, is_fp8_kvcache=True)
    ro, rl = ref_dense(q, deq, block_table, lens, dv, False, 0.07)
    check("out", out, ro.bfloat16(), 8e-4, 2.01 / 128, 5e-6)
    check("lse", lse, rl, 1e-6, 8.01 / 65536)


@pytest.mark.parametrize("step", [0.02, 0.2])
def test_decode_and_prefill_with_growing_scores(step):
    """Scores that climb (or fall, per head) along the keys by ``step`` per key: the running maxima move by less
    (0.02: ~1.8 log2 units per tile) or more (0.2: ~18) than the kernels' lazy-rescaling margin within a tile,
    so the output is rescaled at many tiles; both must match the reference."""
    b, s_q, h_q, d, dv, ps = 2, 1, 16, 576, 512, 64
    lens = torch.tensor([1000, 300], dtype=torch.int32)
    cache, block_table = paged_cache(b, 1000, lens, ps, 1, d, torch.bfloat16)
    ramp = torch.arange(b * 1000 // ps * ps + ps).float() * step
    for i in range(b):   # key t of sequence i gets step * t in dim 0
        for p in range(-(-int(lens[i]) // ps)):
            cache[block_table[i, p].long(), :, 0, 0] = ramp[p * ps:(p + 1) * ps].bfloat16()
    q = query((b, s_q, h_q, d), torch.bfloat16)
    q[..., 0] = torch.where(torch.arange(h_q) % 3 == 0, -1.0, 1.0).bfloat16()   # a third of the heads fall
    out, lse = A.flash_mla_with_kvcache(q, cache, block_table, lens, dv, None, softmax_scale=1.0)
    ro, rl = ref_dense(q, cache, block_table, lens, dv, False, 1.0)
    check("out", out, ro.bfloat16(), 8e-4, 2.01 / 128, 5e-6)
    check("lse", lse, rl, 1e-6, 8.01 / 65536)
    s_kv, topk = 400, 256
    kv = query((s_kv, 1, d), torch.bfloat16)
    kv[:, 0, 0] = (torch.arange(s_kv).float() * step).bfloat16()
    qp = query((8, h_q, d), torch.bfloat16)
    qp[..., 0] = q[0, 0, :, 0]
    idx = torch.stack([torch.randperm(s_kv)[:topk].sort().values for _ in range(8)]).int()
    out, max_logits, lse = A.flash_mla_sparse_fwd(qp, kv, idx.view(8, 1, topk), 1.0, dv)
    ro, rl, rmax = ref_sparse(qp, kv.view(s_kv, d), idx, None, dv, 1.0, None, s_kv)
    check("prefill out", out.float(), ro, 8e-4, 3.01 / 128, 7e-6)
    check("prefill lse", lse, rl, 1e-6, 2.01 / 65536)
    check("prefill max_logits", max_logits, rmax, 1e-6, 2.01 / 65536)


def test_dense_decode_interp(interp):
    b, s_q, h_q, d, dv, ps = 2, 2, 4, 80, 64, 16
    lens = torch.tensor([37, 1], dtype=torch.int32)
    cache, block_table = paged_cache(b, 37, lens, ps, 1, d, torch.bfloat16)
    q = query((b, s_q, h_q, d), torch.bfloat16)
    out, lse = A.flash_mla_with_kvcache(q, cache, block_table, lens, dv, A.get_mla_metadata()[0], causal=True)
    ro, rl = ref_dense(q, cache, block_table, lens, dv, True, d ** -0.5)
    check("out", out, ro.bfloat16(), 8e-4, 2.01 / 128, 5e-6)
    check("lse", lse, rl, 1e-6, 8.01 / 65536)


# sparse decode ----------------------------------------------------------------------------------------------------

def sparse_case(b, s_q, h_q, topk, n_blocks, ps, d, fp8):
    cache = (torch.randn(n_blocks, ps, 1, d) / 10).clamp(-1, 1).bfloat16()
    n_tok = n_blocks * ps
    idx = torch.stack([torch.randperm(n_tok)[:topk] for _ in range(b * s_q)]).int().view(b, s_q, topk)
    idx[torch.rand(b, s_q, topk) < 0.2] = -1                  # FlashMLA's invalid marker
    idx[0, 0] = -1                                            # a query with no key at all
    used = torch.zeros(n_tok, dtype=torch.bool)
    used[idx[idx >= 0].long()] = True
    cache.view(n_tok, d)[~used] = math.nan if not fp8 else 0
    stored = A.quantize_kv_cache_fp8(cache) if fp8 else cache
    deq = A.dequantize_kv_cache_fp8(stored) if fp8 else cache
    return stored, deq.view(n_tok, d), idx


@pytest.mark.parametrize("fp8", [False, True])
def test_sparse_decode(fp8):
    b, s_q, h_q, topk, d, dv, ps = 2, 2, 16, 600, 576, 512, 64     # 600 keys per query: split, then combined
    stored, deq, idx = sparse_case(b, s_q, h_q, topk, 10, ps, d, fp8)
    q = query((b, s_q, h_q, d), torch.bfloat16)
    sink = torch.randn(h_q)
    sink[0], sink[1] = math.inf, -math.inf
    topk_length = torch.tensor([450, topk], dtype=torch.int32)
    out, lse = A.flash_mla_with_kvcache(q, stored, None, None, dv, A.get_mla_metadata()[0], is_fp8_kvcache=fp8,
                                        indices=idx, attn_sink=sink, topk_length=topk_length)
    ro, rl, _ = ref_sparse(q.view(b * s_q, h_q, d), deq, idx.view(b * s_q, topk),
                           topk_length.repeat_interleave(s_q), dv, d ** -0.5, sink, deq.shape[0])
    assert lse.shape == (b, h_q, s_q)
    check("out", out, ro.view(b, s_q, h_q, dv).bfloat16(), 1e-3, 2.01 / 128, 5e-6)
    check("lse", lse, rl.view(b, s_q, h_q).transpose(1, 2), 1e-6, 8.01 / 65536)
    assert torch.equal(out[0, 0], torch.zeros_like(out[0, 0])) and torch.isinf(lse[0, :, 0]).all()



def test_sparse_keys_compacted():
    """The keys that count (inside the cache, within topk_length) go to the front of each row in order; the decode
    kernel then walks only those."""
    idx = torch.randint(-3, 40, (5, 33), dtype=torch.int32)
    idx[1] = -1
    idx[2, :] = torch.arange(33)
    lens = torch.tensor([33, 33, 20, 0, 7], dtype=torch.int32)
    tab, cnt = A._compact(idx, lens, 30)
    for r in range(5):
        row = idx[r, :int(lens[r])]
        want = row[(row >= 0) & (row < 30)]
        assert int(cnt[r]) == want.numel()
        assert torch.equal(tab[r, :want.numel()], want)


def test_sparse_decode_mostly_invalid():
    """Few valid keys in long index lists: the schedule splits each query's top-k positions over cores, and after
    the valid keys move to the front most of those pieces are empty (their partials must not count)."""
    b, s_q, h_q, topk, d, dv, ps = 1, 2, 16, 1024, 576, 512, 64
    stored, deq, idx = sparse_case(b, s_q, h_q, topk, 20, ps, d, False)
    last = idx[0, 1][idx[0, 1] >= 0][-1].clone()     # a key whose cache row holds numbers (unused rows: NaN)
    idx[torch.rand(b, s_q, topk) < 0.9] = -1
    idx[0, 1, -1] = last                              # a valid key at the last position
    q = query((b, s_q, h_q, d), torch.bfloat16)
    out, lse = A.flash_mla_with_kvcache(q, stored, None, None, dv, A.get_mla_metadata()[0], indices=idx)
    ro, rl, _ = ref_sparse(q.view(b * s_q, h_q, d), deq, idx.view(b * s_q, topk), None, dv, d ** -0.5, None,
                           deq.shape[0])
    check("out", out, ro.view(b, s_q, h_q, dv).bfloat16(), 1e-3, 2.01 / 128, 5e-6)
    check("lse", lse, rl.view(b, s_q, h_q).transpose(1, 2), 1e-6, 8.01 / 65536)


# sparse prefill -------------------------------------------------------------------------------------------------

def prefill_case(s_q, s_kv, h_q, topk, d):
    q = query((s_q, h_q, d), torch.bfloat16)
    kv = query((s_kv, 1, d), torch.bfloat16)
    idx = torch.stack([torch.randperm(s_kv)[:topk] for _ in range(s_q)]).int()
    bad = torch.tensor([-2147483648, -123456, -1, s_kv, 114514, 2147483647], dtype=torch.int32)
    mask = torch.rand(s_q, topk) < 0.25
    idx[mask] = bad[torch.randint(0, bad.numel(), (int(mask.sum()),))]
    idx[3] = -1
    return q, kv, idx.view(s_q, 1, topk)


@pytest.mark.parametrize("with_extras", [False, True])
def test_sparse_prefill(with_extras):
    s_q, s_kv, h_q, topk, d, dv = 64, 300, 16, 128, 576, 512
    q, kv, idx = prefill_case(s_q, s_kv, h_q, topk, d)
    sink = topk_length = None
    if with_extras:
        sink = torch.randn(h_q)
        sink[2], sink[5] = math.inf, -math.inf
        topk_length = torch.randint(0, topk + 1, (s_q,), dtype=torch.int32)
    out, max_logits, lse = A.flash_mla_sparse_fwd(q, kv, idx, 0.05, dv, sink, topk_length)
    ro, rl, rmax = ref_sparse(q, kv.view(s_kv, d), idx.view(s_q, topk), topk_length, dv, 0.05, sink, s_kv)
    check("out", out.float(), ro, 8e-4, 3.01 / 128, 7e-6)
    check("lse", lse, rl, 1e-6, 2.01 / 65536)
    check("max_logits", max_logits, rmax, 1e-6, 2.01 / 65536)


def test_sparse_prefill_half_tiles():
    """Key counts around the half of the kernel's 64-key tile: a last tile of at most 32 keys is computed on its
    first half only (alone, or after whole tiles whose scores are still in the second half)."""
    counts = [1, 31, 32, 33, 63, 64, 65, 95, 96, 97, 128]
    s_q, s_kv, h_q, topk, d, dv = len(counts), 300, 16, 128, 576, 512
    q = query((s_q, h_q, d), torch.bfloat16)
    kv = query((s_kv, 1, d), torch.bfloat16)
    idx = torch.stack([torch.randperm(s_kv)[:topk] for _ in range(s_q)]).int()
    lens = torch.tensor(counts, dtype=torch.int32)
    out, max_logits, lse = A.flash_mla_sparse_fwd(q, kv, idx.view(s_q, 1, topk), 0.05, dv, None, lens)
    ro, rl, rmax = ref_sparse(q, kv.view(s_kv, d), idx, lens, dv, 0.05, None, s_kv)
    check("out", out.float(), ro, 8e-4, 3.01 / 128, 7e-6)
    check("lse", lse, rl, 1e-6, 2.01 / 65536)
    check("max_logits", max_logits, rmax, 1e-6, 2.01 / 65536)


def test_sparse_prefill_interp(interp):
    s_q, s_kv, h_q, topk, d, dv = 8, 40, 4, 24, 80, 64
    q, kv, idx = prefill_case(s_q, s_kv, h_q, topk, d)
    out, max_logits, lse = A.flash_mla_sparse_fwd(q, kv, idx, d ** -0.5, dv)
    ro, rl, _ = ref_sparse(q, kv.view(s_kv, d), idx.view(s_q, topk), None, dv, d ** -0.5, None, s_kv)
    check("out", out.float(), ro, 8e-4, 3.01 / 128, 7e-6)
    check("lse", lse, rl, 1e-6, 2.01 / 65536)


# FP8 cache ------------------------------------------------------------------------------------------------------

def ref_quantize(x):
    """FlashMLA's test quantiser (tests/quant.py, V32 layout), written out: per 128 values a power-of-two scale."""
    nb, ps = x.shape[:2]
    x = x.view(nb, ps, 576)
    out = torch.empty(nb, ps, 656, dtype=torch.float8_e4m3fn)
    out[..., 528:].view(torch.bfloat16).copy_(x[..., 512:])
    for t in range(4):
        part = x[..., t * 128:(t + 1) * 128]
        inv = torch.pow(2, (part.abs().amax(-1).float() / 448).clamp_min(1e-4).log2().ceil())
        out[..., 512:528].view(torch.float32)[..., t] = inv
        out[..., t * 128:(t + 1) * 128] = (part.float() / inv[..., None]).to(torch.float8_e4m3fn)
    return out.view(nb, ps, 1, 656)


@pytest.mark.parametrize("target", ["c", "interp"])
def test_fp8_cache_round_trip_bit_exact(target, monkeypatch):
    monkeypatch.setenv("TEGULA_TARGET", target)
    x = (torch.randn(3, 16, 1, 576) * torch.logspace(-7, 4, 48).view(3, 16, 1, 1)).bfloat16()
    x[0, 0, 0, :128] = 0                       # a zero tile: scale 2^-13
    x[1, 2, 0, 7] = 448 * 2.0 ** 3             # an exact power of two times 448
    q8 = A.quantize_kv_cache_fp8(x)
    assert q8.dtype == torch.float8_e4m3fn and q8.shape == (3, 16, 1, 656)
    assert torch.equal(q8.view(torch.uint8), ref_quantize(x).view(torch.uint8))
    back = A.dequantize_kv_cache_fp8(q8)
    ref = q8.view(3, 16, 656)[..., :512].float().view(3, 16, 4, 128) * q8.view(3, 16, 656)[..., 512:528].view(
        torch.float32)[..., None]
    assert torch.equal(back[..., :512].view(torch.int16), ref.view(3, 16, 1, 512).bfloat16().view(torch.int16))
    assert torch.equal(back[..., 512:], x[..., 512:])


@pytest.mark.parametrize("target", ["c", "interp"])
def test_exp2_softmax(target):
    """The softmax exponential of the MLA and flash kernels: 2^x within 2.5e-7 relative over the range they use and
    beyond, 2^-inf and 2^x below -127 give 0, NaN stays NaN, and 2^0 = 1 exactly."""
    import tegula
    import tegula.language as T
    from tegula.ops._mla_kernels import exp2_softmax

    def make():
        n = T.dynamic("n")

        @T.prim_func
        def main(X: T.Tensor((n,), "float32"), Y: T.Tensor((n,), "float32")):
            with T.Kernel(T.ceildiv(n, 64), threads=64) as bx:
                for i in T.Parallel(64):
                    if bx * 64 + i < n:
                        Y[bx * 64 + i] = exp2_softmax(X[bx * 64 + i])
        return main

    kern = tegula.jit(make, target=target)()
    x = torch.cat([torch.linspace(-126, 126, 1999), torch.rand(2000) * 20 - 12,
                   torch.tensor([0.0, 0.5, -0.5, 8.0, -127.5, -200.0, -math.inf, math.nan])])
    y = torch.empty_like(x)
    kern(x, y)
    ref = torch.exp2(x.double())
    fin = x > -126.5
    assert ((y[fin].double() - ref[fin]).abs() / ref[fin]).max() < 2.5e-7
    assert torch.equal(y[-4:-1], torch.zeros(3)) and y[-1].isnan() and y[-8] == 1.0 and y[-5] == 256.0


# flash_attn_varlen_func -----------------------------------------------------------------------------------------

def ref_varlen(q, k, v, cq, ck, causal, scale):
    h_q, h_kv = q.shape[1], k.shape[1]
    outs, lses = [], []
    for i in range(cq.numel() - 1):
        qs, ks = slice(int(cq[i]), int(cq[i + 1])), slice(int(ck[i]), int(ck[i + 1]))
        lq, lk = qs.stop - qs.start, ks.stop - ks.start
        mask = torch.ones(lq, lk, dtype=torch.bool)
        if causal:
            mask = mask.tril(lk - lq)
        kk = k[ks].float().repeat_interleave(h_q // h_kv, 1).transpose(0, 1)
        vv = v[ks].float().repeat_interleave(h_q // h_kv, 1).transpose(0, 1)
        s = (q[qs].float().transpose(0, 1) @ kk.transpose(1, 2)) * scale
        s = s.masked_fill(~mask, -math.inf)
        lse = s.logsumexp(-1)
        o = torch.softmax(s, -1).nan_to_num(0) @ vv
        lonely = lse == -math.inf
        o[lonely], lse[lonely] = 0, math.inf
        outs.append(o.transpose(0, 1))
        lses.append(lse.T)
    return torch.cat(outs), torch.cat(lses)


VARLEN_TOL = {torch.float32: (1e-5, 1e-4, 1e-9), torch.bfloat16: (2e-2, 2.01 / 128, 2e-5)}


@pytest.mark.parametrize("dtype,h_q,h_kv,d,dv,causal", [
    (torch.float32, 4, 4, 64, 64, False),
    (torch.float32, 4, 2, 192, 128, True),     # grouped heads, DeepSeek's 192/128 head dims
    (torch.bfloat16, 4, 1, 128, 128, True),
])
def test_flash_attn_varlen(dtype, h_q, h_kv, d, dv, causal):
    lq, lk = [5, 0, 150, 1, 33, 7], [9, 3, 130, 0, 200, 7]     # empty and length-1 sequences, len_q > len_k
    cq = torch.tensor([0] + lq).cumsum(0).int()
    ck = torch.tensor([0] + lk).cumsum(0).int()
    q = torch.randn(int(cq[-1]), h_q, d).to(dtype)
    k = torch.randn(int(ck[-1]), h_kv, d).to(dtype)
    v = torch.randn(int(ck[-1]), h_kv, dv).to(dtype)
    out, lse = A.flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk), softmax_scale=0.1, causal=causal)
    ro, rl = ref_varlen(q, k, v, cq, ck, causal, 0.1)
    assert out.dtype == dtype and out.shape == (cq[-1], h_q, dv) and lse.shape == (cq[-1], h_q)
    atol, rtol, cos = VARLEN_TOL[dtype]
    check("out", out, ro.to(dtype), atol, rtol, cos)
    check("lse", lse, rl, 1e-5, 1e-5)
    assert torch.equal(A.flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk), softmax_scale=0.1, causal=causal,
                                                return_lse=False), out)
    if h_q == h_kv and d == dv:   # FlashMLA's packed forms slice the same tensors
        kv = torch.cat([k, v], -1)
        packed, _ = A.flash_attn_varlen_kvpacked_func(q, kv, cq, ck, max(lq), max(lk), d, softmax_scale=0.1,
                                                      causal=causal)
        assert torch.equal(packed, out)


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_varlen_growing_scores(causal):
    """Scores that grow along the keys by many log2 units per tile: the float32 kernel's reference maxima move
    (and its output is rescaled) at most tiles, in both directions of its lazy threshold."""
    lq, lk = [300, 70], [300, 130]
    cq, ck = torch.tensor([0] + lq).cumsum(0).int(), torch.tensor([0] + lk).cumsum(0).int()
    q = torch.randn(int(cq[-1]), 2, 64)
    k = torch.randn(int(ck[-1]), 2, 64) * torch.linspace(0.05, 6.0, int(ck[-1]))[:, None, None]
    v = torch.randn(int(ck[-1]), 2, 64)
    out, lse = A.flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk), softmax_scale=1.0, causal=causal)
    ro, rl = ref_varlen(q, k, v, cq, ck, causal, 1.0)
    atol, rtol, cos = VARLEN_TOL[torch.float32]
    check("out", out, ro, atol, rtol, cos)
    check("lse", lse, rl, 1e-5, 1e-5)


def test_flash_attn_varlen_interp(interp):
    lq, lk = [3, 20, 0], [5, 17, 2]
    cq, ck = torch.tensor([0] + lq).cumsum(0).int(), torch.tensor([0] + lk).cumsum(0).int()
    q, k, v = torch.randn(23, 2, 16), torch.randn(24, 1, 16), torch.randn(24, 1, 8)
    out, lse = A.flash_attn_varlen_func(q, k, v, cq, ck, 20, 17, causal=True)
    ro, rl = ref_varlen(q, k, v, cq, ck, True, 0.25)
    check("out", out, ro, 1e-5, 1e-4, 1e-9)
    check("lse", lse, rl, 1e-5, 1e-5)


# bad input --------------------------------------------------------------------------------------------------------

def test_bad_input_raises():
    b, d, dv, ps = 2, 576, 512, 64
    lens = torch.tensor([10, 70], dtype=torch.int32)
    cache, bt = paged_cache(b, 70, lens, ps, 1, d, torch.bfloat16)
    q = query((b, 1, 16, d), torch.bfloat16)
    meta = A.get_mla_metadata()[0]
    run = lambda **kw: A.flash_mla_with_kvcache(**{**dict(q=q, k_cache=cache, block_table=bt, cache_seqlens=lens,  # noqa
                                                     head_dim_v=dv, tile_scheduler_metadata=None), **kw})
    cases = [
        dict(q=q[..., :512]),                                   # head dims differ
        dict(head_dim_v=600),                                   # d_v > d_qk
        dict(k_cache=cache.half()),                             # dtype differs from q
        dict(q=q.float(), k_cache=cache.float()),               # unsupported dtype
        dict(block_table=torch.where(bt == NAN_PAGE, 0, bt + 100).int()),   # pages past the cache
        dict(block_table=bt.long()),                            # wrong dtype
        dict(block_table=bt[:, :1]),                            # too few pages for cache_seqlens
        dict(cache_seqlens=lens[:1]),                           # wrong shape
        dict(indices=torch.zeros(b, 2, 8, dtype=torch.int32)),  # indices of the wrong shape
        dict(indices=torch.zeros(b, 1, 8, dtype=torch.int64)),  # indices of the wrong dtype
        dict(indices=torch.zeros(b, 1, 8, dtype=torch.int32), causal=True),
        dict(is_fp8_kvcache=True),                              # a bf16 cache is not the FP8 layout
        dict(attn_sink=torch.zeros(16)),                        # attn_sink needs indices
    ]
    for kw in cases:
        with pytest.raises(ValueError):
            run(**kw)
    run(tile_scheduler_metadata=meta)
    with pytest.raises(ValueError):                             # the schedule was made for another configuration
        run(tile_scheduler_metadata=meta, causal=True)
    with pytest.raises(TypeError):
        run(q=q.numpy() if False else "q")
    kv = query((50, 1, d), torch.bfloat16)
    qp = query((4, 16, d), torch.bfloat16)
    with pytest.raises(ValueError):
        A.flash_mla_sparse_fwd(qp, kv, torch.zeros(4, 2, 8, dtype=torch.int32), 0.1)
    with pytest.raises(ValueError):
        A.flash_mla_sparse_fwd(qp, kv[..., :500], torch.zeros(4, 1, 8, dtype=torch.int32), 0.1)
    for bad in (-0.1, 0.0, math.inf, math.nan):                 # the softmax scale must be finite and > 0
        with pytest.raises(ValueError, match="scale"):
            A.flash_mla_sparse_fwd(qp, kv, torch.zeros(4, 1, 8, dtype=torch.int32), bad)
        with pytest.raises(ValueError, match="softmax_scale"):
            run(tile_scheduler_metadata=meta, softmax_scale=bad)
    x = torch.randn(5, 3, 64)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    for args in [(x, x[:, :2], x[:, :2], cu, cu, 5, 5),       # 3 q heads over 2 kv heads
                 (x, x[..., :32], x, cu, cu, 5, 5),           # head dims differ
                 (x, x, x, torch.tensor([0, 9], dtype=torch.int32), cu, 9, 5),   # past the packed rows
                 (x, x, x, cu.long(), cu, 5, 5),
                 (x, x, x, cu, cu, 4, 5)]:                    # max_seqlen_qo too small
        with pytest.raises(ValueError):
            A.flash_attn_varlen_func(*args)
    with pytest.raises(ValueError, match="softmax_scale"):
        A.flash_attn_varlen_func(x, x, x, cu, cu, 5, 5, softmax_scale=-1.0)
    with pytest.raises(ValueError):
        A.quantize_kv_cache_fp8(cache[..., :512])
