"""The C prelude's narrow-float conversions and integer helpers, checked bit for bit.

A small driver exposing batch loops over tegula_types.h is compiled with the system C compiler
and loaded with ctypes; conversions are compared against torch (`tensor.to(dtype)`), integer
helpers against Python's `//` and `%`.
"""

import ctypes
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

PRELUDE = Path(__file__).resolve().parents[2] / "tegula" / "codegen" / "prelude"
CC = os.environ.get("TEGULA_CC", "cc")
FLAGS = ["-O3", "-march=native", "-std=gnu11", "-fwrapv", "-Wall", "-Wextra", "-Werror"]

# name in the header, torch dtype, storage numpy dtype, number of bits
NARROW = {
    "bf16": (torch.bfloat16, np.uint16, 16),
    "f16": (torch.float16, np.uint16, 16),
    "f8e4m3": (torch.float8_e4m3fn, np.uint8, 8),
    "f8e5m2": (torch.float8_e5m2, np.uint8, 8),
    "f8e8m0": (torch.float8_e8m0fnu, np.uint8, 8),
}
FP8 = ["f8e4m3", "f8e5m2", "f8e8m0"]
INT_OPS = ["floordiv", "floormod", "ceildiv"]
UNARY = {"rsqrtf": lambda x: 1 / np.sqrt(x)}
BINARY = {"fmaxf": np.fmax, "fminf": np.fmin, "maxf": np.maximum, "minf": np.minimum}
CROSS = (
    [("bf16", "f16"), ("f16", "bf16")]
    + [(a, b) for a in FP8 for b in ("bf16", "f16")]
    + [(a, b) for a in ("bf16", "f16") for b in FP8]
)


def _batch(name, tin, tout, expr):
    return f"void {name}(const {tin} *x, {tout} *y, long k) {{ for (long i = 0; i < k; i++) y[i] = {expr}; }}"


def _driver():
    """C source with one batch loop per line, so the vectorisation report names each loop."""
    lines = ['#include "tegula_types.h"']
    for n in NARROW:
        lines.append(_batch(f"{n}_to_f32", f"tg_{n}", "float", f"tg_{n}_to_f32(x[i])"))
        lines.append(_batch(f"f32_to_{n}", "float", f"tg_{n}", f"tg_f32_to_{n}(x[i])"))
    for a, b in CROSS:
        lines.append(_batch(f"{a}_to_{b}", f"tg_{a}", f"tg_{b}", f"tg_{a}_to_{b}(x[i])"))
    lines.append("// helpers: y[i] = f(x[i]) or f(x[i], x[k + i])")
    for f in UNARY:
        lines.append(_batch(f"tg_{f}_batch", "float", "float", f"tg_{f}(x[i])"))
    for f in BINARY:
        lines.append(_batch(f"tg_{f}_batch", "float", "float", f"tg_{f}(x[i], x[k + i])"))
    for op in INT_OPS:
        for bits in (32, 64):
            lines.append(_batch(f"{op}_i{bits}", f"int{bits}_t", f"int{bits}_t", f"tg_{op}_i{bits}(x[i], x[k + i])"))
    return "\n".join(lines) + "\n"


def _cc():
    path = shutil.which(CC)
    if path is None:
        pytest.skip(f"no C compiler ({CC!r}; set TEGULA_CC)")
    return path


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    cc = _cc()
    d = tmp_path_factory.mktemp("prelude")
    (d / "driver.c").write_text(_driver())
    so = d / "driver.so"
    subprocess.run(
        [cc, *FLAGS, "-shared", "-fPIC", f"-I{PRELUDE}", str(d / "driver.c"), "-o", str(so)],
        check=True,
        capture_output=True,
        text=True,
    )
    return ctypes.CDLL(str(so))


def call(lib, fn, out_dtype, x, n=None):
    """y = fn(x) over n outputs (default len(x)); the integer ops read their operands as x[:n], x[n:]."""
    x = np.ascontiguousarray(x)
    out = np.empty(len(x) if n is None else n, dtype=out_dtype)
    getattr(lib, fn)(ctypes.c_void_p(x.ctypes.data), ctypes.c_void_p(out.ctypes.data), ctypes.c_long(len(out)))
    return out


def torch_bits(x, dtype):
    """`x` (numpy float32 or torch tensor) converted by torch, as unsigned storage bits."""
    t = torch.from_numpy(x) if isinstance(x, np.ndarray) else x
    if dtype == torch.float8_e4m3fn:
        # the prelude saturates (|x| >= 464 and +-inf give +-448), as torch 2.13 does; torch 2.11 gave NaN there,
        # so clamp first: 448 is exact, values in range round as before, NaN stays NaN
        t = t.clamp(-448.0, 448.0)
    t = t.to(dtype)
    if t.element_size() == 2:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.view(torch.uint8).numpy()


