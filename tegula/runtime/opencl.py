"""The ``opencl`` runtime: OpenCL C source -> program binary (pyopencl) -> launches over host arrays.

The device is TEGULA_OPENCL_DEVICE (an index into ``devices()`` or part of a name), else the first GPU, else
the first device (PoCL's CPU device where ``pocl-binary-distribution`` is installed). PoCL compiles each kernel
a second time for its work-group size at the first launch and caches that under POCL_CACHE_DIR, which this
module points into tegula's cache directory unless it is set already.

Tensors are host (numpy) arrays: each is wrapped as a buffer over its own memory (CL_MEM_USE_HOST_PTR, no copy
on a CPU device), and the ones the kernel writes are mapped after it runs, which on a discrete device copies
them back.
"""
from __future__ import annotations

import functools
import os
import warnings

from tegula import config
from tegula.errors import CompileError
from tegula.runtime import launch
from tegula.runtime.prelude import PRELUDE_DIR, prelude_hash

BUILD_OPTIONS = ["-I", PRELUDE_DIR, "-cl-fp32-correctly-rounded-divide-sqrt"]


def _cl():
    os.environ.setdefault("POCL_CACHE_DIR", os.path.join(config.get().cache_dir, "pocl"))
    import pyopencl as cl
    return cl


def _all_devices() -> list:
    cl = _cl()
    return [(p, d) for p in cl.get_platforms() for d in p.get_devices()]


def _describe(platform, dev) -> str:
    cl = _cl()
    kind = "GPU" if dev.type & cl.device_type.GPU else "CPU" if dev.type & cl.device_type.CPU else "accelerator"
    version = " ".join(dev.version.split()[:2])  # "OpenCL 3.0", without the vendor's build string
    return f"{dev.name.strip()} ({kind}, {dev.max_compute_units} compute units, {version}, {platform.name.strip()})"


@functools.lru_cache(maxsize=None)
def _state(choice: str | None):
    """(cl, context, device, queue) for the chosen device."""
    cl = _cl()
    devs = _all_devices()
    if not devs:
        raise RuntimeError("no OpenCL device found (pip install pocl-binary-distribution gives a CPU device)")
    if choice is None:
        gpus = [pd for pd in devs if pd[1].type & cl.device_type.GPU]
        plat, dev = (gpus or devs)[0]
    elif choice.isdigit() and int(choice) < len(devs):
        plat, dev = devs[int(choice)]
    else:
        named = [pd for pd in devs if choice.lower() in pd[1].name.lower()]
        if not named:
            raise RuntimeError(f"TEGULA_OPENCL_DEVICE={choice!r} matches no device of {[d.name for _, d in devs]}")
        plat, dev = named[0]
    ctx = cl.Context([dev])
    return cl, ctx, dev, cl.CommandQueue(ctx)


def state():
    return _state(config.get().opencl_device)


def available() -> tuple[bool, str]:
    try:
        _, _, dev, _ = state()
    except ImportError:
        return False, "pyopencl is not installed (pip install pyopencl pocl-binary-distribution)"
    except Exception as e:  # no platform, no device, a broken ICD
        return False, f"{type(e).__name__}: {e}"
    return True, f"{dev.name.strip()} via {dev.platform.name.strip()} {dev.driver_version.strip()}"


def devices() -> list[str]:
    try:
        return [f"[{k}] {_describe(p, d)}" for k, (p, d) in enumerate(_all_devices())]
    except Exception:  # noqa: BLE001 - nothing to list
        return []


def options() -> list[str]:
    return BUILD_OPTIONS + config.get().opencl_flags.split()


def identity() -> str:
    """The device and driver a kernel is built for, the build options and the prelude (part of the cache key)."""
    _, _, dev, _ = state()
    return "|".join([dev.name, dev.platform.version, dev.driver_version, " ".join(options()), prelude_hash()])


_BUILT: dict = {}  # source -> program built in this process


def _compile(source: str, name: str):
    prg = _BUILT.get(source)
    if prg is None:
        cl, ctx, _, _ = state()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # pyopencl repeats the compiler's warnings
                prg = cl.Program(ctx, source).build(options=options())
        except cl.Error as e:
            raise CompileError(f"the OpenCL compiler failed on kernel {name!r} (a tegula bug or an unsupported "
                               "construct; the source is tegula.lower(...).kernel_source)", detail=str(e)) from None
        _BUILT[source] = prg
    return prg


