"""The prelude's tile GEMM (tegula/codegen/prelude/tegula_gemm.h) against numpy in float64.

A tiny driver exports tg_gemm_<dt> with runtime arguments, plus a few calls with constant shapes
(as generated kernels make them, so gcc specialises the inlined routine). It is built once per ISA
path the host can run, each forced by undefining the target macros of the paths above it:
native (AVX-512 with vdpbf16ps pairs and vpdpbusd quads where the host has them; the kernels' flags),
the same without VBMI (e4m3 converted through fp32 instead of by table), AVX-512 with fp32 panels only,
AVX2 + FMA, and portable C (all but native at -O2, to keep the builds short).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import numpy as np
import pytest

PRELUDE = os.path.join(os.path.dirname(__file__), "..", "..", "tegula", "codegen", "prelude")
CC = os.environ.get("TEGULA_CC", "cc")
CFLAGS = ["-O3", "-march=native", "-std=gnu11", "-fPIC", "-shared", "-fopenmp", "-fwrapv", "-ffp-contract=off"]
PAD_A, PAD_B, PAD_C = 3, 5, 2  # leading dimensions exceed the rows' widths by these

DTYPES = {  # name: (C input type, C accumulator type)
    "f32": ("float", "float"),
    "bf16": ("tg_bf16", "float"),
    "f16": ("tg_f16", "float"),
    "f8e4m3": ("tg_f8e4m3", "float"),
    "f8e5m2": ("tg_f8e5m2", "float"),
    "i8": ("int8_t", "int32_t"),
}
# (dtype, M, N, K, transA, transB): calls compiled with every argument constant
CONSTANT_CALLS = [
    ("f32", 17, 33, 7, 1, 1),
    ("f32", 128, 128, 32, 0, 0),
    ("f32", 4, 256, 64, 0, 1),
    ("bf16", 64, 64, 64, 0, 1),
    ("bf16", 128, 128, 32, 0, 0),
    ("f16", 32, 96, 33, 1, 1),
    ("f8e4m3", 128, 128, 32, 0, 1),
    ("i8", 128, 64, 32, 1, 0),
    ("i8", 16, 256, 256, 0, 1),
    # few rows, B transposed: the dot-product path (tg__gemm_dot) where vdpbf16ps exists
    ("f8e4m3", 1, 64, 128, 0, 1),
    ("f8e4m3", 4, 64, 128, 0, 1),
    ("f8e5m2", 8, 40, 200, 0, 1),
    ("bf16", 1, 64, 7168, 0, 1),
    ("bf16", 16, 33, 1100, 0, 1),
]
# (M, N, K) of e4m3 block-scaled calls compiled with constant arguments, as the fp8 decode kernels make them
SCALED_CONSTANT = [(1, 16, 7168), (1, 128, 1536), (1, 64, 2048), (2, 16, 2048), (4, 16, 7168), (4, 64, 1536),
                   (4, 64, 2048), (8, 16, 256),
                   (3, 33, 2176), (256, 128, 256), (40, 70, 384), (512, 96, 256), (16, 64, 2048), (12, 128, 1536)]
# (M, N, K, transB) of bf16 calls with B's rows at addresses, constant arguments (the sparse prefill's two gemms)
ROWS_CONSTANT = [(64, 64, 576, 1), (64, 32, 576, 1), (64, 512, 64, 0), (64, 512, 32, 0)]
SHAPES = [
    (1, 128, 128),
    (17, 33, 7),
    (9, 17, 5),
    (3, 10, 37),
    (5, 3, 1),
    (16, 16, 16),
    (64, 64, 64),
    (128, 128, 32),
    (130, 260, 300),
    (2, 40, 515),
]


def _driver_source() -> str:
    lines = ['#include "tegula_gemm.h"']
    for dt, (tin, tc) in DTYPES.items():
        lines.append(
            f"void g_{dt}(int M, int N, int K, const {tin} *A, int lda, int tA, const {tin} *B, int ldb,"
            f" int tB, {tc} *C, int ldc, int clear)"
            f" {{ tg_gemm_{dt}(M, N, K, A, lda, tA, B, ldb, tB, C, ldc, clear); }}"
        )
    lines.append(  # the prefetching variant, with the next tiles of A and B named (any readable memory)
        "void n_f32(int M, int N, int K, const float *A, int lda, int tA, const float *B, int ldb, int tB, float *C,"
        " int ldc, int clear) { tg_gemm_f32_next(M, N, K, A, lda, tA, B, ldb, tB, C, ldc, clear,"
        " (tg_gemm_next){A, 4L * lda, tA ? K : M, 4 * (tA ? M : K)}, (tg_gemm_next){B, 4L * ldb, 8, 32}); }"
    )
    for dt, (tin, tc) in DTYPES.items():  # B's rows at addresses (read_gathered_rows' calls)
        lines.append(
            f"void r_{dt}(int M, int N, int K, const {tin} *A, int lda, int tA, const int64_t *rows, int bcol, int tB,"
            f" {tc} *C, int ldc, int clear) {{ tg_gemm_{dt}_rows(M, N, K, A, lda, tA, rows, bcol, tB, C, ldc, clear); }}"
        )
    for m, n, k, tb in ROWS_CONSTANT:
        lines.append(
            f"void rc_{m}x{n}x{k}_{tb}(const tg_bf16 *A, const int64_t *rows, float *C, int clear)"
            f" {{ tg_gemm_bf16_rows({m}, {n}, {k}, A, {k + PAD_A}, 0, rows, 3, {tb}, C, {n + PAD_C}, clear); }}"
        )
    for dt in ("f32", "bf16", "f8e4m3", "f8e5m2"):  # the block-scaled product (fuse_gemm_scale's calls)
        tin = DTYPES[dt][0]
        lines.append(
            f"void s_{dt}(int M, int N, int K, const {tin} *A, int lda, const {tin} *B, int ldb, float *C, int ldc,"
            f" const float *sa, int ldsa, const float *sb, int ldsb, int kb)"
            f" {{ tg_gemm_{dt}_bscaled(M, N, K, A, lda, B, ldb, C, ldc, sa, ldsa, sb, ldsb, kb); }}"
        )
    for m, n, k in SCALED_CONSTANT:
        lines.append(
            f"void sc_{m}x{n}x{k}(const tg_f8e4m3 *A, const tg_f8e4m3 *B, float *C, const float *sa, const float *sb)"
            f" {{ tg_gemm_f8e4m3_bscaled({m}, {n}, {k}, A, {k + PAD_A}, B, {k + PAD_B}, C, {n + PAD_C}, sa,"
            f" {k // 128 + 1}, sb, {n + 1}, 128); }}"
        )
    for dt, m, n, k, ta, tb in CONSTANT_CALLS:
        tin, tc = DTYPES[dt]
        lda, ldb = (m if ta else k) + PAD_A, (k if tb else n) + PAD_B
        lines.append(
            f"void c_{dt}_{m}x{n}x{k}_{ta}{tb}(const {tin} *A, const {tin} *B, {tc} *C, int clear)"
            f" {{ tg_gemm_{dt}({m}, {n}, {k}, A, {lda}, {ta}, B, {ldb}, {tb}, C, {n + PAD_C}, clear); }}"
        )
    return "\n".join(lines) + "\n"


# path: (macros the host must define for the path to differ from the one below it, macros undefined)
PATHS = {
    "native": ((), ()),
    "avx512_bf16_no_vbmi": (("__AVX512BF16__", "__AVX512VBMI__"), ("__AVX512VBMI__",)),  # e4m3 via fp32
    "avx512_f32": (("__AVX512F__",), ("__AVX512BF16__", "__AVX512VNNI__")),
    "avx2": (("__AVX2__", "__FMA__"), ("__AVX512F__",)),
    "portable": ((), ("__AVX512F__", "__AVX2__")),
}


def _target_macros() -> set[str]:
    out = subprocess.run([CC, "-march=native", "-dM", "-E", "-"], input="", capture_output=True, text=True)
    return {line.split()[1] for line in out.stdout.splitlines() if line.startswith("#define")}


_BUILDS: dict = {}


def _start_builds(tmp) -> None:
    """Compile every path's driver at once (each takes seconds of gcc time; they run in parallel)."""
    macros = _target_macros()
    (tmp / "driver.c").write_text(_driver_source())
    for name, (need, undef) in PATHS.items():
        if not set(need) <= macros:
            _BUILDS[name] = f"the host's target lacks {need}"
            continue
        so = tmp / f"{name}.so"
        opt = [] if name == "native" else ["-O2"]  # the kernels' own -O3 takes seconds more per build
        cmd = [CC, *CFLAGS, *opt, *[f"-U{m}" for m in undef], "-Wall", "-Werror", "-I", PRELUDE,
               str(tmp / "driver.c"), "-o", str(so)]
        _BUILDS[name] = (so, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))


