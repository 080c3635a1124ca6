"""The ``cuda`` runtime: CUDA C++ source -> cubin (nvcc; no GPU needed) -> launches through the CUDA driver API
(cuda-bindings) on torch's current stream, with torch CUDA tensors.

The GPU architecture is TEGULA_CUDA_ARCH (``sm_90a``; a comma-separated list such as ``sm_80,sm_90a`` builds
one fat binary for all of them), else that of the current device, else sm_90a. Building needs only nvcc
(NVCC, else ``nvcc`` on PATH, else /usr/local/cuda/bin/nvcc): ``tegula.compile(func, target="cuda")`` works on a
machine without a GPU, and only calling the kernel needs one (it raises RuntimeError before launching
otherwise). nvcc runs with ``--fmad=false``, so that a*b+c rounds twice as on the other targets; the GEMM
asks for its fused multiply-adds explicitly.
"""
from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess

from tegula import config
from tegula.errors import CompileError
from tegula.runtime import launch
from tegula.runtime.prelude import PRELUDE_DIR, prelude_hash

BASE_FLAGS = ["-O3", "-std=c++17", "--fmad=false", "-w"]
DEFAULT_ARCH = "sm_90a"
_CTYPES = {"bool": ctypes.c_bool, "int8": ctypes.c_int8, "int16": ctypes.c_int16, "int32": ctypes.c_int32,
           "int64": ctypes.c_int64, "uint8": ctypes.c_uint8, "uint16": ctypes.c_uint16, "uint32": ctypes.c_uint32,
           "uint64": ctypes.c_uint64, "float32": ctypes.c_float, "float64": ctypes.c_double}


def nvcc() -> str | None:
    env = os.environ.get("NVCC")
    for cand in ([env] if env else []) + ["nvcc", "/usr/local/cuda/bin/nvcc"]:
        found = shutil.which(cand)
        if found:
            return found
    return None


@functools.lru_cache(maxsize=None)
def _nvcc_version(path: str) -> str:
    out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60).stdout
    lines = [ln for ln in out.splitlines() if "release" in ln]
    return lines[-1].strip() if lines else out.strip().splitlines()[-1]


# the driver ----------------------------------------------------------------------------------

def _driver():
    from cuda.bindings import driver as cu
    return cu


def _check(result, what: str):
    err, *rest = result if isinstance(result, tuple) else (result,)
    cu = _driver()
    if err != cu.CUresult.CUDA_SUCCESS:
        _, msg = cu.cuGetErrorString(err)
        raise RuntimeError(f"CUDA {what} failed: {msg.decode() if isinstance(msg, bytes) else msg} ({err})")
    return rest[0] if len(rest) == 1 else rest


@functools.lru_cache(maxsize=None)
def _device_info() -> tuple[list[str], str | None]:
    """(descriptions of the CUDA devices, why there are none)."""
    try:
        cu = _driver()
        _check(cu.cuInit(0), "cuInit")
        n = _check(cu.cuDeviceGetCount(), "cuDeviceGetCount")
    except ImportError:
        return [], "cuda-bindings is not installed (pip install cuda-bindings)"
    except Exception as e:  # noqa: BLE001 - no driver, no device
        return [], f"no CUDA driver or device ({type(e).__name__})"
    out = []
    for k in range(n):
        dev = _check(cu.cuDeviceGet(k), "cuDeviceGet")
        name = _check(cu.cuDeviceGetName(256, dev), "cuDeviceGetName")
        name = name.split(b"\0")[0].decode() if isinstance(name, bytes) else str(name)
        major, minor = _capability(dev)
        out.append(f"[{k}] {name} (sm_{major}{minor})")
    return out, None if out else "no CUDA device"


def _capability(dev) -> tuple[int, int]:
    cu = _driver()
    attr = cu.CUdevice_attribute
    major = _check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), "attribute")
    minor = _check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev), "attribute")
    return major, minor


def devices() -> list[str]:
    return _device_info()[0]


def arch() -> str:
    """The architecture(s) kernels are built for."""
    chosen = config.get().cuda_arch
    if chosen:
        return chosen
    devs, _ = _device_info()
    if devs:
        cu = _driver()
        major, minor = _capability(_check(cu.cuDeviceGet(0), "cuDeviceGet"))
        return f"sm_{major}{minor}" + ("a" if major >= 9 else "")
    return DEFAULT_ARCH


def flags(archs: str | None = None) -> list[str]:
    """nvcc's flags for ``archs`` (comma-separated; default ``arch()``): a cubin for one, a fat binary for more."""
    archs = [a.strip() for a in (archs or arch()).split(",") if a.strip()]
    out = BASE_FLAGS + ["-I", PRELUDE_DIR]
    if len(archs) == 1:
        return out + ["-cubin", f"-arch={archs[0]}"]
    return out + ["-fatbin"] + [f"-gencode=arch=compute_{a[3:]},code={a}" for a in archs]


