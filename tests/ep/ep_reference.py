"""A plain torch.distributed reference of expert-parallel dispatch and combine: every rank gathers every rank's
tensors, then computes its own outputs with obvious loops. Slow and simple on purpose."""
import torch
import torch.distributed as dist

GROUP = None  # the process group the reference runs over (the worker sets it per case)


def rank_and_size():
    return dist.get_rank(GROUP), dist.get_world_size(GROUP)


def gather(obj):
    """Every rank's ``obj``. Tensors are cloned first: pickling a view sends its whole storage (for views of
    tegula.ep's segments, the whole shared window)."""
    def own(o):
        if isinstance(o, torch.Tensor):
            return o.clone()
        return type(o)(own(v) for v in o) if isinstance(o, (tuple, list)) else o
    out = [None] * dist.get_world_size(GROUP)
    dist.all_gather_object(out, own(obj), group=GROUP)
    return out


def layout(topk_idx, num_experts, num_ranks):
    """(num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank) by counting."""
    t, k = topk_idx.shape
    per_local = num_experts // num_ranks
    in_rank = torch.zeros((t, num_ranks), dtype=torch.bool)
    per_expert = torch.zeros(num_experts, dtype=torch.int32)
    for i in range(t):
        for j in range(k):
            e = int(topk_idx[i, j])
            if e >= 0:
                in_rank[i, e // per_local] = True
                per_expert[e] += 1
    return in_rank.sum(0).to(torch.int32), per_expert, in_rank


def dispatch(x, topk_idx, topk_weights, num_experts, scales=None):
    """What this rank receives: rows (and scales) from ranks in rank order, tokens ascending within a rank, with
    top-k ids made local (-1, weight 0, for other ranks' experts). Returns a dict."""
    me, world = rank_and_size()
    everyone = gather((x, scales, topk_idx, topk_weights))
    per_local = num_experts // world
    lo, hi = me * per_local, (me + 1) * per_local
    rows, srows, idx, w, src = [], [], [], [], []
    counts = torch.zeros((world, world), dtype=torch.int64)
    for s, (xs, ss, ts, ws) in enumerate(everyone):
        for t in range(xs.shape[0]):
            for r in range(world):
                if ((ts[t] >= r * per_local) & (ts[t] < (r + 1) * per_local)).any():
                    counts[s, r] += 1
            mine = (ts[t] >= lo) & (ts[t] < hi)
            if mine.any():
                rows.append(xs[t])
                srows.append(ss[t] if ss is not None else None)
                idx.append(torch.where(mine, ts[t] - lo, -1))
                w.append(torch.where(mine, ws[t], 0.0))
                src.append((s, t))
    h = x.shape[1]
    per_expert = [sum(int((ts == lo + j).sum()) for _, _, ts, _ in everyone) for j in range(per_local)]
    return {
        "x": torch.stack(rows) if rows else torch.empty((0, h), dtype=x.dtype),
        "scales": (torch.stack(srows) if rows else torch.empty((0, scales.shape[1]), dtype=scales.dtype))
        if scales is not None else None,
        "topk_idx": torch.stack(idx) if idx else torch.empty((0, topk_idx.shape[1]), dtype=torch.int64),
        "topk_weights": torch.stack(w) if w else torch.empty((0, topk_idx.shape[1])),
        "src": src, "per_expert": per_expert, "rank_prefix_matrix": counts.cumsum(0).to(torch.int32),
    }


def combine(y, src, num_tokens, bias=(), weights=None):
    """For each of this rank's tokens: bias terms, then the rows returned for it, added in float32 in rank order;
    rounded once to y's dtype. ``y`` and ``weights`` are this rank's rows in the order of ``src``."""
    me, _ = rank_and_size()
    everyone = gather((y, src, weights))
    out = torch.zeros((num_tokens, y.shape[1]), dtype=torch.float32)
    for b in bias:
        out += b.float()
    wout = torch.zeros((num_tokens, weights.shape[1])) if weights is not None else None
    for ys, ss, ws in everyone:
        for i, (s, t) in enumerate(ss):
            if s == me:
                out[t] += ys[i].float()
                if wout is not None:
                    wout[t] += ws[i]
    return out.to(y.dtype), wout


def ll_dispatch(x, topk_idx, max_tokens, num_experts):
    """Low-latency receive: per local expert, (token, expert) pairs from ranks in rank order, tokens ascending.
    Returns (recv_x [E_local, R*M, H] with zeros beyond the counts, counts [E_local], layout_range [E_local, R],
    src_info lists)."""
    me, world = rank_and_size()
    everyone = gather((x, topk_idx))
    per_local = num_experts // world
    h = x.shape[1]
    recv = torch.zeros((per_local, world * max_tokens, h), dtype=x.dtype)
    counts = torch.zeros(per_local, dtype=torch.int32)
    layout_range = torch.zeros((per_local, world), dtype=torch.int64)
    src_info = [[] for _ in range(per_local)]
    for j in range(per_local):
        e = me * per_local + j
        for s, (xs, ts) in enumerate(everyone):
            begin = int(counts[j])
            for t in range(xs.shape[0]):
                for k in range(ts.shape[1]):
                    if int(ts[t, k]) == e:
                        recv[j, int(counts[j])] = xs[t]
                        src_info[j].append(t)
                        counts[j] += 1
            layout_range[j, s] = (begin << 32) | (int(counts[j]) - begin)
    return recv, counts, layout_range, src_info


def ll_combine(y, topk_idx, topk_weights, num_experts):
    """combined[t] = sum over k, in order, of w[t, k] * (expert topk_idx[t, k]'s output row for t), in float32.
    ``y`` is this rank's [E_local, R*M, H] output in the ll_dispatch layout."""
    me, world = rank_and_size()
    per_local = num_experts // world
    everyone = gather((y, topk_idx))
    t_n, h = topk_idx.shape[0], y.shape[2]

    rows = {}  # (source rank, token, expert) -> its row at the expert's rank: after every earlier pair for e
    seen = [0] * num_experts
    for s, (_, ts) in enumerate(everyone):
        for t, k in ((t, k) for t in range(ts.shape[0]) for k in range(ts.shape[1])):
            e = int(ts[t, k])
            if e >= 0:
                rows[(s, t, e)] = everyone[e // per_local][0][e % per_local, seen[e]]
                seen[e] += 1

    def row_of(s, t, e):
        return rows[(s, t, e)]

    out = torch.zeros((t_n, h), dtype=torch.float32)
    for t in range(t_n):
        for k in range(topk_idx.shape[1]):
            e = int(topk_idx[t, k])
            if e >= 0:
                out[t] = out[t] + topk_weights[t, k] * row_of(me, t, e).float()
    return out.to(torch.bfloat16)


def cast_to_fp8(x, round_scale=False):
    """Per token and 128 channels: scale so that max(|x|, 1e-4) maps to 448 (a power of two when rounding); the
    scale is one float32 division (``448.0 / t`` in torch would multiply by a reciprocal)."""
    t, h = x.shape
    xf = x.float().view(t, h // 128, 128)
    amax = xf.abs().amax(dim=2).clamp(min=1e-4)
    if round_scale:
        inv = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
        return (xf / inv.unsqueeze(2)).to(torch.float8_e4m3fn).view(t, h), inv
    scale = torch.full_like(amax, 448.0) / amax
    return (xf * scale.unsqueeze(2)).to(torch.float8_e4m3fn).view(t, h), amax / 448.0


def calc_diff(x, y):
    """DeepEP's similarity measure: 1 - 2<x+1, y+1> / (|x+1|^2 + |y+1|^2)."""
    if x.numel() == 0:
        return 0.0
    x, y = x.double() + 1, y.double() + 1
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())