@pytest.fixture(scope="module", params=list(PATHS))
def lib(request, tmp_path_factory):
    if shutil.which(CC) is None:
        pytest.skip(f"no C compiler ({CC})")
    if not _BUILDS:
        _start_builds(tmp_path_factory.mktemp("gemm"))
    build = _BUILDS[request.param]
    if isinstance(build, str):
        pytest.skip(build)
    so, proc = build
    _, err = proc.communicate()
    assert proc.returncode == 0, err
    return ctypes.CDLL(str(so))


def _operand(dt: str, rows: int, cols: int, pad: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """A rows x (cols + pad) array in dt's storage and the rows x cols values it holds, in float64."""
    if dt == "i8":
        bits = rng.integers(-128, 128, size=(rows, cols + pad), dtype=np.int8)
        return bits, bits[:, :cols].astype(np.float64)
    x = rng.standard_normal((rows, cols + pad)).astype(np.float32)
    if dt == "f32":
        return x, x[:, :cols].astype(np.float64)
    torch = pytest.importorskip("torch")
    tdt, view = {
        "bf16": (torch.bfloat16, torch.int16),
        "f16": (torch.float16, torch.int16),
        "f8e4m3": (torch.float8_e4m3fn, torch.uint8),
        "f8e5m2": (torch.float8_e5m2, torch.uint8),
    }[dt]
    t = torch.from_numpy(x).to(tdt)
    return t.view(view).numpy().copy(), t.float().numpy()[:, :cols].astype(np.float64)


def _c_and_operands(dt, m, n, ta, tb, a64, b64, rng):
    """A random C of m x (n + PAD_C) (int32 for i8), its copy, and the float64 operands as the call applies them."""
    ctype = np.int32 if dt == "i8" else np.float32
    c = rng.integers(-1000, 1000, size=(m, n + PAD_C)) if dt == "i8" else rng.standard_normal((m, n + PAD_C))
    c = c.astype(ctype)
    return c, c.copy(), (a64.T if ta else a64), (b64.T if tb else b64)


def _assert_product(dt, m, n, k, ta, tb, clear, opa, opb, c, c0):
    """C's first n columns hold opa @ opb (+ C0 unless clear): exact for i8, within a K-scaled bound otherwise;
    the columns past n untouched."""
    ref = opa @ opb + (0 if clear else c0[:, :n].astype(np.float64))
    where = f"{dt} {m}x{n}x{k} transA={ta} transB={tb} clear={clear}"
    np.testing.assert_array_equal(c[:, n:], c0[:, n:], err_msg=f"{where}: wrote past the row")
    if dt == "i8":
        np.testing.assert_array_equal(c[:, :n], ref.astype(np.int64).astype(np.int32), err_msg=where)
    else:
        scale = np.abs(opa) @ np.abs(opb) + (0 if clear else np.abs(c0[:, :n]))
        bad = np.abs(c[:, :n] - ref) > 1e-5 * (k + 1) * scale + 1e-30
        assert not bad.any(), f"{where}: {bad.sum()} wrong, first at {np.argwhere(bad)[0]}"


def _check(fn, dt, m, n, k, ta, tb, clear, rng, constant=False):
    a, a64 = _operand(dt, *((k, m) if ta else (m, k)), PAD_A, rng)
    b, b64 = _operand(dt, *((n, k) if tb else (k, n)), PAD_B, rng)
    c, c0, opa, opb = _c_and_operands(dt, m, n, ta, tb, a64, b64, rng)
    ptr = [x.ctypes.data_as(ctypes.c_void_p) for x in (a, b, c)]
    if constant:
        fn(ptr[0], ptr[1], ptr[2], clear)
    else:
        fn(m, n, k, ptr[0], a.shape[1], ta, ptr[1], b.shape[1], tb, ptr[2], c.shape[1], clear)
    _assert_product(dt, m, n, k, ta, tb, clear, opa, opb, c, c0)


@pytest.mark.parametrize("trans", [(0, 0), (0, 1), (1, 0), (1, 1)], ids=["nn", "nt", "tn", "tt"])
@pytest.mark.parametrize("dt", list(DTYPES))
def test_gemm_matches_numpy(lib, dt, trans):
    rng = np.random.default_rng(0)
    fn = getattr(lib, f"g_{dt}")
    for m, n, k in SHAPES:
        for clear in (0, 1):
            _check(fn, dt, m, n, k, *trans, clear, rng)


@pytest.mark.parametrize("call", CONSTANT_CALLS, ids=lambda c: "{}_{}x{}x{}_{}{}".format(*c))
def test_gemm_constant_arguments(lib, call):
    dt, m, n, k, ta, tb = call
    rng = np.random.default_rng(1)
    for clear in (0, 1):
        _check(getattr(lib, f"c_{dt}_{m}x{n}x{k}_{ta}{tb}"), dt, m, n, k, ta, tb, clear, rng, constant=True)


@pytest.mark.parametrize("dt", ["f32", "i8"])
def test_gemm_empty_k(lib, dt):
    """K = 0: clear zeroes C, accumulate leaves it alone."""
    c = np.full((3, 4 + PAD_C), 7, dtype=np.int32 if dt == "i8" else np.float32)
    fn = getattr(lib, f"g_{dt}")
    ptr = c.ctypes.data_as(ctypes.c_void_p)
    fn(3, 4, 0, None, 1, 0, None, 4, 0, ptr, c.shape[1], 0)
    assert (c == 7).all()
    fn(3, 4, 0, None, 1, 0, None, 4, 0, ptr, c.shape[1], 1)
    assert (c[:, :4] == 0).all() and (c[:, 4:] == 7).all()


def test_gemm_int8_is_exact_at_the_extremes(lib):
    """-128 * -128 summed over K = 2000 (16 chunks) is 32768000: beyond fp32's 2^24, exact per chunk."""
    k = 2000
    a = np.full((2, k), -128, dtype=np.int8)
    b = np.full((k, 3), -128, dtype=np.int8)
    c = np.full((2, 3), 5, dtype=np.int32)
    p = [x.ctypes.data_as(ctypes.c_void_p) for x in (a, b, c)]
    lib.g_i8(2, 3, k, p[0], k, 0, p[1], 3, 0, p[2], 3, 0)
    assert (c == 5 + 128 * 128 * k).all()


@pytest.mark.parametrize("dt", ["f8e4m3", "f8e5m2"])
def test_gemm_fp8_every_code(lib, dt):
    """Every finite fp8 code times the identity comes back exact: the in-register conversions
    (subnormals included) agree with torch's."""
    torch = pytest.importorskip("torch")
    tdt = {"f8e4m3": torch.float8_e4m3fn, "f8e5m2": torch.float8_e5m2}[dt]
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(tdt).float()
    codes[~torch.isfinite(values)] = 0  # inf * 0 would be NaN off the diagonal
    a = codes.reshape(16, 16).numpy().copy()
    one = torch.tensor([1.0]).to(tdt).view(torch.uint8).item()
    b = (np.eye(16, dtype=np.uint8) * one).copy()
    want = codes.view(tdt).float().reshape(16, 16).numpy()
    for ta, tb in [(0, 0), (1, 1)]:
        c = np.zeros((16, 16), np.float32)
        p = [x.ctypes.data_as(ctypes.c_void_p) for x in (a, b, c)]
        getattr(lib, f"g_{dt}")(16, 16, 16, p[0], 16, ta, p[1], 16, tb, p[2], 16, 1)
        np.testing.assert_array_equal(c, want.T if ta else want, err_msg=f"transA={ta}")
    for rows in (1, 4, 8, 16):  # B transposed: dot products (few rows) or panels in the 64-wide conversion order
        c = np.zeros((16, 16), np.float32)
        for r0 in range(0, 16, rows):
            p = [x.ctypes.data_as(ctypes.c_void_p) for x in (a[r0:], b, c[r0:])]
            getattr(lib, f"g_{dt}")(rows, 16, 16, p[0], 16, 0, p[1], 16, 1, p[2], 16, 1)
        np.testing.assert_array_equal(c, want, err_msg=f"nt, {rows} rows per call")


@pytest.mark.parametrize("dt", list(DTYPES))
def test_gemm_few_rows_transposed_b(lib, dt):
    """The shapes of the dot-product path (M <= 8, bf16 to 16; B transposed) and its edges: each row-block size
    (4, 2, 1) and their mixes, column blocks cut short (N not a multiple of 16 / rows), K tails around a
    vector of 64 and across the 1024-element chunks of A; then the packing path just past the limits."""
    rng = np.random.default_rng(3)
    fn = getattr(lib, f"g_{dt}")
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17):
        for n, k in [(1, 1), (17, 63), (33, 64), (5, 65), (16, 200), (19, 512), (3, 1100), (9, 2049)]:
            for clear in (0, 1):
                _check(fn, dt, m, n, k, 0, 1, clear, rng)


