"""tegula.ep's T.* kernels in one process, against plain torch: the fused dispatch row writer, the gathered sum of
combine (rows anywhere in a flat tensor, weights, biases), and the cache of output mappings."""
import pytest
import torch

from tegula.ep import kernels
from tegula.ep.layout import dispatch_plan, localise, send_lists

needs_c = pytest.mark.skipif(not kernels._compiled(torch.zeros(1)), reason="no C compiler for the c kernels")


def _sum_reference(a, b, idx, w, bias, h):
    """float32 in order: bias terms, then each source's row (times its weight), rounded once."""
    n, s = idx.shape
    acc = torch.zeros((n, h), dtype=torch.float32)
    for bi in bias:
        acc += bi.float()
    na = a.shape[0]
    for t in range(n):
        for j in range(s):
            i = int(idx[t, j])
            if 0 <= i < na:
                row = a[i].float()
            elif na <= i <= na + b.numel() - h:
                row = b[i - na:i - na + h].float()
            else:
                continue
            acc[t] += row if w is None else w[t, j] * row
    return acc.to(a.dtype)


@needs_c
@pytest.mark.parametrize("dtype,h", [(torch.bfloat16, 512), (torch.bfloat16, 40), (torch.float32, 8)])
@pytest.mark.parametrize("weighted,nbias", [(False, 0), (True, 1), (False, 2)])
def test_gather_sum_matches_torch(dtype, h, weighted, nbias):
    """Twice with new tensors of the same shapes: the second call goes through the launcher bound by the first."""
    g = torch.Generator().manual_seed(h + 3 * nbias + weighted)
    n, na, s = 37, 11, 3
    for _ in range(2):
        a = torch.randn((na, h), generator=g).to(dtype)
        b = torch.randn(5 * h + 7, generator=g).to(dtype)
        # rows of a, rows of b starting at unaligned elements (up to the last whole row), entries adding nothing
        choices = torch.tensor([0, 3, na - 1, na, na + 1, na + 3 * h + 5, na + 4 * h + 7, -1, na + 4 * h + 8,
                                na - 20])
        idx = choices[torch.randint(0, len(choices), (n, s), generator=g)]
        w = torch.rand((n, s), generator=g) if weighted else None
        bias = tuple(torch.randn((n, h), generator=g).to(dtype) for _ in range(nbias))
        got = kernels.gather_sum(a, b, idx, w, bias)
        assert torch.equal(got, _sum_reference(a, b, idx, w, bias, h))
        assert torch.equal(got, kernels._gather_sum_torch(a, b, idx, w, bias, torch.empty_like(got)))


@needs_c
def test_gather_sum_rejects_a_strided_row_tensor():
    a = torch.zeros((4, 16), dtype=torch.bfloat16)
    with pytest.raises((TypeError, ValueError)):
        kernels.gather_sum(a[:, ::2], torch.zeros(64, dtype=torch.bfloat16), torch.zeros((3, 2), dtype=torch.int64))


@needs_c
def test_gather_sum_without_rows_of_a():
    h = 16
    b = torch.randn(4 * h).to(torch.bfloat16)
    idx = torch.tensor([[0, 2 * h], [-1, 3 * h], [h + 1, -1]])
    got = kernels.gather_sum(torch.zeros((0, h), dtype=torch.bfloat16), b, idx)
    assert torch.equal(got, _sum_reference(torch.zeros((0, h), dtype=torch.bfloat16), b, idx, None, (), h))


@needs_c
@pytest.mark.parametrize("scales,k", [(None, 4), ((3, torch.float32), 8), (None, 0)])
@pytest.mark.parametrize("rounds,h", [(1, 96), (3, 96), (1, 300), (2, 1536)])
def test_dispatch_scatter_writes_what_the_gathers_would(scales, k, rounds, h):
    """Three receivers in one window (rank 1 is not written here), each from its own first row; rows of one piece,
    of a piece and a tail (600 bytes), of several pieces (3072 bytes). With a cache, new tensors of the same
    shapes and other first rows go through the launcher the first round bound."""
    cache = {} if rounds > 1 else None
    for i in range(rounds):
        _scatter_round(scales, k, h, 5 + 2 * i, cache, seed=k + 10 * i)
    assert cache is None or len(cache) == 1


