"""``tegula.ops.attention``: FlashMLA's attention API (names, argument order, numerics), every kernel in T.*.

    from tegula.ops.attention import get_mla_metadata, flash_mla_with_kvcache, flash_mla_sparse_fwd
    from tegula.ops.attention import flash_attn_varlen_func, quantize_kv_cache_fp8, dequantize_kv_cache_fp8

- ``get_mla_metadata(*args, **kwargs)``: FlashMLA's new form (no arguments: an empty ``FlashMLASchedMeta``, filled
  by the first ``flash_mla_with_kvcache`` call) and its old form ``(cache_seqlens, num_q_tokens_per_head_k,
  num_heads_k, num_heads_q=None, is_fp8_kvcache=False, topk=None)``, which returns ``(tile_scheduler_metadata,
  num_splits)`` tensors. Here the schedule is a CPU one: which (batch, key range) work items the cores take, long
  caches split so that every core has work, and where split partials are merged.
- ``flash_mla_with_kvcache``: MLA decode over a paged KV cache (q [b, s_q, h_q, d_qk], k_cache [num_blocks,
  page_block_size, h_kv, d_qk], V = the first head_dim_v dims of K), causal aligned to the bottom-right, lse in
  natural log ([b, h_q, s_q]); a query row with no key gives out 0 and lse +inf. With ``indices`` [b, s_q, topk]
  (cache positions block * page_block_size + offset; -1 invalid): sparse decode. ``is_fp8_kvcache``: the 656-byte
  FP8 layout (see ``quantize_kv_cache_fp8``). ``attn_sink`` [h_q]: out *= 1 / (1 + exp(sink - lse)).
  ``topk_length`` [b]: only the first topk_length[i] indices count.
- ``flash_mla_sparse_fwd``: sparse prefill, returns (out, max_logits, lse).
- ``flash_attn_varlen_func`` (and its ``_qkvpacked`` / ``_kvpacked`` forms): packed variable-length attention with
  grouped-query heads, forward only.
- ``quantize_kv_cache_fp8`` / ``dequantize_kv_cache_fp8``: FlashMLA's FP8 cache layout from a bf16 cache and back.

Differences from FlashMLA: extensions — any page_block_size and head dims with d_qk >= head_dim_v in the bf16/fp16
cache (FlashMLA: 64, 576 or 512, and 512); the FP8 cache also in dense decode and a bf16 cache also in sparse
decode; fp32 inputs and ``return_lse=False`` in flash_attn_varlen_func. Not supported (ValueError):
``extra_k_cache`` / ``extra_indices_in_kvcache`` / ``extra_topk_length``, the d_qk = 512 FP8 layout ("MODEL1"),
dropout; no autograd (flash_attn_varlen_func returns plain tensors).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

from tegula.ops import _flash_kernels as _flash
from tegula.ops import _mla_kernels as K
from tegula.ops import _tk

BLOCK_N = 64          # keys per tile of the decode kernels
MIN_SPLIT_TILES = 4   # a split of a long cache covers at least this many tiles
ROW_BLOCK = 128       # query rows one decode block keeps (more rows: several row blocks)

__all__ = ["FlashMLASchedMeta", "get_mla_metadata", "flash_mla_with_kvcache", "flash_mla_sparse_fwd",
           "flash_attn_varlen_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func",
           "quantize_kv_cache_fp8", "dequantize_kv_cache_fp8"]


@dataclasses.dataclass
class FlashMLASchedMeta:
    """The scheduling state of ``flash_mla_with_kvcache`` (FlashMLA's name): empty from ``get_mla_metadata()``,
    filled by the first call. Reuse it only while the shapes and the values of cache_seqlens / topk_length stay the
    same (FlashMLA's rule); a call whose configuration differs raises ValueError."""

    @dataclasses.dataclass
    class Config:
        b: int
        s_q: int
        h_q: int
        page_block_size: int
        h_k: int
        causal: bool
        is_fp8_kvcache: bool
        topk: Optional[int]
        extra_page_block_size: Optional[int] = None
        extra_topk: Optional[int] = None

    have_initialized: bool = False
    config: Optional[Config] = None
    tile_scheduler_metadata: Optional[object] = None   # int32 (items, 4): group, first key, end key, slot
    num_splits: Optional[object] = None                # int32 (groups + 1,): partial slots of each group, cumulative


# ---- helpers -----------------------------------------------------------------------------------------------------

def _torch():
    import torch
    return torch


def _target() -> str:
    from tegula.jit.targets import resolve
    return resolve(None).name




def _check_tensor(name, x, ndim=None, dtypes=None):
    torch = _torch()
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.device.type != "cpu":
        raise ValueError(f"{name} is on {x.device}; tegula.ops.attention runs on the CPU here")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(x.shape)}")
    if dtypes is not None and x.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype {' or '.join(str(d) for d in dtypes)}, got {x.dtype}")


def _shape(name, x, want):
    got = tuple(x.shape)
    if len(got) != len(want) or any(w is not None and w != g for w, g in zip(want, got)):
        raise ValueError(f"{name} must have shape {tuple('?' if w is None else w for w in want)}, got {got}")


def _flat(x):
    """A 1-D view from x's first element to its last one (x's last dim contiguous), and x's strides."""
    torch = _torch()
    if x.stride(-1) != 1 and x.shape[-1] > 1:
        raise ValueError(f"the KV cache must have a contiguous last dimension, got strides {tuple(x.stride())}")
    span = 1 + sum((n - 1) * s for n, s in zip(x.shape, x.stride()))
    return torch.as_strided(x, (span,), (1,)), x.stride()


def _int32(name, x, shape):
    torch = _torch()
    _check_tensor(name, x, len(shape), (torch.int32,))
    _shape(name, x, shape)
    return x.contiguous()


def _scale(name: str, value, d: int) -> float:
    """The softmax scale (default 1 / sqrt(d)): a finite float > 0 (the kernels' online softmax keeps the running
    maximum of q . k, which is the maximum of the scaled scores only for a positive scale)."""
    if value is None:
        return d ** -0.5
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}") from None
    if not (v > 0 and math.isfinite(v)):
        raise ValueError(f"{name} must be a finite float > 0, got {value!r}")
    return v


