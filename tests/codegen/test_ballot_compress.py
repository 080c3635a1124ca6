"""The c emitter's ballot and compress idioms (tegula/codegen/c.py, prelude tegula_compress.h) against interp.

Ballot: a reduction ``acc += T.cast(cond, u) << T.cast(j, u)`` over 16..64 iterations (a T.reduce_sum of distinct
bits) becomes a vector compare whose lanes tg_mask16 turns into bits. Compress: a serial loop ``if cond:
buf[n] = v; n = n + 1`` (min / max updates allowed) runs in groups of 16 with compressing stores (of 32 where the
buffers hold 16-bit integers). Both are plain T.* code whose meaning interp defines; the c results must equal
interp's on edge cases (no survivors, all, extents that are not a multiple of the group), and loops that do not
have the form are emitted as written. The prelude routines are built once per ISA path the host can run
(AVX-512, AVX-512 without VBMI2, AVX-512 VBMI2 without BMI2, AVX2 + BMI2, plain C: each forced by undefining the
macros of the paths above it).
"""
import ctypes

import pytest
import torch
from prelude_driver import build, native_macros

import tegula
import tegula.language as T


def ballot_kernel(rows, width, udtype, op="sum", xdtype="int32"):
    """M[r] = bit j set where X[r, j] > t (a reduce_sum, or with op="or" a serial loop with |)."""
    @T.prim_func
    def ballot(X: T.Tensor((rows, width), xdtype), M: T.Tensor((rows,), udtype), t: T.int32):
        with T.Kernel(1, threads=1) as _:
            x = T.alloc_fragment((rows, width), xdtype)
            fb = T.alloc_fragment((rows, width), udtype)
            m = T.alloc_fragment((rows,), udtype)
            T.copy(X, x)
            if op == "sum":
                for r, j in T.Parallel(rows, width):
                    fb[r, j] = T.cast(x[r, j] > T.cast(t, xdtype), udtype) << T.cast(j, udtype)
                T.reduce_sum(fb, m, dim=1)
            else:
                for r in T.serial(rows):
                    acc = T.cast(0, udtype)
                    for j in T.serial(width):
                        acc = acc | (T.cast(x[r, j] > t, udtype) << T.cast(j, udtype))
                    m[r] = acc
            T.copy(m, M)
    return ballot


def compress_kernel(n, vdtype="float32", with_minmax=True, step=1):
    """The values X[j] * 3 > t appended in order to on-chip buffers (keys and j as vdtype), copied out with the
    count (and the largest / smallest appended key)."""
    @T.prim_func
    def compress(X: T.Tensor((n,), "int32"), K: T.Tensor((n + 1,), "int32"), V: T.Tensor((n + 1,), vdtype),
                 C: T.Tensor((3,), "int32"), t: T.int32):
        with T.Kernel(1, threads=1) as _:
            ck = T.alloc_shared((n + 1,), "int32")
            cv = T.alloc_shared((n + 1,), vdtype)
            cnt = T.cast(0, "int32")
            top = T.cast(-(1 << 31), "int32")
            bot = T.cast((1 << 31) - 1, "int32")
            for j in T.serial(0, n, step):
                kv = X[j] * 3
                if kv > t:
                    ck[cnt] = kv
                    cv[cnt] = T.cast(j, vdtype)
                    if with_minmax:
                        top = T.max(top, kv)
                        bot = T.min(bot, kv)
                    cnt = cnt + 1
            for i in T.serial(cnt):
                K[i] = ck[i]
                V[i] = cv[i]
            C[0] = cnt
            C[1] = top
            C[2] = bot
    return compress


def _run(kernel, args):
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args], kernel(*args)


@pytest.mark.parametrize("width,udtype,op,xdtype", [
    (32, "uint32", "sum", "int32"), (16, "uint32", "sum", "int32"), (64, "uint64", "sum", "int32"),
    (48, "uint64", "or", "int32"), (32, "uint32", "or", "int32"), (20, "uint32", "sum", "int32"),
    (32, "uint32", "sum", "int16"), (64, "uint64", "sum", "int16")])
