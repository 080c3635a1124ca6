import os

import pytest
import torch

# PoCL builds a kernel ~20x faster without LLVM's optimisations; the tests check results, not speed.
os.environ.setdefault("TEGULA_OPENCL_FLAGS", "-cl-opt-disable")

# Every language test runs on the reference interpreter, on the CPU C backend, and on OpenCL where pyopencl finds
# a device (PoCL's CPU device in CI: `pip install pyopencl pocl-binary-distribution`).
TARGETS = ["interp", "c", "opencl"]


def _usable(name):
    from tegula import runtime
    return runtime.get(name).available()


@pytest.fixture(params=TARGETS)
def target(request):
    if request.param == "opencl":
        ok, why = _usable("opencl")
        if not ok:
            pytest.skip(f"opencl: {why}")
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
