"""The sparse-attention indexer of DeepSeek V3.2 (DeepGEMM's MQA logits), in T.*:

    logits[i, j] = kv_scale[j] * sum_h weights[i, h] * relu(q[i, h] . kv[j])     for j in [ks[i], ke[i])
                   -inf                                                          elsewhere

q and kv are float8_e4m3fn; the dot products are exact fp8 products summed in fp32 (T.gemm), the head sum and
the scale in fp32, as deep_gemm does. ``fp8_mqa_logits`` is the prefill form (ranges given per query row);
``fp8_paged_mqa_logits`` the decode form over a paged KV cache, with ``get_paged_mqa_logits_metadata``.
Positions outside each row's range are always -inf here (deep_gemm leaves them unwritten unless clean_logits);
results are bit-identical from run to run.
"""
from __future__ import annotations

import tegula.language as T
from tegula.ops._gemm_layout import ceil_div, get_num_sms

SPLIT_KV = 256  # KV positions per block of the paged kernel and per segment of its schedule


def mk_mqa_logits(H: int, D: int, block_q: int, block_kv: int, compressed: bool):
    """Rows of q in blocks of ``block_q`` (bQ * H rows of one T.gemm) against ``block_kv`` positions of kv.
    Compressed: O is (s, w), column t of row i holding position ks[i] + t (one row per block)."""
    s = T.dynamic("s")
    sh = T.dynamic("sh")
    skv = T.dynamic("skv")
    w = T.dynamic("w")
    rows = block_q * H

    @T.prim_func
    def mqa_logits(Q: T.Tensor((sh, D), "float8_e4m3fn"), KV: T.Tensor((skv, D), "float8_e4m3fn"),
                   SF: T.Tensor((skv,), "float32"), W: T.Tensor((s, H), "float32"), KS: T.Tensor((s,), "int32"),
                   KE: T.Tensor((s,), "int32"), O: T.Tensor((s, w), "float32")):
        with T.Kernel(T.ceildiv(w, block_kv), T.ceildiv(s, block_q), threads=128) as (bx, by):
            q_s = T.alloc_shared((rows, D), "float8_e4m3fn")
            kv_s = T.alloc_shared((block_kv, D), "float8_e4m3fn")
            score = T.alloc_fragment((rows, block_kv), "float32")
            out = T.alloc_fragment((block_q, block_kv), "float32")
            wt = T.alloc_fragment((block_q, H), "float32")
            sf = T.alloc_fragment((block_kv,), "float32")
            ks = T.alloc_fragment((block_q,), "int32")
            ke = T.alloc_fragment((block_q,), "int32")
            lo = T.alloc_fragment((1,), "int32")
            hi = T.alloc_fragment((1,), "int32")
            row0 = by * block_q
            col0 = bx * block_kv
            for i in T.Parallel(block_q):
                ks[i] = T.if_then_else(row0 + i < s, KS[T.min(row0 + i, s - 1)], 0)
                ke[i] = T.if_then_else(row0 + i < s, T.min(KE[T.min(row0 + i, s - 1)], skv), 0)
            T.reduce_min(ks, lo, dim=0)
            T.reduce_max(ke, hi, dim=0)
            kv0 = ks[0] + col0 if compressed else col0
            if kv0 < hi[0] and kv0 + block_kv > lo[0]:
                T.copy(Q[row0 * H, 0], q_s)
                T.copy(KV[kv0, 0], kv_s)
                T.copy(SF[kv0], sf)
                T.copy(W[row0, 0], wt)
                T.gemm(q_s, kv_s, score, transpose_B=True, clear_accum=True)
                score3 = T.reshape(score, (block_q, H, block_kv))
                for i, h, j in T.Parallel(block_q, H, block_kv):
                    score3[i, h, j] = T.max(score3[i, h, j], 0.0) * wt[i, h]
                T.reduce_sum(score3, out, dim=1)
                for i, j in T.Parallel(block_q, block_kv):
                    out[i, j] = T.if_then_else(kv0 + j >= ks[i] and kv0 + j < ke[i], out[i, j] * sf[j],
                                               -T.infinity("float32"))
            else:
                T.fill(out, -T.infinity("float32"))
            T.copy(out, O[row0, col0])

    return mqa_logits


