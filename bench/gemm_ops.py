"""tegula.ops.gemm (DeepGEMM's API in T.*) against torch's bf16 matmul and the machine's memory bandwidth.

    python -m bench.gemm_ops [--reps 7] [--quick] [--no-bandwidth]

Rows, all measured side by side in this process (each repeat times every contender of a row in turn, so load
from elsewhere on the machine falls on all of them alike; ratios are medians of the per-repeat ratios, with
the spread (max - min) / median of each contender's samples):

- decode (M <= 64): fp8_gemm_nt on float8 weights [N, K] with 128 x 128 block scales, torch.matmul on the
  same weights in bf16, and tegula's bf16_gemm_nt. Weights rotate over enough copies that each call reads
  them from DRAM (>= --ws MiB per contender, far beyond the last-level cache). GB/s counts every byte read
  or written (weights, activations, scales, output); "of BW" divides by the bandwidth of a plain OpenMP copy
  of --ws MiB ("copy GB/s", read + write bytes / s, all cores) sampled in turn with the row's contenders (the
  memory's speed on a shared host moves within a run; the 1 GiB copy at the start is printed for reference).
  "read GB/s" is a plain read of the same weights (torch's sum over their bytes as int64), sampled likewise, and
  "of read" divides by it: the copy's buffers come from numpy, which asks for transparent huge pages, the weights
  from torch's allocator (4 KiB pages here), and a plain read of such memory runs slower (1 thread: copy 25-27 GB/s
  on numpy's buffers, 21.7 on torch's; a read 18-21 GB/s on torch's, 29 on numpy's).
- compute-bound (M = 4096): fp8_gemm_nt against tegula's bf16_gemm_nt, and bf16_gemm_nt against torch.
- grouped: m_grouped_fp8_gemm_nt_contiguous over G experts (uneven counts, padded to the alignment) against
  fp8_gemm_nt of the same total M on one weight; the masked form; k_grouped_fp8_gemm_tn_contiguous.
- indexer: fp8_mqa_logits and fp8_paged_mqa_logits against a torch implementation of the same formula.

Outputs are preallocated once and reused; torch writes with out=. OMP_WAIT_POLICY defaults to passive here (see
below). On a machine other work shares, --clock cpu
compares the contenders one thread each by the CPU time a call takes, which that load disturbs far less than
wall-clock time.
"""
from __future__ import annotations

import os

# torch and tegula's kernels run on two OpenMP runtimes in this process; threads of one that spin after a call
# starve the other's on a machine with few cores (2-10x on 2). Sleeping at once keeps the side-by-side fair.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import argparse  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from bench.common import (  # noqa: E402
    add_clock_option,
    copy_kernels,
    interleaved,
    last_level_cache,
    measure_bandwidth,
    print_table,
    summary,
    use_clock,
)
from tegula.ops import gemm as dg  # noqa: E402

FP8 = torch.float8_e4m3fn
DECODE_NK = [(2112, 7168), (24576, 1536), (7168, 2048), (4096, 7168)]
DECODE_M = [1, 4, 16, 64]
COMPUTE_NK = [(2112, 7168), (7168, 2048)]


# timing -----------------------------------------------------------------------------------------------------

clock = time.perf_counter


def side_by_side(fns: dict, reps: int, min_s: float = 0.02) -> dict:
    """{name: list of seconds per call}, one sample of every fn per repeat, interleaved (bench.common.interleaved)."""
    return interleaved(fns, reps, clock, min_s)


def med(x):
    return statistics.median(x)


def spread(x):
    return (max(x) - min(x)) / med(x)


def ratio(num, den):
    """Median over repeats of num[i] / den[i]: how many times faster den is than num."""
    return med([a / b for a, b in zip(num, den)])


def rotating(make, count):
    """A callable cycling over ``count`` argument sets made by make(i)."""
    sets = [make(i) for i in range(count)]
    state = [0]

    def nxt():
        state[0] = (state[0] + 1) % count
        return sets[state[0]]
    return nxt


def fp8_weight(n, k):
    b = torch.randn(n, k, dtype=torch.bfloat16)
    return dg.per_block_cast_to_fp8(b, use_ue8m0=False)


# rows ------------------------------------------------------------------------------------------------------

