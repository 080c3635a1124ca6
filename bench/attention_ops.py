"""tegula.ops.attention against plain torch (gather, then attend) and torch SDPA, with the machine's bandwidth.

    python -m bench.attention_ops [--reps 5] [--quick] [--clock cpu] [--only dense,sparse,prefill,varlen]

Rows:
- dense MLA decode (flash_mla_with_kvcache, page 64, d_qk 576 / d_v 512, s_q 1, uneven cache lengths) with a bf16
  and with an FP8 cache, caches far beyond the last-level cache; GB/s = cache bytes read / time, against the
  machine's measured bandwidth (the better of a streaming copy, counted read + write, and a streaming read);
- sparse decode (indices, top-k 2048, FP8 and bf16 caches) and sparse prefill (flash_mla_sparse_fwd, top-k 2048);
- flash_attn_varlen_func forward, one sequence of 2048, 16 heads, d 128, causal, fp32 and bf16, against
  torch.nn.functional.scaled_dot_product_attention on the same data ([1, heads, seq, d]).
The torch peer of the MLA rows is the plain implementation a user writes: gather the rows (block table or indices),
then softmax(q k^T * scale) v with bf16 matmuls and an fp32 softmax (the FP8 cache dequantised after the gather),
batched over the whole call. Each row's two sides are timed alternately, one call each per round, so that both
see the same machine load; medians over --reps rounds, with tegula's spread ((max - min) / median).
FLOP counts: 2 * rows * keys * (d_qk + d_v).
--clock cpu: tegula and torch each on one thread, timed by process CPU time per call, which other load on a shared
machine disturbs far less (GB/s, GFLOP/s and the measured bandwidth are then those of one core). Note that the torch
peer gains less from a second thread than tegula does, so its ratios are lower than those of the default mode.
"""
from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F

from bench.common import (
    add_clock_option,
    do_bench,
    last_level_cache,
    measure_bandwidth,
    print_table,
    summary,
    use_clock,
)
from bench.common import side_by_side as common_side_by_side
from tegula.ops import attention as A

D, DV, PS = 576, 512, 64
clock = time.perf_counter


def side_by_side(ours, peer, reps: int):
    """Timings of ``ours`` and ``peer`` measured alternately (one call each per round, after a warm-up call each),
    so that both see the same machine load; returns (ours, peer) Timings in ms."""
    return tuple(common_side_by_side([ours, peer], reps, clock))


