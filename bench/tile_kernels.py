"""TileKernels' ops in tegula.ops (quant, norm, rope, moe) against torch eager and torch.compile, and the machine's
copy bandwidth.

    python -m bench.tile_kernels [--gib 1.0] [--reps 5] [--no-compile] [--only per_token,rmsnorm,...] [--clock cpu]

Every memory-bound row reads a working set of about --gib GiB (well beyond the last-level cache). tegula's rows call
the ops' compiled kernels with outputs allocated once and reused; torch eager and compiled functions return fresh
tensors (as TileKernels' API does). Bandwidth = bytes read + bytes written per second. A memory-bound row samples a
plain OpenMP copy of the same working set ("copy GB/s", the median of its samples) right after each of tegula's
samples, so that both see the same moment of a shared host whose memory speed moves within seconds: "of copy BW" is
the median over the rounds of tegula's bandwidth over the copy's in that round (a paired ratio), "paired range" its
smallest and largest. "cache GB/s" is tegula's kernel on the first rows of the same tensors, a slice that sits in
the last-level cache (cache_rows: at most 1024 rows of 7168, ~15 MB read, and at most a quarter of the cache), timed
after the row's rounds, sampled in turn with the copy: about what the kernel reaches with DRAM out of the way;
"cache/copy" is the median of its paired ratios to the copy, roughly the ceiling "of copy BW" could reach were every
DRAM access overlapped with work (a low bound where a kernel streams its output past the cache: rmsnorm, e5m6 and
rope write to memory from the slice too). It is not the arithmetic's rate alone where the last-level cache reads
slowly: on a 2-vCPU Xeon (KVM, 480 MB L3) rmsnorm+cast with its arithmetic removed took 13 TSC cycles per 16 words
from that slice against 9.5 from L2 (one thread). The latency rows divide by the copy measured at the start. "of
run copy" divides tegula's bandwidth by the median of every copy sample of the run (all rows' samples together): a
reference that does not move with the moments a row happened to sample. The MoE routing rows are latency rows (a few
MB), where ratios matter.
On a machine other work shares, --clock cpu runs every contender (the copy too) on one thread and times it by the
process CPU time a call takes, which that load disturbs far less than wall-clock time (GB/s are then per core).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

# torch and tegula's kernels share one OpenMP pool (torch's libgomp). Its default active wait (threads spin after a
# parallel region) makes back-to-back short regions stall for milliseconds on a small, shared machine; passive
# waiting is the fair setting for both sides. Set before torch loads libgomp.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import (  # noqa: E402
    Timing,
    add_clock_option,
    check_gib,
    copy_kernels,
    do_bench,
    interleaved,
    last_level_cache,
    print_table,
    summary,
    timing_ms,
    try_compile,
    use_clock,
)
from tegula.ops import _e5m6_kernels as EK  # noqa: E402
from tegula.ops import _moe_kernels as MK  # noqa: E402
from tegula.ops import _quant_kernels as QK  # noqa: E402
from tegula.ops import _quant_pairs as QP  # noqa: E402
from tegula.ops import _swiglu, _tk, moe, norm, quant  # noqa: E402
from tegula.ops.rope import rope_kernel, streams_in_place  # noqa: E402

# torch peers: the plain eager formulation of each op ----------------------------------------------------------------


def per_token_cast_ref(x, group=128, max_q=448.0):
    xf = x.float().view(x.shape[0], -1, group)
    amax = xf.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    mx = torch.full_like(amax, max_q)
    return (xf * (mx / amax)).to(torch.float8_e4m3fn).view(x.shape), (amax / mx).squeeze(-1)


def per_token_cast_ue8m0_ref(x, group=128):
    xf = x.float().view(x.shape[0], -1, group)
    amax = xf.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    sf = amax / 448.0
    e = torch.ceil(torch.log2(sf))
    q = (xf * torch.exp2(-e)).to(torch.float8_e4m3fn).view(x.shape)
    return q, (e.squeeze(-1) + 127).to(torch.uint8)


def per_token_cast_fp4_ref(x, group=32):
    xf = x.float().view(x.shape[0], -1, group)
    amax = xf.abs().amax(-1, keepdim=True).clamp(min=6.0 * 2.0 ** -126)
    v = (xf * (6.0 / amax)).view(x.shape[0], -1)
    a = v.abs()
    rne = torch.round
    mag = torch.where(a < 2, rne(a * 2), torch.where(a < 4, 4 + rne(a - 2), 6 + rne((a - 4) / 2)))
    codes = (mag.clamp(max=7).to(torch.uint8) | ((v < 0).to(torch.uint8) << 3)).view(x.shape[0], -1, 2)
    return (codes[..., 0] | (codes[..., 1] << 4)).view(torch.int8), (amax / 6.0).squeeze(-1)


def per_block_cast_ref(x, block=128):
    t, h = x.shape
    xf = x.float().view(t // block, block, h // block, block)
    amax = xf.abs().amax((1, 3), keepdim=True).clamp(min=1e-4)
    return (xf * (448.0 / amax)).to(torch.float8_e4m3fn).view(t, h), (amax / 448.0).view(t // block, h // block)


def per_channel_cast_ref(x, block=128):
    t, h = x.shape
    xf = x.float().view(t // block, block, h)
    amax = xf.abs().amax(1, keepdim=True).clamp(min=1e-4)
    return (xf * (448.0 / amax)).to(torch.float8_e4m3fn).view(t, h), (amax / 448.0).view(t // block, h)


def cast_back_ref(q, sf, group=128):
    return (q.float().view(q.shape[0], -1, group) * sf.unsqueeze(-1)).view(q.shape).bfloat16()


def e5m6_ref(x):
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    h = (xf * (65024.0 / amax)).half().view(torch.int16).to(torch.int32) >> 4  # (round-to-nearest float16)
    h = (h & 0xFFF).view(x.shape[0], -1, 8)
    w0 = (h[..., 0] << 20) | (h[..., 1] << 8) | (h[..., 2] >> 4)
    w1 = (h[..., 2] << 28) | (h[..., 3] << 16) | (h[..., 4] << 4) | (h[..., 5] >> 8)
    w2 = (h[..., 5] << 24) | (h[..., 6] << 12) | h[..., 7]
    return torch.stack([w0, w1, w2], -1).view(x.shape[0], -1), amax / 65024.0


def rmsnorm_ref(x, w, eps=1e-6):
    xf = x.float()
    return (xf * w.float() * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rmsnorm_cast_ref(x, w, eps=1e-6):
    xf = x.float()
    return per_token_cast_ref(xf * w.float() * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))


def swiglu_cast_ref(x):
    h = x.shape[1] // 2
    return per_token_cast_ref(F.silu(x[:, :h].float()) * x[:, h:].float())


def rope_ref(q, cs, pos):
    r2 = cs.shape[1] // 2
    c, s = cs[pos, :r2].unsqueeze(1), cs[pos, r2:].unsqueeze(1)
    x1, x2 = q[..., :r2].float(), q[..., r2:2 * r2].float()
    q[..., :r2], q[..., r2:2 * r2] = (x1 * c - x2 * s).to(q.dtype), (x2 * c + x1 * s).to(q.dtype)
    return q


def topk_gate_ref(s, k):
    return torch.sort(s, dim=1, descending=True, stable=True)[1][:, :k]


def top2_sum_gate_ref(logits, bias, k=8, ng=8, ntg=4, scale=2.5):
    s = logits.sigmoid()
    b = (s + bias).view(logits.shape[0], ng, -1)
    gs = b.topk(2, -1).values.sum(-1)
    keep = torch.zeros_like(gs, dtype=torch.bool).scatter_(1, gs.topk(ntg, -1).indices, True)
    b = b.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(logits.shape)
    idx = b.topk(k, -1).indices
    w = s.gather(1, idx)
    return idx, w / (w.sum(-1, keepdim=True) + 1e-20) * scale


def fused_mapping_ref(idx, e, a):
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat[flat >= 0], minlength=e)
    aligned = (counts + a - 1) // a * a
    start = torch.cumsum(aligned, 0) - aligned
    sorted_e = flat[order]
    valid = sorted_e >= 0
    rank = torch.arange(flat.numel()) - (torch.cumsum(counts, 0) - counts)[sorted_e.clamp(min=0)] - (~valid).sum()
    pos = start[sorted_e.clamp(min=0)] + rank
    p2e = torch.full((int(aligned.sum()),), -1, dtype=torch.int32)
    p2e[pos[valid]] = sorted_e[valid].int()
    ttp = torch.full_like(flat, -1, dtype=torch.int32)
    ttp[order[valid]] = pos[valid].int()
    return p2e, ttp.view(idx.shape)


def expand_ref(x, ttp, n_pos):
    out = x.new_zeros(n_pos, x.shape[1])
    valid = ttp.view(-1) >= 0
    out[ttp.view(-1)[valid].long()] = x.repeat_interleave(ttp.shape[1], 0)[valid]
    return out


def reduce_ref(xe, w, ttp):
    rows = xe[ttp.clamp(min=0).long()].float() * (w * (ttp >= 0)).unsqueeze(-1)
    return rows.sum(1).to(xe.dtype)


# the table ---------------------------------------------------------------------------------------------------------

def cache_rows(llc: int, row_bytes: int = 7168 * 3) -> int:
    """Rows of the cache columns' slice: a multiple of 128 (per_block's and per_channel's bands), at most 1024 and
    at most a quarter of the last-level cache ``llc`` (bytes) read and written, at least 128."""
    return max(128, min(1024, llc // 4 // row_bytes // 128 * 128))


class lazy:
    """``_tk.kernel(*spec)``, built on its first call: the rows --only leaves out build nothing (and a kernel file
    being edited elsewhere does not stop the others)."""

    def __init__(self, *spec):
        self.spec, self.k = spec, None

    def __call__(self, *args):
        if self.k is None:
            self.k = _tk.kernel(*self.spec)
        return self.k(*args)


def cpu_bench(fn, warmup: int = 2, rep: int = 10, min_time_s: float = 0.05) -> Timing:
    """do_bench timed by the process CPU time (time.process_time) instead of the wall clock."""
    for _ in range(max(1, warmup)):
        fn()
    t0 = time.process_time()
    fn()
    inner = max(1, int(2e-2 / max(time.process_time() - t0, 1e-9)))  # process_time ticks are coarser
    samples, spent = [], 0.0
    while len(samples) < rep or spent < min_time_s:
        t = time.process_time()
        for _ in range(inner):
            fn()
        dt = time.process_time() - t
        spent += dt
        samples.append(dt / inner * 1e3)
    return Timing(statistics.median(samples), min(samples), max(samples), len(samples))


def main(argv=None):
    p = argparse.ArgumentParser(description=summary(__doc__))
    p.add_argument("--gib", type=float, default=1.0, help="working set read per memory-bound row, GiB (default 1)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile peers (slow to build)")
    p.add_argument("--only", default="", help="comma-separated row-name prefixes to run")
    add_clock_option(p)
    args = p.parse_args(argv)
    clock = use_clock(args.clock)
    timer = cpu_bench if args.clock == "cpu" else do_bench
    torch.manual_seed(0)
    nbytes = int(args.gib * (1 << 30))
    llc = last_level_cache()
    copies = copy_kernels(nbytes, threads=1 if args.clock == "cpu" else None)
    bw = {k: moved / (timer(fn, warmup=2, rep=5).median_ms * 1e-3) / 1e9 for k, (fn, moved) in copies.items()}
    peak = bw["stream_copy"]
    copy_fn, copy_moved = copies["stream_copy"]
    print(f"measured: plain copy {peak:.1f} GB/s, non-temporal copy {bw['stream_copy_nt']:.1f} GB/s "
          f"({args.gib} GiB source); torch threads {torch.get_num_threads()}, tegula threads "
          f"{os.environ.get('TEGULA_NUM_THREADS') or 'all'}; clock {args.clock}; last-level cache {llc >> 20} MiB")
    check_gib(args.gib, "memory-bound rows")
    comp = (lambda f: None) if args.no_compile else try_compile
    only = [s for s in args.only.split(",") if s]
    rows = []
    copy_samples = []   # seconds per copy call, every memory-bound row's samples: the run's reference

    def bench(name, ours, eager, compiled, moved_bytes, cached=None):
        """``cached``: (tegula's call on the first R rows, the bytes it moves), for the cache columns."""
        if only and not any(name.startswith(o) for o in only):
            return
        memory_bound = moved_bytes >= nbytes // 4
        # the copy sampled right after tegula's call in every round (a paired ratio: see the module docstring)
        fns = {"ours": ours, "copy": copy_fn} if memory_bound else {"ours": ours}
        fns["eager"] = eager
        if compiled is not None:
            try:
                compiled()
                fns["compiled"] = compiled
            except Exception as e:  # inductor failing here is a fact to report, not a crash
                print(f"  torch.compile failed for {name}: {type(e).__name__}: {str(e).splitlines()[0]}")
        # the contenders sampled in turn (each sample >= 1 ms of calls, process_time's coarser ticks: 20 ms), so a
        # drift of the host's speed reaches every side alike
        samples = interleaved(fns, args.reps, clock, 2e-2 if args.clock == "cpu" else 1e-3,
                              min_total_s=0.05)
        t = {k: timing_ms(v) for k, v in samples.items()}
        copy_samples.extend(samples.get("copy", ()))
        t_ours, t_eager, t_comp = t["ours"], t["eager"], t.get("compiled")
        gbs = moved_bytes / (t_ours.median_ms * 1e-3) / 1e9
        cache_gbs = cache_of = "-"
        if memory_bound:
            copy_gbs = copy_moved / (t["copy"].median_ms * 1e-3) / 1e9
            paired = sorted(moved_bytes * tc / (copy_moved * to) for to, tc in zip(samples["ours"], samples["copy"]))
            of_copy, prange = statistics.median(paired), f"{paired[0]:.2f}-{paired[-1]:.2f}"
            if cached is not None:  # paired with the copy as the row's rounds are; samples of >= 20 ms of calls,
                # so that the one call a sample makes on a cache the copy has just flushed weighs little
                cs = interleaved({"cached": cached[0], "copy": copy_fn}, args.reps, clock, 2e-2)
                cache_gbs = cached[1] / statistics.median(cs["cached"]) / 1e9
                cache_of = statistics.median(cached[1] * tc / (copy_moved * to) for to, tc in zip(cs["cached"],
                                                                                                 cs["copy"]))
        else:
            copy_gbs, prange = peak, "-"
            of_copy = gbs / copy_gbs
        rows.append([name, t_ours.median_ms, f"{t_ours.spread:.0%}", gbs, copy_gbs, of_copy, prange, cache_gbs,
                     cache_of, t_eager.median_ms, t_eager.median_ms / t_ours.median_ms,
                     "-" if t_comp is None else t_comp.median_ms,
                     "-" if t_comp is None else t_comp.median_ms / t_ours.median_ms, memory_bound])
        print(f"  {name}: {t_ours.median_ms:.1f} ms, {gbs:.2f} GB/s", flush=True)

    def wrap(f, *a):
        cf = comp(f)
        return None if cf is None else (lambda: cf(*a))

    H = 7168
    T_ = max(128, nbytes // 2 // H // 128 * 128)
    x = torch.randn(T_, H).bfloat16()
    q8 = torch.empty(T_, H, dtype=torch.float8_e4m3fn)
    sf = torch.empty(T_, H // 128, dtype=torch.float32)
    # the kernels quant.per_token_cast picks for this shape (bf16 read as words of two elements; block width:
    # quant._pairs_shape)
    xw, q16 = x.view(torch.uint32), q8.view(torch.uint16)
    R = min(cache_rows(llc), T_)

    def rows_bench(name, run, moved, n, r, eager, compiled):
        """bench() of ``run(rows)``, tegula's call on the first ``rows`` rows of its tensors (``moved(rows)`` bytes):
        on all n of them, and on r for the cache columns."""
        bench(name, lambda: run(n), eager, compiled, moved(n), (lambda: run(r), moved(r)))

    k = lazy(QP.per_token_pairs, "e4m3", 128, *quant._pairs_shape(H, "e4m3", 128, False, False))
    rows_bench("per_token_cast bf16->e4m3 /128", lambda m: k(xw[:m], q16[:m], sf[:m].view(torch.int32), H, 0),
               lambda m: m * H * 3 + m * (H // 128) * 4, T_, R,
               lambda: per_token_cast_ref(x), wrap(per_token_cast_ref, x))
    kp = lazy(QP.per_token_pairs, "e4m3", 128, *quant._pairs_shape(H, "e4m3", 128, True, True))
    sfks = {m: _tk.alloc_sf(m, H // 128, True, True) for m in (T_, R)}  # (the packed column-major layout of m rows)
    rows_bench("per_token_cast ue8m0 packed", lambda m: kp(xw[:m], q16[:m], sfks[m][1], H, 3),
               lambda m: m * H * 3 + sfks[m][0].numel() * 4, T_, R,
               lambda: per_token_cast_ue8m0_ref(x), wrap(per_token_cast_ue8m0_ref, x))
    q4 = torch.empty(T_, H // 2, dtype=torch.uint8)
    sf32 = torch.empty(T_, H // 32, dtype=torch.float32)
    k4 = lazy(QP.per_token_pairs, "e2m1", 32, *quant._pairs_shape(H, "e2m1", 32, False, False))
    rows_bench("per_token_cast bf16->e2m1 /32", lambda m: k4(xw[:m], q4[:m], sf32[:m].view(torch.int32), H, 0),
               lambda m: m * H * 2.5 + m * (H // 32) * 4, T_, R,
               lambda: per_token_cast_fp4_ref(x), wrap(per_token_cast_fp4_ref, x))
    sfb = torch.empty(T_ // 128, H // 128, dtype=torch.float32)
    kb = lazy(QP.per_block_pairs, 128, 128, H)
    rows_bench("per_block_cast 128x128", lambda m: kb(xw[:m], q16[:m], sfb[:m // 128].view(torch.int32), H, 0),
               lambda m: m * H * 3, T_, R, lambda: per_block_cast_ref(x), wrap(per_block_cast_ref, x))
    kc = lazy(QP.per_channel_pairs, H)
    sfc = torch.empty(T_ // 128, H, dtype=torch.float32)
    rows_bench("per_channel_cast 128x1", lambda m: kc(xw[:m], q16[:m], sfc[:m // 128].view(torch.int32), 0),
               lambda m: m * H * 3, T_, R, lambda: per_channel_cast_ref(x), wrap(per_channel_cast_ref, x))
    e5 = torch.empty(T_, H // 8 * 3, dtype=torch.uint32)
    sf1 = torch.empty(T_, 1, dtype=torch.float32)
    ke = lazy(EK.per_row_cast_e5m6, "bfloat16", *EK.widths(H))
    rows_bench("per_token_cast_to_e5m6", lambda m: ke(x[:m], xw[:m], e5[:m], sf1[:m].view(torch.int32), H, 0),
               lambda m: m * H * 3.5, T_, R, lambda: e5m6_ref(x), wrap(e5m6_ref, x))
    qq, ss = per_token_cast_ref(x)
    y = torch.empty(T_, H, dtype=torch.bfloat16)
    kbk = lazy(QK.cast_back, "e4m3", "bfloat16", 1, 128, False, 512)
    rows_bench("cast_back e4m3->bf16 /128", lambda m: kbk(qq[:m], ss[:m].view(torch.int32), y[:m], H),
               lambda m: m * H * 3, T_, R, lambda: cast_back_ref(qq, ss), wrap(cast_back_ref, qq, ss))
    qq = q4 = e5 = None  # free them (the closures above have run)

    w = torch.randn(H).bfloat16()
    krn = lazy(norm.rmsnorm_kernel, "bfloat16", "bfloat16")
    rows_bench("rmsnorm bf16", lambda m: krn(x[:m], w, y[:m], 1e-6), lambda m: m * H * 4, T_, R,
               lambda: rmsnorm_ref(x, w), wrap(rmsnorm_ref, x, w))
    krc = lazy(norm.rmsnorm_cast_pairs_kernel, 128)  # what the op runs on bf16 x and weight (rows as uint32 words)
    rows_bench("rmsnorm+per_token_cast", lambda m: krc(xw[:m], w.view(torch.uint32), q16[:m],
                                                       sf[:m].view(torch.int32), 1e-6, 0),
               lambda m: m * H * 3 + m * (H // 128) * 4, T_, R,
               lambda: rmsnorm_cast_ref(x, w), wrap(rmsnorm_cast_ref, x, w))
    y = None

    xs = x.view(T_ * H // 4096, 4096)  # SwiGLU over hidden 2048: x (tokens, 4096)
    n2 = xs.shape[0]
    qs = torch.empty(n2, 2048, dtype=torch.float8_e4m3fn)
    sfs = torch.empty(n2, 16, dtype=torch.float32)
    i32, f32 = torch.zeros(1, dtype=torch.int32), torch.zeros(1)
    ksw = lazy(_swiglu.swiglu_forward_pairs, 2048, 128, False, False, False)  # what the op runs on bf16 x
    tb = _swiglu._silu_table()
    rows_bench("swiglu+per_token_cast", lambda m: ksw(xs[:m].view(torch.uint32), qs[:m].view(torch.uint16),
                                                      sfs[:m].view(torch.int32), i32, f32, i32, tb, 0.0, 1e-4, 0),
               lambda m: m * (4096 * 2 + 2048 + 16 * 4), n2, min(n2, R * H // 4096),  # (the bytes of R rows of x)
               lambda: swiglu_cast_ref(xs), wrap(swiglu_cast_ref, xs))
    qs = None

    heads, d = 16, 128  # q (tokens, 16, 128) bf16, NeoX over the first 64 dims
    nq = T_ * H // (heads * d)
    q = x.view(nq, heads, d)
    cs = torch.randn(8192, 64)
    pos = torch.randint(0, 8192, (nq,))
    kr = lazy(rope_kernel, "bfloat16", "float32", d, 64, False, False, True, streams_in_place())  # as the op
    pos32 = pos.int()
    rows_bench("rope neox in place", lambda m: kr(q[:m], pos32[:m], cs, m, 0), lambda m: m * heads * 64 * 2 * 2,
               nq, min(nq, R * H // (heads * d)), lambda: rope_ref(q, cs, pos), wrap(rope_ref, q, cs, pos))
    x = q8 = sf = None

    # MoE routing: latency rows (inputs of a few MB)
    n, E, K = 16384, 256, 8
    scores = torch.randn(n, E)
    ti = torch.empty(n, K, dtype=torch.int64)
    kg = lazy(MK.topk_gate, E, K)
    bench("moe topk_gate 256/8", lambda: kg(scores, ti), lambda: topk_gate_ref(scores, K),
          wrap(topk_gate_ref, scores, K), scores.numel() * 4 + ti.numel() * 8)
    bias = torch.randn(E) * 0.1
    bench("moe top2_sum_gate 8/4 groups", lambda: moe.top2_sum_gate(scores, bias, K, 4, 8, False, 0, 2.5, 0, 1, 0, 1,
                                                                    "sigmoid"),
          lambda: top2_sum_gate_ref(scores, bias), wrap(top2_sum_gate_ref, scores, bias), scores.numel() * 4)
    tw = torch.rand(n, K)
    bench("moe normalize_weight", lambda: moe.normalize_weight(tw), lambda: (tw.sum(-1) + 1e-20, tw / (tw.sum(
        -1, keepdim=True) + 1e-20)), None, tw.numel() * 8)
    idx = topk_gate_ref(scores, K).contiguous()
    bench("moe get_fused_mapping", lambda: moe.get_fused_mapping(idx, E, 0, 128),
          lambda: fused_mapping_ref(idx, E, 128), None, idx.numel() * 12)
    p2e, _, _, ttp, *_ = moe.get_fused_mapping(idx, E, 0, 128)
    hx = 2048
    xm = torch.randn(n // 4, hx).bfloat16()
    ttp4 = ttp[:n // 4].contiguous()
    xe = torch.empty(p2e.shape[0], hx, dtype=torch.bfloat16)
    kx = lazy(MK.expand_rows)
    bench("moe expand_to_fused", lambda: kx(xm.view(torch.uint8), ttp4, p2e, xe.view(torch.uint8)),
          lambda: expand_ref(xm, ttp4, p2e.shape[0]), None, xm.numel() * 2 * (K + 1))
    red = torch.empty(n // 4, hx, dtype=torch.bfloat16)
    kred = lazy(MK.reduce_fused, "bfloat16", "bfloat16", True, False, False)
    one = torch.ones(1)
    tw4 = tw[:n // 4].contiguous()
    bench("moe reduce_fused", lambda: kred(xe, tw4.view(-1), ttp4, red, one, one),
          lambda: reduce_ref(xe, tw4, ttp4), wrap(reduce_ref, xe, tw4, ttp4), red.numel() * 2 * (K + 1))

    run_gbs = copy_moved / statistics.median(copy_samples) / 1e9 if copy_samples else None
    if run_gbs is not None:
        print(f"run copy: the median of {len(copy_samples)} copy samples over the run, {run_gbs:.1f} GB/s (the "
              f"samples read {copy_moved / max(copy_samples) / 1e9:.1f}-{copy_moved / min(copy_samples) / 1e9:.1f})")
    rows = [r[:7] + [r[3] / run_gbs if r[-1] and run_gbs else "-"] + r[7:-1] for r in rows]
    print_table(f"tegula.ops (TileKernels' ops) vs torch, ~{args.gib} GiB working sets, "
                f"{torch.get_num_threads()} threads, clock {args.clock} (medians of >= {args.reps} runs)",
                ["op", "tegula ms", "spread", "GB/s", "copy GB/s", "of copy BW", "paired range", "of run copy",
                 "cache GB/s", "cache/copy", "eager ms", "eager/tegula", "compile ms", "compile/tegula"], rows)
    print("ratios > 1: tegula is faster. tegula writes into preallocated outputs; torch allocates its results.")


if __name__ == "__main__":
    main()
