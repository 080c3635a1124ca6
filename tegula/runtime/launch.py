"""What the SIMT runtimes (opencl, cuda) share: the launch description at the top of a kernel's source, and the
file a built kernel is cached as (the description, then the device binary).

The description (written by codegen/simt.py) is one JSON line: the kernel's name, its grid as Python
expressions over the launch arguments ``v``, threads per block, each argument's kind, the tensors it writes and
its shared memory in bytes.
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


def grid(meta: dict, args) -> tuple:
    """The grid (3 ints) for the launch arguments ``args`` (tensors and scalars, then symbolic dims)."""
    env = {"v": args, "min": min, "max": max, "int": int, "_tdiv": _tdiv, "__builtins__": {}}
    return tuple(int(eval(g, env)) for g in meta["grid"])  # noqa: S307 (expressions written by codegen/simt.py)


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