def all_codes(name):
    _, storage, bits = NARROW[name]
    return np.arange(1 << bits, dtype=np.int64).astype(storage)


def torch_from_codes(codes, name):
    dtype = NARROW[name][0]
    t = torch.from_numpy(codes.view(np.int16) if codes.dtype == np.uint16 else codes)
    return t.view(dtype)


def assert_same_bits(ours, ref, inputs):
    bad = np.nonzero(ours != ref)[0]
    if len(bad):
        eg = [
            (
                hex(int(inputs.view(np.uint32)[i]) if inputs.dtype == np.float32 else int(inputs[i])),
                hex(int(ours[i])),
                hex(int(ref[i])),
            )
            for i in bad[:8]
        ]
        pytest.fail(f"{len(bad)} mismatches (input, ours, torch): {eg}")


# ---- narrow -> f32: every bit pattern, NaNs included ---------------------------------------


@pytest.mark.parametrize("name", list(NARROW))
def test_to_f32_exhaustive(lib, name):
    codes = all_codes(name)
    ours = call(lib, f"{name}_to_f32", np.float32, codes).view(np.uint32)
    ref = torch_from_codes(codes, name).float().numpy().view(np.uint32)
    assert_same_bits(ours, ref, codes)


# ---- f32 -> narrow ---------------------------------------------------------------------------


def boundary_inputs(name):
    """Every finite narrow value, the midpoints between neighbours (including the one above the
    largest finite value, the overflow threshold), each +-1 float32 ulp, both signs."""
    vals = torch_from_codes(all_codes(name), name).float().numpy()
    v = np.unique(np.abs(vals[np.isfinite(vals)])).astype(np.float64)
    v = np.append(v, 2 * v[-1] - v[-2])
    with np.errstate(over="ignore"):
        pts = np.concatenate([v, (v[:-1] + v[1:]) / 2]).astype(np.float32)
    b = pts.view(np.uint32)
    b = np.concatenate([b, b + 1, b[b > 0] - 1])
    b = b[(b & 0x7F800000) != 0x7F800000]
    return np.concatenate([b, b | 0x80000000]).view(np.float32)


def random_inputs(n=2_000_000, seed=0):
    """Uniform float32 bit patterns (NaN, inf and subnormals included), and as many again with
    the exponent drawn from [2^-31, 2^33], where fp8 and f16 round, flush and overflow."""
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 1 << 32, 2 * n, dtype=np.uint64).astype(np.uint32)
    b[n:] = (b[n:] & 0x807FFFFF) | (rng.integers(96, 161, n, dtype=np.uint64).astype(np.uint32) << 23)
    return b.view(np.float32)


# zeros, infinities, NaNs (quiet, signalling, payloads, both signs), float32 subnormals and
# extremes, and the e8m0 edge 2^-127 = 0x00400000 with its tie 1.5 * 2^-127 and neighbours
SPECIALS_HEX = """0 80000000 7f800000 ff800000 7fc00000 ffc00000 7f800001 ff800001 7fa00000 7fffffff ffffffff
    7fc12345 1 80000001 7fffff 800000 7f7fffff ff7fffff 3f800000 bf800000 400000 600000 600001 5fffff"""
SPECIALS = np.array([int(h, 16) for h in SPECIALS_HEX.split()], dtype=np.uint32).view(np.float32)


@pytest.mark.parametrize("name", list(NARROW))
def test_from_f32(lib, name):
    dtype, storage, _ = NARROW[name]
    x = np.concatenate([SPECIALS, boundary_inputs(name), random_inputs()])
    ours = call(lib, f"f32_to_{name}", storage, x)
    ref = torch_bits(x, dtype)
    if name == "bf16":
        # torch's NaN code for bf16 depends on the kernel path (0x7fc0 scalar, 0xffff
        # vectorised on x86); the prelude always writes 0x7fc0.
        nan = np.isnan(x)
        assert (ours[nan] == 0x7FC0).all()
        assert np.isnan(torch_from_codes(ref[nan], name).float().numpy()).all()
        ours, ref, x = ours[~nan], ref[~nan], x[~nan]
    assert_same_bits(ours, ref, x)


@pytest.mark.parametrize(
    "name, values, expected",
    [
        ("f8e4m3", [448.0, 464.0, 500.0, 1e6, np.inf, -np.inf, -1e6], [448, 448, 448, 448, 448, -448, -448]),
        ("f8e5m2", [57344.0, 61439.0, 61440.0, 1e6, -np.inf], [57344, 57344, np.inf, np.inf, -np.inf]),
        ("f8e8m0", [3.0, 0.75, 1.5, 1.4999, 6.0, 5.0, 0.0, -1.0], [4.0, 1.0, 2.0, 1.0, 8.0, 4.0, 2.0**-127, 1.0]),
    ],
)
def test_documented_rules(lib, name, values, expected):
    codes = call(lib, f"f32_to_{name}", np.uint8, np.array(values, dtype=np.float32))
    got = call(lib, f"{name}_to_f32", np.float32, codes)
    assert got.tolist() == np.array(expected, dtype=np.float32).tolist()