def _scatter_round(scales, k, h, first, cache, seed):
    g = torch.Generator().manual_seed(seed)
    t, n_exp, n_local, r_n = 23, 16, 4, 4
    x = torch.randn((t, h), generator=g).to(torch.bfloat16)
    xs = torch.randn((t, scales[0]), generator=g) if scales else None
    ti = torch.randint(-1, n_exp, (t, k), generator=g) if k else None
    tw = torch.rand((t, k), generator=g) if k else None
    in_rank = torch.rand((t, r_n), generator=g) < 0.6
    tokens, send_head = send_lists(in_rank)
    plans = [dispatch_plan(9 + r + int(in_rank[:, r].sum()) + 2, h, x.dtype, scales, k) for r in range(r_n)]
    at = [0]
    for p in plans:
        at.append(at[-1] + p.nbytes + 64)  # regions one after another, 64 bytes apart
    window = _WINDOW.fill_(0x5A)  # the same window every round
    before = window.clone()
    views = [p.views(window[at[r]:at[r] + p.nbytes]) for r, p in enumerate(plans)]
    dests = {r: ({f: v.data_ptr() - window.data_ptr() for f, v in views[r].items()}, first + r) for r in (0, 2, 3)}
    assert kernels.dispatch_scatter(x, xs, ti, tw, send_head, window, dests, n_local, cache)
    for r in range(r_n):
        if r not in dests:
            assert torch.equal(window[at[r]:at[r + 1]], before[at[r]:at[r + 1]])
            continue
        row0, sel = first + r, tokens[r].long()
        rows = slice(row0, row0 + len(sel))
        want = {"x": x[sel], "src_idx": tokens[r]}
        if scales:
            want["x_scales"] = xs[sel]
        if k:
            want["topk_idx"], want["topk_weights"] = localise(ti[sel], tw[sel], r * n_local, n_local)
        assert set(want) == set(views[r])
        for f, v in views[r].items():
            old = plans[r].views(before[at[r]:at[r] + plans[r].nbytes])[f]
            assert torch.equal(v[rows], want[f]), (r, f)
            assert torch.equal(v[:row0], old[:row0]) and torch.equal(v[rows.stop:], old[rows.stop:]), (r, f)


_WINDOW = torch.empty(1 << 20, dtype=torch.uint8)


def test_empty_reuses_a_mapping_only_once_nothing_refers_to_it():
    shape, dtype = (1024, 4096), torch.bfloat16  # 8 MiB: large enough for the cache
    a = kernels.empty(shape, dtype, "cpu")
    first = a.data_ptr()
    b = kernels.empty(shape, dtype, "cpu")
    assert b.data_ptr() != first
    view, storage = a[5:7], b.untyped_storage()
    del a, b
    c = kernels.empty(shape, dtype, "cpu")
    assert c.data_ptr() not in (first, storage.data_ptr())  # a view and a storage keep their mappings in use
    del view
    d = kernels.empty(shape, dtype, "cpu")
    assert d.data_ptr() == first
    assert kernels.empty((3, 5), dtype, "cpu").shape == (3, 5)  # small ones are plain torch tensors
    assert len(kernels._POOL) <= kernels._POOL_SIZE


@needs_c
@pytest.mark.parametrize("t,r", [(1, 1), (37, 3), (300, 8), (5, 2)])
def test_send_head_matches_the_torch_layout(t, r):
    """Twice per shape (the second call through the launcher the first bound); a rank nobody sends to, and on
    (5, 2) every token to every rank."""
    from tegula.ep.layout import send_head_of
    g = torch.Generator().manual_seed(t + r)
    for _ in range(2):
        in_rank = torch.rand((t, r), generator=g) < 0.5 if t != 5 else torch.ones((t, r), dtype=torch.bool)
        if r > 2:
            in_rank[:, 1] = False
        head, sent = kernels.send_head(in_rank)
        want_head, want_sent = send_head_of(in_rank)
        assert head.dtype == sent.dtype == torch.int32
        assert torch.equal(head, want_head) and torch.equal(sent, want_sent)


def test_plan_views_in_a_typed_window_equal_its_views():
    from tegula.ep.layout import dispatch_plan
    window = torch.arange(1 << 16, dtype=torch.int64).view(torch.uint8)
    plan = dispatch_plan(7, 96, torch.bfloat16, (3, torch.float32), 4)
    at = 4096 + 64
    typed = {}
    got = plan.views_in(lambda d: typed.setdefault(d, window.view(d)), at)
    want = plan.views(window[at:at + plan.nbytes])
    assert set(got) == set(want)
    for f, v in want.items():
        assert got[f].data_ptr() == v.data_ptr() and got[f].shape == v.shape and got[f].stride() == v.stride()
        assert got[f].dtype == v.dtype and torch.equal(got[f], v)
