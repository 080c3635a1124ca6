"""The ``c`` runtime: C source -> shared library (the machine's C compiler, OpenMP) -> a ctypes launcher."""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading

from tegula import config
from tegula.errors import CompileError
from tegula.runtime.prelude import PRELUDE_DIR, prelude_hash

# -fno-trapping-math: floating-point exceptions are not part of a kernel's meaning, and under gcc's default a float
# op that only one side of a select needs is not if-converted, which leaves the whole loop scalar (no value changes:
# rounding and contraction stay IEEE's)
BASE_FLAGS = ["-O3", "-march=native", "-std=gnu11", "-fPIC", "-shared", "-fwrapv", "-ffp-contract=off",
              "-fno-math-errno", "-fno-trapping-math", "-fvisibility=hidden"]
_CTYPES = {"p": ctypes.c_void_p, "bool": ctypes.c_bool, "int8": ctypes.c_int8, "int16": ctypes.c_int16,
           "int32": ctypes.c_int32, "int64": ctypes.c_int64, "uint8": ctypes.c_uint8, "uint16": ctypes.c_uint16,
           "uint32": ctypes.c_uint32, "uint64": ctypes.c_uint64, "float32": ctypes.c_float,
           "float64": ctypes.c_double}


def compiler() -> str:
    return config.get().cc


@functools.lru_cache(maxsize=None)
def _compiler_info(cc: str) -> tuple[str, bool]:
    """(identity line, whether it links OpenMP)."""
    path = shutil.which(cc)
    if path is None:
        raise CompileError(f"C compiler {cc!r} not found; install gcc or clang, or set TEGULA_CC")
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise CompileError(f"C compiler {cc!r} does not run: {e}") from None
    ident = (out.splitlines() or [cc])[0]
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "t.c")
        with open(src, "w") as f:
            f.write("#include <omp.h>\nint f(void){return omp_get_max_threads();}\n")
        r = subprocess.run([cc, "-fopenmp", "-shared", "-fPIC", src, "-o", os.path.join(d, "t.so")],
                           capture_output=True, timeout=60)
    return ident, r.returncode == 0


@functools.lru_cache(maxsize=None)
def _cpuinfo() -> tuple[dict, str]:
    """The first processor's lines of /proc/cpuinfo up to its feature flags: ({key: value}, the model name and flags
    lines as they read) (empty where it cannot be read). What host_isa, host_vendor and vector_flags read."""
    info, lines = {}, ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
                if line.startswith(("flags", "Features", "model name")):
                    lines += line
                if line.startswith(("flags", "Features")):
                    break
    except OSError:
        pass
    return info, lines


@functools.lru_cache(maxsize=None)
def host_isa() -> str:
    """What -march=native will target: the machine and its CPU feature flags."""
    return platform.machine() + ":" + hashlib.sha256(_cpuinfo()[1].encode()).hexdigest()[:16]


def host_vendor() -> str:
    """The CPU's vendor string ("GenuineIntel", "AuthenticAMD", ...; "" where /proc/cpuinfo does not say): for
    ops whose best form differs between vendors' memory systems (tegula.ops.rope's streaming write-back)."""
    return _cpuinfo()[0].get("vendor_id", "")


def available() -> tuple[bool, str]:
    cc = compiler()
    try:
        ident, omp = _compiler_info(cc)
    except CompileError as e:
        return False, str(e)
    return True, f"{ident}{'' if omp else ' (no OpenMP: grids run on one core)'}"


@functools.lru_cache(maxsize=None)
def _host_flags() -> frozenset:
    """The CPU feature flags /proc/cpuinfo lists (empty where it cannot be read)."""
    info = _cpuinfo()[0]
    return frozenset(info.get("flags", info.get("Features", "")).split())


# where the compiler takes them (gcc >= 12 on x86): block copies (a loop that only moves 64 bytes, which gcc turns
# into a copy by pieces) in 512-bit moves as well. In 256-bit pieces, a 64-byte group of lanes written as two
# halves and read back as one zmm (the compress idiom's values, tegula_compress.h) failed store forwarding: ~20%
# of top-k's selects and merge waited on it (b1 1M k2048 merge 8.6 -> 5.2 us on an Intel Xeon)
_MOVE_FLAGS = ("-mmove-max=512", "-mstore-max=512")


