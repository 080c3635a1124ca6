"""The targets: for each, its pass family, its emitter and its runtime. One registry line per backend."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    name: str
    family: str             # pass pipeline (passes/pipeline.py) and tile-op lowerings (tileops/)
    runtime: str            # runtime module (runtime/__init__.py registry)
    emitter: str            # "module:function" turning the lowered PrimFunc into source text
    source_ext: str         # file extension of the source (for TEGULA_DUMP)
    args: str               # how tensors are passed: "numpy" arrays or raw "pointer"s
    max_block_bytes: int | None = None
    binary: str | None = None   # extension of the built kernel the disk cache keeps (None: nothing built)
    device: str = "cpu"         # where tensors must live (torch device type)
    warp_size: int | None = None    # SIMT: lanes that exchange registers (warp shuffles); None: none
    max_threads: int | None = None  # SIMT: threads per block
    mma: tuple = ()                 # SIMT: operand dtypes of T.gemm that run on warp MMA instructions


TARGETS = {
    "c": Target("c", "cpu", "c", "tegula.codegen.c:emit_c", "c", "pointer", max_block_bytes=64 << 20, binary="so"),
    "interp": Target("interp", "interp", "interp", "tegula.codegen.python:emit_python", "py", "numpy",
                     max_block_bytes=64 << 20),
    "opencl": Target("opencl", "simt", "opencl", "tegula.codegen.opencl:emit_opencl", "cl", "numpy",
                     max_block_bytes=1 << 20, binary="clbin", max_threads=1024),
    "cuda": Target("cuda", "simt", "cuda", "tegula.codegen.cuda:emit_cuda", "cu", "pointer", max_block_bytes=227 << 10,
                   binary="cubin", device="cuda", warp_size=32, max_threads=1024, mma=("float16", "bfloat16")),
}


def resolve(name: str | None) -> Target:
    """The target named ``name``, else TEGULA_TARGET, else the best usable one on this machine."""
    from tegula import config
    name = name or config.get().target or default_target()
    if hasattr(name, "kind"):  # a TileLang/TVM target object
        name = str(name.kind.name)
    name = {"cpu": "c", "llvm": "c", "auto": default_target()}.get(str(name), str(name))
    if name not in TARGETS:
        raise ValueError(f"unknown target {name!r}; expected one of {sorted(TARGETS)}")
    return TARGETS[name]


def default_target() -> str:
    from tegula import runtime
    ok, _ = runtime.get("c").available()
    return "c" if ok else "interp"