def test_gemm_few_rows_is_deterministic(lib):
    """The same call twice gives the same bits (fixed summation order)."""
    rng = np.random.default_rng(4)
    a, _ = _operand("f8e4m3", 3, 1100, PAD_A, rng)
    b, _ = _operand("f8e4m3", 70, 1100, PAD_B, rng)
    out = []
    for _ in range(2):
        c = np.zeros((3, 70), np.float32)
        p = [x.ctypes.data_as(ctypes.c_void_p) for x in (a, b, c)]
        lib.g_f8e4m3(3, 70, 1100, p[0], a.shape[1], 0, p[1], b.shape[1], 1, p[2], 70, 1)
        out.append(c)
    np.testing.assert_array_equal(out[0].view(np.int32), out[1].view(np.int32))


def test_gemm_next_prefetches_without_changing_the_result(lib):
    rng = np.random.default_rng(2)
    for m, n, k in [(128, 128, 32), (17, 33, 7)]:
        _check(lib.n_f32, "f32", m, n, k, 0, 0, 0, rng)


def _check_scaled(lib, dt, m, n, k, kb, rng, constant=False):
    """tg_gemm_<dt>_bscaled: C += sum_t sa[i, t] sb[t, j] (A_i . B_j over block t), against float64."""
    a, a64 = _operand(dt, m, k, PAD_A, rng)
    b, b64 = _operand(dt, n, k, PAD_B, rng)
    nb = k // kb
    sa = np.exp2(rng.integers(-6, 7, size=(m, nb + 1))).astype(np.float32) * rng.uniform(0.5, 1, (m, nb + 1)).astype(
        np.float32)
    sb = np.exp2(rng.integers(-6, 7, size=(nb, n + 1))).astype(np.float32)
    c = rng.standard_normal((m, n + PAD_C)).astype(np.float32)
    c0 = c.copy()
    ref = c0[:, :n].astype(np.float64)
    scale = np.abs(ref)
    for t in range(nb):
        s = (sa[:, t:t + 1] * sb[t:t + 1, :n]).astype(np.float64)
        blk = a64[:, t * kb:(t + 1) * kb] @ b64[:, t * kb:(t + 1) * kb].T
        ref = ref + blk * s
        scale = scale + (np.abs(a64[:, t * kb:(t + 1) * kb]) @ np.abs(b64[:, t * kb:(t + 1) * kb]).T) * np.abs(s)
    ptr = [x.ctypes.data_as(ctypes.c_void_p) for x in (a, b, c, sa, sb)]
    if constant:
        getattr(lib, f"sc_{m}x{n}x{k}")(ptr[0], ptr[1], ptr[2], ptr[3], ptr[4])
    else:
        getattr(lib, f"s_{dt}")(m, n, k, ptr[0], a.shape[1], ptr[1], b.shape[1], ptr[2], c.shape[1], ptr[3],
                                sa.shape[1], ptr[4], sb.shape[1], kb)
    where = f"{dt} {m}x{n}x{k} kb={kb}"
    np.testing.assert_array_equal(c[:, n:], c0[:, n:], err_msg=f"{where}: wrote past the row")
    bad = np.abs(c[:, :n] - ref) > 1e-5 * (k + 1) * scale + 1e-30
    assert not bad.any(), f"{where}: {bad.sum()} wrong, first at {np.argwhere(bad)[0]}"


