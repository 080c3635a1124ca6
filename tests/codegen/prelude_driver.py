"""Building a small C driver over the prelude headers once per ISA path the host can run: each path below the
native one is forced by undefining the target macros above it (-U__AVX512F__ ...), so the portable fallbacks are
tested on this machine too."""
import ctypes
import functools
import os
import subprocess

PRELUDE = os.path.join(os.path.dirname(__file__), "..", "..", "tegula", "codegen", "prelude")
CC = os.environ.get("TEGULA_CC", "cc")


@functools.lru_cache(maxsize=None)
def native_macros() -> frozenset:
    """The predefined macros of ``cc -march=native`` (names only)."""
    out = subprocess.run([CC, "-march=native", "-dM", "-E", "-"], input="", capture_output=True, text=True).stdout
    return frozenset(line.split()[1] for line in out.splitlines() if line.startswith("#define "))


def paths_below(order) -> list:
    """[(name, macros to undefine)]: the native path, then for each macro of ``order`` (fastest first) that the
    host defines, the path with it and every macro before it undefined."""
    have = native_macros()
    return [("native", [])] + [(f"below {m}", list(order[:i + 1])) for i, m in enumerate(order) if m in have]


def build(tmp_path, source: str, undef) -> ctypes.CDLL:
    """``source`` compiled with -march=native minus ``undef`` (-O2, -Wall -Werror) and loaded."""
    src, so = tmp_path / "drv.c", tmp_path / "drv.so"
    src.write_text(source)
    subprocess.run([CC, "-O2", "-march=native", "-std=gnu11", "-fPIC", "-shared", "-Wall", "-Werror",
                    *[f"-U{m}" for m in undef], "-I", PRELUDE, str(src), "-o", str(so)], check=True)
    return ctypes.CDLL(str(so))