def build(source: str, out_path: str, name: str = "kernel") -> None:
    """Compile ``source`` for the device and keep it, with its launch description, in ``out_path``.

    The file holds the source, not the device binary: asking PoCL for a binary makes it compile the kernel for
    every work-group size (tens of seconds for a flash attention kernel), while building from the source again
    hits PoCL's own cache (POCL_CACHE_DIR) and the GPU drivers' caches."""
    meta = launch.parse(source)
    _compile(source, name)
    launch.write(out_path, meta, source.encode())


def load(path: str, name: str, signature: list[str]) -> "OpenCLProgram":
    meta, source = launch.read(path)
    cl, ctx, dev, queue = state()
    try:
        prg = _compile(source.decode(), name)
    except CompileError as e:
        raise OSError(f"cached OpenCL kernel {path} does not build: {e}") from None
    return OpenCLProgram(cl, ctx, queue, prg, meta)


class OpenCLProgram:
    """A loaded function (its kernels, launched in order); called with host arrays for tensors and Python numbers
    for scalars, then symbolic dims."""

    def __init__(self, cl, ctx, queue, program, meta: dict):
        import numpy as np
        self.cl, self.ctx, self.queue, self.meta = cl, ctx, queue, meta
        self.kernels = [(cl.Kernel(program, k["name"]), k) for k in meta["kernels"]]
        self.writes = set(meta["writes"])
        self.scalars = {}
        for k, kind in enumerate(meta["params"]):
            if not kind.startswith("p:"):
                self.scalars[k] = _scalar_type(np, kind)
        limit = queue.device.max_work_group_size
        for _, k in self.kernels:
            if k["threads"] > limit:
                raise CompileError(f"kernel {k['name']} uses {k['threads']} threads per block; the OpenCL device "
                                   f"{queue.device.name.strip()} runs at most {limit}")

    def __call__(self, *args):
        cl, mf = self.cl, self.cl.mem_flags
        values, results = [], []  # the buffers must outlive the launches
        for k, a in enumerate(args):
            if k in self.scalars:
                values.append(self.scalars[k](a))
                continue
            raw = _bytes(a)
            flags = (mf.READ_WRITE if k in self.writes else mf.READ_ONLY) | mf.USE_HOST_PTR
            buf = cl.Buffer(self.ctx, flags, hostbuf=raw)
            values.append(buf)
            if k in self.writes and a.size:
                results.append((buf, raw))
        for nbytes in launch.workspace_bytes(self.meta, args):
            values.append(cl.Buffer(self.ctx, mf.READ_WRITE, max(nbytes, 1)))
        for kernel, k in self.kernels:
            g = launch.grid(k, args)
            if min(g) > 0:
                kernel.set_args(*values)
                cl.enqueue_nd_range_kernel(self.queue, kernel, (g[0] * k["threads"], g[1], g[2]), (k["threads"], 1, 1))
        for buf, raw in results:  # make the results visible in host memory
            m, _ = cl.enqueue_map_buffer(self.queue, buf, cl.map_flags.READ, 0, raw.shape, raw.dtype)
            m.base.release(self.queue)
        self.queue.finish()


def _scalar_type(np, kind: str):
    if kind == "bool":
        return lambda v: np.uint8(bool(v))
    if kind in ("float16", "bfloat16") or kind.startswith("float8"):
        from tegula.runtime.interp import np_dtype
        dt = np_dtype(kind)
        bits = np.dtype(f"u{dt.itemsize}")
        return lambda v: np.array(v, dt).view(bits)[()]
    t = np.dtype(kind).type
    return lambda v: t(v)


def _bytes(a):
    """The host memory of array ``a`` as bytes: the array itself, or for a strided view the span from its first
    element to its last (the kernel indexes it with the strides). OpenCL has no empty buffers: a 0-element
    tensor (which a kernel never touches) gets a one-byte one."""
    import numpy as np
    if a.size == 0:
        return np.zeros(1, np.uint8)
    if a.flags.c_contiguous:
        return a.reshape(-1).view(np.uint8)
    span = 1 + sum((n - 1) * (s // a.itemsize) for n, s in zip(a.shape, a.strides))
    return np.lib.stride_tricks.as_strided(a, shape=(span,), strides=(a.itemsize,)).view(np.uint8)