@pytest.mark.parametrize("dt", ["f32", "bf16", "f8e4m3", "f8e5m2"])
def test_gemm_block_scaled_matches_numpy(lib, dt):
    rng = np.random.default_rng(7)
    # one row: K <= 2048 reads the rows as one stream, longer K 8 / 4 / 2 / 1 groups side by side (200, 40 rows)
    for m, n, k, kb in [(1, 16, 256, 128), (1, 250, 1536, 128), (1, 40, 512, 64), (1, 7, 4096, 256),
                        (1, 200, 3072, 128), (1, 40, 2560, 256),
                        (1, 20, 4352, 128), (2, 5, 128, 128), (3, 33, 2176, 128), (4, 16, 1152, 128),
                        (4, 64, 2048, 128), (5, 17, 2048, 64), (8, 40, 2048, 128), (4, 9, 300, 100),
                        (2, 70, 2048, 256), (6, 20, 4096, 128),
                        # more rows: the panel path, each register block's product scaled into C
                        (9, 20, 256, 128), (16, 40, 512, 128), (70, 150, 384, 128), (130, 33, 256, 64),
                        (12, 40, 512, 256),
                        # 9-16 rows of e4m3 (tg__gemm_lanes16: A's rows in lanes, B's pairs broadcast), partial
                        # column groups, fewer columns than a group, blocks of 64 and 256
                        (16, 64, 2048, 128), (13, 37, 1024, 64), (10, 5, 384, 128), (16, 17, 512, 256),
                        (11, 33, 7168, 128)]:
        _check_scaled(lib, dt, m, n, k, kb, rng)


