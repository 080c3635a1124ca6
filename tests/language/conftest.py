import os

import pytest
import torch

# PoCL builds a kernel ~20x faster without LLVM's optimisations; the tests check results, not speed.
os.environ.setdefault("TEGULA_OPENCL_FLAGS", "-cl-opt-disable")

# Every language test runs on the reference interpreter, on the CPU C backend, and on OpenCL where pyopencl finds
# a device (PoCL's CPU device in CI: `pip install pyopencl pocl-binary-distribution`). Where nvcc is found, the
# `cuda` column builds every kernel for sm_80 and sm_90a and runs it on the CPU (cuda_build.py): a compile-only
# check for machines without a GPU.
TARGETS = ["interp", "c", "opencl", "cuda"]


@pytest.fixture(params=TARGETS)
def target(request, monkeypatch):
    from tegula import runtime
    if request.param == "opencl":
        ok, why = runtime.get("opencl").available()
        if not ok:
            pytest.skip(f"opencl: {why}")
    if request.param == "cuda":
        ok, why = runtime.get("cuda").can_compile()
        if not ok:
            pytest.skip(f"cuda: {why}")
        import cuda_build

        import tegula.jit
        monkeypatch.setattr(tegula.jit, "compile_func", cuda_build.compile_for_cuda_then_run_on_cpu(
            tegula.jit.compile_func))
    return request.param


@pytest.fixture(scope="module", autouse=True)
def _cuda_builds():
    """nvcc builds the cuda column's kernels of each module together, when the module is done."""
    yield
    import cuda_build
    cuda_build.build_pending()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
