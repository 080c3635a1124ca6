"""Every environment knob of tegula, in one typed place. Read lazily, at each use."""
from __future__ import annotations

import os
from dataclasses import dataclass


def _int(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    try:
        return int(raw) if raw.strip() else default
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tegula")


@dataclass(frozen=True)
class Config:
    cache_dir: str      # TEGULA_CACHE_DIR: compiled kernels (default ~/.cache/tegula)
    target: str | None  # TEGULA_TARGET: default target for compile/jit (default: best available)
    dump_dir: str | None  # TEGULA_DUMP: write every stage (name.ir, name.c, name.py) here
    debug: int          # TEGULA_DEBUG: >=1 keeps generated sources, >=2 runs the verifier between passes
    cc: str             # TEGULA_CC: the C compiler for the c target (default cc)
    cflags: str         # TEGULA_CFLAGS: extra flags appended to the C compiler's command line
    num_threads: int    # TEGULA_NUM_THREADS: threads of the c target's grid loop (0 = all cores)
    disk_cache: bool    # TEGULA_DISK_CACHE=0 disables the on-disk kernel cache
    cuda_arch: str | None  # TEGULA_CUDA_ARCH: the cuda target's GPU arch, e.g. sm_90a or sm_80,sm_90a (default:
                           # the device's, else sm_90a)
    opencl_device: str | None  # TEGULA_OPENCL_DEVICE: the opencl target's device, an index into `tegula info`'s
                               # list or part of its name (default: the first GPU, else the first device)
    opencl_flags: str   # TEGULA_OPENCL_FLAGS: extra OpenCL build options (-cl-opt-disable builds PoCL kernels ~20x
                        # faster, runs them slower: the test suite's choice)
    trampoline: bool = True  # TEGULA_TRAMPOLINE=0: c kernels launch through ctypes, not the trampoline (read once
                             # per process, when the first c kernel loads)


def get() -> Config:
    env = os.environ
    return Config(
        cache_dir=env.get("TEGULA_CACHE_DIR") or _default_cache_dir(),
        target=env.get("TEGULA_TARGET") or None,
        dump_dir=env.get("TEGULA_DUMP") or None,
        debug=_int("TEGULA_DEBUG", 0),
        cc=env.get("TEGULA_CC") or "cc",
        cflags=env.get("TEGULA_CFLAGS", ""),
        num_threads=_int("TEGULA_NUM_THREADS", 0),
        disk_cache=env.get("TEGULA_DISK_CACHE", "1") != "0",
        cuda_arch=env.get("TEGULA_CUDA_ARCH") or None,
        opencl_device=env.get("TEGULA_OPENCL_DEVICE") or None,
        opencl_flags=env.get("TEGULA_OPENCL_FLAGS", ""),
        trampoline=env.get("TEGULA_TRAMPOLINE", "1") != "0",
    )
