"""Flash attention forward (examples/flash_attention.py, the kernel text unchanged) against torch SDPA.

    python -m bench.attention [--seq 2048] [--heads 16] [--dim 128] [--reps 5] [--tune] [--clock cpu]

fp32, batch 1, causal and not. The output tensor is preallocated by torch.empty on each call of the tegula kernel
(out_idx) and by SDPA itself: both sides allocate. FLOP counts: 4*b*h*s*s*d, halved when causal.

--clock cpu: tegula and SDPA each on one thread, timed by process CPU time per call and measured alternately (one
call of each per round), which other load on a shared machine disturbs far less than wall-clock time.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import tegula
from bench.common import add_clock_option, do_bench, load_example, print_table, side_by_side, summary, use_clock


def main(argv=None):
    p = argparse.ArgumentParser(description=summary(__doc__))
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--tune", action="store_true", help="also try other block sizes (block_M, block_N)")
    add_clock_option(p)
    args = p.parse_args(argv)
    clock = use_clock(args.clock)
    nthreads = torch.get_num_threads()
    fa = load_example("flash_attention")
    b, h, s, d = 1, args.heads, args.seq, args.dim
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d) for _ in range(3))
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    rows = []
    configs = [dict(block_M=64, block_N=64)]
    if args.tune:
        configs += [dict(block_M=bm, block_N=bn) for bm in (32, 64, 128) for bn in (32, 64, 128)
                    if (bm, bn) != (64, 64)]
    for causal in (True, False):
        flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
        sdpa_fn = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)  # noqa: E731
        sdpa = do_bench(sdpa_fn, rep=args.reps) if args.clock == "wall" else None
        ref = fa.reference(q, k, v, causal)
        for cfg in configs:
            kern = tegula.compile(fa.flash_attention(b, h, s, d, causal, dtype="float32", **cfg), out_idx=[3],
                                  target="c")
            out = kern(q, k, v)
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
            if args.clock == "cpu":
                t, sdpa = side_by_side([lambda: kern(q, k, v), sdpa_fn], args.reps, clock)
            else:
                t = do_bench(lambda: kern(q, k, v), rep=args.reps)
            rows.append([f"{'causal' if causal else 'full'} {cfg['block_M']}x{cfg['block_N']}", t.median_ms,
                         f"{t.spread:.0%}", flops / t.median_ms / 1e6, sdpa.median_ms, flops / sdpa.median_ms / 1e6,
                         sdpa.median_ms / t.median_ms])
            print(f"  {rows[-1][0]}: done", flush=True)
    print_table(f"flash attention fp32 b={b} h={h} s={s} d={d}, {nthreads} thread(s), {args.clock} clock "
                f"(medians of >= {args.reps})",
                ["case (block_M x block_N)", "tegula ms", "spread", "GFLOP/s", "SDPA ms", "SDPA GFLOP/s",
                 "SDPA/tegula"], rows)


if __name__ == "__main__":
    main()
