"""tegula.ops.topk: DeepSelect's topk checked without a reference top-k (as DeepSelect's own tests do): indices
unique and in range, values bit-equal to input[indices], the smallest selected value >= the largest unselected one,
the requested order; fill values past short rows; NaN rows flagged or refused; bad arguments raise. Runs on the
c target, a few tiny cases on interp."""
import random

import pytest
import torch

from tegula.ops import topk as topk_mod
from tegula.ops.topk import get_stride_requirement, topk
from tests._threads import run_in_threads

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
RAW = {BF16: torch.int16, F16: torch.int16, F32: torch.int32}
NAN_FLAG = 0x3F3F3F3F


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("TEGULA_TARGET", "c")
    torch.manual_seed(0)
    random.seed(0)


def check(x, k, values, indices, end=None, by_value=False, offset=None, idx_fill=2**31 - 1,
          val_fill=float("-inf")):
    """Every property of a correct result, vectorised over the rows (NaN-free rows)."""
    b, n = x.shape
    assert indices.shape == (b, k) and (values is None or values.shape == (b, k))
    length = torch.full((b,), n) if end is None else end.long()
    valid = torch.arange(k)[None, :] < length.clamp(max=k)[:, None]
    idx = indices.long() - (0 if offset is None else offset.long()[:, None])
    assert bool((indices[~valid] == idx_fill).all()), "fill indices past a short row"
    assert bool((((idx >= 0) & (idx < length[:, None])) | ~valid).all()), "index out of range"
    big = torch.iinfo(torch.int64).max
    srt = torch.where(valid, idx, big).sort(1).values
    assert not bool(((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] != big)).any()), "duplicate index"
    safe = torch.where(valid, idx, 0)
    picked = x.gather(1, safe)
    raw = RAW[x.dtype]
    if values is not None:
        fill_bits = torch.tensor([val_fill], dtype=x.dtype).view(raw)
        want = torch.where(valid, picked.view(raw), fill_bits)
        assert torch.equal(values.view(raw), want), "values are not input[indices] (bit for bit) and fills"
    xf = x.float()
    in_row = torch.arange(n)[None, :] < length[:, None]
    chosen = torch.zeros(b, n, dtype=torch.int32).scatter_add(1, safe, valid.int()) > 0
    lo = torch.where(valid, picked.float(), float("inf")).amin(1)
    hi = torch.where(in_row & ~chosen, xf, float("-inf")).amax(1)
    assert bool((lo >= hi).all()), "an unselected value is larger than a selected one"
    if by_value:
        v = torch.where(valid, picked.float(), float("-inf"))
        assert bool(((v[:, 1:] <= v[:, :-1]) | ~valid[:, 1:]).all()), "values not descending"
        bits = picked.view(raw)   # equal bits keep index order (-0.0 ranks below +0.0)
        ties = (bits[:, 1:] == bits[:, :-1]) & valid[:, 1:]
        assert bool(((idx[:, 1:] > idx[:, :-1]) | ~ties).all()), "equal values not in index order"
    else:
        assert bool(((idx[:, 1:] > idx[:, :-1]) | ~valid[:, 1:]).all()), "indices not ascending"


# random rows, every dtype ------------------------------------------------------------------------------

SHAPES = [(1, 1, 1), (3, 7, 1), (2, 10, 20), (5, 100, 10), (4, 513, 512), (3, 5000, 512), (2, 8192, 2048),
          (1, 40000, 4096), (2, 70000, 3), (3, 131072, 777), (64, 2048, 64), (4096, 48, 5)]


