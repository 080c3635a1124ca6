"""``tegula.ops.moe``: TileKernels' MoE routing ops (names, arguments, results), kernels in T.*.

    from tegula.ops.moe import topk_gate, top2_sum_gate, normalize_weight
    from tegula.ops.moe import get_fused_mapping, expand_to_fused, expand_to_fused_with_sf, reduce_fused

- ``topk_gate(scores, num_topk)``: int64 (num_tokens, num_topk), the largest scores of each row in descending
  order, ties to the lower index (a stable descending sort's first num_topk).
- ``top2_sum_gate(logits, bias, num_topk, num_topk_groups, num_groups, use_shared_as_routed, num_shared_experts,
  routed_scaling_factor, ep_rank, num_ep_ranks, tp_rank, num_tp_ranks, scoring_func, mask=None,
  fix_routing_mask=None, to_physical_map=None, logical_count=None, unmapped_topk_idx=None)``: DeepSeek's
  group-limited routing. Scores s = sigmoid / sqrt(softplus) / softmax of the logits; the bias only ranks (softmax
  ranks logits + bias, the others s + bias); with num_groups != num_topk_groups only the num_topk_groups groups
  with the largest sum of their two best biased scores stay; the num_topk best experts (ties to the lower index)
  get weights s / (1e-20 + sum of the chosen s, in selection order) * routed_scaling_factor. Shared experts are
  appended (index num_routed + j, weight 1); to_physical_map / logical_count pick a duplicate
  ((ep_rank + token * 23333) % count); experts of other TP ranks become -1 and the rest are renumbered per rank.
  mask: False rows get -1 / 0. fix_routing_mask: True rows take their experts from unmapped_topk_idx.
  unmapped_topk_idx (int64, updated in place): the chosen logical experts. Returns (topk_idx int64, weights).
- ``normalize_weight(topk_weights) -> (denominator, normalized)``: denominator = 1e-20 + w_0 + w_1 + ... .
- ``get_fused_mapping(topk_idx, num_experts, num_expanded_tokens, alignment, force_no_sync=False)``: the
  per-expert contiguous layout (DeepGEMM's contiguous grouped GEMM layout: each expert's rows together, padded to
  a multiple of ``alignment``, padding rows marked -1): returns (pos_to_expert, pos_to_token, pos_to_token_topk,
  token_topk_to_pos, expert_start, expert_end, num_tokens_per_expert (aligned), num_tokens_per_expert_list).
  Within an expert, rows follow the flat (token, k) order. num_expanded_tokens 0: sized to fit (and trimmed
  unless force_no_sync).
- ``expand_to_fused(x, token_topk_to_pos, pos_to_expert)`` (and ``_with_sf``): token rows copied to their
  positions, padding rows 0. ``reduce_fused(x, topk_weights, token_topk_to_pos, fp8_format='', sf=None,
  out=None)``: per token, the sum over its positions of x * weight (* x's per-row scale when x = (data, sf)),
  accumulated as fused multiply-adds in k order, times sf[0], cast to x's dtype or e4m3.

Numerics: sigmoid is bit-identical to torch.sigmoid on the CPU; softmax and sqrt(softplus) are within a few ulp
of torch's (their exp / log1p are not torch's), so their weights match torch only closely.
"""
from __future__ import annotations

from tegula.ops import _moe_kernels as K
from tegula.ops import _tk
from tegula.ops._tk import align, ceil_div

__all__ = ["topk_gate", "top2_sum_gate", "normalize_weight", "get_fused_mapping", "expand_to_fused",
           "expand_to_fused_with_sf", "reduce_fused"]

_SCORING = {"sigmoid": K.SIGMOID, "sqrtsoftplus": K.SQRTSOFTPLUS, "softmax": K.SOFTMAX}
_CHUNK = 4096
_MAPPING_SERIAL_MAX = 1 << 18   # see get_fused_mapping
_MAPPING_OUT = _tk.Recycled()     # get_fused_mapping's result block