def test_ballot_equals_interp(width, udtype, op, xdtype):
    f = ballot_kernel(5, width, udtype, op, xdtype)
    kc, ki = tegula.compile(f, target="c"), tegula.compile(f, target="interp")
    src = kc.get_kernel_source()
    # 20 lanes, or a serial loop (its iterations are not known independent): not the form, emitted as written;
    # a compare of 16-bit values gets 16-bit lanes
    fn = "tg_mask16_16(" if xdtype == "int16" else "tg_mask16("
    assert (fn in src) == (width % 16 == 0 and op == "sum")
    tdt, sdt = {"uint32": (torch.uint32, torch.int32), "uint64": (torch.uint64, torch.int64)}[udtype]
    torch.manual_seed(width)
    for t in (-10**6, 0, 10**6, 37):   # none, about half, all, a few set
        t = max(min(t, 30000), -30000) if xdtype == "int16" else t
        x = torch.randint(-100, 100, (5, width), dtype=getattr(torch, xdtype))
        x[1] = 1000   # a row with every bit set (the top bit of the word included)
        x[2] = -1000  # and one with none
        outs = []
        for k in (kc, ki):
            m = torch.full((5,), 7, dtype=sdt)
            k(x, m.view(tdt), t)
            outs.append(m)
        assert torch.equal(outs[0], outs[1]), (t, outs)


@pytest.mark.parametrize("n", [1, 15, 16, 17, 100, 512, 1000])
@pytest.mark.parametrize("vdtype,with_minmax", [("float32", True), ("int32", False), ("uint32", True)])
def test_compress_equals_interp(n, vdtype, with_minmax):
    f = compress_kernel(n, vdtype, with_minmax)
    kc, ki = tegula.compile(f, target="c"), tegula.compile(f, target="interp")
    assert "tg_compress16_32(" in kc.get_kernel_source()
    tdt = {"float32": torch.float32, "int32": torch.int32, "uint32": torch.int32}[vdtype]
    udt = torch.uint32 if vdtype == "uint32" else tdt
    torch.manual_seed(n)
    for t in (-10**9, 0, 10**9, 150):   # all survive, about half, none, a few
        x = torch.randint(-100, 100, (n,), dtype=torch.int32)
        outs = []
        for k in (kc, ki):
            ok = torch.full((n + 1,), -7, dtype=torch.int32)
            ov = torch.full((n + 1,), -7, dtype=tdt)
            c = torch.zeros(3, dtype=torch.int32)
            k(x, ok, ov.view(udt), c, t)
            outs.append((ok, ov, c))
        for a, b in zip(*outs):
            assert torch.equal(a, b), (n, t, outs)


def compress16_kernel(n, kdtype="int16", vdtype="uint16"):
    """The keys X[j] * 3 > t (as kdtype) and j + 7 (as vdtype) appended in order to on-chip buffers, copied out with
    the count: 16-bit buffers (32 per group) when both are 16-bit, else a mixed loop."""
    @T.prim_func
    def compress16(X: T.Tensor((n,), "int16"), K: T.Tensor((n + 1,), kdtype), V: T.Tensor((n + 1,), vdtype),
                   C: T.Tensor((1,), "int32"), t: T.int32):
        with T.Kernel(1, threads=1) as _:
            ck = T.alloc_shared((n + 1,), kdtype)
            cv = T.alloc_shared((n + 1,), vdtype)
            cnt = T.cast(0, "int32")
            for j in T.serial(n):
                kv = T.cast(X[j], "int32") * 3
                if kv > t:
                    ck[cnt] = T.cast(kv, kdtype)
                    cv[cnt] = T.cast(j + 7, vdtype)
                    cnt = cnt + 1
            for i in T.serial(cnt):
                K[i] = ck[i]
                V[i] = cv[i]
            C[0] = cnt
    return compress16