def mk_paged_mqa_logits(H: int, D: int, next_n: int, page: int, block_kv: int):
    """One block per batch entry and ``block_kv`` positions (whole pages): all next_n x H query rows of the
    entry in one T.gemm against the pages the block table names. KV values and scales are strided views into
    deep_gemm's fused cache (per page: page x D fp8 values, then page fp32 scales)."""
    b = T.dynamic("b")
    bnh = T.dynamic("bnh")
    bn = T.dynamic("bn")
    nblk = T.dynamic("nblk")
    maxb = T.dynamic("maxb")
    w = T.dynamic("w")
    rows = next_n * H
    pages = block_kv // page
    stride = page * (D + 4)

    @T.prim_func
    def paged_mqa_logits(Q: T.Tensor((bnh, D), "float8_e4m3fn"),
                         KVV: T.StridedTensor((nblk, page, D), (stride, D, 1), "float8_e4m3fn"),
                         KVS: T.StridedTensor((nblk, page), (stride // 4, 1), "float32"),
                         W: T.Tensor((bn, H), "float32"), CL: T.Tensor((b, next_n), "int32"),
                         BT: T.Tensor((b, maxb), "int32"), O: T.Tensor((bn, w), "float32")):
        with T.Kernel(T.ceildiv(w, block_kv), b, threads=128) as (bx, by):
            q_s = T.alloc_shared((rows, D), "float8_e4m3fn")
            kv_s = T.alloc_shared((block_kv, D), "float8_e4m3fn")
            score = T.alloc_fragment((rows, block_kv), "float32")
            out = T.alloc_fragment((next_n, block_kv), "float32")
            wt = T.alloc_fragment((next_n, H), "float32")
            sf = T.alloc_fragment((block_kv,), "float32")
            cl = T.alloc_fragment((next_n,), "int32")
            hi = T.alloc_fragment((1,), "int32")
            col0 = bx * block_kv
            T.copy(CL[by, 0], cl)
            T.reduce_max(cl, hi, dim=0)
            if col0 < hi[0]:
                T.copy(Q[by * rows, 0], q_s)
                T.copy(W[by * next_n, 0], wt)
                for p in T.serial(pages):
                    pg = col0 // page + p
                    if pg * page < hi[0]:
                        phys = BT[by, pg]
                        T.copy(KVV[phys, 0:page, 0:D], kv_s[p * page:p * page + page, 0:D])
                        T.copy(KVS[phys, 0:page], sf[p * page:p * page + page])
                    else:
                        for t, d in T.Parallel(page, D):
                            kv_s[p * page + t, d] = T.cast(0, "float8_e4m3fn")
                        for t in T.Parallel(page):
                            sf[p * page + t] = 0.0
                T.gemm(q_s, kv_s, score, transpose_B=True, clear_accum=True)
                score3 = T.reshape(score, (next_n, H, block_kv))
                for i, h, j in T.Parallel(next_n, H, block_kv):
                    score3[i, h, j] = T.max(score3[i, h, j], 0.0) * wt[i, h]
                T.reduce_sum(score3, out, dim=1)
                for i, j in T.Parallel(next_n, block_kv):
                    out[i, j] = T.if_then_else(col0 + j < cl[i], out[i, j] * sf[j], -T.infinity("float32"))
            else:
                T.fill(out, -T.infinity("float32"))
            T.copy(out, O[by * next_n, col0])

    return paged_mqa_logits


# the op layer -----------------------------------------------------------------------------------------------

def _torch():
    import torch
    return torch


def _check(name, x, dtype, ndim):
    torch = _torch()
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.device.type != "cpu":
        raise ValueError(f"{name}: expected a CPU tensor, got one on {x.device}")
    if x.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {str(dtype).replace('torch.', '')}, got "
                         f"{str(x.dtype).replace('torch.', '')}")
    if x.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {tuple(x.shape)}")
    return x


def _fp8_q(q):
    """deep_gemm's fp8_fp4 entry points take q as (values, fp4 scales or None)."""
    if isinstance(q, (tuple, list)):
        if len(q) != 2:
            raise TypeError("q: expected a tensor or a (tensor, None) pair")
        if q[1] is not None:
            raise ValueError("q: FP4 queries (with scales) are not supported; pass float8_e4m3fn q")
        return q[0]
    return q


def _logits_dtype(logits, logits_dtype):
    torch = _torch()
    if logits_dtype in (None, torch.float32):
        return logits
    if logits_dtype == torch.bfloat16:
        return logits.to(torch.bfloat16)
    raise ValueError(f"logits_dtype: expected torch.float32 or torch.bfloat16, got {logits_dtype}")


def fp8_mqa_logits(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits: bool = True,
                   max_seqlen_k: int = 0):
    """Indexer logits for prefill: q fp8 [S, H, D], kv = (fp8 [S_kv, D], scales fp32 [S_kv]), weights fp32
    [S, H], cu_seq_len_k_start / _end int32 [S] (row i attends kv rows [start[i], end[i])). Returns fp32
    [S, S_kv]; with max_seqlen_k > 0 the compressed [S, max_seqlen_k] form instead, column t of row i holding
    kv row start[i] + t (-inf past end[i] - start[i])."""
    return _mqa_logits(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, max_seqlen_k)


def fp8_fp4_mqa_logits(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits: bool = True,
                       max_seqlen_k: int = 0, logits_dtype=None):
    """fp8_mqa_logits with q = (fp8 values, None) and a choice of float32 or bfloat16 logits."""
    out = _mqa_logits(_fp8_q(q), kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, max_seqlen_k)
    return _logits_dtype(out, logits_dtype)


def _mqa_logits(q, kv, weights, ks, ke, max_seqlen_k):
    torch = _torch()
    from tegula.ops.gemm import _kernel
    _check("q", q, torch.float8_e4m3fn, 3)
    if not isinstance(kv, (tuple, list)) or len(kv) != 2:
        raise TypeError("kv: expected a (fp8 values, fp32 scales) pair")
    kv, sf = kv
    _check("kv[0]", kv, torch.float8_e4m3fn, 2)
    _check("kv[1]", sf, torch.float32, 1)
    _check("weights", weights, torch.float32, 2)
    _check("cu_seq_len_k_start", ks, torch.int32, 1)
    _check("cu_seq_len_k_end", ke, torch.int32, 1)
    s, h, d = q.shape
    skv = kv.shape[0]
    if kv.shape[1] != d:
        raise ValueError(f"kv[0]: expected head dim {d} (q's), got {kv.shape[1]}")
    if sf.shape[0] != skv:
        raise ValueError(f"kv[1]: expected one scale per kv row ({skv}), got {sf.shape[0]}")
    if tuple(weights.shape) != (s, h):
        raise ValueError(f"weights: expected shape ({s}, {h}), got {tuple(weights.shape)}")
    for name, x in (("cu_seq_len_k_start", ks), ("cu_seq_len_k_end", ke)):
        if x.shape[0] != s:
            raise ValueError(f"{name}: expected one entry per query row ({s}), got {x.shape[0]}")
    if not isinstance(max_seqlen_k, int) or max_seqlen_k < 0:
        raise ValueError(f"max_seqlen_k: expected a non-negative int, got {max_seqlen_k!r}")
    ks, ke = ks.contiguous(), ke.contiguous()
    if s and (int(ks.min()) < 0 or bool((ke < ks).any()) or int(ke.max()) > skv):
        raise ValueError(f"cu_seq_len_k_start/end: need 0 <= start <= end <= {skv} (kv rows) for every row")
    compressed = max_seqlen_k > 0
    if compressed and s and int((ke - ks).max()) > max_seqlen_k:
        raise ValueError("max_seqlen_k: smaller than the longest row range end - start")
    width = max_seqlen_k if compressed else skv
    out = torch.empty((s, width), dtype=torch.float32)
    if s == 0 or width == 0:
        return out
    block_q = 1 if compressed else max(1, min(8, 128 // h))
    kern = _kernel(mk_mqa_logits, h, d, block_q, 128, compressed)
    kern(q.contiguous().view(s * h, d), kv.contiguous(), sf.contiguous(), weights.contiguous(), ks, ke, out)
    return out


def get_paged_mqa_logits_metadata(context_lens, block_kv: int, num_sms: int, indices=None):
    """deep_gemm's work schedule for fp8_paged_mqa_logits: int32 [num_sms + 1, 2], row w the (batch entry,
    256-position split) where worker w starts, the last row (batch size, 0). tegula's kernel spreads its
    blocks over the cores itself and only checks this argument's shape."""
    torch = _torch()
    if indices is not None:
        raise ValueError("indices: variable-length (indexed) batches are not supported")
    if not isinstance(context_lens, torch.Tensor):
        raise TypeError(f"context_lens: expected a torch.Tensor, got {type(context_lens).__name__}")
    if context_lens.dtype != torch.int32 or context_lens.dim() not in (1, 2):
        raise ValueError(f"context_lens: expected int32 [batch] or [batch, next_n], got {context_lens.dtype} "
                         f"{tuple(context_lens.shape)}")
    if not isinstance(num_sms, int) or num_sms <= 0:
        raise ValueError(f"num_sms: expected a positive int, got {num_sms!r}")
    if not isinstance(block_kv, int) or block_kv <= 0:
        raise ValueError(f"block_kv: expected a positive int, got {block_kv!r}")
    last = context_lens if context_lens.dim() == 1 else context_lens[:, -1]
    segs = (last.long().clamp(min=0) + SPLIT_KV - 1) // SPLIT_KV
    ends = torch.cumsum(segs, 0)
    total = int(ends[-1]) if ends.numel() else 0
    q, r = divmod(total, num_sms)
    starts = torch.tensor([w * q + max(0, w - (num_sms - r)) for w in range(num_sms)], dtype=torch.long)
    batch = torch.searchsorted(ends, starts, right=True)
    prev = torch.where(batch > 0, ends[(batch - 1).clamp(min=0)], torch.zeros_like(batch)) if ends.numel() else batch
    meta = torch.zeros((num_sms + 1, 2), dtype=torch.int32)
    meta[:num_sms, 0] = batch.to(torch.int32)
    meta[:num_sms, 1] = (starts - prev).to(torch.int32)
    meta[num_sms, 0] = last.numel()
    return meta


def fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len: int,
                         clean_logits: bool = False, indices=None):
    """Indexer logits for decode over a paged cache: q fp8 [B, next_n, H, D]; kv_cache uint8
    [num_blocks, block_kv, 1, D + 4], each page's block_kv x D fp8 values followed by its block_kv fp32 scales;
    weights fp32 [B * next_n, H]; context_lens int32 [B, next_n] (row j of entry b sees positions
    < context_lens[b, j]) or [B] (it sees positions <= context_lens[b] - next_n + j); block_table int32
    [B, max_blocks]; schedule_meta from get_paged_mqa_logits_metadata. Returns fp32 [B * next_n,
    max_context_len], -inf past each row's context."""
    return _paged(q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len, indices)


def fp8_fp4_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len: int,
                             clean_logits: bool = False, logits_dtype=None, indices=None):
    """fp8_paged_mqa_logits with q = (fp8 values, None) and a choice of float32 or bfloat16 logits."""
    out = _paged(_fp8_q(q), kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len, indices)
    return _logits_dtype(out, logits_dtype)


def _paged(q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len, indices):
    torch = _torch()
    from tegula.ops.gemm import _kernel
    if indices is not None:
        raise ValueError("indices: variable-length (indexed) batches are not supported")
    _check("q", q, torch.float8_e4m3fn, 4)
    _check("kv_cache", kv_cache, torch.uint8, 4)
    _check("weights", weights, torch.float32, 2)
    _check("block_table", block_table, torch.int32, 2)
    _check("schedule_meta", schedule_meta, torch.int32, 2)
    bsz, next_n, h, d = q.shape
    nblk, page, heads_kv, dsf = kv_cache.shape
    if heads_kv != 1 or dsf != d + 4:
        raise ValueError(f"kv_cache: expected [num_blocks, block_kv, 1, {d + 4}] (head dim {d} + a 4-byte scale), "
                         f"got {tuple(kv_cache.shape)}")
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache: expected a contiguous tensor")
    if tuple(weights.shape) != (bsz * next_n, h):
        raise ValueError(f"weights: expected shape ({bsz * next_n}, {h}), got {tuple(weights.shape)}")
    if block_table.shape[0] != bsz:
        raise ValueError(f"block_table: expected {bsz} rows (q's batch), got {block_table.shape[0]}")
    if schedule_meta.shape[1] != 2:
        raise ValueError(f"schedule_meta: expected [num_sms + 1, 2], got {tuple(schedule_meta.shape)}")
    if not isinstance(context_lens, torch.Tensor):
        raise TypeError(f"context_lens: expected a torch.Tensor, got {type(context_lens).__name__}")
    if context_lens.dim() == 1:
        _check("context_lens", context_lens, torch.int32, 1)
        if context_lens.shape[0] != bsz:
            raise ValueError(f"context_lens: expected {bsz} entries, got {context_lens.shape[0]}")
        cl = (context_lens.view(-1, 1) - next_n + 1 + torch.arange(next_n, dtype=torch.int32)).clamp(min=0)
    else:
        _check("context_lens", context_lens, torch.int32, 2)
        if tuple(context_lens.shape) != (bsz, next_n):
            raise ValueError(f"context_lens: expected shape ({bsz}, {next_n}), got {tuple(context_lens.shape)}")
        cl = context_lens
    cl = cl.to(torch.int32).contiguous()
    if not isinstance(max_context_len, int) or max_context_len < 0:
        raise ValueError(f"max_context_len: expected a non-negative int, got {max_context_len!r}")
    maxb = block_table.shape[1]
    if bsz and (int(cl.min()) < 0 or int(cl.max()) > min(max_context_len, maxb * page)):
        raise ValueError(f"context_lens: every length must lie in [0, min(max_context_len, block_table pages x "
                         f"{page})] = [0, {min(max_context_len, maxb * page)}]")
    bt = block_table.contiguous()
    if bsz and maxb:
        need = (cl.max(dim=1).values.long() + page - 1) // page
        used = bt[torch.arange(maxb).view(1, -1) < need.view(-1, 1)]
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= nblk):
            raise ValueError(f"block_table: the pages within each context must lie in [0, {nblk})")
    out = torch.empty((bsz * next_n, max_context_len), dtype=torch.float32)
    if bsz == 0 or max_context_len == 0:
        return out
    block_kv = page * max(1, SPLIT_KV // page) if SPLIT_KV % page == 0 else page
    flat = kv_cache.view(nblk, page * (d + 4))
    kvv = flat[:, :page * d].view(torch.float8_e4m3fn).view(nblk, page, d)
    kvs = flat[:, page * d:].view(torch.float32)
    kern = _kernel(mk_paged_mqa_logits, h, d, next_n, page, block_kv)
    kern(q.contiguous().view(-1, d), kvv, kvs, weights.contiguous(), cl, bt, out)
    return out


__all__ = ["fp8_mqa_logits", "fp8_fp4_mqa_logits", "fp8_paged_mqa_logits", "fp8_fp4_paged_mqa_logits",
           "get_paged_mqa_logits_metadata", "get_num_sms", "ceil_div"]
