"""Start a world of tests/ep/ep_worker.py processes on this machine and collect their results, bounded in time."""
import glob
import json
import os
import signal
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
    seconds, output). The whole world is killed at ``timeout``."""
    with tempfile.TemporaryDirectory(prefix="tegula-ep-test-") as d:
        child_env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
                         **(env or {}))
        out = os.path.join(d, "result")
        t0 = time.monotonic()
        p = subprocess.Popen([sys.executable, os.path.join(HERE, "ep_worker.py"), str(world), os.path.join(d, "store"),
                              out, ",".join(cases)], env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             start_new_session=True)
        try:
            log = p.communicate(timeout=timeout)[0].decode(errors="replace")
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            log = p.communicate()[0].decode(errors="replace") + f"\n(killed at the {timeout} s timeout)"
        results = []
        for r in range(world):
            try:
                with open(f"{out}.{r}") as f:
                    results.append(json.load(f))
            except (OSError, ValueError):
                results.append(None)
        try:
            with open(f"{out}.codes") as f:
                codes = json.load(f)
        except (OSError, ValueError):
            codes = [None] * world
        return results, codes, time.monotonic() - t0, [log] * world


def failures(results, logs, case):
    """Readable errors of ``case`` across ranks ('' when it passed everywhere)."""
    out = []
    for r, res in enumerate(results):
        if res is None or case not in res:
            out.append(f"rank {r}: no result for {case}\n{logs[r][-3000:] if r < len(logs) else ''}")
        elif not res[case]["ok"]:
            out.append(f"rank {r}:\n{res[case]['error']}")
    return "\n".join(out)