def topk_gate(scores, num_topk: int):
    """Indices (int64, (num_tokens, num_topk)) of each row's num_topk largest scores, descending, ties to the
    lower index."""
    t = _tk.torch()
    _tk.check_tensor(scores, "scores", (t.float32,), 2)
    n, e = scores.shape
    k = _tk.check_int(num_topk, "num_topk", lo=1)
    if k > e:
        raise ValueError(f"num_topk ({k}) must be <= num_experts ({e})")
    out = t.empty((n, k), dtype=t.int64)
    if n > 0:
        _tk.kernel(K.topk_gate, e, k)(scores.contiguous(), out)
    return out


def normalize_weight(topk_weights):
    """``(denominator, normalized_weights)``: 1e-20 + the row's weights summed in order, and weights / it."""
    w = topk_weights
    # a fixed cost of a few microseconds is most of a call: a contiguous float32 CPU tensor of a shape seen before
    # (under the same TEGULA_TARGET setting, read raw: one dict lookup) goes straight to its plan, the launcher
    # bound for that shape and a denominator to allocate like; anything else takes the checks
    plan = _NORMALIZE.get((w.shape, _tk.ENV.get(_tk.TARGET_VAR))) if w.__class__ is _Tensor else None
    if plan is None or w.dtype is not plan[0] or not w.is_cpu or not w.is_contiguous():
        t = _tk.torch()
        _tk.check_tensor(w, "topk_weights", (t.float32,), 2)
        w = w.contiguous()
        plan = _normalize_plan(t, w)
    f32, den_out, out_out, launch = plan
    # both results in the last call's memory where the caller has let go of it (_tk.Recycled: new memory faulted
    # in anew, 512 KB of it at 16384 x 8, when torch's allocations between calls had the heap trimmed)
    den = den_out.take(w.shape[:1], f32)
    out = out_out.take(w.shape, f32)
    if launch is not None:
        launch(w, den, out)
    return den, out


# (shape, raw TEGULA_TARGET) -> normalize_weight's plan for contiguous float32 CPU weights: (torch.float32, the
# denominators' and the weights' _tk.Recycled, the bound launcher or None when there is nothing to compute)
_NORMALIZE: dict = {}
# weights of at most this many values are normalised by one thread (the serial kernel): where the OpenMP threads
# sleep between regions (OMP_WAIT_POLICY=passive, as the benches set it) waking the second one costs more than
# it gives: 2 threads wall, 4096 / 16384 / 32768 x 8: grid 52 / 30 / 58 us, one thread 7.2 / 24.6 / 47 us; with
# spinning threads the grid is faster (8.3 / 23 / 43 us against 9.1 / 30 / 54). On the Intel Xeon the grid won
# 16384 x 8 alternated back to back in one process (50-54 us against 58-60) but not in bench.tile_kernels, where
# torch's eager calls run between samples (three runs each: medians 70 us serial, 77 grid): the bound is kept
_NORMALIZE_SERIAL_MAX = 1 << 17
_Tensor = None   # torch.Tensor once a call has imported torch (before that, every call takes the checks)


def _normalize_plan(t, w):
    global _Tensor
    _Tensor = t.Tensor
    n, k = w.shape
    key = (w.shape, _tk.ENV.get(_tk.TARGET_VAR))
    plan = _NORMALIZE.get(key)
    if plan is None:
        den = t.empty((n,), dtype=t.float32)
        launch = None if n == 0 or k == 0 else \
            _tk.kernel(K.normalize_weight, k, 256, n * k <= _NORMALIZE_SERIAL_MAX).bind(w, den, t.empty_like(w))
        plan = _NORMALIZE[key] = (t.float32, _tk.Recycled(), _tk.Recycled(), launch)
    return plan


def _bool_vector(x, name, n):
    t = _tk.torch()
    _tk.check_tensor(x, name, (t.bool,), 1)
    if x.shape[0] != n:
        raise ValueError(f"{name} must have {n} entries, got {x.shape[0]}")
    return x.contiguous().view(t.int8)


