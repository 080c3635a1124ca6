"""Start a world of tests/ep/ep_worker.py processes on this machine and collect their results, bounded in time."""
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def shm_names():
    return set(glob.glob("/dev/shm/tegula-ep-*"))


def run_world(world, cases, timeout=150, env=None):
    """Run ``cases`` on ``world`` ranks. Returns (per-rank results (None for a rank that wrote nothing), exit codes,
    seconds). Every process is killed at ``timeout``."""
    with tempfile.TemporaryDirectory(prefix="tegula-ep-test-") as d:
        child_env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
                         **(env or {}))
        outs = [os.path.join(d, f"rank{r}.json") for r in range(world)]
        t0 = time.monotonic()
        procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "ep_worker.py"), str(r), str(world),
                                   os.path.join(d, "store"), outs[r], ",".join(cases)], env=child_env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(world)]
        logs = []
        try:
            for p in procs:
                left = max(1.0, timeout - (time.monotonic() - t0))
                try:
                    logs.append(p.communicate(timeout=left)[0].decode(errors="replace"))
                except subprocess.TimeoutExpired:
                    logs.append("(killed at the timeout)")
                    break
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        results = []
        for path in outs:
            try:
                with open(path) as f:
                    results.append(json.load(f))
            except (OSError, ValueError):
                results.append(None)
        return results, [p.returncode for p in procs], time.monotonic() - t0, logs


def failures(results, logs, case):
    """Readable errors of ``case`` across ranks ('' when it passed everywhere)."""
    out = []
    for r, res in enumerate(results):
        if res is None or case not in res:
            out.append(f"rank {r}: no result for {case}\n{logs[r][-3000:] if r < len(logs) else ''}")
        elif not res[case]["ok"]:
            out.append(f"rank {r}:\n{res[case]['error']}")
    return "\n".join(out)
