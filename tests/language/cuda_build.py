"""The `cuda` column of the language tests.

With a CUDA device (bench/gpu_check.py runs it there), the kernels are built for it and run on it: the tests'
CPU tensors go to the GPU for the call and the results come back, so every check holds as written.

Without one, every kernel a test compiles is lowered to CUDA C++ and built with nvcc for sm_80 and sm_90a, and
the test goes on with the same kernel on `c` (or `interp`), so its checks still run.

nvcc takes about a second to start, more than most of these kernels take to compile, so the sources of one test
module are built together, as one translation unit, when the module's tests are done; a kernel nvcc rejects
fails the module there, with nvcc's log. Device code is built without optimisation (the checks are the same; the
unrolled GEMM tiles build 3-4x faster). A batch that built once is remembered in the tegula cache directory.
"""
import hashlib
import os
import re
import subprocess
import tempfile

import tegula
import tegula.jit
from tegula import config
from tegula.runtime import cuda as cuda_rt

ARCHS = "sm_80,sm_90a"
_pending: list[tuple[str, str]] = []  # (where, CUDA source) waiting for the module's build


def compile_for_cuda_then_run_on_cpu(real_compile):
    """A stand-in for tegula.jit.compile_func: cuda requests are lowered (and queued for nvcc); the kernel
    returned runs on the CPU."""
    fallback = "c" if tegula.runtime.get("c").available()[0] else "interp"
    on_gpu = bool(cuda_rt.devices())

    def compile_func(func, out_idx=None, target=None, options=None):
        if target != "cuda":
            return real_compile(func, out_idx, target, options)
        if on_gpu:
            return OnGpu(real_compile(func, out_idx, target, options))
        source = tegula.lower(func, target="cuda").kernel_source
        _pending.append((f"{func.name} ({func.loc[0]}:{func.loc[1]})" if func.loc else func.name, source))
        return real_compile(func, out_idx, fallback, options)

    return compile_func


def build_pending() -> None:
    """Build the queued sources with nvcc (one run for all of them); raise AssertionError with nvcc's log."""
    batch, _pending[:] = list(_pending), []
    if not batch:
        return
    unit, seen = [], set()
    for k, (where, src) in enumerate(batch):
        if src in seen:
            continue
        seen.add(src)
        for kernel in re.findall(r'"name":"(\w+)"', src.split("\n", 1)[0]):  # unique names in the unit
            src = src.replace(f" {kernel}(", f" {kernel}_b{k}(", 1)
        unit.append(f"// ---- {where}\n" + src)
    text = "\n".join(unit)
    path = cuda_rt.nvcc()
    # device code unoptimised: a third of the time of -O3 for the unrolled GEMM tiles, and the same checks
    flags = cuda_rt.flags(ARCHS) + ["-Xcicc", "-O0", "-Xptxas", "-O0", "--threads", "2"]
    key = hashlib.sha256("\0".join([path, " ".join(flags), cuda_rt.prelude_hash(), text]).encode()).hexdigest()
    marker = os.path.join(config.get().cache_dir, "cuda-batches", key)
    if os.path.exists(marker):
        return
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "batch.cu")
        with open(src, "w") as f:
            f.write(text)
        r = subprocess.run([path, *flags, src, "-o", os.path.join(d, "batch.bin")], capture_output=True, text=True,
                           timeout=1800)
    if r.returncode != 0:
        raise AssertionError(f"nvcc ({ARCHS}) rejected kernels of this module:\n{r.stderr[-8000:]}")
    os.makedirs(os.path.dirname(marker), exist_ok=True)
    open(marker, "w").close()


def _on_device(a):
    """``a`` on the GPU with its strides: ``.cuda()`` would make a view that is not dense contiguous, and the
    tests of stride checks would see other strides than the ones they pass."""
    import torch
    if a.is_contiguous():
        return a.cuda()
    d = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="cuda")
    d.copy_(a)
    return d


class OnGpu:
    """A cuda kernel called with the tests' CPU tensors (or numpy arrays): they are copied to the GPU for the call,
    and back, in place, after it; returned tensors come back to the CPU."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getattr__(self, name):
        return getattr(self.kernel, name)

    def __call__(self, *args):
        import numpy as np
        import torch
        host = [torch.from_numpy(a) if isinstance(a, np.ndarray) else a for a in args]
        dev = [_on_device(a) if isinstance(a, torch.Tensor) else a for a in host]
        out = self.kernel(*dev)
        for h, d in zip(host, dev):
            if isinstance(h, torch.Tensor):
                h.copy_(d)
        if isinstance(out, (list, tuple)):
            return [o.cpu() for o in out]
        return out.cpu() if isinstance(out, torch.Tensor) else out
