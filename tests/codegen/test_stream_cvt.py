"""The converting streaming copy: T.copy(float32 run, bfloat16 global run, eviction_policy="evict_first") on the c
target becomes one tg_stream_cvt_f32_bf16 call (tegula_stream.h), whose rounding must be tg_f32_to_bf16's bit for
bit on every ISA path (vcvtne2ps2bf16 flushes subnormals and keeps NaN payloads: those vectors take the integer
rounding). The prelude function is built once per path the host can run, each forced by undefining the target
macros of the paths above it, and checked on special values and every alignment of the ends."""
import ctypes

import numpy as np
import pytest
import torch
from prelude_driver import build, paths_below

import tegula
import tegula.language as T

ORDER = ["__AVX512BF16__", "__AVX512F__", "__AVX2__", "__SSE2__"]


DRIVER = r"""
#include "tegula_stream.h"
void cvt_then_fence(tg_bf16 *d, const float *s, size_t n) { tg_stream_cvt_f32_bf16(d, s, n); tg_store_fence(); }
void cvt_scalar(tg_bf16 *d, const float *s, size_t n) { for (size_t i = 0; i < n; ++i) d[i] = tg_f32_to_bf16(s[i]); }
"""


def _special_bits(n, seed=0):
    """float32 bit patterns: random over every exponent, then ties of both parities, subnormals, NaNs (quiet,
    signalling, both signs, with payloads), infinities, zeros and values that round up to infinity, scattered."""
    rng = np.random.default_rng(seed)
    u = rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32)
    special = np.array([0x00000000, 0x80000000, 0x00000001, 0x807fffff, 0x00008000, 0x00018000, 0x007fffff,
                        0x00800000, 0x3f808000, 0x3f818000, 0x3f807fff, 0x3f80ffff, 0x7f7fffff, 0xff7f8000,
                        0x7f7f7fff, 0x7f800000, 0xff800000, 0x7fc00000, 0xffc00001, 0x7f800001, 0xff812345,
                        0x7fffffff], dtype=np.uint32)
    idx = rng.choice(n, size=min(n, 400), replace=False)
    u[idx] = special[np.arange(idx.size) % special.size]
    ties = rng.choice(n, size=min(n, 200), replace=False)
    u[ties] = (u[ties] & 0xffff0000) | 0x8000
    return u


@pytest.mark.parametrize("name,undef", paths_below(ORDER))
def test_prelude_cvt_every_path(tmp_path, name, undef):
    lib = build(tmp_path, DRIVER, undef)
    for fn in (lib.cvt_then_fence, lib.cvt_scalar):
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    bits = _special_bits(1 << 16)
    x = torch.from_numpy(bits.view(np.float32).copy())
    want = torch.empty(x.numel(), dtype=torch.int16)
    lib.cvt_scalar(want.data_ptr(), x.data_ptr(), x.numel())
    fin = ~torch.isnan(x)
    assert torch.equal(want[fin], x[fin].bfloat16().view(torch.int16))  # the reference is torch's rounding
    assert bool((want[~fin] == 0x7fc0).all())
    for n in (0, 1, 31, 63, 64, 65, 100, 1000, 1 << 16):
        for d_off in (0, 1, 7, 31):
            for s_off in (0, 3):
                if s_off + n > x.numel():
                    continue
                dst = torch.zeros(x.numel() + 96, dtype=torch.int16)
                lib.cvt_then_fence(dst.data_ptr() + 2 * d_off, x.data_ptr() + 4 * s_off, n)
                exp = torch.empty(n, dtype=torch.int16)
                lib.cvt_scalar(exp.data_ptr(), x.data_ptr() + 4 * s_off, n)
                assert torch.equal(dst[d_off:d_off + n], exp), (name, n, d_off, s_off)
                assert not dst[:d_off].any() and not dst[d_off + n:].any(), (name, n, d_off, s_off)


def scaled_rows(w, policy="evict_first"):
    """Y's row t = bf16(X's row t * 3): a float32 fragment copied into a bfloat16 row."""
    M = T.dynamic("M")

    @T.prim_func
    def rows(X: T.Tensor((M, w), "float32"), Y: T.Tensor((M, w), "bfloat16")):
        with T.Kernel(M) as t:
            f = T.alloc_fragment((w,), "float32")
            for j in T.Parallel(w):
                f[j] = X[t, j] * 3.0
            T.copy(f, Y[t, 0:w], eviction_policy=policy)
    return rows


@pytest.mark.parametrize("w", [8, 96, 1000])
@pytest.mark.parametrize("target", ["c", "interp"])
def test_converting_stream_copy_equals_a_plain_copy(target, w):
    bits = _special_bits(5 * w, seed=w)
    x = torch.from_numpy(bits.view(np.float32).copy()).view(5, w) / 3.0
    y = torch.zeros(5, w, dtype=torch.bfloat16)
    y0 = torch.zeros(5, w, dtype=torch.bfloat16)
    tegula.compile(scaled_rows(w), target=target)(x, y)
    tegula.compile(scaled_rows(w, None), target=target)(x, y0)
    nan = torch.isnan(x * 3.0)
    assert torch.equal(y.view(torch.int16)[~nan], (x * 3.0).bfloat16().view(torch.int16)[~nan])
    assert torch.equal(y.view(torch.int16), y0.view(torch.int16))


def test_source_converts_only_float32_to_bfloat16_runs():
    src = tegula.compile(scaled_rows(256), target="c").get_kernel_source()
    assert "tg_stream_cvt_f32_bf16(" in src and "tg_store_fence();" in src
    assert "tg_stream" not in tegula.compile(scaled_rows(256, None), target="c").get_kernel_source()
    M = T.dynamic("M")

    @T.prim_func
    def to_half(X: T.Tensor((M, 64), "float32"), Y: T.Tensor((M, 64), "float16")):
        with T.Kernel(M) as t:
            f = T.alloc_fragment((64,), "float32")
            T.copy(X[t, 0:64], f)
            T.copy(f, Y[t, 0:64], eviction_policy="evict_first")
    assert "tg_stream" not in tegula.compile(to_half, target="c").get_kernel_source()  # element stores
