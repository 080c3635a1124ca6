"""Layouts: which token goes where (from top-k expert indices), and how a receiver's region is carved into the
arrays it hands out. Pure functions of torch tensors and sizes; every rank computes the same plan for every
receiver from the exchanged counts, so nobody needs to be told an offset."""
from __future__ import annotations

ALIGN = 64
# dtype codes exchanged between ranks (a mismatch is an error, not a silent reinterpretation)
DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "int32", "int64", "uint8", "int8")


def dtype_code(dtype) -> int:
    name = str(dtype).replace("torch.", "")
    if name not in DTYPES:
        raise TypeError(f"tegula.ep: unsupported dtype {name} (supported: {', '.join(DTYPES)})")
    return DTYPES.index(name)


class Plan:
    """Named arrays packed one after another (each 64-byte aligned) from byte 0 of a region."""

    def __init__(self, fields):
        self.fields, off = {}, 0
        self._strides = []  # (name, byte offset, shape, strides in elements, dtype) for views_in
        for name, shape, dtype in fields:
            n, strides = 1, []
            for d in reversed(shape):
                strides.append(n)
                n *= d
            nbytes = n * dtype.itemsize
            self.fields[name] = (off, tuple(shape), dtype, nbytes)
            self._strides.append((name, off, tuple(shape), tuple(reversed(strides)), dtype))
            off += -(-nbytes // ALIGN) * ALIGN
        self.nbytes = off

    def views(self, region):
        """The arrays as views of ``region`` (a uint8 tensor at least ``nbytes`` long)."""
        return {name: region[off:off + nb].view(dtype).view(shape)
                for name, (off, shape, dtype, nb) in self.fields.items()}

    def views_in(self, typed, at: int):
        """The arrays of the region starting ``at`` bytes into a tensor seen as every dtype through
        ``typed(dtype)`` (a 1-D tensor of that dtype over the same memory from the same start): as ``views``, one
        torch operation per array. ``at`` must be a multiple of the arrays' element sizes."""
        return {name: typed(dtype).as_strided(shape, strides, (at + off) // dtype.itemsize)
                for name, off, shape, strides, dtype in self._strides}

    def span(self, name: str, row0: int, row1: int) -> tuple[int, int]:
        """Byte range of rows [row0, row1) of array ``name`` (rows along its first dimension)."""
        off, shape, _, nb = self.fields[name]
        row = nb // shape[0] if shape[0] else 0
        return off + row0 * row, off + row1 * row


def dispatch_plan(n, hidden, x_dtype, scales=None, num_topk=0):
    """A dispatch receiver's arrays for ``n`` rows: x, x_scales (``scales`` = (columns, dtype)), topk_idx,
    topk_weights, src_idx."""
    import torch
    fields = [("x", (n, hidden), x_dtype)]
    if scales is not None:
        fields.append(("x_scales", (n, scales[0]), scales[1]))
    if num_topk:
        fields += [("topk_idx", (n, num_topk), torch.int64), ("topk_weights", (n, num_topk), torch.float32)]
    fields.append(("src_idx", (n,), torch.int32))
    return Plan(fields)


def combine_plan(n, hidden, x_dtype, num_topk=0):
    """A combine receiver's arrays: the ``n`` rows sent back to it, and their top-k weights."""
    import torch
    fields = [("x", (n, hidden), x_dtype)]
    if num_topk:
        fields.append(("topk_weights", (n, num_topk), torch.float32))
    return Plan(fields)


def ll_dispatch_plan(num_local_experts, num_ranks, max_tokens, hidden, use_fp8, use_ue8m0=False):
    """A low-latency receiver's arrays: x [E_local, R*M, H] (bf16, or fp8 with column-major scales stored as
    [E_local, S, R*M]: float32, or int32 holding four UE8M0 bytes), and src_info [E_local, R*M]."""
    import torch
    rows = num_ranks * max_tokens
    if not use_fp8:
        fields = [("x", (num_local_experts, rows, hidden), torch.bfloat16)]
    else:
        cols = hidden // 512 if use_ue8m0 else hidden // 128
        fields = [("x", (num_local_experts, rows, hidden), torch.float8_e4m3fn),
                  ("x_scales", (num_local_experts, cols, rows), torch.int32 if use_ue8m0 else torch.float32)]
    fields.append(("src_info", (num_local_experts, rows), torch.int32))
    return Plan(fields)


def token_layout(topk_idx, num_experts: int, num_ranks: int, node_of=None):
    """DeepEP's get_dispatch_layout: (num_tokens_per_rank [R] int32, num_tokens_per_rdma_rank [nodes] int32 or
    None, num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool). Rank r owns experts
    [r*E/R, (r+1)*E/R); -1 selects nothing; a token counts once per rank however many of its experts live there."""
    import torch
    t = topk_idx.shape[0]
    valid = topk_idx >= 0
    experts = topk_idx[valid]
    num_tokens_per_expert = torch.bincount(experts, minlength=num_experts).to(torch.int32)
    rank_of = torch.where(valid, topk_idx // (num_experts // num_ranks), num_ranks)
    hit = torch.zeros((t, num_ranks + 1), dtype=torch.bool, device=topk_idx.device)
    hit.scatter_(1, rank_of, True)
    is_token_in_rank = hit[:, :num_ranks].contiguous()
    num_tokens_per_rank = is_token_in_rank.sum(0, dtype=torch.int32)
    per_node = None
    if node_of is not None and max(node_of) > 0:
        per_node = torch.stack([is_token_in_rank[:, [r for r, m in enumerate(node_of) if m == n]].any(1)
                                for n in range(max(node_of) + 1)], 1).sum(0, dtype=torch.int32)
    return num_tokens_per_rank, per_node, num_tokens_per_expert, is_token_in_rank


def send_lists(is_token_in_rank):
    """For each rank r: the tokens sent to r in token order (int32), and send_head [T, R] int32, the position of
    token t among them (-1 when not sent)."""
    return send_tokens(is_token_in_rank), send_head_of(is_token_in_rank)[0]


def send_head_of(is_token_in_rank):
    """-> (send_head [T, R] int32: token t's position among the tokens sent to rank r, in token order, -1 when not
    sent; the number of tokens sent to each rank [R] int32)."""
    import torch
    t, r = is_token_in_rank.shape
    if t == 0:
        return (torch.zeros((0, r), dtype=torch.int32, device=is_token_in_rank.device),
                torch.zeros(r, dtype=torch.int32, device=is_token_in_rank.device))
    pos = is_token_in_rank.to(torch.int32).cumsum(0, dtype=torch.int32)  # pos[t, r] - 1: token t's place at r
    return torch.where(is_token_in_rank, pos - 1, -1).to(torch.int32), pos[-1]


def send_tokens(is_token_in_rank):
    """For each rank r, the tokens sent to r in token order (int32)."""
    import torch
    t, r = is_token_in_rank.shape
    if t == 0:
        return [torch.zeros(0, dtype=torch.int32, device=is_token_in_rank.device)] * r
    tokens = is_token_in_rank.t().nonzero()[:, 1].to(torch.int32)  # (rank, token) pairs, rank-major
    return list(tokens.split(is_token_in_rank.sum(0).tolist()))


def expert_positions(topk_idx, num_experts: int):
    """Low-latency order: the (token, k) pairs sorted by expert, tokens ascending within one.
    Returns (pair indices into the flattened [T*K] top-k in that order, their expert ids, the position of each
    pair within its expert's run, counts per expert [E] int64)."""
    import torch
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    keep = experts >= 0
    order, experts = order[keep], experts[keep]
    counts = torch.bincount(experts, minlength=num_experts)
    starts = counts.cumsum(0) - counts
    pos = torch.arange(order.numel(), device=flat.device) - starts[experts]
    return order, experts, pos, counts


def pack_ue8m0(scale_inv):
    """float32 power-of-two scales [T, S] -> int32 [T, S/4]: the exponent bytes, four per word, lowest first."""
    import torch
    e = (scale_inv.view(torch.int32) >> 23).to(torch.uint8)
    return e.contiguous().view(torch.int32)


def exclusive(prefix):
    """Inclusive prefix sums down the rows of ``prefix`` -> exclusive ones (numpy)."""
    import numpy as np
    out = np.zeros_like(prefix)
    out[1:] = prefix[:-1]
    return out


def localise(topk_idx, topk_weights, first: int, n_local: int):
    """Top-k as the rank owning experts [first, first+n_local) sees it: local ids; -1 and weight 0 elsewhere."""
    import torch
    local = topk_idx - first
    keep = (topk_idx >= 0) & (local >= 0) & (local < n_local)
    return torch.where(keep, local, -1), torch.where(keep, topk_weights, 0.0)


def ranges(first, count):
    """Concatenated aranges [first[i], first[i] + count[i]) (int64)."""
    import torch
    count = count.long()
    total = int(count.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.int64)
    starts = torch.repeat_interleave(first.long() - (count.cumsum(0) - count), count)
    return starts + torch.arange(total)
