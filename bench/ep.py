"""tegula.ep dispatch and combine between processes of this machine, against a single-process memcpy and a bare
gloo all_to_all_single of the same bytes, measured in one run.

    python -m bench.ep [--tokens 4096] [--hidden 7168] [--topk 8] [--experts 256] [--ranks 2] [--reps 10]
                       [--transport auto|shm|dist]

Each rank is a process pinned to one core (rank % cores) with one thread. GB/s per rank = the bytes of x a rank
receives in dispatch (DeepEP's convention; combine sends the same rows back) / the time. Each repeat starts after
a start line and its time is the slowest rank's; the table gives the median over repeats and the spread (min-max).
The start line (--start spin, the default) is a counter per rank in a shared page that every rank bumps and then
spins on until all have: the ranks leave it within microseconds. gloo's barrier (--start barrier) wakes its ranks
through sockets, up to milliseconds apart on this VM, and a late rank's delay lands in its peers' time (they wait
for its rows); "start skew" gives the median spread of the ranks' start times for each kind of call.
memcpy = one process (rank 0 widened to all cores, the other ranks waiting) copying the same bytes into a warm
buffer, the faster of torch's copy_ and numpy's copyto (glibc memcpy), counted in bytes copied; the same on the
one core of rank 0 is shown for reference (the ratios are against all cores). gloo =
all_to_all_single of the same per-destination bytes. The four are interleaved in every repeat, so all of them see
the same machine load. CPU ms (process CPU time; the memcpy's is summed over its threads) tells how much of a
time was work when the machine is shared; wait ms, how long each rank waited for the others inside a tegula.ep
call (entering it, and for the peers' rows or reads), part of its time and, while it spins, of its CPU time.

Outputs: recv_x and the received top-k are views of the receiver's segment (two receive slots, reused); combine's
output comes from tegula.ep's cache of idle mappings (kernels.empty: the bench drops each result before the next
call, so after the warm-up no call faults pages in); the memcpy copies into a warm buffer.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench.common import summary  # (plain Python: no torch, no numpy, no OpenMP before a worker pins its core)


def _worker(args) -> None:
    rank, world = args.worker, args.ranks
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})
    os.environ["TEGULA_NUM_THREADS"] = "1"
    from datetime import timedelta

    import numpy as np
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    from tegula.ep import Buffer
    gen = torch.Generator().manual_seed(rank)
    t, h, e, k = args.tokens, args.hidden, args.experts, args.topk
    x = torch.randn((t, h), generator=gen).to(torch.bfloat16)
    topk_idx = torch.rand((t, e), generator=gen).topk(k, dim=1).indices
    topk_weights = torch.rand((t, k), generator=gen)
    nvl = Buffer.get_nvl_buffer_size_hint(t, h * 2, world, k)
    buf = Buffer(None, nvl, 0, transport=None if args.transport == "auto" else args.transport, timeout_s=120)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, e)

    def dispatch():
        return buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                            num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights)

    def waited():  # seconds this rank has spent waiting for its peers inside tegula.ep calls
        shm = getattr(buf._comm, "shm", None)
        return shm.waited_s if shm is not None else 0.0

    line = StartLine(args.store + ".start", rank, world) if args.start == "spin" else None

    def timed(fn):
        if line is not None:
            line.cross()
        else:
            dist.barrier()
        t0, c0, w0 = time.perf_counter(), time.process_time(), waited()
        out = fn()
        return (time.perf_counter() - t0, time.process_time() - c0, waited() - w0, t0), out

    # a bare gloo all_to_all_single of the same bytes of x
    send_bytes = [int(n) * h * 2 for n in per_rank.tolist()]
    counts = [None] * world
    dist.all_gather_object(counts, send_bytes)
    recv_split = [counts[s][rank] for s in range(world)]
    a2a_src = torch.empty(sum(send_bytes), dtype=torch.uint8)
    a2a_dst = torch.empty(sum(recv_split), dtype=torch.uint8)
    # memcpy of one rank's received bytes by one process (rank 0, widened to every core) while the others wait
    cpy_src = torch.empty(sum(recv_split), dtype=torch.uint8).fill_(1) if rank == 0 else None
    cpy_dst = torch.empty_like(cpy_src).fill_(0) if rank == 0 else None

    def memcpy(all_cores=True):
        if all_cores:
            os.sched_setaffinity(0, cores)
            torch.set_num_threads(len(cores))
        best = None
        for fn in (lambda: cpy_dst.copy_(cpy_src),  # torch, every core
                   lambda: np.copyto(cpy_dst.numpy(), cpy_src.numpy())):  # glibc memcpy: non-temporal stores here
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            t = (time.perf_counter() - t0, time.process_time() - c0, 0.0, t0)
            best = t if best is None or t[0] < best[0] else best
        torch.set_num_threads(1)
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
        return best

    times = {"dispatch": [], "combine": [], "combine_private": [], "gloo": [], "memcpy": [], "memcpy1": []}
    expert_out = None
    for i in range(args.reps + 2):  # the first two warm up both receive slots and the kernels
        dt, (recv_x, _, recv_w, _, handle, _) = timed(dispatch)
        ct, _ = timed(lambda: buf.combine(recv_x, handle, recv_w))  # x in the segment: read in place
        if expert_out is None or expert_out.shape != recv_x.shape:
            expert_out = torch.empty_like(recv_x)
        expert_out.copy_(recv_x)
        pt, _ = timed(lambda: buf.combine(expert_out, handle, recv_w))  # x a private tensor: copied over
        gt, _ = timed(lambda: dist.all_to_all_single(a2a_dst, a2a_src, recv_split, send_bytes))
        dist.barrier()
        mt = memcpy() if rank == 0 else (0.0, 0.0, 0.0, 0.0)
        dist.barrier()
        m1 = memcpy(all_cores=False) if rank == 0 else (0.0, 0.0, 0.0, 0.0)
        if i >= 2:
            for name, v in zip(times, (dt, ct, pt, gt, mt, m1)):
                times[name].append(v)
    recv_bytes = recv_x.numel() * recv_x.element_size()
    out = [None] * world
    dist.all_gather_object(out, dict(times, bytes=recv_bytes, transports=buf.transports))
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(out, f)
    buf.destroy()
    dist.barrier()
    if line is not None:
        line.close(unlink=rank == 0)
    dist.destroy_process_group()


class StartLine:
    """A start line shared by the ranks of one machine: slot r of a shared page holds how many times rank r has
    reached it; cross() bumps this rank's count and spins until every rank's count has caught up (polling the page,
    no system call), so the ranks leave within microseconds of the last arrival. A peer that never arrives raises
    after timeout_s."""

    def __init__(self, path: str, rank: int, world: int, timeout_s: float = 120.0):
        import mmap

        import numpy as np
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, 4096)  # every rank sizes it alike; a new file reads as zeros
        self.map = mmap.mmap(fd, 4096)
        os.close(fd)
        self.path, self.rank, self.timeout_s = path, rank, timeout_s
        self.counts = np.frombuffer(self.map, dtype=np.int64, count=world * 8)[::8]  # one cache line each
        self.crossed = 0

    def cross(self) -> None:
        self.crossed += 1
        self.counts[self.rank] = self.crossed
        deadline = time.perf_counter() + self.timeout_s
        spins = 0
        while self.counts.min() < self.crossed:
            spins += 1
            if spins % 4096 == 0 and time.perf_counter() > deadline:
                late = [r for r, c in enumerate(self.counts.tolist()) if c < self.crossed]
                raise TimeoutError(f"start line {self.crossed}: ranks {late} did not arrive in {self.timeout_s} s")

    def close(self, unlink: bool) -> None:
        del self.counts
        self.map.close()
        if unlink and os.path.exists(self.path):
            os.unlink(self.path)


def main() -> None:
    p = argparse.ArgumentParser(description=summary(__doc__))
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--transport", default="auto", choices=["auto", "shm", "dist"])
    p.add_argument("--start", default="spin", choices=["spin", "barrier"],
                   help="how the ranks start each timed call together: a spin on a shared page (default) or "
                        "gloo's barrier")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--store", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker is not None:
        return _worker(args)

    from bench.common import print_table
    with tempfile.TemporaryDirectory(prefix="tegula-bench-ep-") as d:
        store, out = os.path.join(d, "store"), os.path.join(d, "out.json")
        cmd = [sys.executable, "-m", "bench.ep", "--store", store, "--out", out] + [
            f"--{a}={getattr(args, a)}" for a in ("tokens", "hidden", "topk", "experts", "ranks", "reps", "transport",
                                                 "start")]
        procs = [subprocess.Popen(cmd + [f"--worker={r}"]) for r in range(args.ranks)]
        try:
            for pr in procs:
                if pr.wait(timeout=900):
                    raise SystemExit(f"a rank failed (exit {pr.returncode})")
        finally:
            for pr in procs:
                if pr.poll() is None:
                    pr.kill()
        with open(out) as f:
            ranks = json.load(f)
    nbytes = statistics.mean(r["bytes"] for r in ranks)

    names = {"dispatch": "dispatch", "combine": "combine (x = recv_x, read in place)",
             "combine_private": "combine (x a private tensor)", "memcpy": "memcpy (1 process, all cores)",
             "memcpy1": "memcpy (1 process, 1 core)", "gloo": "gloo all_to_all_single"}

    def slowest(key):  # per repeat, the slowest rank's wall time
        return [max(r[key][i][0] for r in ranks) for i in range(len(ranks[0][key]))]

    def cpu(key):  # per repeat, the CPU time summed over the ranks that took part, per rank
        busy = [r for r in ranks if any(v[1] for v in r[key])]
        return statistics.median(sum(r[key][i][1] for r in busy) / len(busy) for i in range(len(ranks[0][key])))

    def waits(key):  # each rank's median time waiting for its peers inside the call (tegula.ep's calls only)
        if key not in ("dispatch", "combine", "combine_private"):
            return ""
        return "/".join(f"{statistics.median(v[2] for v in r[key]) * 1e3:.2f}" for r in ranks)

    def skew(key):  # per repeat, the spread of the ranks' start times
        return statistics.median(max(r[key][i][3] for r in ranks) - min(r[key][i][3] for r in ranks)
                                 for i in range(len(ranks[0][key])))

    medians = {k: statistics.median(slowest(k)) for k in names}
    rows = []
    for key, label in names.items():
        ts = slowest(key)
        rows.append([label, medians[key] * 1e3, f"{min(ts) * 1e3:.3g}-{max(ts) * 1e3:.3g}", cpu(key) * 1e3,
                     waits(key), nbytes / medians[key] / 1e9, medians["memcpy"] / medians[key],
                     medians["gloo"] / medians[key]])
    print(f"\ntegula.ep on this machine: {args.ranks} ranks x {args.tokens} tokens, hidden {args.hidden}, "
          f"top-{args.topk} of {args.experts} experts, bf16; transports of rank 0: {ranks[0]['transports']}; "
          f"{nbytes / 1e6:.1f} MB received per rank; {args.reps} repeats; outputs: segment views (dispatch), "
          "reused mappings (combine), a warm buffer (memcpy)")
    print_table("per rank (median; spread = min-max over repeats, slowest rank each; CPU = process CPU time; "
                "wait = each rank's time waiting for its peers inside the call, rank 0/1/...)",
                ["", "ms", "spread ms", "CPU ms", "wait ms", "GB/s", "x memcpy", "x gloo"], rows)
    print(f"start skew ({args.start}; median over repeats of the latest rank's start minus the earliest's): "
          + ", ".join(f"{k} {skew(k) * 1e6:.0f} us" for k in ("dispatch", "combine", "combine_private", "gloo")))


if __name__ == "__main__":
    main()