def top2_sum_gate(logits, bias, num_topk: int, num_topk_groups: int, num_groups: int, use_shared_as_routed: bool,
                  num_shared_experts: int, routed_scaling_factor: float, ep_rank: int, num_ep_ranks: int,
                  tp_rank: int, num_tp_ranks: int, scoring_func: str, mask=None, fix_routing_mask=None,
                  to_physical_map=None, logical_count=None, unmapped_topk_idx=None):
    """DeepSeek's group-limited top-k routing (TileKernels' top2_sum_gate); see the module docstring."""
    t = _tk.torch()
    _tk.check_tensor(logits, "logits", (t.float32,), 2)
    _tk.check_tensor(bias, "bias", (t.float32,), 1)
    n, e = logits.shape
    if bias.shape[0] != e:
        raise ValueError(f"bias must have {e} entries (one per routed expert), got {bias.shape[0]}")
    kk = _tk.check_int(num_topk, "num_topk", lo=1)
    ng = _tk.check_int(num_groups, "num_groups", lo=0)
    ntg = _tk.check_int(num_topk_groups, "num_topk_groups", lo=0)
    if kk > e:
        raise ValueError(f"num_topk ({kk}) must be <= the number of routed experts ({e})")
    if (ng == 0) != (ntg == 0) or ntg > ng:
        raise ValueError(f"num_topk_groups ({ntg}) and num_groups ({ng}) must be both 0, or 0 < num_topk_groups <= "
                         "num_groups")
    if ng and e % ng:
        raise ValueError(f"num_groups ({ng}) must divide the number of routed experts ({e})")
    scoring = _tk.check_choice(scoring_func, "scoring_func", tuple(_SCORING))
    if not isinstance(use_shared_as_routed, bool):
        raise TypeError(f"use_shared_as_routed must be a bool, got {type(use_shared_as_routed).__name__}")
    ns = _tk.check_int(num_shared_experts, "num_shared_experts", lo=0) if use_shared_as_routed else 0
    if use_shared_as_routed and ns not in (1, 2):
        raise ValueError(f"num_shared_experts must be 1 or 2 with use_shared_as_routed, got {ns}")
    scale = _tk.check_float(routed_scaling_factor, "routed_scaling_factor")
    ep_ranks = _tk.check_int(num_ep_ranks, "num_ep_ranks", lo=1)
    tp_ranks = _tk.check_int(num_tp_ranks, "num_tp_ranks", lo=1)
    epr = _tk.check_int(ep_rank, "ep_rank", lo=0)
    tpr = _tk.check_int(tp_rank, "tp_rank", lo=0)
    if epr >= ep_ranks or tpr >= tp_ranks:
        raise ValueError(f"ep_rank / tp_rank must be below num_ep_ranks / num_tp_ranks, got {epr}/{ep_ranks}, "
                         f"{tpr}/{tp_ranks}")
    kp = kk + ns
    m8 = _bool_vector(mask, "mask", n) if mask is not None else t.zeros(1, dtype=t.int8)
    if fix_routing_mask is not None and unmapped_topk_idx is None:
        raise ValueError("fix_routing_mask needs unmapped_topk_idx (the experts to keep)")
    f8 = _bool_vector(fix_routing_mask, "fix_routing_mask", n) if fix_routing_mask is not None else t.zeros(
        1, dtype=t.int8)
    if (to_physical_map is None) != (logical_count is None):
        raise ValueError("to_physical_map and logical_count come together")
    extra = 0
    if to_physical_map is not None:
        _tk.check_tensor(to_physical_map, "to_physical_map", (t.int32,), 2)
        _tk.check_tensor(logical_count, "logical_count", (t.int32,), 1)
        if to_physical_map.shape[0] != e + ns or logical_count.shape[0] != e + ns:
            raise ValueError(f"to_physical_map and logical_count must have {e + ns} rows (routed + shared experts)")
        extra = to_physical_map.shape[1] - 1
        pm, lc = to_physical_map.contiguous(), logical_count.contiguous()
        if int(lc.min()) < 1 or int(lc.max()) > extra + 1:
            raise ValueError(f"logical_count entries must lie in [1, {extra + 1}] (to_physical_map's columns)")
        used = pm[t.arange(extra + 1).unsqueeze(0) < lc.unsqueeze(1)]  # the first logical_count[x] of row x
        if int(used.min()) < 0 or int(used.max()) >= e + extra:
            raise ValueError(f"to_physical_map's used entries must lie in [0, {e + extra}) (routed + extra experts)")
    else:
        pm, lc = t.zeros((1, 1), dtype=t.int32), t.ones(1, dtype=t.int32)
    if ns > extra:
        raise ValueError(f"num_shared_experts ({ns}) needs as many extra (duplicate) experts, got {extra}")
    if (e + extra) % ep_ranks:
        raise ValueError(f"num_ep_ranks ({ep_ranks}) must divide routed + extra experts ({e + extra})")
    if unmapped_topk_idx is not None:
        _tk.check_tensor(unmapped_topk_idx, "unmapped_topk_idx", (t.int64,), 2)
        _tk.check_shape(unmapped_topk_idx, "unmapped_topk_idx", (n, kk))
        if unmapped_topk_idx.stride(1) != 1:
            raise ValueError("unmapped_topk_idx must have a contiguous last dim")
        u = unmapped_topk_idx
    else:  # not written (the kernel is built without it): one row seen n times, nothing to fill
        u = t.zeros((1, kk), dtype=t.int64).expand(n, kk)
    topk_idx = t.empty((n, kp), dtype=t.int64)
    weights = t.empty((n, kp), dtype=t.float32)
    if n > 0:
        k = _tk.kernel(K.top2_sum_gate, e, kk, ng, ntg, _SCORING[scoring], ns, mask is not None,
                       fix_routing_mask is not None, unmapped_topk_idx is not None, to_physical_map is not None)
        k(logits.contiguous(), bias.contiguous(), m8, f8, pm, lc, topk_idx, u, weights,
          _rank_local(e + extra, ep_ranks, tpr, tp_ranks), scale, epr)
    return topk_idx, weights