@functools.lru_cache(maxsize=None)
def _accepts(cc: str, opts: tuple) -> bool:
    """Whether ``cc`` compiles a trivial file with the options ``opts`` (without a warning about them)."""
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "t.c")
        with open(src, "w") as f:
            f.write("int f(int x){return x + 1;}\n")
        try:
            r = subprocess.run([cc, *opts, "-Werror", "-c", src, "-o", os.path.join(d, "t.o")], capture_output=True,
                               timeout=60)
        except (OSError, subprocess.SubprocessError):
            return False
    return r.returncode == 0


def vector_flags() -> list[str]:
    """Loops vectorise at the widest width the host has: with -march=native on Intel AVX-512 parts gcc tunes for
    256-bit vectors (-mprefer-vector-width=256, a guard against old parts' 512-bit clock drop), which halved the
    width of every auto-vectorised loop; measured on a 2-core Xeon (gcc 12, -march=rocketlake): topk b1 8K k2048
    10.0 -> 5.5 us. Block copies go 512 bits at a time too (_MOVE_FLAGS) where the compiler has the options.
    TEGULA_CFLAGS comes after, so -mprefer-vector-width=256 there restores gcc's choice."""
    if "avx512f" not in _host_flags():
        return []
    return ["-mprefer-vector-width=512"] + (list(_MOVE_FLAGS) if _accepts(compiler(), _MOVE_FLAGS) else [])


def flags() -> list[str]:
    _, omp = _compiler_info(compiler())
    extra = config.get().cflags.split()
    return BASE_FLAGS + vector_flags() + (["-fopenmp"] if omp else []) + ["-I", PRELUDE_DIR] + extra


def identity() -> str:
    """Everything about the toolchain a binary depends on (part of the cache key)."""
    cc = compiler()
    ident, _ = _compiler_info(cc)
    return "|".join([cc, ident, " ".join(flags()), host_isa(), prelude_hash()])


# Half of a GEMM kernel's compile is parsing the prelude (immintrin.h above all), so the prelude headers a source
# starts with are precompiled once (gcc's .gch) and given to the compiler with -include; the source's own #includes
# then find their include guards set. The .gch lives in TEGULA_CACHE_DIR/pch under a key of everything it depends
# on (compiler, flags, host ISA, prelude text, the include lines); a .gch gcc cannot use is ignored by gcc itself
# (it reads the header's text instead), and one that cannot be built is not retried in this process.
PCH_MIN_INCLUDES = ("tegula_gemm.h",)  # precompile only sources that include these (the rest parse in ~20 ms)
_PCH_FAILED: set[str] = set()


def _leading_includes(source: str) -> str:
    """The #include lines a source starts with (after comments and blank lines)."""
    out = []
    for line in source.splitlines():
        t = line.strip()
        if not t or t.startswith("//"):
            continue
        if not t.startswith("#include"):
            break
        out.append(t)
    return "".join(x + "\n" for x in out)


def precompiled_header(source: str) -> str | None:
    """The path of a header holding ``source``'s leading prelude includes, with its .gch built beside it; None
    where none is used (not gcc, no GEMM headers, or the build failed)."""
    includes = _leading_includes(source)
    if not any(h in includes for h in PCH_MIN_INCLUDES):
        return None
    ident, _ = _compiler_info(compiler())
    if "clang" in ident.lower():  # clang keeps its own PCH format and flags (-include-pch)
        return None
    key = hashlib.sha256(f"{identity()}\0{includes}".encode()).hexdigest()[:32]
    if key in _PCH_FAILED:
        return None
    d = os.path.join(config.get().cache_dir, "pch", key)
    header = os.path.join(d, "tg_prelude.h")
    if os.path.exists(header + ".gch"):
        return header
    tag = f"{os.getpid()}.{threading.get_ident()}"
    try:
        os.makedirs(d, exist_ok=True)
        with open(f"{header}.{tag}.tmp", "w") as f:
            f.write(includes)
        os.replace(f"{header}.{tag}.tmp", header)
        tmp = f"{header}.gch.{tag}.tmp"
        cmd = [compiler(), *[x for x in flags() if x != "-shared"], "-x", "c-header", header, "-o", tmp]
        r = subprocess.run(cmd, capture_output=True, timeout=600)
        if r.returncode != 0:
            raise OSError(r.stderr.decode(errors="replace")[-2000:])
        os.replace(tmp, header + ".gch")
    except (OSError, subprocess.SubprocessError):
        _PCH_FAILED.add(key)
        try:
            os.unlink(f"{header}.gch.{tag}.tmp")
        except OSError:
            pass
        return None
    return header