def read_bandwidth(nbytes: int = 1 << 30) -> float:
    """GB/s of torch summing a float32 tensor of ``nbytes`` (a streaming read on every core)."""
    x = torch.ones(nbytes // 4)
    t = do_bench(lambda: x.sum(), warmup=1, rep=5)
    return nbytes / (t.median_ms * 1e-3) / 1e9


def dequant_rows(rows):
    """FP8 rows [..., 656] (float8_e4m3fn) -> bf16 [..., 576] in torch."""
    raw = rows.view(torch.uint8)
    nope = raw[..., :512].view(torch.float8_e4m3fn).float().unflatten(-1, (4, 128))
    scale = raw[..., 512:528].contiguous().view(torch.float32)
    rope = raw[..., 528:].contiguous().view(torch.bfloat16)
    return torch.cat([(nope * scale[..., None]).flatten(-2).bfloat16(), rope], -1)


def torch_attend(q, kv, valid, scale):
    """q [g, rows, d], kv [g, n, d] (bf16), valid [g, rows or 1, n] -> out [g, rows, dv]."""
    s = torch.matmul(q, kv.transpose(1, 2)).float() * scale
    s = s.masked_fill(~valid, -math.inf)
    p = torch.softmax(s, -1).nan_to_num(0).to(kv.dtype)
    return torch.matmul(p, kv[..., :DV])


def dense_case(b, h_q, mean_len, fp8, gen):
    lens = (torch.randn(b, generator=gen) * mean_len / 4 + mean_len).clamp(PS, 2 * mean_len).int()
    pages = -(-int(lens.max()) // PS)
    block_table = torch.randperm(b * pages, generator=gen).int().view(b, pages)
    cache = (torch.randn(b * pages, PS, 1, D, generator=gen) / 10).bfloat16()
    if fp8:
        cache = A.quantize_kv_cache_fp8(cache)
    q = (torch.randn(b, 1, h_q, D, generator=gen) / 10).bfloat16()
    used_bytes = int(lens.sum()) * cache.shape[-1] * cache.element_size()
    return q, cache, block_table, lens, used_bytes


def dense_row(name, b, h_q, mean_len, fp8, reps, gen, bw):
    q, cache, block_table, lens, nbytes = dense_case(b, h_q, mean_len, fp8, gen)
    meta, _ = A.get_mla_metadata()
    ours = lambda: A.flash_mla_with_kvcache(q, cache, block_table, lens, DV, meta, is_fp8_kvcache=fp8)  # noqa: E731
    max_len = block_table.shape[1] * PS
    valid = (torch.arange(max_len)[None, :] < lens[:, None])[:, None, :]

    def peer():
        kv = cache[block_table.long()].view(b, max_len, -1)
        kv = dequant_rows(kv) if fp8 else kv
        return torch_attend(q.view(b, h_q, D), kv, valid, D ** -0.5)

    out, _ = ours()
    torch.testing.assert_close(out.view(b, h_q, DV).float(), peer().float(), atol=2e-2, rtol=2e-2)
    t, tp = side_by_side(ours, peer, reps)
    flops = 2 * h_q * int(lens.sum()) * (D + DV)
    gbs = nbytes / t.median_ms / 1e6
    return [name, f"b={b} h={h_q} ~{mean_len}", nbytes / 2**20, t.median_ms, f"{t.spread:.0%}", gbs, gbs / bw,
            flops / t.median_ms / 1e6, tp.median_ms, tp.median_ms / t.median_ms]


def sparse_decode_row(name, b, h_q, topk, n_blocks, fp8, reps, gen):
    cache = (torch.randn(n_blocks, PS, 1, D, generator=gen) / 10).bfloat16()
    if fp8:
        cache = A.quantize_kv_cache_fp8(cache)
    n_tok = n_blocks * PS
    idx = torch.randint(0, n_tok, (b, 1, topk), generator=gen, dtype=torch.int32)
    idx[torch.rand(b, 1, topk, generator=gen) < 0.05] = -1
    q = (torch.randn(b, 1, h_q, D, generator=gen) / 10).bfloat16()
    meta, _ = A.get_mla_metadata()
    ours = lambda: A.flash_mla_with_kvcache(q, cache, None, None, DV, meta, is_fp8_kvcache=fp8,  # noqa: E731
                                            indices=idx)
    flat = cache.view(n_tok, -1)
    valid = (idx >= 0).view(b, 1, topk)

    def peer():
        kv = flat.index_select(0, idx.clamp_min(0).view(-1).long()).view(b, topk, -1)
        kv = dequant_rows(kv) if fp8 else kv
        return torch_attend(q.view(b, h_q, D), kv, valid, D ** -0.5)

    out, _ = ours()
    torch.testing.assert_close(out.view(b, h_q, DV).float(), peer().float(), atol=2e-2, rtol=2e-2)
    t, tp = side_by_side(ours, peer, reps)
    flops = 2 * b * h_q * topk * (D + DV)
    nbytes = b * topk * flat.shape[1] * flat.element_size()
    return [name, f"b={b} h={h_q} topk={topk}", nbytes / 2**20, t.median_ms, f"{t.spread:.0%}",
            nbytes / t.median_ms / 1e6, "", flops / t.median_ms / 1e6, tp.median_ms, tp.median_ms / t.median_ms]


def sparse_prefill_row(name, s_q, h_q, topk, s_kv, reps, gen):
    q = (torch.randn(s_q, h_q, D, generator=gen) / 10).bfloat16()
    kv = (torch.randn(s_kv, 1, D, generator=gen) / 10).bfloat16()
    idx = torch.randint(0, s_kv, (s_q, 1, topk), generator=gen, dtype=torch.int32)
    idx[torch.rand(s_q, 1, topk, generator=gen) < 0.05] = -1
    scale = D ** -0.5
    ours = lambda: A.flash_mla_sparse_fwd(q, kv, idx, scale)  # noqa: E731
    valid = (idx >= 0).view(s_q, 1, topk)

    def peer():
        g = kv.view(s_kv, D).index_select(0, idx.clamp_min(0).view(-1).long()).view(s_q, topk, D)
        return torch_attend(q, g, valid, scale)

    torch.testing.assert_close(ours()[0].float(), peer().float(), atol=2e-2, rtol=2e-2)
    t, tp = side_by_side(ours, peer, reps)
    flops = 2 * s_q * h_q * topk * (D + DV)
    nbytes = s_q * topk * D * 2
    return [name, f"s_q={s_q} h={h_q} topk={topk}", nbytes / 2**20, t.median_ms, f"{t.spread:.0%}",
            nbytes / t.median_ms / 1e6, "", flops / t.median_ms / 1e6, tp.median_ms, tp.median_ms / t.median_ms]


def varlen_row(dtype, seq, heads, dim, reps, gen):
    q, k, v = (torch.randn(seq, heads, dim, generator=gen).to(dtype) for _ in range(3))
    cu = torch.tensor([0, seq], dtype=torch.int32)
    ours = lambda: A.flash_attn_varlen_func(q, k, v, cu, cu, seq, seq, causal=True)  # noqa: E731
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    sdpa = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)  # noqa: E731
    torch.testing.assert_close(ours()[0].float(), sdpa()[0].transpose(0, 1).float(), atol=2e-2, rtol=2e-2)
    t, ts = side_by_side(ours, sdpa, reps)
    flops = 2 * heads * seq * (seq + 1) / 2 * dim * 2
    name = f"varlen fwd {str(dtype).replace('torch.', '')}"
    return [name, f"s={seq} h={heads} d={dim} causal", "", t.median_ms, f"{t.spread:.0%}", "", "",
            flops / t.median_ms / 1e6, ts.median_ms, ts.median_ms / t.median_ms]


def main(argv=None):
    p = argparse.ArgumentParser(description=summary(__doc__))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="smaller caches and sequences (a smoke run)")
    add_clock_option(p)
    p.add_argument("--only", default="dense,sparse,prefill,varlen", help="comma-separated sections")
    args = p.parse_args(argv)
    global clock
    clock = use_clock(args.clock)
    only = set(args.only.split(","))
    gen = torch.Generator().manual_seed(0)
    scale = 8 if args.quick else 1
    copy = measure_bandwidth(1 << 30)
    read = read_bandwidth()
    bw = max(copy["stream_copy"], copy["stream_copy_nt"], read)
    print(f"measured bandwidth: copy {copy['stream_copy']:.1f} GB/s, non-temporal copy {copy['stream_copy_nt']:.1f} "
          f"GB/s, read {read:.1f} GB/s -> {bw:.1f} GB/s", flush=True)
    rows = []
    for section, (name, fn) in zip(["dense"] * 3 + ["sparse"] * 2 + ["prefill"] + ["varlen"] * 2, [
        ("dense decode bf16", lambda: dense_row("dense decode bf16", 16, 16, 4096 // scale, False, args.reps, gen, bw)),
        ("dense decode bf16", lambda: dense_row("dense decode bf16", 16, 128, 4096 // scale, False, args.reps, gen,
                                                bw)),
        ("dense decode fp8", lambda: dense_row("dense decode fp8", 16, 16, 4096 // scale, True, args.reps, gen, bw)),
        ("sparse decode fp8", lambda: sparse_decode_row("sparse decode fp8", 32 // scale, 64, 2048, 4096 // scale,
                                                        True, args.reps, gen)),
        ("sparse decode bf16", lambda: sparse_decode_row("sparse decode bf16", 32 // scale, 64, 2048, 4096 // scale,
                                                         False, args.reps, gen)),
        ("sparse prefill", lambda: sparse_prefill_row("sparse prefill bf16", 128 // scale, 64, 2048, 8192, args.reps,
                                                      gen)),
        ("varlen fp32", lambda: varlen_row(torch.float32, 2048 // scale, 16, 128, args.reps, gen)),
        ("varlen bf16", lambda: varlen_row(torch.bfloat16, 2048 // scale, 16, 128, args.reps, gen)),
    ]):
        if section not in only:
            continue
        rows.append(fn())
        print(f"  {rows[-1][0]} {rows[-1][1]}: done", flush=True)
    print_table(f"tegula.ops.attention vs torch, {torch.get_num_threads()} threads, clock {args.clock} "
                f"(medians of >= {args.reps}; "
                "peer: gather + attend, or SDPA for varlen)",
                ["op", "shape", "MiB read", "tegula ms", "spread", "GB/s", "of bw", "GFLOP/s", "peer ms",
                 "peer/tegula"], rows)
    llc = last_level_cache() >> 20
    small = [f"{r[0]} {r[1]}" for r in rows if isinstance(r[2], (int, float)) and r[2] < 2 * llc]
    if small:
        print(f"note: the last-level cache holds {llc} MiB; rows reading less than twice that may read partly from "
              f"it, and their 'of bw' is then above what memory gives: {', '.join(small)}")


if __name__ == "__main__":
    main()