@pytest.mark.parametrize("n", [1, 31, 32, 33, 100, 512, 1000])
@pytest.mark.parametrize("kdtype,vdtype", [("int16", "uint16"), ("int16", "int16"), ("int16", "int32")])
def test_compress16_equals_interp(n, kdtype, vdtype):
    # 16-bit buffers go 32 at a time (tg_compress32_16); buffers of two widths are not the form (as written)
    f = compress16_kernel(n, kdtype, vdtype)
    kc, ki = tegula.compile(f, target="c"), tegula.compile(f, target="interp")
    src = kc.get_kernel_source()
    assert ("tg_compress32_16(" in src) == (vdtype != "int32") and "tg_compress16_32(" not in src
    same_appends(kc, ki, n, kdtype, vdtype, (-10**6, 0, 10**6, 150))


def same_appends(kc, ki, n, kdtype, vdtype, thresholds):
    """Both kernels (X int16 (n,), K kdtype / V vdtype (n + 1,), C, t) give the same K, V and C on random X for
    each threshold t (all keys passing, about half, none, a few)."""
    store_dt = {"int16": torch.int16, "uint16": torch.int16, "int32": torch.int32}
    view_dt = {"int16": torch.int16, "uint16": torch.uint16, "int32": torch.int32}
    torch.manual_seed(n)
    for t in thresholds:
        x = torch.randint(-100, 100, (n,), dtype=torch.int16)
        outs = []
        for k in (kc, ki):
            ok = torch.full((n + 1,), -7, dtype=store_dt[kdtype])
            ov = torch.full((n + 1,), -7, dtype=store_dt[vdtype])
            c = torch.zeros(1, dtype=torch.int32)
            k(x, ok.view(view_dt[kdtype]), ov.view(view_dt[vdtype]), c, t)
            outs.append((ok, ov, c))
        for a, b in zip(*outs):
            assert torch.equal(a, b), (n, t, outs)


def index_compress_kernel(n, start, kdtype, vdtype):
    """X[j] (as kdtype) and the index j itself (cast to vdtype, or as it is when int32) appended in order for
    the j in [start, n) with X[j] > t: the compress idiom carries the index as a vector of lanes."""
    @T.prim_func
    def index_compress(X: T.Tensor((n,), "int16"), K: T.Tensor((n + 1,), kdtype), V: T.Tensor((n + 1,), vdtype),
                       C: T.Tensor((1,), "int32"), t: T.int32):
        with T.Kernel(1, threads=1) as _:
            ck = T.alloc_shared((n + 1,), kdtype)
            cv = T.alloc_shared((n + 1,), vdtype)
            cnt = T.cast(0, "int32")
            for j in T.serial(start, n):
                if T.cast(X[j], "int32") > t:
                    ck[cnt] = T.cast(X[j], kdtype)
                    cv[cnt] = j if vdtype == "int32" else T.cast(j, vdtype)
                    cnt = cnt + 1
            for i in T.serial(cnt):
                K[i] = ck[i]
                V[i] = cv[i]
            C[0] = cnt
    return index_compress


@pytest.mark.parametrize("n,start", [(33, 0), (100, 5), (1000, 37), (70000, 3)])
@pytest.mark.parametrize("kdtype,vdtype", [("int16", "int16"), ("int16", "uint16"), ("int32", "int32")])
def test_compress_carries_the_loop_index(n, start, kdtype, vdtype):
    # (int16 indices of a 70000-long loop wrap, as the cast does in the interpreter)
    f = index_compress_kernel(n, start, kdtype, vdtype)
    kc, ki = tegula.compile(f, target="c"), tegula.compile(f, target="interp")
    assert "tg_iota" in kc.get_kernel_source()
    same_appends(kc, ki, n, kdtype, vdtype, (-10**6, 0, 10**6, 90))