@pytest.mark.parametrize("dtype", [BF16, F16, F32])
@pytest.mark.parametrize("b,n,k", SHAPES)
def test_random_rows(dtype, b, n, k):
    x = torch.randn(b, n).to(dtype)
    v, i = topk(x, k)
    assert v.dtype == dtype and i.dtype == torch.int64
    check(x, k, v, i)


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_keys_over_the_whole_bit_range(dtype):
    """Random bit patterns (every exponent, both signs, +-inf, denormals; NaN replaced): the select's search
    spans the whole key range, 2^32 wide for float32."""
    raw = RAW[dtype]
    info = torch.iinfo(raw)
    x = torch.randint(info.min, info.max + 1, (3, 30000), dtype=torch.int64).to(raw).view(dtype)
    x = torch.where(x.isnan(), torch.zeros((), dtype=dtype), x)
    for k in (1, 100, 3000):
        v, i = topk(x, k)
        check(x, k, v, i)


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_one_million_long_rows(dtype):
    x = (torch.randn(2, 1 << 20) * 100).to(dtype)
    v, i = topk(x, 2048, sorted=True)
    check(x, 2048, v, i, by_value=True)


@pytest.mark.parametrize("k", [1, 700, 4096])
def test_long_rows_split_over_cores_and_merged(monkeypatch, k):
    monkeypatch.setitem(topk_mod._CACHE, "threads", 8)   # fewer rows than cores: segments, then a merge
    assert topk_mod._segments(3, 300000) > 1
    x = torch.randn(3, 300000).to(BF16)
    end = torch.tensor([300000, 200001, k // 2], dtype=torch.int32)
    off = torch.tensor([5, -3, 100], dtype=torch.int32)
    v, i = topk(x, k, end=end, output_idx_offset=off)
    check(x, k, v, i, end=end, offset=off)
    v, i = topk(x, k, sorted=True)
    check(x, k, v, i, by_value=True)


@pytest.mark.parametrize("dtype", [BF16, F16, F32])
def test_sorted_by_value(dtype):
    x = torch.randn(6, 3000).to(dtype)
    x[0] = 1.5  # all equal: index order
    x[1, ::3] = 2.0
    for k in (1, 64, 999, 3000, 4000):
        v, i = topk(x, k, sorted=True)
        check(x, k, v, i, by_value=True)


def test_sorted_index_and_adversarial_orders():
    n = 20000
    up = torch.arange(n, dtype=F32)[None, :]
    rows = torch.cat([up, up.flip(1), (up % 97) * 0.5, -up]).to(F32)
    for k in (1, 300, 2048):
        v, i = topk(rows, k, sorted_index=True)
        check(rows, k, v, i)
        assert torch.equal(i[0], torch.arange(n - k, n))  # ascending input: the last k, in index order


def test_sample_fallback_when_the_sample_is_misleading():
    # the evenly spaced sample sees only large values, fewer than k of them: the row is scanned again
    n, k = 4096, 600
    x = torch.zeros(2, n)
    x[:, ::n // 512] = 10.0
    x[1] += torch.randn(n) * 0.01
    v, i = topk(x, k)
    check(x, k, v, i)


def test_run_sample_fallback_when_the_runs_are_misleading():
    # a long 16-bit row samples runs of adjacent keys (here 32 runs of 32, 2048 apart): 256 large values placed
    # at the start of every run fill the sample but are fewer than k, so the row is scanned again
    n, k = 65536, 400
    x = torch.zeros(2, n)
    for g in range(32):
        x[:, g * 2048:g * 2048 + 8] = 10.0
    x[1] += torch.randn(n) * 0.01
    x = x.to(BF16)
    v, i = topk(x, k)
    check(x, k, v, i)


# 16-bit rows where many keys pass the sampled threshold (pass2_dense: compressing stores, no bit walk) -------

@pytest.mark.parametrize("dtype,idx_type", [(BF16, torch.int64), (F16, torch.int32)])
def test_dense_rows_lengths_offsets_and_orders(dtype, idx_type):
    # k / n between 1/16 and 1/8 (top_range, about a tenth of the keys pass); lengths with partial chunks and
    # blocks, ties, offsets, both orders
    b, n, k = 5, 32768, 2048
    x = torch.randn(b, n).to(dtype)
    x[0, 100:400] = x[0, 50]   # ties
    x[3] = torch.randint(-20, 20, (n,)).to(dtype)
    end = torch.tensor([32768, 30001, 20000, 32767, 2048 * 9 + 5], dtype=torch.int32)
    off = torch.tensor([0, -9, 77, 1 << 20, 3], dtype=torch.int32)
    for by_value in (False, True):
        v, i = topk(x, k, sorted=by_value, end=end, indices_type=idx_type, output_idx_offset=off)
        check(x, k, v, i, end=end, by_value=by_value, offset=off)
    for rows in (x[:1, :8192], x[1:4, :8192], x[:, :5000]):   # 8K k512 (b1, b3), k / n > 1/10
        v, i = topk(rows.contiguous(), 512)
        check(rows, 512, v, i)


def test_dense_rows_flag_nan_and_rescan_a_misleading_sample():
    n, k = 8192, 512
    x = torch.randn(3, n).to(BF16)
    x[1, 4000] = float("nan")      # mid-row: chunks that follow survivors skip the cheap first pass
    # row 2: the sample (runs of 8 keys, 128 apart) meets 256 large keys in its runs, and the row holds no other:
    # fewer than k pass, the row is scanned again with a rising threshold. The other keys are adjacent values,
    # the first 2048 all equal: the select when the buffer first fills makes them the threshold, and the keys one
    # above it, all later in the row, are among the top k
    x[2] = (1.0 + torch.randint(0, 4, (n,)) * 2.0**-7).to(BF16)
    x[2, :2048] = 1.0 + 2 * 2.0**-7
    for g in range(64):
        x[2, g * 128:g * 128 + 4] = 10.0
    v, i = topk(x, k, abort_when_nan_found=False)
    assert i[1, 0] == NAN_FLAG
    check(x[[0, 2]], k, v[[0, 2]], i[[0, 2]])
    assert bool((x[2].float()[i[2].long()] == 10.0).sum() == 256)
    with pytest.raises(ValueError, match="row 1 holds NaN"):
        topk(x, k)


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_dense_rows_whose_buffer_fills(dtype):
    # a sample (runs of 8 keys, 128 apart) of the row's smallest values: every other key passes the sampled
    # threshold, the buffer fills again and again, and each select takes the candidates' largest key from the
    # candidates themselves (pass2_dense keeps no range); the largest keys first, last, in the tail past the
    # last whole chunk (end), and in row 3 300 keys one below the largest before 300 of the largest (the k-th:
    # a top taken one too low would keep the first 512 of the 600 in index order)
    n, k = 8192, 512
    x = torch.randn(4, n)
    for g in range(64):
        x[:, g * 128:g * 128 + 8] = -50.0
    x[0, 9] = 60.0
    x[1, n - 1] = 60.0
    x[2, 8190] = 60.0
    x = x.to(dtype)
    seven = torch.tensor([7.0], dtype=dtype)
    x[3, 3000:3300] = (seven.view(torch.int16) - 1).view(dtype)
    x[3, 3300:3600] = seven
    end = torch.tensor([n, n, 8191, n - 5], dtype=torch.int32)
    for e in (None, end):
        v, i = topk(x, k, end=e)
        check(x, k, v, i, end=e)


# end, fill values, offsets, outputs -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,idx_type", [(BF16, torch.int32), (F16, torch.int64), (F32, torch.int64)])
def test_end_fill_offset(dtype, idx_type):
    b, n, k = 7, 3000, 100
    x = torch.randn(b, n).to(dtype)
    end = torch.tensor([0, 1, 99, 100, 101, 2999, 3000], dtype=torch.int32)
    off = torch.arange(b, dtype=torch.int32) * 1000 - 3000
    v, i = topk(x, k, end=end, indices_type=idx_type, output_idx_offset=off, idx_oob_fill_value=-7,
                value_oob_fill_value=0.5)
    assert i.dtype == idx_type
    check(x, k, v, i, end=end, offset=off, idx_fill=-7, val_fill=0.5)
    v, i = topk(x, k, end=end, sorted=True)
    check(x, k, v, i, end=end, by_value=True)


def test_short_rows_rescan_when_the_sample_misleads():
    # short_row (16-bit rows, k >= n / 8) keeps the keys above a sampled lower end of the k-th key's range before
    # counting; its sample is 64 runs of 8 adjacent keys, 128 apart at n = 8192: 512 large keys placed on exactly
    # those runs fill it but are fewer than k, so fewer than k keys pass and every key is taken again (row 1:
    # the others tied, the k-th key's ties kept from the row's start)
    n, k = 8192, 2048
    x = torch.randn(2, n) * 0.01
    x[1] = 0.0
    for g in range(64):
        x[:, g * 128:g * 128 + 8] = 10.0 + torch.rand(2, 8)
    x = x.to(BF16)
    for by_value in (False, True):
        v, i = topk(x, k, sorted=by_value)
        check(x, k, v, i, by_value=by_value)
    zeros = (x[1] == 0).nonzero().flatten()
    assert torch.equal(i[1][v[1] == 0].sort().values, zeros[:k - 512])


@pytest.mark.parametrize("dtype,idx_type", [(BF16, torch.int32), (F16, torch.int64)])
def test_short_rows_offsets_and_orders(dtype, idx_type):
    # k >= n / 8 on 16-bit rows of 2048..65536: short_row keeps the top k (written out from its 16-bit copies
    # unsorted, widened for the sort); beside it a row of top_range (2047 long) and one not longer than k
    b, n, k = 4, 4000, 600
    x = torch.randn(b, n).to(dtype)
    x[0, 10:20] = x[0, 5]   # ties
    end = torch.tensor([4000, 2500, 2047, 600], dtype=torch.int32)
    off = torch.tensor([0, -70000, 123, 5], dtype=torch.int32)
    for by_value in (False, True):
        v, i = topk(x, k, sorted=by_value, end=end, indices_type=idx_type, output_idx_offset=off)
        check(x, k, v, i, end=end, by_value=by_value, offset=off)


def test_output_idx_and_return_value():
    x = torch.randn(4, 1000).to(BF16)
    out = torch.full((4, 33), -1, dtype=torch.int64)
    v, i = topk(x, 33, output_idx=out)
    assert i is out
    check(x, 33, v, i)
    wide = torch.zeros(4, 40, dtype=torch.int32)  # a strided output (rows padded as DeepSelect pads them)
    v, i = topk(x, 33, output_idx=wide[:, :33], indices_type=torch.int32, return_value=False)
    assert v is None and i.data_ptr() == wide.data_ptr()
    check(x, 33, None, wide[:, :33])
    assert bool((wide[:, 33:] == 0).all())


def test_strided_input_and_empty_shapes():
    big = torch.randn(5, 3000).to(F16)
    x = big[:, 100:2100]
    v, i = topk(x, 50)
    check(x.contiguous(), 50, v, i)
    v, i = topk(torch.empty(0, 10, dtype=BF16), 4)
    assert v.shape == (0, 4) and i.shape == (0, 4)
    v, i = topk(torch.empty(3, 0, dtype=F32), 4, idx_oob_fill_value=9)
    assert bool((i == 9).all()) and bool(torch.isneginf(v).all())
    assert get_stride_requirement() == (2, 8)


# special values -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [BF16, F16, F32])
def test_special_values(dtype):
    info = torch.finfo(dtype)
    n = 3000
    rows = torch.randn(8, n).to(dtype)
    rows[0, ::7] = float("inf")
    rows[1] = float("-inf")
    rows[1, 5:9] = torch.tensor([1.0, -2.0, 0.0, -0.0])               # 4 finite values among -inf
    rows[2] = info.tiny * torch.rand(n) * (torch.rand(n) - 0.5)         # denormals, both signs
    rows[3] = torch.randint(-3, 4, (n,)).to(dtype)                     # heavy ties
    rows[4] = 0.0
    rows[4, ::2] = -0.0                                                # signed zeros
    raw = RAW[dtype]
    base = torch.tensor([1.0], dtype=dtype).view(raw)
    rows[5] = (base + torch.randint(0, 8, (n,), dtype=raw)).view(dtype)  # a narrow bit range
    rows[6] = info.max
    rows[6, 1::3] = info.min
    rows[7] = torch.randn(n).to(dtype) * 1e-3 + 7
    for k in (1, 5, 100, 2048):
        for s in (False, True):
            v, i = topk(rows, k, sorted=s)
            check(rows, k, v, i, by_value=s)


@pytest.mark.parametrize("n,k", [(8192, 2048), (3000, 1000), (20000, 2600), (8192, 512)])
def test_ties_at_the_kth_value_keep_the_lowest_indices(n, k):
    # rows of few distinct values (the k-th value is shared by many keys): those equal to it that are kept are
    # the first ones in the row (short rows with k >= n / 8 find them by counting, the others in their buffer)
    x = torch.randint(-6, 7, (3, n)).to(BF16)
    x[2, n // 3:] = 1.0   # the k-th value runs to the end of the row
    v, i = topk(x, k)
    check(x, k, v, i)
    for r in range(3):
        kth = v[r].float().min()
        eq = (x[r].float() == kth).nonzero().flatten()
        kept = i[r][v[r].float() == kth].sort().values
        assert torch.equal(kept, eq[:kept.numel()]), r


# NaN ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,n,k", [(BF16, 2000, 64), (F32, 2000, 64), (BF16, 3000, 1000), (F16, 8192, 2048)])
def test_nan_rows_are_refused_or_flagged(dtype, n, k):
    b = 5
    x = torch.randn(b, n).to(dtype)
    x[1, n - 3] = float("nan")   # in the row's last, partial chunk
    x[3, :5] = -float("nan")
    x[4, 1] = float("nan")
    end = torch.tensor([n, n, n, n, 30], dtype=torch.int32)    # row 4 is short: not checked, as in DeepSelect
    with pytest.raises(ValueError, match="row 1 holds NaN"):
        topk(x, k, end=end)
    v, i = topk(x, k, end=end, abort_when_nan_found=False)
    assert i[1, 0] == NAN_FLAG and i[3, 0] == NAN_FLAG
    ok = [0, 2]
    check(x[ok], k, v[ok], i[ok])
    assert sorted(i[4, :30].tolist()) == list(range(30)) and bool((i[4, 30:] == 2**31 - 1).all())
    v, i = topk(x[[0, 2]], k)       # the status is per call: clean rows pass again
    check(x[[0, 2]], k, v, i)


def test_nan_in_split_rows(monkeypatch):
    monkeypatch.setitem(topk_mod._CACHE, "threads", 8)
    x = torch.randn(2, 300000).to(BF16)
    assert topk_mod._segments(2, 300000) > 1
    x[1, 250000] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        topk(x, 10)
    v, i = topk(x, 10, abort_when_nan_found=False)
    assert i[1, 0] == NAN_FLAG
    check(x[:1], 10, v[:1], i[:1])


# bad arguments -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("call,err,match", [
    (lambda x: topk(x, 0), ValueError, "topk must be in"),
    (lambda x: topk(x, 4097), ValueError, "4096"),
    (lambda x: topk(x, 2.0), TypeError, "topk must be an int"),
    (lambda x: topk(x.double(), 4), TypeError, "bfloat16, float16 or float32"),
    (lambda x: topk(x.float().numpy(), 4), TypeError, "input must be a torch.Tensor"),
    (lambda x: topk(x[0], 4), ValueError, "2-D"),
    (lambda x: topk(x, 4, sorted=True, return_value=False), ValueError, "return_value"),
    (lambda x: topk(x, 4, sorted=True, sorted_index=True), ValueError, "sorted_index"),
    (lambda x: topk(x, 4, sorted=1), TypeError, "sorted must be a bool"),
    (lambda x: topk(x, 4, begin=torch.zeros(3, dtype=torch.int32)), ValueError, "begin"),
    (lambda x: topk(x, 4, hint=torch.zeros(3)), ValueError, "hint"),
    (lambda x: topk(x, 4, end=torch.zeros(3, dtype=torch.int64)), TypeError, "end must have dtype torch.int32"),
    (lambda x: topk(x, 4, end=torch.zeros(2, dtype=torch.int32)), ValueError, r"end must have shape \(3,\)"),
    (lambda x: topk(x, 4, end=[1, 2, 3]), TypeError, "end must be a torch.Tensor"),
    (lambda x: topk(x, 4, end=torch.tensor([5, 101, 0], dtype=torch.int32)), ValueError, r"end\[1\] = 101"),
    (lambda x: topk(x, 4, end=torch.tensor([5, 1, -1], dtype=torch.int32)), ValueError, r"end\[2\] = -1"),
    (lambda x: topk(x, 4, output_idx_offset=torch.zeros(3)), TypeError, "output_idx_offset must have dtype"),
    (lambda x: topk(x, 4, indices_type=torch.int16), TypeError, "indices_type"),
    (lambda x: topk(x, 4, output_idx=torch.zeros(3, 4, dtype=torch.int32)), TypeError, "output_idx has dtype"),
    (lambda x: topk(x, 4, output_idx=torch.zeros(3, 5, dtype=torch.int64)), ValueError, "output_idx must have shape"),
    (lambda x: topk(x, 4, idx_oob_fill_value=2**31), ValueError, "idx_oob_fill_value"),
    (lambda x: topk(x, 4, value_oob_fill_value="x"), TypeError, "value_oob_fill_value"),
])
def test_bad_arguments(call, err, match):
    x = torch.randn(3, 100).to(BF16)
    with pytest.raises(err, match=match):
        call(x)


# the reference interpreter -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,b,n,k,by_value", [(BF16, 2, 40, 5, False), (F32, 2, 40, 5, True),
                                                   (F16, 1, 1100, 7, False), (BF16, 1, 1100, 300, True),
                                                   (BF16, 1, 2100, 300, False),    # the counting path
                                                   (BF16, 1, 8192, 8, False)])     # a sample in runs