def build(source: str, out_path: str, name: str = "kernel") -> None:
    """Compile ``source`` into the shared library ``out_path``."""
    d = os.path.dirname(out_path)
    src = os.path.join(d, f".{os.path.basename(out_path)}.{os.getpid()}.c")
    with open(src, "w") as f:
        f.write(source)
    pch = precompiled_header(source)
    cmd = [compiler(), *flags(), src, "-o", out_path, "-lm"]
    try:
        r = None
        if pch:
            r = subprocess.run(cmd[:1] + ["-include", pch] + cmd[1:], capture_output=True, text=True, timeout=600)
        if r is None or r.returncode != 0:  # without the precompiled header: its failure is never the kernel's
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    finally:
        os.unlink(src)
    if r.returncode != 0:
        raise CompileError(f"the C compiler failed on kernel {name!r} (this is a tegula bug or an unsupported "
                           "construct; the generated source is available from tegula.lower(...).kernel_source)",
                           detail=f"$ {' '.join(cmd)}\n{r.stderr}")


class CpuProgram:
    """A loaded kernel: ``launch(*args)`` with ints for pointers and Python scalars, per ``signature``.
    ``direct``: where the trampoline serves this signature (see ``trampoline``), ``(call, address)``:
    ``call(address, *args)`` launches with every argument a Python int (pointers as addresses); else None."""

    def __init__(self, path: str, name: str, signature: list[str]):
        self.lib = ctypes.CDLL(path)
        self.fn = getattr(self.lib, f"tg_{name}")
        self.fn.argtypes = [_CTYPES[s] for s in signature]
        self.fn.restype = None
        n = config.get().num_threads
        self.lib.tg_set_num_threads(ctypes.c_int(n if n > 0 else _default_threads()))
        self.launch = self.fn
        self.direct = direct_call(self.fn)


def _default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# The trampoline: a foreign call through ctypes costs ~0.6-1 us (argument conversion by argtypes or ctypes objects,
# libffi), most of a small kernel's fixed cost. Where every argument is a pointer or an integer of at most 64
# bits (int32, uint32, int64) and the ABI passes each in one 64-bit integer slot (x86-64 System V: registers, then
# 8-byte stack slots; a callee reads the low bits of its narrower ones), a tiny CPython extension calls the kernel
# instead: call(address, *ints), one METH_FASTCALL builtin that converts each int and calls through a pointer
# of the exact arity (releasing the GIL, as ctypes does). Built once per toolchain and Python into the cache
# directory; where it cannot be built (no Python headers, another ABI) kernels launch through ctypes as before.
TRAMPOLINE_MAX_ARGS = 24
# (narrower integers and bool are left to ctypes, which narrows an out-of-range Python int the way C does)
_TRAMPOLINE_TYPES = {ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_uint32}
_TRAMPOLINE: list = []   # [call or None] once tried in this process
_TRAMPOLINE_LOCK = threading.Lock()


