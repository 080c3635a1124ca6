"""tegula.ep across processes of this machine, against a plain torch.distributed reference (ep_reference.py).

One world of four rank processes (gloo on loopback) runs everything, bounded in time: a world of one per rank; the
cases of ep_cases.py as two worlds of two ranks at once ({0, 1} and {2, 3}), then as one world of four; then a late
rank (timeout by name), a rank killed in the middle of a dispatch and a rank killed while the segments are being
mapped."""
import os
import subprocess
import sys

import pytest
from ep_launch import failures, run_world, shm_names

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")

BOTH = ["layout", "dispatch_combine", "fp8_dispatch", "alignment_cached_worst", "receives_nothing", "low_latency",
        "low_latency_fp8", "transport_dist", "torch_fallback"]
FOUR = BOTH + ["transport_mixed", "mismatch"]
SPECS = ["solo:one_rank", "solo:api"] + [f"pairs:{c}" for c in BOTH] + [f"all:{c}" for c in FOUR] + [
    "pairs:hung", "split:killed/killed_in_setup"]


@pytest.fixture(scope="module")
def world():
    before = shm_names()
    results, codes, seconds, logs = run_world(4, SPECS, timeout=240)
    return {"results": results, "codes": codes, "logs": logs, "seconds": seconds, "leaked": shm_names() - before}


def _check(world, spec, ranks=range(4)):
    err = failures([world["results"][r] for r in ranks], [world["logs"][r] for r in ranks], spec)
    assert not err, err


@pytest.mark.parametrize("case", BOTH)
def test_two_ranks(world, case):
    _check(world, f"pairs:{case}")


@pytest.mark.parametrize("case", FOUR)
def test_four_ranks(world, case):
    _check(world, f"all:{case}")


def test_one_rank(world):
    _check(world, "solo:one_rank")


def test_api_and_argument_errors(world):
    _check(world, "solo:api")


def test_import_is_cheap():
    code = "import sys, tegula.ep; print(','.join(m for m in ('torch', 'numpy') if m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == ""


def test_late_rank_times_out_naming_it(world):
    _check(world, "pairs:hung")


def test_killed_rank_makes_the_others_raise(world):
    assert world["codes"][1] == -9, world["logs"][1]  # rank 1 killed itself in the middle of a dispatch
    _check(world, "split:killed/killed_in_setup", ranks=[0])


def test_rank_killed_while_mapping_segments(world):
    assert world["codes"][3] == -9, world["logs"][3]
    _check(world, "split:killed/killed_in_setup", ranks=[2])


def test_survivors_exit_and_no_shared_memory_is_left(world):
    assert world["codes"][0] == world["codes"][2] == 0, world["logs"]
    assert not world["leaked"], world["leaked"]
    for res in world["results"]:
        assert res and all(not os.path.exists(p) for p in res["segments"])