def available() -> tuple[bool, str]:
    path = nvcc()
    devs, why = _device_info()
    if path is None:
        return False, "nvcc not found (install the CUDA toolkit, or set NVCC)"
    if not devs:
        return False, f"compile only: {_nvcc_version(path)} builds for {arch()}, but {why}"
    return True, f"{_nvcc_version(path)}, building for {arch()}"


def can_compile() -> tuple[bool, str]:
    path = nvcc()
    return (True, _nvcc_version(path)) if path else (False, "nvcc not found")


def identity() -> str:
    path = nvcc()
    if path is None:
        raise CompileError("the cuda target needs nvcc (install the CUDA toolkit, or set NVCC)")
    return "|".join([path, _nvcc_version(path), " ".join(flags()), prelude_hash()])


def build(source: str, out_path: str, name: str = "kernel") -> None:
    """Compile ``source`` with nvcc; the binary, with its launch description, goes to ``out_path``."""
    meta = launch.parse(source)
    path = nvcc()
    if path is None:
        raise CompileError("the cuda target needs nvcc (install the CUDA toolkit, or set NVCC)")
    src = f"{out_path}.{os.getpid()}.cu"
    obj = f"{out_path}.{os.getpid()}.bin"
    with open(src, "w") as f:
        f.write(source)
    cmd = [path, *flags(), src, "-o", obj]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise CompileError(f"nvcc failed on kernel {name!r} (a tegula bug or an unsupported construct; the "
                               "source is tegula.lower(..., target='cuda').kernel_source)",
                               detail=f"$ {' '.join(cmd)}\n{r.stderr}")
        with open(obj, "rb") as f:
            binary = f.read()
    finally:
        for p in (src, obj):
            if os.path.exists(p):
                os.unlink(p)
    launch.write(out_path, meta, binary)


def load(path: str, name: str, signature: list[str]) -> "CudaProgram":
    meta, binary = launch.read(path)
    return CudaProgram(meta, binary)


class CudaProgram:
    """A built function: ``launch(*args)`` with device pointers (ints) for tensors, Python numbers for scalars,
    then the symbolic dims; its kernels run in order on torch's current stream. The module is loaded into the
    current context at the first launch."""

    def __init__(self, meta: dict, binary: bytes):
        self.meta, self.binary = meta, binary
        self.functions = None
        self.types = [ctypes.c_uint64 if k.startswith("p:") else _CTYPES.get(k) for k in meta["params"]]
        self.name = meta["kernels"][0]["name"]
        if any(t is None for t in self.types):
            bad = [k for k, t in zip(meta["params"], self.types) if t is None]
            raise CompileError(f"kernel {self.name}: scalar parameters of type {bad} are not supported on cuda")

    def ready(self) -> None:
        """Raise RuntimeError unless a CUDA device can run this kernel (before any argument is touched)."""
        devs, why = _device_info()
        if not devs:
            raise RuntimeError(f"kernel {self.name} was built for cuda ({arch()}), but it cannot run here: {why}. "
                               "Use target='opencl' or 'c' on this machine.")

    def _load(self):
        import torch
        cu = _driver()
        torch.cuda.init()
        dev = _check(cu.cuDeviceGet(torch.cuda.current_device()), "cuDeviceGet")
        ctx = _check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        _check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        self.module = _check(cu.cuModuleLoadData(self.binary), "cuModuleLoadData")
        functions = []
        for k in self.meta["kernels"]:
            fn = _check(cu.cuModuleGetFunction(self.module, k["name"].encode()), "cuModuleGetFunction")
            if k["smem"] > 48 * 1024:
                attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                _check(cu.cuFuncSetAttribute(fn, attr, k["smem"]), "cuFuncSetAttribute")
            functions.append((fn, k))
        self.functions = functions

    def launch(self, *args) -> None:
        self.ready()
        if self.functions is None:
            self._load()
        import torch
        cu = _driver()
        values = [t(int(a) if t is ctypes.c_uint64 else a) for t, a in zip(self.types, args)]
        spaces = [torch.empty(max(n, 1), dtype=torch.uint8, device="cuda")
                  for n in launch.workspace_bytes(self.meta, args)]
        values += [ctypes.c_uint64(w.data_ptr()) for w in spaces]
        ptrs = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        stream = cu.CUstream(torch.cuda.current_stream().cuda_stream)
        for fn, k in self.functions:
            g = launch.grid(k, args)
            if min(g) > 0:
                _check(cu.cuLaunchKernel(fn, g[0], g[1], g[2], k["threads"], 1, 1, k["smem"], stream,
                                         ctypes.addressof(ptrs), 0), "cuLaunchKernel")
        if spaces:  # the workspaces go back to torch's allocator once the stream is past these kernels
            for w in spaces:
                w.record_stream(torch.cuda.current_stream())