def test_interp_agrees(monkeypatch, dtype, b, n, k, by_value):
    x = torch.randn(b, n).to(dtype)
    x[0, 3] = x[0, 9]   # a tie
    end = torch.tensor([n, n - 3][:b], dtype=torch.int32)
    v, i = topk(x, k, sorted=by_value, end=end)
    monkeypatch.setenv("TEGULA_TARGET", "interp")
    vi, ii = topk(x, k, sorted=by_value, end=end)
    check(x, k, vi, ii, end=end, by_value=by_value)
    assert torch.equal(ii, i) and torch.equal(vi.view(RAW[dtype]), v.view(RAW[dtype]))


# plans: what a repeated call reuses ---------------------------------------------------------------------------

def test_repeated_calls_reuse_a_plan_and_still_check_each_call():
    x = torch.randn(2, 3000).to(BF16)
    out = torch.empty(2, 40, dtype=torch.int64)
    for _ in range(3):                       # new values, same shapes: the plan's bound kernel, right results
        x = torch.randn(2, 3000).to(BF16)
        v, i = topk(x, 40, output_idx=out)
        assert i is out
        check(x, 40, v, i)
    assert v.data_ptr() != topk(x, 40, output_idx=out)[0].data_ptr()   # values are fresh on every call
    with pytest.raises(TypeError, match="topk must be an int"):
        topk(x, 40.0, output_idx=out)        # equal to 40 as a key, refused by type
    with pytest.raises(TypeError, match="sorted must be a bool"):
        topk(x, 40, sorted=0, output_idx=out)
    with pytest.raises(TypeError, match="output_idx has dtype"):
        topk(x, 40, output_idx=out.int())
    with pytest.raises(ValueError, match="output_idx must have shape"):
        topk(x, 40, output_idx=torch.empty(2, 41, dtype=torch.int64))
    end = torch.tensor([3000, 10], dtype=torch.int32)
    for e in (end, end.long()):              # the plan for end-given rows checks each end it is given
        if e.dtype != torch.int32:
            with pytest.raises(TypeError, match="end must have dtype"):
                topk(x, 40, end=e)
        else:
            v, i = topk(x, 40, end=e)
            check(x, 40, v, i, end=e)
    wide = torch.randn(2, 6000).to(BF16)
    v, i = topk(wide[:, ::2], 40)            # a strided input of a planned shape is copied, not misread
    check(wide[:, ::2].contiguous(), 40, v, i)