@pytest.mark.parametrize("shape", SCALED_CONSTANT, ids=lambda s: "x".join(map(str, s)))
def test_gemm_block_scaled_constant_arguments(lib, shape):
    _check_scaled(lib, "f8e4m3", *shape, 128, np.random.default_rng(8), constant=True)


def test_gemm_block_scaled_is_deterministic(lib):
    rng = np.random.default_rng(9)
    m, n, k = 4, 24, 2048
    a, _ = _operand("f8e4m3", m, k, PAD_A, rng)
    b, _ = _operand("f8e4m3", n, k, PAD_B, rng)
    sa = rng.uniform(0.1, 2, (m, 17)).astype(np.float32)
    sb = rng.uniform(0.1, 2, (16, n + 1)).astype(np.float32)
    outs = []
    for _ in range(3):
        c = np.zeros((m, n + PAD_C), np.float32)
        ptr = [x.ctypes.data_as(ctypes.c_void_p) for x in (a, b, c, sa, sb)]
        lib.s_f8e4m3(m, n, k, ptr[0], a.shape[1], ptr[1], b.shape[1], ptr[2], c.shape[1], ptr[3], 17, ptr[4], n + 1,
                     128)
        outs.append(c)
    assert all(np.array_equal(outs[0], o) for o in outs[1:])