def test_guarded_loads_are_not_speculated():
    # X[j + 1] is read only where j + 1 < n: computing it for every lane could read past X, so not compressed
    n = 40

    @T.prim_func
    def guarded(X: T.Tensor((n,), "int32"), K: T.Tensor((n,), "int32"), C: T.Tensor((1,), "int32")):
        with T.Kernel(1, threads=1) as _:
            ck = T.alloc_shared((n,), "int32")
            cnt = T.cast(0, "int32")
            for j in T.serial(n):
                if j + 1 < n:
                    ck[cnt] = X[j + 1]
                    cnt = cnt + 1
            for i in T.serial(cnt):
                K[i] = ck[i]
            C[0] = cnt

    kc, ki = tegula.compile(guarded, target="c"), tegula.compile(guarded, target="interp")
    assert "tg_compress16_32(" not in kc.get_kernel_source()
    x = torch.arange(n, dtype=torch.int32)
    outs = []
    for k in (kc, ki):
        o, c = torch.zeros(n, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
        k(x, o, c)
        outs.append((o, c))
    assert all(torch.equal(a, b) for a, b in zip(*outs)) and outs[0][1].item() == n - 1


def test_float_min_max_keep_the_nan_rule():
    # a float accumulator is updated as written (not an OpenMP min / max reduction, whose combine would keep a NaN
    # start where T.max / T.min give the other operand): the values still go out by compressing stores
    n = 40

    @T.prim_func
    def fminmax(X: T.Tensor((n,), "float32"), K: T.Tensor((n,), "float32"), C: T.Tensor((1,), "int32"),
                R: T.Tensor((2,), "float32"), init: T.float32):
        with T.Kernel(1, threads=1) as _:
            ck = T.alloc_shared((n,), "float32")
            cnt = T.cast(0, "int32")
            top = init
            bot = init
            for j in T.serial(n):
                v = X[j]
                if v > 0.0:
                    ck[cnt] = v
                    top = T.max(top, v)
                    bot = T.min(bot, v)
                    cnt = cnt + 1
            for i in T.serial(cnt):
                K[i] = ck[i]
            C[0] = cnt
            R[0] = top
            R[1] = bot

    kc, ki = tegula.compile(fminmax, target="c"), tegula.compile(fminmax, target="interp")
    assert "reduction(max" not in kc.get_kernel_source()
    x = torch.linspace(-3, 5, n)
    for init in (float("nan"), 0.5):
        outs = []
        for k in (kc, ki):
            o, c, r = torch.zeros(n), torch.zeros(1, dtype=torch.int32), torch.zeros(2)
            k(x, o, c, r, init)
            outs.append((o, c, r))
        assert all(torch.equal(a, b) for a, b in zip(*outs)), (init, outs)
        assert not outs[0][2].isnan().any() and outs[0][2][0].item() == 5.0


@pytest.mark.parametrize("vdtype,step", [("int64", 1), ("float32", 2)])
def test_other_loops_equal_interp(vdtype, step):
    # 64-bit values are not compressed (emitted as written); a loop with a step is, over its own trip count
    f = compress_kernel(100, vdtype, True, step=step)
    kc, ki = tegula.compile(f, target="c"), tegula.compile(f, target="interp")
    assert ("tg_compress16_32(" in kc.get_kernel_source()) == (vdtype != "int64")
    tdt = torch.float32 if vdtype == "float32" else torch.int64
    for t in (-10**9, 0, 150):
        x = torch.randint(-100, 100, (100,), dtype=torch.int32)
        outs = []
        for k in (kc, ki):
            ok, ov = torch.zeros(101, dtype=torch.int32), torch.zeros(101, dtype=tdt)
            c = torch.zeros(3, dtype=torch.int32)
            k(x, ok, ov, c, t)
            outs.append((ok, ov, c))
        for a, b in zip(*outs):
            assert torch.equal(a, b), (t, outs)


def _paths():
    have = native_macros()
    paths = [("native", [])]
    if "__AVX512VBMI2__" in have:
        paths.append(("AVX-512 without VBMI2", ["__AVX512VBMI2__"]))
    if {"__AVX512VBMI2__", "__BMI2__"} <= have:   # tg_compress32_16's store mask without bzhi
        paths.append(("AVX-512 VBMI2 without BMI2", ["__BMI2__"]))
    if "__AVX512F__" in have and {"__AVX2__", "__BMI2__"} <= have:
        paths.append(("AVX2 + BMI2", ["__AVX512F__"]))
    paths.append(("plain C", ["__AVX512F__", "__AVX2__"]))
    return paths


DRIVER = r"""
#include "tegula_compress.h"
uint32_t mask16(const int32_t *m) { return tg_mask16(m); }
uint32_t mask16_16(const int16_t *m) { return tg_mask16_16(m); }
void compress16(void *d, const void *s, uint32_t mask) { tg_compress16_32(d, s, mask); }
uint32_t mask32_16(const int16_t *m) { return tg_mask32_16(m); }
void compress32_16(void *d, const void *s, uint32_t mask) { tg_compress32_16(d, s, mask); }
"""


@pytest.mark.parametrize("name,undef", _paths())
def test_prelude_every_path(tmp_path, name, undef):
    lib = build(tmp_path, DRIVER, undef)
    lib.mask16.argtypes = [ctypes.c_void_p]
    lib.mask16.restype = ctypes.c_uint32
    lib.mask16_16.argtypes = [ctypes.c_void_p]
    lib.mask16_16.restype = ctypes.c_uint32
    lib.compress16.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint32]
    g = torch.Generator().manual_seed(1)
    src_vals = torch.randint(-2**31, 2**31 - 1, (16,), dtype=torch.int32, generator=g)
    for mask in (0, 1, 0x8000, 0xFFFF, 0x00FF, 0xFF00, 0x5A5A, 0x0180, 0x7FFE, 12345):
        lanes = torch.tensor([-(mask >> i & 1) * (i + 3) for i in range(16)], dtype=torch.int32)  # any nonzero
        assert lib.mask16(lanes.data_ptr()) == mask
        assert lib.mask16_16(lanes.to(torch.int16).data_ptr()) == mask
        dst = torch.full((16 + 8,), 99, dtype=torch.int32)
        lib.compress16(dst.data_ptr() + 4 * 4, src_vals.data_ptr(), mask)
        keep = [src_vals[i].item() for i in range(16) if mask >> i & 1]
        assert dst[4:4 + len(keep)].tolist() == keep, (name, hex(mask))
        assert (dst[:4] == 99).all() and (dst[4 + len(keep):] == 99).all(), (name, hex(mask))  # nothing else
    lib.mask32_16.argtypes = [ctypes.c_void_p]
    lib.mask32_16.restype = ctypes.c_uint32
    lib.compress32_16.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint32]
    src16 = torch.randint(-2**15, 2**15 - 1, (32,), dtype=torch.int16, generator=g)
    for mask in (0, 1, 0x80000000, 0xFFFFFFFF, 0x7FFFFFFF, 0xFFFF0000, 0x0000FFFF, 0x5A5A5A5A, 0x00018000, 123456789):
        lanes = torch.tensor([-(mask >> i & 1) * (i + 3) for i in range(32)], dtype=torch.int16)
        assert lib.mask32_16(lanes.data_ptr()) == mask, (name, hex(mask))
        dst = torch.full((32 + 16,), 99, dtype=torch.int16)
        lib.compress32_16(dst.data_ptr() + 8 * 2, src16.data_ptr(), mask)
        keep = [src16[i].item() for i in range(32) if mask >> i & 1]
        assert dst[8:8 + len(keep)].tolist() == keep, (name, hex(mask))
        assert (dst[:8] == 99).all() and (dst[8 + len(keep):] == 99).all(), (name, hex(mask))


def test_popcount_of_a_scalar_local():
    # T.popcount of a scalar (a 0-d value in interp) as topk's keep counts a ballot word; c and interp agree
    @T.prim_func
    def pc(X: T.Tensor((8,), "uint32"), Y: T.Tensor((8,), "int32")):
        with T.Kernel(1, threads=1) as _:
            for i in T.serial(8):
                m = X[i]
                Y[i] = T.cast(T.popcount(m), "int32")

    x = torch.tensor([0, 1, 0xFFFFFFFF, 0x80000000, 0x5A5A5A5A, 7, 1 << 20, 12345], dtype=torch.int64)
    x = x.to(torch.uint32)
    want = [bin(v).count("1") for v in x.tolist()]
    for target in ("c", "interp"):
        y = torch.zeros(8, dtype=torch.int32)
        tegula.compile(pc, target=target)(x, y)
        assert y.tolist() == want, target