def test_values_cut_from_blocks_are_disjoint_and_kept():
    x = torch.randn(1, 3000).to(BF16)
    kept = []
    for r in range(150):                     # past two blocks of 64 (1 x 40 bf16 values each)
        x[0, r] = 100.0 + r                  # a new largest value each call
        v, i = topk(x, 40, sorted=True)
        check(x, 40, v, i, by_value=True)
        assert v.float()[0, 0] == 100.0 + r and v.is_contiguous() and not v._is_view()
        kept.append((r, v))
    assert len({v.data_ptr() for _, v in kept}) == len(kept)
    for r, v in kept:                        # later calls wrote none of the earlier results
        assert v.float()[0, 0] == 100.0 + r
    big, big_i = topk(torch.randn(16, 3000).to(BF16), 1200)   # 38400 / 153600 bytes: allocated on their own
    assert big.untyped_storage().nbytes() == big.numel() * 2
    assert big_i.untyped_storage().nbytes() == big_i.numel() * 8


def test_plans_are_per_thread():
    xs = [torch.randn(3, 20000).to(BF16) for _ in range(4)]
    res = {}

    def work(t):
        for _ in range(5):
            res[t] = topk(xs[t], 300, sorted=True)
    run_in_threads(work, range(4))
    for t in range(4):
        check(xs[t], 300, *res[t], by_value=True)