def _check_rows(fn, dt, m, n, k, ta, tb, clear, rng, constant=False):
    """tg_gemm_<dt>_rows: B's stored rows picked (with repeats) from a larger array, from column 3 on."""
    bcol, pool_rows = 3, 50
    nrow, width = (n, k) if tb else (k, n)
    a, a64 = _operand(dt, *((k, m) if ta else (m, k)), PAD_A, rng)
    pool, p64 = _operand(dt, pool_rows, bcol + width, PAD_B, rng)
    pick = rng.integers(0, pool_rows, size=nrow)
    rows = (pool.ctypes.data + pick * pool.strides[0]).astype(np.int64)
    b64 = p64[pick, bcol:]
    c, c0, opa, opb = _c_and_operands(dt, m, n, ta, tb, a64, b64, rng)
    pa, pr, pc = (x.ctypes.data_as(ctypes.c_void_p) for x in (a, rows, c))
    if constant:
        fn(pa, pr, pc, clear)
    else:
        fn(m, n, k, pa, a.shape[1], ta, pr, bcol, tb, pc, c.shape[1], clear)
    _assert_product(dt, m, n, k, ta, tb, clear, opa, opb, c, c0)


@pytest.mark.parametrize("trans", [(0, 0), (0, 1), (1, 0), (1, 1)], ids=["nn", "nt", "tn", "tt"])
@pytest.mark.parametrize("dt", list(DTYPES))
def test_gemm_rows_at_addresses(lib, dt, trans):
    """tg_gemm_<dt>_rows equals the product with B gathered: bf16 pairs packed from the rows (both panel layouts),
    other formats through a copy of each panel's rows; few rows included (never the dot path)."""
    rng = np.random.default_rng(10)
    for m, n, k in [(17, 33, 7), (64, 64, 300), (4, 130, 260), (9, 17, 5), (130, 40, 70)]:
        for clear in (0, 1):
            _check_rows(getattr(lib, f"r_{dt}"), dt, m, n, k, *trans, clear, rng)


@pytest.mark.parametrize("call", ROWS_CONSTANT, ids=lambda c: "{}x{}x{}_{}".format(*c))
def test_gemm_rows_constant_arguments(lib, call):
    m, n, k, tb = call
    rng = np.random.default_rng(11)
    for clear in (0, 1):
        _check_rows(getattr(lib, f"rc_{m}x{n}x{k}_{tb}"), "bf16", m, n, k, 0, tb, clear, rng, constant=True)
