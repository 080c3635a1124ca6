"""DeepEP's low-latency dispatch and combine over a Buffer's rdma region.

Every (token, expert) pair goes to the expert's rank, into a fixed [E_local, R*M, H] layout: for local expert j the
rows from source rank s sit at [begin(s, j), begin(s, j) + count(s, j)), sources in rank order, tokens ascending.
The counts of every rank are exchanged first, so the rows are packed from row 0 and no receiver scans for them.
The region holds two receive slots (used alternately) and, after them, the rows that combine sends back, laid
out at their owner by global expert, tokens ascending.
"""
from __future__ import annotations

from tegula.ep import kernels
from tegula.ep.event import EventOverlap, completed_hook
from tegula.ep.layout import (
    combine_plan,
    dtype_code,
    expert_positions,
    ll_dispatch_plan,
    pack_ue8m0,
    ranges,
)
from tegula.ep.transport import OP_LL_COMBINE, OP_LL_DISPATCH

_PAGE = 4096


def slot_bytes(m: int, hidden: int, num_ranks: int, num_experts: int) -> int:
    """Bytes of one receive slot (the bf16 layout, the largest)."""
    plan = ll_dispatch_plan(num_experts // num_ranks, num_ranks, m, hidden, False)
    return -(-plan.nbytes // _PAGE) * _PAGE


def dispatch(buf, x, topk_idx, m, num_experts, recv_stats, use_fp8, round_scale, use_ue8m0):
    import torch
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise TypeError("tegula.ep: low_latency_dispatch: x must be a [num_tokens, hidden] tensor")
    buf._check_topk(topk_idx, num_experts, "low_latency_dispatch")
    t, hidden = x.shape
    r_n, me = buf.group_size, buf.rank
    if topk_idx.shape[0] != t or t > m:
        raise ValueError(f"tegula.ep: low_latency_dispatch: {t} tokens (topk_idx has {topk_idx.shape[0]}); at most "
                         f"num_max_dispatch_tokens_per_rank={m}")
    if use_ue8m0 and not round_scale:
        raise ValueError("tegula.ep: low_latency_dispatch: use_ue8m0 needs round_scale=True")
    if use_fp8 and hidden % (512 if use_ue8m0 else 128):
        raise ValueError(f"tegula.ep: low_latency_dispatch: fp8 needs hidden % {512 if use_ue8m0 else 128} == 0")
    order, experts, pos, cnt = expert_positions(topk_idx, num_experts)
    meta = buf._exchange(
        "low_latency_dispatch", [OP_LL_DISPATCH, hidden, m, num_experts, int(use_fp8), int(round_scale),
                                 int(use_ue8m0)],
        ("operation", "hidden", "num_max_dispatch_tokens_per_rank", "num_experts", "use_fp8", "round_scale",
         "use_ue8m0"), cnt.tolist(), x.device)
    counts = meta[:, 7:]  # counts[s, e]: the pairs rank s sends expert e
    begin = counts.cumsum(0) - counts
    n_local, rows = num_experts // r_n, r_n * m
    plan = ll_dispatch_plan(n_local, r_n, m, hidden, use_fp8, use_ue8m0)
    size = slot_bytes(m, hidden, r_n, num_experts)
    slot = buf._num_ll_dispatches % 2
    buf._num_ll_dispatches += 1

    if use_fp8:
        xq, scale_inv = kernels.cast_to_fp8(x, round_scale)
        scales = pack_ue8m0(scale_inv) if use_ue8m0 else scale_inv
    else:
        xq, scales = x.to(torch.bfloat16).contiguous(), None
    tok = (order // topk_idx.shape[1]).to(torch.int32)
    dst_rank, j = experts // n_local, experts % n_local
    within = torch.from_numpy(begin[me]).to(x.device)[experts] + pos  # the pair's row among its expert's R*M

    def pairs_to(r):
        return (dst_rank == r).nonzero().squeeze(1)

    def spans(r):
        lo = r * n_local
        return _spans(plan, rows, begin[me, lo:lo + n_local], counts[me, lo:lo + n_local])

    def write(views, r):
        sel = pairs_to(r)
        _write(views, rows, j[sel], within[sel], (xq, tok[sel]), (scales, tok[sel]) if scales is not None else None,
               tok[sel])

    def payload(r):
        sel = pairs_to(r)
        out = {"where": torch.stack([j[sel], within[sel]], 1).to(torch.int32), "tok": tok[sel], "x": (xq, tok[sel])}
        if scales is not None:
            out["scales"] = (scales, tok[sel])
        return out

    def place(mine, s, got):
        where = got["where"].long()
        _write(mine, rows, where[:, 0], where[:, 1], got["x"], got.get("scales"), got["tok"])

    fields = [("where", (2,), torch.int32), ("tok", (), torch.int32), ("x", xq.shape[1:], xq.dtype)]
    if scales is not None:
        fields.append(("scales", scales.shape[1:], scales.dtype))
    pairs = counts.reshape(r_n, r_n, n_local).sum(2)  # pairs[s, r]: the pairs rank s sends rank r
    mine = buf._move("low_latency_dispatch", x.device, buf._rdma_at + slot * size,
                     size if buf.num_rdma_bytes >= 2 * size else 0, [plan] * r_n, spans, write, fields, payload,
                     pairs[me], pairs[:, me], place)

    own = counts[:, me * n_local:(me + 1) * n_local]  # [R, E_local]
    recv_count = torch.from_numpy(own.sum(0)).to(torch.int32)
    layout_range = torch.from_numpy((begin[:, me * n_local:(me + 1) * n_local].T << 32) | own.T)
    if recv_stats is not None:
        recv_stats += recv_count.to(recv_stats)
    recv_x = mine["x"] if not use_fp8 else (mine["x"], mine["x_scales"].transpose(1, 2))
    handle = (mine["src_info"], layout_range, m, hidden, num_experts)
    return recv_x, recv_count.to(x.device), handle, EventOverlap(), completed_hook


def combine(buf, x, topk_idx, topk_weights, handle, out):
    import numpy as np
    import torch
    _, layout_range, m, hidden, num_experts = handle
    r_n, me = buf.group_size, buf.rank
    n_local, rows = num_experts // r_n, r_n * m
    if not isinstance(x, torch.Tensor) or tuple(x.shape) != (n_local, rows, hidden):
        raise TypeError(f"tegula.ep: low_latency_combine: x must be [{n_local}, {rows}, {hidden}]")
    buf._check_topk(topk_idx, num_experts, "low_latency_combine")
    t, k = topk_idx.shape
    if topk_weights.dtype != torch.float32 or topk_weights.shape != topk_idx.shape:
        raise TypeError("tegula.ep: low_latency_combine: topk_weights must be float32 shaped like topk_idx")
    if out is not None and (tuple(out.shape) != (t, hidden) or out.dtype != x.dtype or not out.is_contiguous()):
        raise ValueError(f"tegula.ep: low_latency_combine: out must be a contiguous [{t}, {hidden}] {x.dtype} tensor")
    order, experts, pos, cnt = expert_positions(topk_idx, num_experts)
    meta = buf._exchange("low_latency_combine", [OP_LL_COMBINE, hidden, m, num_experts, dtype_code(x.dtype)],
                         ("operation", "hidden", "num_max_dispatch_tokens_per_rank", "num_experts", "x dtype"),
                         cnt.tolist(), x.device)
    counts = meta[:, 5:]  # counts[s, e]: the pairs rank s sent expert e
    lo, hi = me * n_local, (me + 1) * n_local
    lr = layout_range.cpu().numpy()
    if ((lr & 0xFFFFFFFF).T != counts[:, lo:hi]).any():
        raise ValueError("tegula.ep: low_latency_combine: topk_idx differs from the dispatch's on some rank")
    start = counts.cumsum(1) - counts  # start[s, e]: the first row of (s, e) among what rank s gets back
    plans = [combine_plan(int(counts[s].sum()), hidden, x.dtype) for s in range(r_n)]
    two = 2 * slot_bytes(m, hidden, r_n, num_experts)
    xf = x.contiguous().view(n_local * rows, hidden)

    def rows_for(s):  # (rows of xf, rows at s) of this rank's experts' outputs for s's tokens
        c = torch.from_numpy(counts[s, lo:hi])
        src = ranges(torch.from_numpy((lr[:, s] >> 32) + np.arange(n_local) * rows), c)
        dst = ranges(torch.from_numpy(start[s, lo:hi]), c)
        return src.to(torch.int32).to(x.device), dst.to(torch.int32).to(x.device)

    def spans(s):
        return [] if s == me else [plans[s].span("x", start[s, lo], start[s, lo] + counts[s, lo:hi].sum())]

    def write(views, s):
        if s != me:
            kernels.copy_rows(xf, *rows_for(s), views["x"])

    def place(mine, r, got):
        mine["x"][start[me, r * n_local]:start[me, r * n_local] + got["x"].shape[0]].copy_(got["x"])

    pairs = counts.reshape(r_n, r_n, n_local).sum(2)  # pairs[s, r]: the pairs rank s sent rank r
    mine = buf._move("low_latency_combine", x.device, buf._rdma_at + two, max(0, buf.num_rdma_bytes - two), plans,
                     spans, write, [("x", (hidden,), x.dtype)], lambda s: {"x": (xf, rows_for(s)[0])},
                     pairs[:, me], pairs[me], place)

    # each pair's row: this rank's own experts' outputs straight from x, the others from what came back
    own = (experts // n_local) == me
    e_local = (experts - lo).clamp(0, n_local - 1)
    here = e_local * rows + torch.from_numpy(lr >> 32).to(x.device)[e_local, me] + pos
    there = xf.shape[0] + (torch.from_numpy(start[me]).to(x.device)[experts] + pos) * hidden  # into mine["x"]
    idx = torch.full((t * k,), -1, dtype=torch.int64, device=x.device)
    idx[order] = torch.where(own, here, there)
    combined = kernels.gather_sum(xf, mine["x"].view(-1), idx.view(t, k), topk_weights.contiguous(), (), out)
    return combined, EventOverlap(), completed_hook


def _write(views, rows, j, within, x, scales, src_tok):
    """Pairs into a receive slot: pair i to local expert j[i], row within[i]. ``x`` / ``scales`` are tensors in
    pair order or (tensor, token) pairs to gather from."""
    import torch
    n_local, _, hidden = views["x"].shape
    dst = (j * rows + within).to(torch.int32)
    flat = views["x"].view(n_local * rows, hidden)
    if isinstance(x, tuple):
        kernels.copy_rows(x[0], x[1], dst, flat)
    else:
        flat[dst.long()] = x
    views["src_info"].view(-1)[dst.long()] = src_tok.to(torch.int32)
    if scales is not None:  # stored [E_local, S, R*M]: column-major per expert
        values = scales[0].index_select(0, scales[1].long()) if isinstance(scales, tuple) else scales
        cols = views["x_scales"].shape[1]
        at = j.unsqueeze(1) * (cols * rows) + torch.arange(cols, device=j.device).unsqueeze(0) * rows + \
            within.unsqueeze(1)
        views["x_scales"].view(-1)[at.reshape(-1)] = values.reshape(-1)


def _spans(plan, rows, begins, counts):
    """The byte ranges one sender writes in a receive slot: its run of rows in each expert, and the scales."""
    out = []
    for jj, (b, c) in enumerate(zip(begins.tolist(), counts.tolist())):
        if c:
            a = jj * rows + b
            for name in ("x", "src_info"):
                off, _, _, nb = plan.fields[name]
                per_row = nb // (len(begins) * rows)
                out.append((off + a * per_row, off + (a + c) * per_row))
            if "x_scales" in plan.fields:
                off, _, _, nb = plan.fields["x_scales"]
                out.append((off + jj * nb // len(begins), off + (jj + 1) * nb // len(begins)))
    return out