def _row_block(rows: int) -> tuple[int, int]:
    """(rows per block, row blocks): all rows in one block up to ROW_BLOCK, else the largest divisor <= it."""
    if rows <= ROW_BLOCK:
        return rows, 1
    for rb in range(ROW_BLOCK, 0, -1):
        if rows % rb == 0 and rb >= 16:
            return rb, rows // rb
    return rows, 1


def _schedule(lengths: list[int], blocks_per_item: int):
    """Work items (group, start, end, slot) over groups with ``lengths`` keys: a long group is split into pieces of
    at least MIN_SPLIT_TILES tiles when that gives every core work; pieces of split groups get workspace slots
    (slot -1: the item writes the output itself). Longest items first (the grid hands them out dynamically).
    Returns (items, num_splits = cumulative slots per group)."""
    torch = _torch()
    tiles = [max(0, -(-n // BLOCK_N)) for n in lengths]
    total = sum(tiles) * blocks_per_item
    want = 4 * _tk.threads()
    chunk = max(MIN_SPLIT_TILES, -(-total // max(1, want)) // max(1, blocks_per_item) or 1)
    items, ns = [], [0]
    for g, (n, t) in enumerate(zip(lengths, tiles)):
        parts = max(1, min(t // MIN_SPLIT_TILES, -(-t // chunk))) if t else 1
        if parts == 1:
            items.append((t, g, 0, n, -1))
        else:
            for p in range(parts):
                a, b = t * p // parts * BLOCK_N, min(n, t * (p + 1) // parts * BLOCK_N)
                items.append((b - a, g, a, b, ns[-1] + p))
        ns.append(ns[-1] + (parts if parts > 1 else 0))
    items.sort(key=lambda it: -it[0])
    sched = torch.tensor([it[1:] for it in items], dtype=torch.int32).reshape(-1, 4)
    return sched, torch.tensor(ns, dtype=torch.int32)


def _expand_groups(sched, ns, s_q: int):
    """A per-batch schedule as one over (batch, query token) groups: sparse decode gives each token its keys."""
    torch = _torch()
    if s_q == 1:
        return sched, ns
    b = ns.numel() - 1
    cnt = ns[1:] - ns[:-1]
    s = torch.arange(s_q, dtype=torch.int32)
    g, st, en, slot = sched.unbind(1)
    base = ns[:-1].index_select(0, g.long())
    nslot = cnt.index_select(0, g.long())
    new_g = (g[:, None] * s_q + s[None, :]).reshape(-1)
    new_slot = torch.where(slot[:, None] < 0, -1, base[:, None] * s_q + s[None, :] * nslot[:, None]
                           + (slot - base)[:, None]).reshape(-1)
    out = torch.stack([new_g, st.repeat_interleave(s_q), en.repeat_interleave(s_q), new_slot], 1).to(torch.int32)
    per_group = cnt.repeat_interleave(s_q)
    new_ns = torch.zeros(b * s_q + 1, dtype=torch.int32)
    new_ns[1:] = torch.cumsum(per_group, 0)
    return out.contiguous(), new_ns


# ---- get_mla_metadata --------------------------------------------------------------------------------------------

def get_mla_metadata(*args, **kwargs):
    """FlashMLA's scheduler entry point, both forms (see the module docstring).

    No arguments: returns ``(FlashMLASchedMeta(), None)``; the schedule is made by the first
    ``flash_mla_with_kvcache`` call that receives it. Old form ``(cache_seqlens, num_q_tokens_per_head_k,
    num_heads_k, num_heads_q=None, is_fp8_kvcache=False, topk=None)``: returns ``(tile_scheduler_metadata,
    num_splits)``, int32 tensors of shapes (items, 4) and (batch + 1,), for the calls of one decode step."""
    if not args and not kwargs:
        return FlashMLASchedMeta(), None
    torch = _torch()
    names = ["cache_seqlens", "num_q_tokens_per_head_k", "num_heads_k", "num_heads_q", "is_fp8_kvcache", "topk"]
    if len(args) > len(names):
        raise TypeError(f"get_mla_metadata takes at most {len(names)} arguments, got {len(args)}")
    bound = dict(zip(names, args))
    for k, v in kwargs.items():
        if k not in names:
            raise TypeError(f"get_mla_metadata got an unexpected keyword argument {k!r}")
        if k in bound:
            raise TypeError(f"get_mla_metadata got multiple values for {k!r}")
        bound[k] = v
    if "cache_seqlens" not in bound:
        return FlashMLASchedMeta(), None
    seqlens = bound["cache_seqlens"]
    _check_tensor("cache_seqlens", seqlens, 1, (torch.int32,))
    rows = int(bound.get("num_q_tokens_per_head_k") or 1)
    h_kv = int(bound.get("num_heads_k") or 1)
    topk = bound.get("topk")
    if rows <= 0 or h_kv <= 0:
        raise ValueError(f"num_q_tokens_per_head_k and num_heads_k must be positive, got {rows}, {h_kv}")
    if topk is None:
        lens, blocks = seqlens.tolist(), h_kv * _row_block(rows)[1]
        if any(n < 0 for n in lens):
            raise ValueError("cache_seqlens must be >= 0")
    else:  # sparse: one group per query token, of num_heads_q rows
        h_q = int(bound.get("num_heads_q") or rows * h_kv)
        s_q = max(1, rows * h_kv // h_q)
        lens, blocks = [int(topk)] * seqlens.numel(), s_q * _row_block(h_q)[1]
    return _schedule(lens, blocks)


# ---- flash_mla_with_kvcache ----------------------------------------------------------------------------------------

def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                           num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=False, indices=None,
                           attn_sink=None, extra_k_cache=None, extra_indices_in_kvcache=None, topk_length=None,
                           extra_topk_length=None):
    """MLA decode over a paged KV cache; returns ``(out [b, s_q, h_q, head_dim_v], lse [b, h_q, s_q])``.

    Dense (``indices`` None): query token s of batch i sees keys 0 .. cache_seqlens[i] - 1, with ``causal`` only
    keys up to cache_seqlens[i] - s_q + s; keys are rows of ``k_cache`` pages named by ``block_table[i]``.
    Sparse (``indices`` [b, s_q, topk]): query token s sees the cache rows indices[i, s, :topk_length[i]]
    (entries outside the cache, e.g. -1, are skipped); ``causal`` must be False. Scores are
    softmax_scale * q . k (default 1 / sqrt(d_qk)) in fp32 from bf16/fp16 products, P is rounded to q's dtype
    for P V, lse = log(sum exp(scores)); rows without keys give out 0 and lse +inf; ``attn_sink`` [h_q] (fp32)
    scales out by 1 / (1 + exp(sink - lse)) and leaves lse alone."""
    torch = _torch()
    if extra_k_cache is not None or extra_indices_in_kvcache is not None or extra_topk_length is not None:
        raise ValueError("extra_k_cache / extra_indices_in_kvcache / extra_topk_length are not supported")
    sparse = indices is not None
    _check_tensor("q", q, 4, (torch.bfloat16, torch.float16))
    b, s_q, h_q, d = q.shape
    _check_tensor("k_cache", k_cache, 4)
    nb, ps, h_kv = k_cache.shape[:3]
    if not isinstance(head_dim_v, int) or isinstance(head_dim_v, bool):
        raise TypeError(f"head_dim_v must be an int, got {type(head_dim_v).__name__}")
    if b < 1 or s_q < 1 or h_q < 1 or nb < 1 or ps < 1 or h_kv < 1:
        raise ValueError(f"empty q {tuple(q.shape)} or k_cache {tuple(k_cache.shape)}")
    if h_q % h_kv:
        raise ValueError(f"the number of q heads ({h_q}) must be a multiple of the number of kv heads ({h_kv})")
    if is_fp8_kvcache:
        if k_cache.dtype not in (torch.float8_e4m3fn, torch.uint8, torch.int8):
            raise ValueError(f"an FP8 k_cache must have dtype float8_e4m3fn (or uint8/int8), got {k_cache.dtype}")
        if q.dtype != torch.bfloat16:
            raise ValueError(f"q must be bfloat16 with an FP8 cache, got {q.dtype}")
        if (d, head_dim_v, h_kv, k_cache.shape[3]) != (576, 512, 1, K.FP8_BYTES):
            raise ValueError(f"the FP8 cache holds d_qk 576 / head_dim_v 512, h_kv 1, {K.FP8_BYTES} bytes per token: "
                             f"got d_qk {d}, head_dim_v {head_dim_v}, k_cache {tuple(k_cache.shape)}")
    else:
        if k_cache.dtype != q.dtype:
            raise ValueError(f"k_cache must have q's dtype {q.dtype}, got {k_cache.dtype}")
        if k_cache.shape[3] != d:
            raise ValueError(f"q's head dim {d} differs from k_cache's {k_cache.shape[3]}")
    if not 0 < head_dim_v <= d:
        raise ValueError(f"head_dim_v must be in 1..d_qk={d}, got {head_dim_v}")
    scale = _scale("softmax_scale", softmax_scale, d)

    if sparse:
        if causal:
            raise ValueError("causal must be False with indices (sparse attention)")
        if h_kv != 1:
            raise ValueError(f"sparse decode needs h_kv == 1, got {h_kv}")
        _check_tensor("indices", indices, 3, (torch.int32,))
        _shape("indices", indices, (b, s_q, None))
        topk = indices.shape[2]
        if topk < 1:
            raise ValueError("indices must hold at least one entry per query")
        tab = indices.reshape(b * s_q, topk).contiguous()
        if topk_length is not None:
            lens = _int32("topk_length", topk_length, (b,)).clamp(0, topk).repeat_interleave(s_q)
        else:
            lens = torch.full((b * s_q,), topk, dtype=torch.int32)
        groups, sq_k, hpk = b * s_q, 1, h_q
        key_counts = None if topk_length is None else topk_length
    else:
        if attn_sink is not None or topk_length is not None:
            raise ValueError("attn_sink and topk_length need indices (sparse attention)")
        if block_table is None or cache_seqlens is None:
            raise ValueError("dense decode needs block_table and cache_seqlens")
        _check_tensor("block_table", block_table, 2, (torch.int32,))
        _shape("block_table", block_table, (b, None))
        lens = _int32("cache_seqlens", cache_seqlens, (b,))
        tab = block_table.contiguous()
        _check_pages(tab, lens, nb, ps)
        groups, sq_k, hpk, topk = b, s_q, h_q // h_kv, None
        key_counts = lens
    if attn_sink is not None:
        _check_tensor("attn_sink", attn_sink, 1, (torch.float32,))
        _shape("attn_sink", attn_sink, (h_q,))
    rows = sq_k * hpk
    rb, nrb = _row_block(rows)
    sched, ns = _get_schedule(tile_scheduler_metadata, num_splits, q, k_cache, causal, is_fp8_kvcache, topk,
                              key_counts, sparse, h_kv * nrb * (s_q if sparse else 1), s_q)

    target = _target()
    kva, kvs, kvr, (sb, rs, hs) = _cache_views(k_cache, is_fp8_kvcache)
    n_tok = nb * ps
    if sparse:
        tab, lens = _compact(tab, lens, min(n_tok, 2**31 - 1))
    qv = q.contiguous().view(groups, sq_k, h_kv, hpk, d)
    out = torch.empty(b, s_q, h_q, head_dim_v, dtype=q.dtype)
    lse = torch.empty((b, s_q, h_q) if sparse else (b, h_q, s_q), dtype=torch.float32)
    n_slots = int(ns[-1])
    opart = torch.empty(max(n_slots, 1), h_kv, rows, head_dim_v, dtype=torch.float32)
    lpart = torch.empty(max(n_slots, 1), h_kv, rows, dtype=torch.float32)
    sink = attn_sink.contiguous() if attn_sink is not None else torch.zeros(1, dtype=torch.float32)
    outv = out.view(groups, sq_k, h_kv, hpk, head_dim_v)
    lsev = lse.view(groups, h_kv, hpk, sq_k)
    kern = K.get("decode", target, rb, nrb, sq_k, hpk, h_kv, d, head_dim_v, ps, sparse, bool(causal),
                 bool(is_fp8_kvcache), _dt(q.dtype), attn_sink is not None, False)
    kern(qv, kva, kvs, kvr, tab, lens, sched, sink, outv, lsev, _dummy_max(h_kv, hpk, sq_k), opart, lpart,
         int(sb), int(rs), int(hs), int(min(n_tok, 2**31 - 1)), scale)
    if n_slots:
        comb = K.get("combine", target, sq_k, hpk, h_kv, head_dim_v, _dt(q.dtype), attn_sink is not None)
        comb(opart, lpart, ns, sink, outv, lsev)
    return out, (lse.transpose(1, 2) if sparse else lse)


def _compact(tab, lens, n_tok):
    """(key lists, counts) of sparse attention with the entries that name a cache row (in [0, n_tok), within the
    first lens[r]) moved to the front of each row, the rest skipped."""
    torch = _torch()
    out, cnt = torch.empty_like(tab), torch.empty_like(lens)
    K.get("compact", _target())(tab, lens, out, cnt, int(n_tok))
    return out, cnt


def _check_pages(tab, lens, nb, ps):
    torch = _torch()
    if lens.numel() and int(lens.min()) < 0:
        raise ValueError("cache_seqlens must be >= 0")
    pages = (lens.long() + ps - 1) // ps
    if pages.numel() and int(pages.max()) > tab.shape[1]:
        raise ValueError(f"cache_seqlens need up to {int(pages.max())} pages but block_table has {tab.shape[1]} "
                         "columns")
    used = tab[torch.arange(tab.shape[1])[None, :] < pages[:, None]]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= nb):
        raise ValueError(f"block_table points past the cache: pages must be in [0, {nb}), got "
                         f"[{int(used.min())}, {int(used.max())}]")


def _cache_views(k_cache, fp8):
    """(flat main view, flat fp32 view, flat bf16 view, (elements per page, per token, per kv head)) of the cache."""
    torch = _torch()
    if not fp8:
        flat, st = _flat(k_cache)
        return flat, torch.zeros(1, dtype=torch.float32), torch.zeros(1, dtype=torch.bfloat16), st[:3]
    c8 = k_cache.view(torch.float8_e4m3fn)
    st = c8.stride()
    if st[1] != K.FP8_BYTES or st[3] != 1 or st[0] % 4 or c8.data_ptr() % 4:
        raise ValueError("an FP8 k_cache must keep each page's tokens contiguous (656 bytes apart) with 4-byte "
                         f"aligned pages, got strides {tuple(st)}")
    flat, _ = _flat(c8)
    n4 = flat.numel() // 4
    base = torch.as_strided(flat, (n4 * 4,), (1,))
    return flat, base.view(torch.float32), base.view(torch.bfloat16), (st[0], st[1], st[1])


def _dummy_max(h_kv, hpk, sq):
    return _torch().empty(1, h_kv, hpk, sq, dtype=_torch().float32)


def _dt(torch_dtype) -> str:
    return str(torch_dtype).replace("torch.", "")


def _get_schedule(meta, num_splits, q, k_cache, causal, fp8, topk, key_counts, sparse, blocks_per_item, s_q):
    """The (items, num_splits) schedule for this call: from a FlashMLASchedMeta (made on its first use, checked
    against its configuration after), from the old form's tensors, or made now when ``meta`` is None."""
    torch = _torch()
    b = q.shape[0]

    def make():
        if key_counts is None:
            counts = [topk] * b
        else:
            counts = [min(int(n), topk) if topk is not None else int(n) for n in key_counts.tolist()]
        return _schedule(counts, blocks_per_item)

    if isinstance(meta, FlashMLASchedMeta):
        if num_splits is not None:
            raise ValueError("num_splits must be None with a FlashMLASchedMeta (FlashMLA's rule)")
        cfg = FlashMLASchedMeta.Config(b, q.shape[1], q.shape[2], k_cache.shape[1], k_cache.shape[2], bool(causal),
                                       bool(fp8), topk)
        if not meta.have_initialized:
            sched, ns = make()
            if sparse:
                sched, ns = _expand_groups(sched, ns, s_q)
            meta.config, meta.tile_scheduler_metadata, meta.num_splits = cfg, sched, ns
            meta.have_initialized = True
        elif meta.config != cfg:
            raise ValueError(f"the arguments differ from those tile_scheduler_metadata was made for: {cfg} vs "
                             f"{meta.config}; use a new get_mla_metadata() per configuration")
        return meta.tile_scheduler_metadata, meta.num_splits
    if meta is None:
        sched, ns = make()
    else:
        _check_tensor("tile_scheduler_metadata", meta, 2, (torch.int32,))
        _shape("tile_scheduler_metadata", meta, (None, 4))
        if num_splits is None:
            raise ValueError("num_splits is needed with a tile_scheduler_metadata tensor (get_mla_metadata's old "
                             "form returns both)")
        _check_tensor("num_splits", num_splits, 1, (torch.int32,))
        _shape("num_splits", num_splits, (b + 1,))
        sched, ns = meta.contiguous(), num_splits.contiguous()
        if sched.numel() and (int(sched[:, 0].min()) < 0 or int(sched[:, 0].max()) >= b):
            raise ValueError("tile_scheduler_metadata was made for another batch size")
    if sparse:
        sched, ns = _expand_groups(sched, ns, s_q)
    return sched, ns


# ---- flash_mla_sparse_fwd ---------------------------------------------------------------------------------------

def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
    """Sparse (DSA) prefill: q [s_q, h_q, d_qk], kv [s_kv, 1, d_qk], indices [s_q, 1, topk] int32 (entries < 0 or
    >= s_kv are skipped; with ``topk_length`` [s_q] only the first topk_length[i]); returns (out [s_q, h_q, d_v]
    in q's dtype, max_logits [s_q, h_q], lse [s_q, h_q]), max_logits and lse of sm_scale * q . k in natural log
    (a row without keys: out 0, max_logits -inf, lse +inf). ``attn_sink`` [h_q] scales out by
    1 / (1 + exp(sink - lse))."""
    torch = _torch()
    _check_tensor("q", q, 3, (torch.bfloat16, torch.float16))
    _check_tensor("kv", kv, 3, (q.dtype,))
    _check_tensor("indices", indices, 3, (torch.int32,))
    s_q, h_q, d = q.shape
    s_kv, h_kv, dk = kv.shape
    if h_kv != 1:
        raise ValueError(f"kv must have one head (MLA), got {h_kv}")
    if dk != d:
        raise ValueError(f"q's head dim {d} differs from kv's {dk}")
    if not isinstance(d_v, int) or not 0 < d_v <= d:
        raise ValueError(f"d_v must be an int in 1..d_qk={d}, got {d_v!r}")
    _shape("indices", indices, (s_q, 1, None))
    topk = indices.shape[2]
    if s_kv < 1 or s_q < 1 or h_q < 1 or topk < 1:
        raise ValueError(f"empty q {tuple(q.shape)}, kv {tuple(kv.shape)} or indices {tuple(indices.shape)}")
    if attn_sink is not None:
        _check_tensor("attn_sink", attn_sink, 1, (torch.float32,))
        _shape("attn_sink", attn_sink, (h_q,))
    if topk_length is not None:
        lens = _int32("topk_length", topk_length, (s_q,)).clamp(0, topk)
    else:
        lens = torch.full((s_q,), topk, dtype=torch.int32)
    scale = _scale("sm_scale", sm_scale, d)
    kva, (sb, _, _) = _flat(kv)
    tab, lens = _compact(indices.reshape(s_q, topk).contiguous(), lens, s_kv)
    g = torch.arange(s_q, dtype=torch.int32)
    sched = torch.stack([g, torch.zeros_like(g), lens, torch.full_like(g, -1)], 1)
    out = torch.empty(s_q, h_q, d_v, dtype=q.dtype)
    lse = torch.empty(s_q, h_q, dtype=torch.float32)
    max_logits = torch.empty(s_q, h_q, dtype=torch.float32)
    sink = attn_sink.contiguous() if attn_sink is not None else torch.zeros(1, dtype=torch.float32)
    rb, nrb = _row_block(h_q)
    kern = K.get("decode", _target(), rb, nrb, 1, h_q, 1, d, d_v, 1, True, False, False, _dt(q.dtype),
                 attn_sink is not None, True)
    kern(q.contiguous().view(s_q, 1, 1, h_q, d), kva, torch.zeros(1), torch.zeros(1, dtype=torch.bfloat16),
         tab, lens, sched, sink, out.view(s_q, 1, 1, h_q, d_v),
         lse.view(s_q, 1, h_q, 1), max_logits.view(s_q, 1, h_q, 1), torch.empty(1, 1, h_q, d_v),
         torch.empty(1, 1, h_q), int(sb), 0, 0, int(s_kv), scale)
    return out, max_logits, lse


# ---- FP8 KV cache ------------------------------------------------------------------------------------------------

def _fp8_views(buf):
    """The nope (fp8), scale (fp32) and rope (bf16) parts of a contiguous (n, 656)-byte FP8 cache."""
    torch = _torch()
    q8 = buf[:, :K.FP8_NOPE]
    sc = buf.view(torch.float32)[:, K.FP8_NOPE // 4:K.FP8_NOPE // 4 + 4]
    rope = buf.view(torch.bfloat16)[:, (K.FP8_NOPE + 16) // 2:]
    return q8, sc, rope


def quantize_kv_cache_fp8(k_cache):
    """bf16 MLA cache [num_blocks, page_block_size, 1, 576] -> FP8 cache [num_blocks, page_block_size, 1, 656]
    (dtype float8_e4m3fn, FlashMLA's layout): per token, 512 float8_e4m3fn values, then 4 float32 scales (one per
    128 values: 2^ceil(log2(max(amax / 448, 1e-4))), so value / scale rounds to e4m3 without overflow), then the 64
    RoPE values as bfloat16. Bit for bit what FlashMLA's test quantiser writes."""
    torch = _torch()
    _check_tensor("k_cache", k_cache, 4, (torch.bfloat16,))
    nb, ps, h, d = k_cache.shape
    if h != 1 or d != 576:
        raise ValueError(f"k_cache must be [num_blocks, page_block_size, 1, 576], got {tuple(k_cache.shape)}")
    n = nb * ps
    out = torch.empty(nb, ps, 1, K.FP8_BYTES, dtype=torch.float8_e4m3fn)
    if n == 0:
        return out
    K.get("quant", _target(), 16)(k_cache.reshape(n, d).contiguous(), *_fp8_views(out.view(n, K.FP8_BYTES)))
    return out


def dequantize_kv_cache_fp8(k_cache):
    """The inverse of ``quantize_kv_cache_fp8``: FP8 cache [num_blocks, page_block_size, 1, 656] -> bf16
    [num_blocks, page_block_size, 1, 576] (value * scale, exact in bf16)."""
    torch = _torch()
    _check_tensor("k_cache", k_cache, 4, (torch.float8_e4m3fn, torch.uint8, torch.int8))
    nb, ps, h, nbytes = k_cache.shape
    if h != 1 or nbytes != K.FP8_BYTES:
        raise ValueError(f"k_cache must be [num_blocks, page_block_size, 1, {K.FP8_BYTES}], got {tuple(k_cache.shape)}")
    n = nb * ps
    out = torch.empty(nb, ps, 1, 576, dtype=torch.bfloat16)
    if n == 0:
        return out
    buf = k_cache.view(torch.float8_e4m3fn).reshape(n, K.FP8_BYTES).contiguous()
    K.get("dequant", _target(), 16)(*_fp8_views(buf), out.view(n, 576))
    return out



# ---- flash_attn_varlen_func ----------------------------------------------------------------------------------------

VARLEN_BLOCK = (128, 64)  # (query rows, keys) per tile; 64 query rows when no sequence is longer


def flash_attn_varlen_func(q, k, v, cu_seqlens_qo, cu_seqlens_kv, max_seqlen_qo, max_seqlen_kv, dropout_p=0.0,
                           softmax_scale=None, causal=False, deterministic=False, is_varlen=True, *, return_lse=True):
    """Attention over packed variable-length sequences (FlashMLA's / FlashAttention's argument order).

    q [total_q, h_q, d], k [total_k, h_kv, d], v [total_k, h_kv, dv] (float32, bfloat16 or float16; h_q a multiple
    of h_kv, query head h uses kv head h // (h_q / h_kv)); sequence i is rows cu_seqlens_qo[i] ..
    cu_seqlens_qo[i + 1] of q and cu_seqlens_kv[i] .. of k / v (int32, batch + 1 entries, non-decreasing).
    ``causal`` aligns the mask to the bottom-right (query i sees keys j <= i + len_k - len_q). Returns (out
    [total_q, h_q, dv] in q's dtype, lse [total_q, h_q] float32, natural log, a view of an [h_q, total_q] tensor
    as FlashMLA's); a query without keys gives out 0 and lse +inf. ``return_lse=False`` returns out alone.
    Scores and sums are fp32; for bf16/fp16 inputs P is rounded to the input dtype before P V."""
    torch = _torch()
    if dropout_p != 0.0:
        raise ValueError(f"dropout_p must be 0.0 (no dropout in inference kernels), got {dropout_p}")
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    _check_tensor("q", q, 3, dtypes)
    _check_tensor("k", k, 3, (q.dtype,))
    _check_tensor("v", v, 3, (q.dtype,))
    total_q, h_q, d = q.shape
    total_k, h_kv, dk = k.shape
    dv = v.shape[2]
    if dk != d:
        raise ValueError(f"q's head dim {d} differs from k's {dk}")
    _shape("v", v, (total_k, h_kv, None))
    if h_kv < 1 or h_q % h_kv:
        raise ValueError(f"the number of q heads ({h_q}) must be a multiple of the number of kv heads ({h_kv})")
    if d < 1 or dv < 1:
        raise ValueError("head dims must be positive")
    _check_tensor("cu_seqlens_qo", cu_seqlens_qo, 1, (torch.int32,))
    nb = cu_seqlens_qo.numel() - 1
    if nb < 1:
        raise ValueError("cu_seqlens_qo must hold batch + 1 >= 2 entries")
    cq = _int32("cu_seqlens_qo", cu_seqlens_qo, (nb + 1,))
    ck = _int32("cu_seqlens_kv", cu_seqlens_kv, (nb + 1,))
    lq, lk = cq[1:] - cq[:-1], ck[1:] - ck[:-1]
    if int(cq[0]) < 0 or int(ck[0]) < 0 or int(lq.min()) < 0 or int(lk.min()) < 0:
        raise ValueError("cu_seqlens must start at >= 0 and be non-decreasing")
    if int(cq[-1]) > total_q or int(ck[-1]) > total_k:
        raise ValueError(f"cu_seqlens reach past the packed tensors: {int(cq[-1])} > {total_q} rows of q or "
                         f"{int(ck[-1])} > {total_k} rows of k")
    max_q = int(lq.max())
    if not isinstance(max_seqlen_qo, int) or max_seqlen_qo < max_q:
        raise ValueError(f"max_seqlen_qo must be an int >= the longest query sequence ({max_q}), got "
                         f"{max_seqlen_qo!r}")
    scale = _scale("softmax_scale", softmax_scale, d)
    out = torch.empty(total_q, h_q, dv, dtype=q.dtype)
    lse = torch.empty(h_q, total_q, dtype=torch.float32)
    if total_q:
        bm, bn = VARLEN_BLOCK
        bm = bm if max_q > 64 else 64
        kern = _flash.get(_target(), h_q, h_kv, d, dv, bool(causal), _dt(q.dtype), bm, bn)
        kern(q.contiguous(), k.contiguous(), v.contiguous(), cq, ck, out, lse, max(1, -(-max_q // bm)), scale)
    return (out, lse.T) if return_lse else out


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, head_dim_qk, dropout_p=0.0, softmax_scale=None,
                                     causal=False, deterministic=False, is_varlen=True):
    """``flash_attn_varlen_func`` on qkv [total, h, 2 * head_dim_qk + d_v] (q, k, v side by side in the last dim,
    one sequence layout for all three)."""
    _check_tensor("qkv", qkv, 3)
    q, k, v = qkv[..., :head_dim_qk], qkv[..., head_dim_qk:2 * head_dim_qk], qkv[..., 2 * head_dim_qk:]
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, deterministic, is_varlen)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_qo, cu_seqlens_kv, max_seqlen_qo, max_seqlen_kv, head_dim_qk,
                                    dropout_p=0.0, softmax_scale=None, causal=False, deterministic=False,
                                    is_varlen=True):
    """``flash_attn_varlen_func`` with kv [total_k, h_kv, head_dim_qk + d_v] (k and v side by side)."""
    _check_tensor("kv", kv, 3)
    return flash_attn_varlen_func(q, kv[..., :head_dim_qk], kv[..., head_dim_qk:], cu_seqlens_qo, cu_seqlens_kv,
                                  max_seqlen_qo, max_seqlen_kv, dropout_p, softmax_scale, causal, deterministic,
                                  is_varlen)