def test_calls_alternating_flags_keep_their_plans(monkeypatch):
    monkeypatch.setattr(topk_mod._LOCAL, "plans", {}, raising=False)  # before any call too; 64 plans cap
    x = torch.randn(2, 3000).to(BF16)
    topk(x, 40)
    topk(x, 40, sorted=True)
    built = []
    monkeypatch.setattr(topk_mod, "_Plan", lambda *a: built.append(a))   # any new plan would show here
    for s in (False, True, False):
        v, i = topk(x, 40, sorted=s)
        check(x, 40, v, i, by_value=s)
    assert not built


# the common call's short path: topk(x, k) and topk(x, k, output_idx=...) with every other argument at its default

def test_common_calls_take_the_plans_launch_and_still_check_each_call(monkeypatch):
    x = torch.randn(2, 3000).to(BF16)
    out = torch.empty(2, 40, dtype=torch.int64)
    topk(x, 40)                                   # plans it (and keys its launch)
    calls = []
    real = topk_mod._Plan.__call__
    monkeypatch.setattr(topk_mod._Plan, "__call__", lambda self, *a: calls.append(a) or real(self, *a))
    for _ in range(3):                            # new values, same shapes: the launch alone, right results
        x = torch.randn(2, 3000).to(BF16)
        check(x, 40, *topk(x, 40))
        v, i = topk(x, 40, sorted=False, output_idx=out)
        assert i is out
        check(x, 40, v, i)
    assert not calls
    wide = torch.randn(2, 6000).to(BF16)
    check(wide[:, ::2].contiguous(), 40, *topk(wide[:, ::2], 40))   # a strided input is copied, not misread
    strided_out = torch.zeros(2, 80, dtype=torch.int64)[:, ::2]
    v, i = topk(x, 40, output_idx=strided_out)    # written through a contiguous tensor, by the plan's call
    assert i is strided_out
    check(x, 40, v, i)
    assert len(calls) == 1
    for bad, err, match in [(out.int(), TypeError, "output_idx has dtype"),
                            (torch.empty(2, 41, dtype=torch.int64), ValueError, "output_idx must have shape"),
                            (torch.empty(1, 80, dtype=torch.int64), ValueError, "output_idx must have shape"),
                            (out.tolist(), TypeError, "output_idx must be a torch.Tensor"),
                            (out.to("meta"), ValueError, "output_idx is on meta")]:
        with pytest.raises(err, match=match):
            topk(x, 40, output_idx=bad)
    with pytest.raises(ValueError, match="input is on meta"):
        topk(x.to("meta"), 40)
    with pytest.raises(TypeError, match="topk must be an int"):
        topk(x, 40.0)
    with pytest.raises(TypeError, match="input must be a torch.Tensor"):
        topk(x.float().numpy(), 40)
    x[1, 7] = float("nan")
    with pytest.raises(ValueError, match="input row 1 holds NaN"):
        topk(x, 40)
    with pytest.raises(ValueError, match="input row 1 holds NaN"):
        topk(x, 40, output_idx=out)
    x[1, 7] = 0.0
    check(x, 40, *topk(x, 40))                    # the status words were cleared


