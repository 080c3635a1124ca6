"""The sparse-attention indexer (deep_gemm's fp8_mqa_logits, fp8_paged_mqa_logits) against torch references as in
DeepGEMM's tests, scaled down: the -inf mask exact, calc_diff < 1e-3 against the unquantised logits and tight
against the dequantised ones, bit-identical reruns, ValueError on bad input."""
import pytest
import torch

from tegula.ops import gemm as dg

FP8 = torch.float8_e4m3fn
NEG = float("-inf")


@pytest.fixture(autouse=True)
def _seed(monkeypatch):
    monkeypatch.setenv("TEGULA_TARGET", "c")
    torch.manual_seed(0)


def ref_mqa(q, kv, w, ks, ke):
    score = torch.einsum("mhd,nd->mhn", q.float(), kv.float())
    logits = (score.relu() * w[:, :, None]).sum(1)
    cols = torch.arange(kv.shape[0])
    return logits.masked_fill(~((cols[None] >= ks[:, None]) & (cols[None] < ke[:, None])), NEG)


def mqa_inputs(s, skv, h, d, causal):
    q = torch.randn(s, h, d, dtype=torch.bfloat16)
    kv = torch.randn(skv, d, dtype=torch.bfloat16)
    w = torch.randn(s, h)
    if causal:  # deep_gemm's no-CP case: row i sees [0, skv - s + i]
        ks = torch.zeros(s, dtype=torch.int32)
        ke = (torch.arange(s) + skv - s + 1).int()
    else:
        ks = torch.randint(0, skv // 2, (s,), dtype=torch.int32)
        ke = (ks + torch.randint(0, skv // 2, (s,), dtype=torch.int32)).int()
        ke[0] = ks[0]  # an empty row
    return q, kv, w, ks, ke


@pytest.mark.parametrize("s,skv,h,d,causal", [(48, 300, 16, 64, True), (40, 260, 8, 128, False)])
def test_mqa_logits(s, skv, h, d, causal):
    q, kv, w, ks, ke = mqa_inputs(s, skv, h, d, causal)
    ref = ref_mqa(q, kv, w, ks, ke)
    qf = q.to(FP8)
    kvq = dg.per_custom_dims_cast_to_fp8(kv, (0,), False)
    sim = ref_mqa(qf, kvq[0].float() * kvq[1][:, None], w, ks, ke)
    out = dg.fp8_mqa_logits(qf, kvq, w, ks, ke)
    mask = ref == NEG
    assert out.shape == (s, skv) and out.dtype == torch.float32
    assert torch.equal(out == NEG, mask)
    assert dg.calc_diff(out.masked_fill(mask, 0), ref.masked_fill(mask, 0)) < 1e-3
    assert dg.calc_diff(out.masked_fill(mask, 0), sim.masked_fill(mask, 0)) < 5e-6
    for _ in range(3):
        assert torch.equal(dg.fp8_mqa_logits(qf, kvq, w, ks, ke).view(torch.int32), out.view(torch.int32))


def test_mqa_logits_compressed():
    s, skv, h, d = 24, 200, 16, 32
    q, kv, w, ks, ke = mqa_inputs(s, skv, h, d, False)
    qf, kvq = q.to(FP8), dg.per_custom_dims_cast_to_fp8(kv, (0,), False)
    full = dg.fp8_mqa_logits(qf, kvq, w, ks, ke)
    width = int((ke - ks).max())
    out = dg.fp8_mqa_logits(qf, kvq, w, ks, ke, max_seqlen_k=width)
    assert out.shape == (s, width)
    for i in range(s):
        n = int(ke[i] - ks[i])
        assert torch.equal(out[i, :n], full[i, ks[i]:ke[i]])
        assert bool((out[i, n:] == NEG).all())
    bf = dg.fp8_fp4_mqa_logits((qf, None), kvq, w, ks, ke, logits_dtype=torch.bfloat16)
    assert bf.dtype == torch.bfloat16 and torch.equal(bf, full.bfloat16())


def paged_inputs(bsz, next_n, h, d, page, avg):
    cl = torch.randint(int(0.7 * avg), int(1.3 * avg), (bsz,), dtype=torch.int32)
    pages = (cl + page - 1) // page
    total = int(pages.sum())
    kv = torch.randn(total, page, 1, d, dtype=torch.bfloat16)
    bt = torch.zeros(bsz, int(pages.max()) + 1, dtype=torch.int32)  # a spare column: pages past the context
    perm = torch.randperm(total, dtype=torch.int32)
    off = 0
    for i, p in enumerate(pages.tolist()):
        bt[i, :p] = perm[off:off + p]
        off += p
    # deep_gemm's fused cache: per page, page x d fp8 values, then page fp32 scales
    sf = kv.abs().float().amax(dim=3, keepdim=True).clamp(1e-4) / 448.0
    q8 = (kv * (1.0 / sf)).to(FP8)
    fused = torch.empty(total, page * (d + 4), dtype=torch.uint8)
    fused[:, :page * d] = q8.view(total, page * d).view(torch.uint8)
    fused[:, page * d:] = sf.view(total, page).view(torch.uint8)
    deq = q8.float() * sf
    return cl, pages, kv, deq, fused.view(total, page, 1, d + 4), bt


def ref_paged(q, kv, w, limits, pages, bt, width):
    bsz, next_n, h, d = q.shape
    out = torch.full((bsz * next_n, width), NEG)
    for b in range(bsz):
        k = kv[bt[b, :pages[b]].long()].reshape(-1, d).float()
        lg = (torch.einsum("nhd,td->nht", q[b].float(), k).relu() * w[b * next_n:(b + 1) * next_n, :, None]).sum(1)
        for j in range(next_n):
            n = int(limits[b, j])
            out[b * next_n + j, :n] = lg[j, :n]
    return out


@pytest.mark.parametrize("next_n,two_d", [(2, True), (1, False)])
def test_paged_mqa_logits(next_n, two_d):
    bsz, h, d, page = 3, 16, 64, 64
    cl, pages, kv, deq, fused, bt = paged_inputs(bsz, next_n, h, d, page, 300)
    q = torch.randn(bsz, next_n, h, d, dtype=torch.bfloat16)
    w = torch.randn(bsz * next_n, h)
    if two_d:
        lens = ((cl[:, None] + 1) * torch.rand(bsz, next_n)).int()
        lens[:, -1] = cl
        limits = lens
    else:  # deep_gemm's 1-D form: row j of entry b sees positions <= len - next_n + j
        lens = cl
        limits = cl[:, None] - next_n + 1 + torch.arange(next_n)
    width = int(pages.max()) * page
    ref = ref_paged(q, kv, w, limits, pages, bt, width)
    sim = ref_paged(q.to(FP8).float(), deq, w, limits, pages, bt, width)
    meta = dg.get_paged_mqa_logits_metadata(lens, page, dg.get_num_sms())
    assert meta.shape == (dg.get_num_sms() + 1, 2) and meta.dtype == torch.int32
    out = dg.fp8_paged_mqa_logits(q.to(FP8), fused, w, lens, bt, meta, width)
    mask = ref == NEG
    assert torch.equal(out == NEG, mask)
    assert dg.calc_diff(out.masked_fill(mask, 0), ref.masked_fill(mask, 0)) < 1e-3
    assert dg.calc_diff(out.masked_fill(mask, 0), sim.masked_fill(mask, 0)) < 5e-6
    again = dg.fp8_paged_mqa_logits(q.to(FP8), fused, w, lens, bt, meta, width)
    assert torch.equal(again.view(torch.int32), out.view(torch.int32))


def test_metadata_schedule():
    lens = torch.tensor([[300], [0], [1000], [256]], dtype=torch.int32)
    meta = dg.get_paged_mqa_logits_metadata(lens, 64, 4)
    segs = [2, 0, 4, 1]  # 256-position splits per entry: 7 in all, 4 workers get 1, 2, 2, 2
    starts = [0, 1, 3, 5]
    pos = [(b, s) for b, n in enumerate(segs) for s in range(n)]
    assert [tuple(r) for r in meta[:4].tolist()] == [pos[i] for i in starts]
    assert meta[4].tolist() == [4, 0]


def test_bad_input_raises():
    q, kv, w, ks, ke = mqa_inputs(8, 64, 8, 32, True)
    qf, kvq = q.to(FP8), dg.per_custom_dims_cast_to_fp8(kv, (0,), False)
    cases = [
        (lambda: dg.fp8_mqa_logits(q, kvq, w, ks, ke), "q"),                                   # dtype
        (lambda: dg.fp8_mqa_logits(qf, (kvq[0][:, :16], kvq[1]), w, ks, ke), "kv"),          # head dim
        (lambda: dg.fp8_mqa_logits(qf, (kvq[0], kvq[1][:10]), w, ks, ke), "kv"),
        (lambda: dg.fp8_mqa_logits(qf, kvq, w[:, :4], ks, ke), "weights"),
        (lambda: dg.fp8_mqa_logits(qf, kvq, w, ks, ke + 100), "cu_seq_len_k"),                # past the kv
        (lambda: dg.fp8_mqa_logits(qf, kvq, w, ks.long(), ke), "cu_seq_len_k_start"),
        (lambda: dg.fp8_mqa_logits(qf, kvq, w, ks, ke, max_seqlen_k=3), "max_seqlen_k"),
    ]
    cl, pages, kvp, _, fused, bt = paged_inputs(2, 1, 8, 32, 32, 100)
    qp = torch.randn(2, 1, 8, 32, dtype=torch.bfloat16).to(FP8)
    wp = torch.randn(2, 8)
    lens = cl.view(2, 1).contiguous()
    meta = dg.get_paged_mqa_logits_metadata(lens, 32, 2)
    width = int(pages.max()) * 32
    bad_bt = bt.clone()
    bad_bt[0, 0] = 10_000
    cases += [
        (lambda: dg.fp8_paged_mqa_logits(qp, fused, wp, lens, bad_bt, meta, width), "block_table"),
        (lambda: dg.fp8_paged_mqa_logits(qp, fused, wp, lens + 1000, bt, meta, width), "context_lens"),
        (lambda: dg.fp8_paged_mqa_logits(qp, fused[..., :-4], wp, lens, bt, meta, width), "kv_cache"),
        (lambda: dg.fp8_paged_mqa_logits(qp, fused, wp[:1], lens, bt, meta, width), "weights"),
        (lambda: dg.fp8_paged_mqa_logits(qp, fused, wp, lens, bt, meta[:, :1], width), "schedule_meta"),
        (lambda: dg.fp8_fp4_mqa_logits((qf, torch.ones(1)), kvq, w, ks, ke), "FP4"),
    ]
    for fn, word in cases:
        with pytest.raises(ValueError, match=word):
            fn()
    with pytest.raises(TypeError):
        dg.fp8_mqa_logits(qf, kvq[0], w, ks, ke)