def decode_rows(args):
    rows = []
    # the plain copy of a working set as large as a contender's weights, sampled in turn with each row: "of BW"
    # divides by the copy of the same rounds (the memory's speed on a shared host moves within a run)
    copy_fn, copy_moved = copy_kernels(args.ws << 20, threads=1 if args.clock == "cpu" else None)["stream_copy"]
    for n, k in DECODE_NK[:2] if args.quick else DECODE_NK:
        copies = max(2, -(-args.ws * 2**20 // (n * k)))
        base = fp8_weight(n, k)
        # distinct memory per copy (the values may repeat: only where the bytes come from matters)
        w8 = rotating(lambda i: (base[0].clone(), base[1].clone()), copies)
        wb_base = torch.randn(n, k, dtype=torch.bfloat16)
        w16 = rotating(lambda i: wb_base.clone(), max(2, copies // 2))
        for m in DECODE_M[:2] if args.quick else DECODE_M:
            a = torch.randn(m, k, dtype=torch.bfloat16)
            qa = dg.per_token_cast_to_fp8(a, use_ue8m0=False)
            d, d2, d3 = (torch.empty(m, n, dtype=torch.bfloat16) for _ in range(3))
            t = side_by_side({
                "fp8": lambda: dg.fp8_gemm_nt(qa, w8(), d),
                "torch": lambda: torch.matmul(a, w16().T, out=d2),
                "bf16": lambda: dg.bf16_gemm_nt(a, w16(), d3),
                "copy": copy_fn,
                "read": lambda: w8()[0].view(torch.int64).sum(),
            }, args.reps)
            moved = n * k + m * k + 4 * (m * (k // 128) + (n // 128) * (k // 128)) + 2 * m * n
            gbs = moved / med(t["fp8"]) / 1e9
            copy_gbs = copy_moved / med(t["copy"]) / 1e9
            read_gbs = n * k / med(t["read"]) / 1e9
            rows.append([f"{m}x{n}x{k}", med(t["fp8"]) * 1e3, f"{spread(t['fp8']):.0%}", gbs, copy_gbs,
                         gbs / copy_gbs, read_gbs, gbs / read_gbs,
                         med(t["torch"]) * 1e3, f"{spread(t['torch']):.0%}", ratio(t["torch"], t["fp8"]),
                         med(t["bf16"]) * 1e3, ratio(t["torch"], t["bf16"])])
            print(f"  decode {m}x{n}x{k} done", flush=True)
    print_table("decode: fp8_gemm_nt vs torch bf16 matmul (weights from DRAM)",
                ["MxNxK", "fp8 ms", "spread", "GB/s", "copy GB/s", "of BW", "read GB/s", "of read", "torch ms",
                 "spread", "fp8 x torch", "tg bf16 ms", "bf16 x torch"], rows)


def compute_rows(args):
    rows = []
    m = 1024 if args.quick else 4096
    for n, k in COMPUTE_NK[:1] if args.quick else COMPUTE_NK:
        a = torch.randn(m, k, dtype=torch.bfloat16)
        b = torch.randn(n, k, dtype=torch.bfloat16)
        qa, qb = dg.per_token_cast_to_fp8(a, use_ue8m0=False), dg.per_block_cast_to_fp8(b, use_ue8m0=False)
        d, d2, d3 = (torch.empty(m, n, dtype=torch.bfloat16) for _ in range(3))
        t = side_by_side({
            "fp8": lambda: dg.fp8_gemm_nt(qa, qb, d),
            "bf16": lambda: dg.bf16_gemm_nt(a, b, d2),
            "torch": lambda: torch.matmul(a, b.T, out=d3),
        }, max(3, args.reps // 2), min_s=0.0)
        tf = 2 * m * n * k / 1e12
        rows.append([f"{m}x{n}x{k}", tf / med(t["fp8"]), f"{spread(t['fp8']):.0%}", tf / med(t["bf16"]),
                     f"{spread(t['bf16']):.0%}", tf / med(t["torch"]), f"{spread(t['torch']):.0%}",
                     ratio(t["bf16"], t["fp8"]), ratio(t["torch"], t["bf16"])])
        print(f"  compute {m}x{n}x{k} done", flush=True)
    print_table("compute-bound: TFLOP/s", ["MxNxK", "fp8", "spread", "tg bf16", "spread", "torch bf16", "spread",
                                          "fp8 x tg bf16", "tg bf16 x torch"], rows)


def grouped_rows(args):
    rows = []
    random.seed(0)
    al = dg.get_mk_alignment_for_contiguous_layout()
    n, k = (2048, 2048) if args.quick else (4096, 2048)
    for groups in (4, 8):
        per = (1024 if args.quick else 4096) // groups
        ms = [max(1, int(per * random.uniform(0.7, 1.3))) for _ in range(groups)]
        starts, m = [], 0
        for x in ms:
            starts.append(m)
            m += dg.align(x, al)
        qa = dg.per_token_cast_to_fp8(torch.randn(m, k, dtype=torch.bfloat16), use_ue8m0=False)
        ws = [fp8_weight(n, k) for _ in range(groups)]
        qb = (torch.stack([w[0] for w in ws]), torch.stack([w[1] for w in ws]))
        mi = torch.full((m,), -1, dtype=torch.int32)
        for g, (s, x) in enumerate(zip(starts, ms)):
            mi[s:s + x] = g
        d, d2 = torch.empty(m, n, dtype=torch.bfloat16), torch.empty(m, n, dtype=torch.bfloat16)
        dense_b = (qb[0][0], qb[1][0])
        t = side_by_side({
            "grouped": lambda: dg.m_grouped_fp8_gemm_nt_contiguous(qa, qb, d, mi),
            "dense": lambda: dg.fp8_gemm_nt(qa, dense_b, d2),
        }, max(3, args.reps // 2), min_s=0.0)
        tf = 2 * m * n * k / 1e12
        rows.append([f"contiguous G={groups} M={m} N={n} K={k}", tf / med(t["grouped"]), f"{spread(t['grouped']):.0%}",
                     tf / med(t["dense"]), ratio(t["dense"], t["grouped"])])
        print(f"  grouped G={groups} done", flush=True)
    # masked: per-expert capacity, counts around expected_m
    groups, max_m, exp_m = 8, 256, 128
    qa = (torch.randint(-100, 100, (groups, max_m, k), dtype=torch.int8).view(FP8), torch.rand(groups, max_m, k // 128))
    ws = [fp8_weight(n, k) for _ in range(groups)]
    qb = (torch.stack([w[0] for w in ws]), torch.stack([w[1] for w in ws]))
    masked = torch.tensor([int(exp_m * random.uniform(0.7, 1.3)) for _ in range(groups)], dtype=torch.int32)
    d = torch.empty(groups, max_m, n, dtype=torch.bfloat16)
    valid = int(masked.sum())
    qd = (qa[0][0, :1].expand(valid, k).contiguous(), qa[1][0, :1].expand(valid, k // 128).contiguous())
    d2 = torch.empty(valid, n, dtype=torch.bfloat16)
    t = side_by_side({
        "masked": lambda: dg.m_grouped_fp8_gemm_nt_masked(qa, qb, d, masked, exp_m),
        "dense": lambda: dg.fp8_gemm_nt(qd, (qb[0][0], qb[1][0]), d2),
    }, max(3, args.reps // 2), min_s=0.0)
    tf = 2 * valid * n * k / 1e12
    rows.append([f"masked G={groups} rows={valid} N={n} K={k}", tf / med(t["masked"]), f"{spread(t['masked']):.0%}",
                 tf / med(t["dense"]), ratio(t["dense"], t["masked"])])
    print_table("grouped: TFLOP/s against a dense fp8 GEMM of the same total M",
                ["case", "grouped", "spread", "dense", "grouped x dense"], rows)


def k_grouped_rows(args):
    groups, m, n = 4, 1024, 1024
    ks = [dg.align(int(1024 * random.uniform(0.7, 1.3)), 128) for _ in range(groups)]
    total = sum(ks)
    a = torch.randn(total, m, dtype=torch.bfloat16)
    b = torch.randn(total, n, dtype=torch.bfloat16)

    def cast(x):
        parts = [dg.per_channel_cast_to_fp8(x[s:s + kk], use_ue8m0=False)
                 for s, kk in zip([sum(ks[:i]) for i in range(groups)], ks)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    qa, qb = cast(a), cast(b)
    d = torch.zeros(groups, m, n)
    lay = torch.tensor(ks, dtype=torch.int32)
    t = side_by_side({"k_grouped": lambda: dg.k_grouped_fp8_gemm_tn_contiguous(qa, qb, d, ks, lay, d)},
                     max(3, args.reps // 2), min_s=0.0)
    tf = 2 * m * n * total / 1e12
    print_table("k-grouped (weight gradient): TFLOP/s", ["case", "TFLOP/s", "spread"],
                [[f"G={groups} M={m} N={n} sum_k={total}", tf / med(t["k_grouped"]), f"{spread(t['k_grouped']):.0%}"]])


def indexer_rows(args):
    rows = []
    s, skv, h, dim = (512, 4096, 32, 128) if not args.quick else (256, 2048, 32, 128)
    q = torch.randn(s, h, dim, dtype=torch.bfloat16).to(FP8)
    kv = dg.per_custom_dims_cast_to_fp8(torch.randn(skv, dim, dtype=torch.bfloat16), (0,), False)
    w = torch.randn(s, h)
    ks = torch.zeros(s, dtype=torch.int32)
    ke = torch.arange(s, dtype=torch.int32) + (skv - s) + 1

    def torch_mqa():
        score = torch.einsum("mhd,nd->mhn", q.float(), kv[0].float())
        lg = (score.relu() * w[:, :, None]).sum(1) * kv[1][None]
        cols = torch.arange(skv)
        return lg.masked_fill(~((cols[None] >= ks[:, None]) & (cols[None] < ke[:, None])), float("-inf"))
    t = side_by_side({"tegula": lambda: dg.fp8_mqa_logits(q, kv, w, ks, ke), "torch": torch_mqa},
                     max(3, args.reps // 2), min_s=0.0)
    rows.append([f"fp8_mqa_logits S={s} S_kv={skv} H={h} D={dim}", med(t["tegula"]) * 1e3, f"{spread(t['tegula']):.0%}",
                 med(t["torch"]) * 1e3, ratio(t["torch"], t["tegula"])])

    bsz, next_n, page, avg = 32, 2, 64, 4096
    cl = torch.randint(int(0.7 * avg), int(1.3 * avg), (bsz,), dtype=torch.int32)
    pages = (cl + page - 1) // page
    maxlen = int(pages.max()) * page
    total = int(pages.sum())
    cache = torch.randint(0, 255, (total, page * (dim + 4)), dtype=torch.uint8)
    cache[:, page * dim:] = torch.rand(total, page).view(torch.uint8).view(total, -1)
    cache = cache.view(total, page, 1, dim + 4)
    bt = torch.zeros(bsz, int(pages.max()), dtype=torch.int32)
    perm = torch.randperm(total, dtype=torch.int32)
    off = 0
    for i, p in enumerate(pages.tolist()):
        bt[i, :p] = perm[off:off + p]
        off += p
    qp = torch.randn(bsz, next_n, h, dim, dtype=torch.bfloat16).to(FP8)
    wp = torch.randn(bsz * next_n, h)
    cl2 = cl.view(-1, 1).repeat(1, next_n).contiguous()
    meta = dg.get_paged_mqa_logits_metadata(cl2, page, dg.get_num_sms())
    vals = cache.view(total, -1)[:, :page * dim].contiguous().view(FP8).view(total, page, dim)
    sfs = cache.view(total, -1)[:, page * dim:].contiguous().view(torch.float32)

    def torch_paged():
        out = torch.full((bsz * next_n, maxlen), float("-inf"))
        for i in range(bsz):
            kvb = vals[bt[i, :pages[i]].long()].reshape(-1, dim).float()
            sf = sfs[bt[i, :pages[i]].long()].reshape(-1)
            sc = torch.einsum("nhd,td->nht", qp[i].float(), kvb)
            lg = (sc.relu() * wp[i * next_n:(i + 1) * next_n, :, None]).sum(1) * sf
            n_ = int(cl[i])
            out[i * next_n:(i + 1) * next_n, :n_] = lg[:, :n_]
        return out
    t = side_by_side({"tegula": lambda: dg.fp8_paged_mqa_logits(qp, cache, wp, cl2, bt, meta, maxlen),
                      "torch": torch_paged}, max(3, args.reps // 2), min_s=0.0)
    rows.append([f"fp8_paged_mqa_logits B={bsz} next_n={next_n} H={h} D={dim} ctx~{avg}", med(t["tegula"]) * 1e3,
                 f"{spread(t['tegula']):.0%}", med(t["torch"]) * 1e3, ratio(t["torch"], t["tegula"])])
    print_table("indexer (ms)", ["case", "tegula", "spread", "torch", "tegula x torch"], rows)


def main(argv=None):
    p = argparse.ArgumentParser(description=summary(__doc__))
    p.add_argument("--reps", type=int, default=7, help="interleaved repeats per row (default 7)")
    p.add_argument("--ws", type=int, default=None,
                   help="MiB of weights each decode contender cycles through (default: twice the last-level cache, "
                        "at least 256)")
    p.add_argument("--quick", action="store_true", help="fewer and smaller shapes")
    p.add_argument("--only", default="decode,compute,grouped,indexer", help="comma-separated sections")
    add_clock_option(p, help="wall: every core, wall-clock time (default); cpu: one thread each, process CPU time per "
                             "call, which other load on the machine disturbs far less (GB/s are then per core)")
    args = p.parse_args(argv)
    if args.ws is None:
        args.ws = max(256, 2 * (last_level_cache() >> 20))
    elif args.ws < 1:
        p.error(f"--ws must be a positive number of MiB, got {args.ws}")
    global clock
    clock = use_clock(args.clock)
    torch.manual_seed(0)
    only = set(args.only.split(","))
    bw = measure_bandwidth(1 << 30, threads=1 if args.clock == "cpu" else None)
    print(f"measured bandwidth: plain copy {bw['stream_copy']:.1f} GB/s, non-temporal {bw['stream_copy_nt']:.1f} GB/s "
          f"(wall clock); torch threads {torch.get_num_threads()}, tegula threads "
          f"{os.environ.get('TEGULA_NUM_THREADS') or dg.get_num_sms()}; clock {args.clock}", flush=True)
    if "decode" in only:
        decode_rows(args)
    if "compute" in only:
        compute_rows(args)
    if "grouped" in only:
        grouped_rows(args)
        k_grouped_rows(args)
    if "indexer" in only:
        indexer_rows(args)


if __name__ == "__main__":
    main()
