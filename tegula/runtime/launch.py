"""What the SIMT runtimes (opencl, cuda) share: the launch description at the top of a kernel's source, and the
file a built kernel is cached as (the description, then the device binary).

The description (written by codegen/simt.py) is one JSON line: the kernels to launch in order, each with its
name, grid (Python expressions over the launch arguments ``v``), threads per block and shared memory in bytes;
each argument's kind; the tensors the kernels write; and the workspaces (T.alloc_global) a call allocates.
"""
from __future__ import annotations

import json

TAG = "// tegula-launch "
MAGIC = b"tegula-kernel 1\n"


def parse(source: str) -> dict:
    first = source.split("\n", 1)[0]
    if not first.startswith(TAG):
        raise ValueError("not a SIMT kernel source: its first line must be the tegula-launch description")
    return json.loads(first[len(TAG):])


def _tdiv(a: int, b: int) -> int:
    if b == 0:
        return 0
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


def evaluate(expr: str, args) -> int:
    """A host expression of the description (written by codegen/simt.py) for the launch arguments ``args``."""
    env = {"v": args, "min": min, "max": max, "int": int, "_tdiv": _tdiv, "__builtins__": {}}
    return int(eval(expr, env))  # noqa: S307


def grid(kernel: dict, args) -> tuple:
    """The grid (3 ints) of one of the description's kernels for the launch arguments ``args`` (tensors and
    scalars, then symbolic dims)."""
    return tuple(evaluate(g, args) for g in kernel["grid"])


def workspace_bytes(meta: dict, args) -> list[int]:
    """Bytes of each T.alloc_global workspace for the launch arguments ``args``."""
    sizes = {"bool": 1, "int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2, "int32": 4,
             "uint32": 4, "float32": 4, "int64": 8, "uint64": 8, "float64": 8}
    return [evaluate(w["numel"], args) * sizes.get(w["dtype"], 1) for w in meta.get("workspaces", [])]


def write(path: str, meta: dict, binary: bytes) -> None:
    with open(path, "wb") as f:
        f.write(MAGIC + json.dumps(meta).encode() + b"\n" + binary)


def read(path: str) -> tuple[dict, bytes]:
    """(description, binary) of a file written by ``write``; OSError when it is not one (a corrupt entry)."""
    with open(path, "rb") as f:
        data = f.read()
    if not data.startswith(MAGIC):
        raise OSError(f"{path} is not a tegula kernel file")
    head, _, binary = data[len(MAGIC):].partition(b"\n")
    try:
        return json.loads(head), binary
    except ValueError as e:
        raise OSError(f"{path}: corrupt kernel description ({e})") from None