_RANK_LOCAL: dict = {}


def _rank_local(total: int, ep_ranks: int, tp_rank: int, tp_ranks: int):
    """int32 (total,): each global expert's number on TP rank tp_rank, or -1 where another rank holds it (a table
    per configuration: the kernel looks experts up instead of dividing for each)."""
    key = (total, ep_ranks, tp_rank, tp_ranks)
    table = _RANK_LOCAL.get(key)
    if table is None:
        per_rank = total // ep_ranks
        per_dp = per_rank * tp_ranks
        local = []
        for e in range(total):
            x = e - tp_rank * per_rank
            dp = x // per_dp
            x = x - dp * per_dp + dp * per_rank
            local.append(-1 if (e // per_rank) % tp_ranks != tp_rank or x < 0 else x)
        table = _RANK_LOCAL[key] = _tk.torch().tensor(local, dtype=_tk.torch().int32)
    return table


# the per-expert contiguous layout ---------------------------------------------------------------------------------

def get_fused_mapping(topk_idx, num_experts: int, num_expanded_tokens: int, alignment: int,
                      force_no_sync: bool = False):
    """The token <-> per-expert contiguous layout of ``topk_idx`` (int64 (num_tokens, num_topk), -1 = none);
    see the module docstring for the 8 results."""
    t = _tk.torch()
    _tk.check_tensor(topk_idx, "topk_idx", (t.int64,), 2)
    e = _tk.check_int(num_experts, "num_experts", lo=1)
    a = _tk.check_int(alignment, "alignment", lo=1)
    ne = _tk.check_int(num_expanded_tokens, "num_expanded_tokens", lo=0)
    n, kk = topk_idx.shape
    flat = topk_idx.contiguous().view(-1)
    sized = ne == 0
    if sized:
        ne = (n * kk + (a - 1) * e) // a * a
    chunks = max(1, ceil_div(flat.numel(), _CHUNK))
    serial = flat.numel() <= _MAPPING_SERIAL_MAX
    hist = t.zeros((chunks, e), dtype=t.int32)
    start, end, count = (t.empty((e,), dtype=t.int32) for _ in range(3))
    if flat.numel():
        bad = t.empty((chunks,), dtype=t.int32)  # the range check, made by the histogram's pass over the entries
        _tk.kernel(K.expert_histogram, e, _CHUNK, serial)(flat, hist, bad)
        if bool(bad.any()):
            raise ValueError(f"topk_idx entries must lie in [-1, {e})")
    _tk.kernel(K.expert_layout, e)(hist, start, end, count, a)
    need = int(end[-1])
    if need > ne:
        raise ValueError(f"num_expanded_tokens ({ne}) is too small: the layout needs {need} rows")
    # the four int32 results share one allocation, the last call's again where the caller has let go of all of
    # them (_tk.Recycled: a new one page-faults anew, ~1 ms a call at 16384 x 8)
    block = _MAPPING_OUT.take((3 * ne + n * kk,), t.int32)
    p2e, p2t, p2tt = block[:ne], block[ne:2 * ne], block[2 * ne:3 * ne]
    ttp = block[3 * ne:].view(n, kk)
    # one scattered store per entry (its position's entry, P2TT), then the position-ordered arrays from it
    if ne:
        _tk.kernel(K.fill_i32, 4096, serial)(p2tt, -1)
    if flat.numel():
        _tk.kernel(K.expert_scatter, e, _CHUNK, serial)(flat, hist, ttp.view(-1), p2tt)
        if ne:
            _tk.kernel(K.positions_of, kk, 4096, serial)(flat, p2tt, p2e, p2t)
    elif ne:
        _tk.kernel(K.fill_i32)(p2e, -1)
        _tk.kernel(K.fill_i32)(p2t, -1)
    counts = []
    if sized and not force_no_sync:
        counts = count.tolist()
        p2e, p2t, p2tt = p2e[:need], p2t[:need], p2tt[:need]
    return p2e, p2t, p2tt, ttp, start, end, count, counts


def _layout_args(token_topk_to_pos, pos_to_expert, n):
    t = _tk.torch()
    _tk.check_tensor(token_topk_to_pos, "token_topk_to_pos", (t.int32,), 2)
    _tk.check_tensor(pos_to_expert, "pos_to_expert", (t.int32,), 1)
    if token_topk_to_pos.shape[0] != n:
        raise ValueError(f"token_topk_to_pos must have {n} rows (x's tokens), got {token_topk_to_pos.shape[0]}")
    ttp = token_topk_to_pos.contiguous()
    if ttp.numel() and int(ttp.max()) >= pos_to_expert.shape[0]:
        raise ValueError("token_topk_to_pos has positions past pos_to_expert's length")
    return ttp, pos_to_expert.contiguous()


def _bytes(x):
    return x.contiguous().view(_tk.torch().uint8)


def expand_to_fused(x, token_topk_to_pos, pos_to_expert):
    """(num_expanded_tokens, hidden): row p is x[t] for every (t, k) with token_topk_to_pos[t, k] = p, and 0 where
    pos_to_expert[p] < 0."""
    t = _tk.torch()
    _tk.check_tensor(x, "x", None, 2)
    ttp, p2e = _layout_args(token_topk_to_pos, pos_to_expert, x.shape[0])
    out = t.empty((p2e.shape[0], x.shape[1]), dtype=x.dtype)
    if out.numel() or x.numel():
        if x.shape[1]:
            _tk.kernel(K.expand_rows)(_bytes(x), ttp, p2e, _bytes(out))
    return out


def expand_to_fused_with_sf(x, num_per_channels: int, token_topk_to_pos, pos_to_expert,
                            use_tma_aligned_col_major_sf: bool = False):
    """``expand_to_fused`` of a quantised ``x = (data, sf)`` (sf float32 (num_tokens, groups), or packed UE8M0
    int32 with use_tma_aligned_col_major_sf): returns (data, sf) expanded, sf row- or column-major (TMA-aligned)."""
    t = _tk.torch()
    if not isinstance(x, tuple) or len(x) != 2:
        raise TypeError("x must be a pair (data, sf)")
    data, sf = x
    _tk.check_tensor(data, "x[0]", None, 2)
    _tk.check_tensor(sf, "x[1]", (t.float32, t.int32), 2)
    g = _tk.check_int(num_per_channels, "num_per_channels", choices=(32, 128))
    n, hidden = data.shape
    groups = ceil_div(hidden, g)
    packed = sf.dtype == t.int32
    if packed and not use_tma_aligned_col_major_sf:
        raise ValueError("packed UE8M0 scales (int32) need use_tma_aligned_col_major_sf=True")
    _tk.check_shape(sf, "x[1]", (n, ceil_div(groups, 4) if packed else groups))
    out = expand_to_fused(data, token_topk_to_pos, pos_to_expert)
    ttp, p2e = _layout_args(token_topk_to_pos, pos_to_expert, n)
    ne, cols = p2e.shape[0], sf.shape[1]
    if use_tma_aligned_col_major_sf:
        out_sf = t.empty((cols, align(ne, 4)), dtype=sf.dtype)[:, :ne].T
    else:
        out_sf = t.empty((ne, cols), dtype=sf.dtype)
    if cols and (ne or n):
        _tk.kernel(K.expand_rows, "int32", 64, True)(sf.contiguous().view(t.int32), ttp, p2e, out_sf.view(t.int32))
    return out, out_sf


def reduce_fused(x, topk_weights, token_topk_to_pos, fp8_format: str = "", sf=None, out=None):
    """(num_tokens, hidden): per token, the sum over k of x[token_topk_to_pos[t, k]] * topk_weights[t, k] (rows at
    positions < 0 skipped; x = (data, x_sf) scales each row by x_sf[pos]), as fused multiply-adds in k order, times
    sf[0] (with fp8_format='e4m3'), in x's dtype or e4m3. ``out``: written in place and returned."""
    t = _tk.torch()
    x_sf = None
    if isinstance(x, tuple):
        if len(x) != 2:
            raise TypeError("x must be a tensor or a pair (data, x_sf)")
        x, x_sf = x
    _tk.check_tensor(x, "x", (t.float32, t.bfloat16, t.float16, t.float8_e4m3fn), 2)
    np_, hidden = x.shape
    _tk.check_tensor(token_topk_to_pos, "token_topk_to_pos", (t.int32,), 2)
    n, kk = token_topk_to_pos.shape
    ttp = token_topk_to_pos.contiguous()
    if ttp.numel() and int(ttp.max()) >= np_:
        raise ValueError(f"token_topk_to_pos has positions past x's {np_} rows")
    if topk_weights is not None:
        _tk.check_tensor(topk_weights, "topk_weights", (t.float32,), 2)
        _tk.check_shape(topk_weights, "topk_weights", (n, kk))
    if x_sf is not None:
        _tk.check_tensor(x_sf, "x_sf", (t.float32,), 1)
        if x_sf.shape[0] != np_:
            raise ValueError(f"x_sf must have {np_} entries (one per row of x), got {x_sf.shape[0]}")
    fmt = _tk.check_choice(fp8_format, "fp8_format", ("", "e4m3"))
    if sf is not None:
        if fmt != "e4m3":
            raise ValueError("sf is only for an fp8 output (fp8_format='e4m3')")
        _tk.check_tensor(sf, "sf", (t.float32,), 1)
        if sf.numel() < 1:
            raise ValueError("sf must hold one value")
    out_dtype = t.float8_e4m3fn if fmt == "e4m3" else x.dtype
    if out is not None:
        _tk.check_tensor(out, "out", (out_dtype,), 2)
        _tk.check_shape(out, "out", (n, hidden))
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")
    else:
        out = t.empty((n, hidden), dtype=out_dtype)
    if n > 0 and hidden > 0:
        names = {t.float32: "float32", t.bfloat16: "bfloat16", t.float16: "float16", t.float8_e4m3fn: "float8_e4m3fn"}
        k = _tk.kernel(K.reduce_fused, names[x.dtype], names[out_dtype], topk_weights is not None, x_sf is not None,
                       sf is not None)
        one = t.ones(1, dtype=t.float32)
        k(x.contiguous(), topk_weights.contiguous().view(-1) if topk_weights is not None else one, ttp, out,
          sf.contiguous()[:1] if sf is not None else one, x_sf.contiguous() if x_sf is not None else one)
    return out