def test_common_calls_of_another_flag_value_object_are_checked_in_full():
    x = torch.randn(2, 300).to(BF16)
    topk(x, 40)
    v, i = topk(x, 40, idx_oob_fill_value=int("2147483647"), value_oob_fill_value=float("-inf"),
                end=torch.tensor([300, 20], dtype=torch.int32))
    check(x, 40, v, i, end=torch.tensor([300, 20], dtype=torch.int32))
    with pytest.raises(TypeError, match="sorted must be a bool"):
        topk(x, 40, sorted=0)
    with pytest.raises(TypeError, match="return_value must be a bool"):
        topk(x, 40, return_value=1)


def test_indices_cut_from_blocks_are_disjoint_and_kept():
    x = torch.randn(1, 3000).to(BF16)
    kept = []
    for r in range(140):                          # past two blocks of 64 (1 x 512 int64 indices each)
        x[0, r] = 100.0 + r                       # a new largest value each call, at column r
        v, i = topk(x, 512)
        check(x, 512, v, i)
        assert i.is_contiguous() and not i._is_view() and r in i[0].tolist()
        kept.append((r, v, i))
    assert len({i.data_ptr() for _, _, i in kept}) == len({v.data_ptr() for _, v, _ in kept}) == len(kept)
    for r, v, i in kept:                          # later calls wrote none of the earlier results
        assert r in i[0].tolist() and float(v.float().max()) == 100.0 + r


