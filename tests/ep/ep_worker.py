"""A tests/ep world: imports torch and tegula.ep once, then forks one process per rank. Each rank joins a gloo group
through a file store, runs cases from ep_cases.py in order and writes {case: {"ok", "error", "s"}} as JSON to
OUT.<rank> after each one (a killed rank leaves what it finished); the parent writes the exit codes to OUT.codes.

    python tests/ep/ep_worker.py WORLD STORE OUT SPEC[,SPEC...]

A SPEC is "all:NAME" (every rank, one group), "pairs:NAME" (ranks {0, 1}, {2, 3}, ... each run NAME as a world of
two, at the same time), "solo:NAME" (every rank alone, a world of one) or "split:NAME0/NAME1" (pair 0 runs NAME0,
pair 1 runs NAME1, other pairs nothing).
"""
import json
import os
import sys
import time
import traceback
from datetime import timedelta


def main():
    world, store, out, specs = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    os.environ.setdefault("TEGULA_NUM_THREADS", "1")
    import ep_cases  # noqa: F401  (torch, tegula.ep and the reference, imported once for every rank)
    pids = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                run_rank(rank, world, store, f"{out}.{rank}", specs)
                code = 0
            finally:
                os._exit(code)
        pids[pid] = rank
    codes = [None] * world
    while pids:
        pid, status = os.wait()
        codes[pids.pop(pid)] = os.waitstatus_to_exitcode(status)
    with open(f"{out}.codes", "w") as f:
        json.dump(codes, f)


def run_rank(rank, world, store, out, specs):
    started = time.monotonic()
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=float(os.environ.get("EP_TEST_GLOO_TIMEOUT", "30"))))
    pairs = [dist.new_group([p, p + 1]) for p in range(0, world - 1, 2)]
    solos = [dist.new_group([r]) for r in range(world)]
    import ep_cases as cases
    import ep_reference as ref
    results = {"startup_s": round(time.monotonic() - started, 3)}
    for spec in specs.split(","):
        mode, name = spec.split(":")
        if mode == "all":
            ref.GROUP, r, n = None, rank, world
        elif mode == "solo":
            ref.GROUP, r, n = solos[rank], 0, 1
        else:
            if rank // 2 >= len(pairs):
                continue
            ref.GROUP, r, n = pairs[rank // 2], rank % 2, 2
            if mode == "split":
                names = name.split("/")
                if rank // 2 >= len(names):
                    continue
                name = names[rank // 2]
        t0 = time.monotonic()
        try:
            getattr(cases, "case_" + name)(r, n)
            results[spec] = {"ok": True}
        except BaseException:  # report, and go on to the next case
            results[spec] = {"ok": False, "error": f"(running {name})\n" + traceback.format_exc()}
        results[spec]["s"] = round(time.monotonic() - t0, 3)
        results["segments"] = sorted(cases.SEGMENTS)
        with open(out + ".tmp", "w") as f:
            json.dump(results, f)
        os.replace(out + ".tmp", out)


if __name__ == "__main__":
    main()