# ---- between narrow types ----------------------------------------------------------------------


@pytest.mark.parametrize("src, dst", CROSS)
def test_cross(lib, src, dst):
    codes = all_codes(src)
    ours = call(lib, f"{src}_to_{dst}", NARROW[dst][1], codes)
    # The reference widens to float first; torch's direct fp8 <-> 16-bit casts agree on numbers,
    # and float is exact for every input, so this is the single rounding the prelude promises.
    wide = torch_from_codes(codes, src).float()
    ref = torch_bits(wide, NARROW[dst][0])
    nan = torch.isnan(wide).numpy()
    if dst == "bf16":
        assert (ours[nan] == 0x7FC0).all()
        ours, ref, codes = ours[~nan], ref[~nan], codes[~nan]
    assert_same_bits(ours, ref, codes)


# ---- integers --------------------------------------------------------------------------------


def python_ref(op, a, b, bits):
    """Python semantics, with the prelude's choices where Python has no answer in `bits` bits:
    a zero divisor gives 0, and results wrap (only INT_MIN // -1 and ceildiv(INT_MIN, -1) do)."""
    if b == 0:
        return 0
    r = {"floordiv": a // b, "floormod": a % b, "ceildiv": -(-a // b)}[op]
    return (r + (1 << (bits - 1))) % (1 << bits) - (1 << (bits - 1))


@pytest.mark.parametrize("bits", [32, 64])
@pytest.mark.parametrize("op", INT_OPS)
def test_int_helpers(lib, op, bits):
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    edges = [lo, lo + 1, -(1 << 16), -7, -3, -2, -1, 0, 1, 2, 3, 7, 1 << 16, hi - 1, hi]
    a = [x for x in edges for _ in edges]
    b = [y for _ in edges for y in edges]
    rng = np.random.default_rng(bits)
    n = 20_000
    for _ in range(2):  # full-width values, then values of random magnitude
        ra = rng.integers(lo, hi, n, endpoint=True, dtype=np.int64) >> rng.integers(0, bits, n)
        rb = rng.integers(lo, hi, n, endpoint=True, dtype=np.int64) >> rng.integers(0, bits, n)
        a += ra.tolist()
        b += rb.tolist()
    dt = np.int32 if bits == 32 else np.int64
    ours = call(lib, f"{op}_i{bits}", dt, np.array(a + b, dtype=dt), n=len(a))
    ref = [python_ref(op, x, y, bits) for x, y in zip(a, b)]
    bad = [(x, y, int(o), r) for x, y, o, r in zip(a, b, ours, ref) if o != r]
    assert not bad, f"{len(bad)} mismatches (a, b, ours, python): {bad[:8]}"


# ---- float helpers ---------------------------------------------------------------------------


@pytest.mark.parametrize("fn", list(UNARY))
def test_unary_float_helpers(lib, fn):
    x = np.concatenate([np.linspace(-100, 100, 4001), [0.0, -0.0, 1e-30, 1e30, np.inf, -np.inf, np.nan]])
    x = x.astype(np.float32)
    if fn == "rsqrtf":
        x = np.abs(x)
    ours = call(lib, f"tg_{fn}_batch", np.float32, x)
    with np.errstate(all="ignore"):
        ref = UNARY[fn](x.astype(np.float64))
    np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-38)  # atol: float32 underflow


@pytest.mark.parametrize("fn", list(BINARY))
def test_minmax_helpers(lib, fn):
    """fmaxf/fminf ignore a NaN operand (C99); maxf/minf propagate it (torch.maximum)."""
    v = np.array([np.nan, -np.inf, -1.5, -0.0, 0.0, 2.0, np.inf], dtype=np.float32)
    a, b = np.repeat(v, len(v)), np.tile(v, len(v))
    ours = call(lib, f"tg_{fn}_batch", np.float32, np.concatenate([a, b]), n=len(a))
    np.testing.assert_array_equal(ours, BINARY[fn](a, b))


# ---- the header itself -------------------------------------------------------------------------