@pytest.mark.parametrize("where", ["interp", "split"])
def test_common_calls_launch_without_the_trampoline(monkeypatch, where):
    """The common call's launch on plans whose kernels have no direct call: interp, and rows split over cores
    (segments, then a merge)."""
    if where == "interp":
        monkeypatch.setenv("TEGULA_TARGET", "interp")
        x, k = torch.randn(2, 900).to(BF16), 9
    else:
        monkeypatch.setitem(topk_mod._CACHE, "threads", 8)
        x, k = torch.randn(1, 300000).to(BF16), 300
        assert topk_mod._segments(1, 300000) > 1
    out = torch.empty(1 if where == "split" else 2, k, dtype=torch.int64)
    for _ in range(3):
        x.normal_()
        check(x, k, *topk(x, k))
        v, i = topk(x, k, output_idx=out)
        assert i is out
        check(x, k, v, i)
    assert topk_mod._LOCAL.plans[(x.shape, x.dtype, k, topk_mod._ENV.get(topk_mod._TARGET_VAR),
                                  topk_mod._CACHE.get("threads"))].__code__.co_name == "launch"


@pytest.mark.parametrize("vendor", ["GenuineIntel", "AuthenticAMD"])
def test_dense_share_by_vendor(vendor, monkeypatch):
    """Rows whose sampled threshold lets ~1-4% of the keys through take the compressing stores on one vendor and the
    bit walk on the other (_topk_kernels.DENSE_BY_VENDOR): both give a correct top k (kernels traced anew)."""
    import threading

    from tegula.ops import _topk_kernels as K
    from tegula.runtime import cpu
    monkeypatch.setattr(cpu, "host_vendor", lambda: vendor)
    monkeypatch.setattr(K, "_KERNELS", {})
    monkeypatch.setattr(K, "_JIT", {})
    monkeypatch.setattr(topk_mod, "_LOCAL", threading.local())
    for b, n, k in ((3, 1 << 17, 512), (2, 1 << 17, 2048), (1, 300_001, 1000)):
        x = torch.randn(b, n).to(torch.bfloat16)
        values, indices = topk(x, k)
        check(x, k, values, indices)