def _trampoline_source() -> str:
    cases = []
    for n in range(TRAMPOLINE_MAX_ARGS + 1):
        params = ", ".join(["I"] * n) or "void"
        args = ", ".join(f"a[{i}]" for i in range(n))
        cases.append(f"    case {n}: ((void (*)({params}))f)({args}); break;\n")
    return ("#define PY_SSIZE_T_CLEAN\n#include <Python.h>\n#include <stdint.h>\n"
            "typedef int64_t I;\n"
            "static PyObject *tg_call(PyObject *self, PyObject *const *args, Py_ssize_t n) {\n"
            "  (void)self;\n"
            f"  if (n < 1 || n > {TRAMPOLINE_MAX_ARGS + 1}) {{\n"
            "    PyErr_SetString(PyExc_TypeError, \"call(address, *ints): too many arguments\"); return NULL; }\n"
            "  void *f = PyLong_AsVoidPtr(args[0]);\n"
            f"  I a[{TRAMPOLINE_MAX_ARGS}];\n"
            # PyLong_AsLong: long is int64 where the trampoline is built (LP64), and CPython converts two-digit
            # ints (pointers) by a loop there where PyLong_AsLongLong goes through a byte array (~4 ns an argument)
            "  for (Py_ssize_t i = 1; i < n; ++i) a[i - 1] = (I)PyLong_AsLong(args[i]);\n"
            "  if (PyErr_Occurred()) return NULL;\n"
            "  Py_BEGIN_ALLOW_THREADS\n"
            "  switch (n - 1) {\n" + "".join(cases) + "  }\n"
            "  Py_END_ALLOW_THREADS\n"
            "  Py_RETURN_NONE;\n}\n"
            "static PyMethodDef tg_methods[] = {{\"call\", (PyCFunction)(void (*)(void))tg_call, METH_FASTCALL, "
            "\"call(address, *ints)\"}, {NULL, NULL, 0, NULL}};\n"
            "static struct PyModuleDef tg_module = {PyModuleDef_HEAD_INIT, \"tg_trampoline\", NULL, -1, tg_methods};\n"
            "PyMODINIT_FUNC PyInit_tg_trampoline(void) { return PyModule_Create(&tg_module); }\n")


def trampoline():
    """The trampoline's ``call(address, *ints)``, or None where it is not used (TEGULA_TRAMPOLINE=0, another ABI
    than x86-64 System V, or it cannot be built); decided once per process."""
    if _TRAMPOLINE:
        return _TRAMPOLINE[0]
    with _TRAMPOLINE_LOCK:
        if not _TRAMPOLINE:
            try:
                call = _build_trampoline()
            except Exception:   # noqa: BLE001 (any failure only means launching through ctypes)
                call = None
            _TRAMPOLINE.append(call)
    return _TRAMPOLINE[0]


def _build_trampoline():
    import importlib.util
    import sys
    import sysconfig
    if not config.get().trampoline:
        return None
    if platform.machine() not in ("x86_64", "AMD64") or os.name != "posix" or sys.platform == "darwin" or \
            ctypes.sizeof(ctypes.c_void_p) != 8 or ctypes.sizeof(ctypes.c_long) != 8:
        return None
    include = sysconfig.get_paths().get("include")
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    if not include or not os.path.exists(os.path.join(include, "Python.h")):
        return None
    source = _trampoline_source()
    cc = compiler()
    ident, _ = _compiler_info(cc)
    key = hashlib.sha256(f"{cc}|{ident}|{sys.version}|{include}|{suffix}\0{source}".encode()).hexdigest()[:32]
    d = os.path.join(config.get().cache_dir, "trampoline", key)
    path = os.path.join(d, "tg_trampoline" + suffix)
    if not os.path.exists(path):
        os.makedirs(d, exist_ok=True)
        tag = f"{os.getpid()}.{threading.get_ident()}"
        src = os.path.join(d, f"tg_trampoline.{tag}.c")
        tmp = f"{path}.{tag}.tmp"
        with open(src, "w") as f:
            f.write(source)
        try:
            r = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-I", include, src, "-o", tmp], capture_output=True,
                               timeout=120)
            if r.returncode != 0:
                return None
            os.replace(tmp, path)
        finally:
            for x in (src, tmp):
                try:
                    os.unlink(x)
                except OSError:
                    pass
    spec = importlib.util.spec_from_file_location("tg_trampoline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.call


def direct_call(fn):
    """``(call, address)`` launching the ctypes function ``fn`` through the trampoline, where its argtypes allow
    (pointers, int32, uint32 and int64, at most TRAMPOLINE_MAX_ARGS of them); else None."""
    types = getattr(fn, "argtypes", None)
    if types is None or len(types) > TRAMPOLINE_MAX_ARGS or any(t not in _TRAMPOLINE_TYPES for t in types):
        return None
    call = trampoline()
    if call is None:
        return None
    return call, ctypes.cast(fn, ctypes.c_void_p).value


def load(path: str, name: str, signature: list[str]) -> CpuProgram:
    return CpuProgram(path, name, signature)