def test_header_is_light_and_strict(tmp_path):
    """Only the four cheap headers, and clean as strict ISO C11 with every warning on."""
    text = (PRELUDE / "tegula_types.h").read_text()
    assert set(re.findall(r"#\s*include\s*<([^>]+)>", text)) == {"stdint.h", "string.h", "math.h", "stdbool.h"}
    assert '#include "' not in text
    src = tmp_path / "t.c"
    src.write_text('#include "tegula_types.h"\n#include "tegula_types.h"\nint main(void) { return 0; }\n')
    subprocess.run(
        [_cc(), "-std=c11", "-Wall", "-Wextra", "-Wpedantic", "-Werror", "-fsyntax-only", f"-I{PRELUDE}", str(src)],
        check=True,
        capture_output=True,
        text=True,
    )


VECTOR_MARCH = {"x86_64": "-march=x86-64-v3", "AMD64": "-march=x86-64-v3"}  # AVX2 has per-lane shifts


def test_conversion_loops_vectorise(tmp_path):
    """Every conversion loop vectorises at -O3 (gcc only: it is the compiler that reports it)."""
    cc = _cc()
    version = subprocess.run([cc, "--version"], check=False, capture_output=True, text=True).stdout
    if "Free Software Foundation" not in version or platform.machine() not in VECTOR_MARCH:
        pytest.skip("vectorisation is only checked with gcc on x86_64")
    src = tmp_path / "v.c"
    src.write_text(_driver().split("// helpers")[0])
    march = VECTOR_MARCH[platform.machine()]
    # -fno-trapping-math as the c runtime compiles kernels (float ops under a select vectorise only then)
    cmd = [cc, "-O3", march, "-std=gnu11", "-fwrapv", "-fno-trapping-math", "-S", "-o", os.devnull,
           "-fopt-info-vec-optimized"]
    res = subprocess.run([*cmd, f"-I{PRELUDE}", str(src)], check=True, capture_output=True, text=True)
    vectorised = {int(m) for m in re.findall(r"v\.c:(\d+):\d+: optimized: loop vectorized", res.stderr)}
    lines = src.read_text().splitlines()
    wanted = set(range(2, len(lines) + 1))
    assert wanted <= vectorised, res.stderr


# ---- f32 -> f8e4m3 over every float32 --------------------------------------------------------------

# tg_f32_to_f8e4m3 rounds with a float add whose sum's bits give the code; the reference here is the plain
# integer rounding (tg__round_narrow, as f16 / f8e5m2 use), saturated at 448, NaN -> 0x7f, the sign on top. The
# conversion runs in a loop as kernels call it (vectorised), the reference in a loop of its own.
E4M3_EXHAUSTIVE = r"""
#include <stdio.h>
#include "tegula_types.h"
static tg_f8e4m3 ref(uint32_t x) {
    uint32_t a = x & 0x7fffffffu, r = tg__round_narrow(a, 3u, 7u);
    r = a > 0x7f800000u ? 0x7fu : (r > 0x7eu ? 0x7eu : r);
    return (tg_f8e4m3)(((x >> 24) & 0x80u) | r);
}
static float in[1 << 16];
static tg_f8e4m3 got[1 << 16], want[1 << 16];
int main(void) {
    unsigned long long bad = 0;
    uint32_t first = 0;
    for (uint32_t hi = 0; hi < (1u << 16); hi++) {
        for (uint32_t lo = 0; lo < (1u << 16); lo++) in[lo] = tg__bits_f32(hi << 16 | lo);
        for (uint32_t lo = 0; lo < (1u << 16); lo++) got[lo] = tg_f32_to_f8e4m3(in[lo]);
        for (uint32_t lo = 0; lo < (1u << 16); lo++) want[lo] = ref(hi << 16 | lo);
        for (uint32_t lo = 0; lo < (1u << 16); lo++)
            if (got[lo] != want[lo] && bad++ == 0) first = hi << 16 | lo;
    }
    printf("%llu %08x\n", bad, (unsigned)first);
    return 0;
}
"""

E4M3_MARCHES = {"x86_64": ["-march=native", "-march=x86-64-v3", "-march=x86-64"], "AMD64": ["-march=native"]}


@pytest.mark.slow
@pytest.mark.parametrize("march", E4M3_MARCHES.get(platform.machine(), ["-march=native"]))
def test_f32_to_f8e4m3_exhaustive(tmp_path, march):
    """tg_f32_to_f8e4m3 equals the plain rounding on all 2^32 float32 inputs, compiled as the c runtime compiles
    kernels, on each ISA level of this machine (x86: AVX-512 where the host has it, AVX2, SSE2)."""
    src, exe = tmp_path / "e4m3.c", tmp_path / "e4m3"
    src.write_text(E4M3_EXHAUSTIVE)
    cmd = [_cc(), "-O3", march, "-std=gnu11", "-fwrapv", "-ffp-contract=off", "-fno-math-errno",
           "-fno-trapping-math", f"-I{PRELUDE}", str(src), "-o", str(exe)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    bad, first = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()
    assert bad == "0", f"{bad} mismatches, the first at float32 bits 0x{first}"
