"""T.copy(..., eviction_policy="evict_first") of a contiguous run into a global tensor: one streaming copy on the c
target (tegula_stream.h: non-temporal stores, a fence at the end of every thread), the same result as a plain copy
and as interp, which ignores the hint. The prelude's streaming copy is built once per ISA path the host can run
(AVX-512, AVX2, SSE2, plain C: each forced by undefining the target macros of the paths above it) and checked for
every alignment of the ends."""
import ctypes

import pytest
import torch
from prelude_driver import build, paths_below

import tegula
import tegula.language as T


def row_copy(w, dtype, policy="evict_first"):
    """Y's row o[t] = X's row t; Y's rows start at every element (a strided view with strides (1, 1)), so the
    destination runs have every alignment."""
    M = T.dynamic("M")
    P = T.dynamic("P", "int64")

    @T.prim_func
    def rows(X: T.Tensor((M, w), dtype), o: T.Tensor((M,), "int64"), Y: T.StridedTensor((P, w), (1, 1), dtype)):
        with T.Kernel(M) as t:
            T.copy(X[t, 0:w], Y[o[t], 0:w], eviction_policy=policy)
    return rows


@pytest.mark.parametrize("dtype,w", [("int64", 1792), ("bfloat16", 7168), ("float32", 40), ("uint8", 1000),
                                     ("bfloat16", 8)])
@pytest.mark.parametrize("target", ["c", "interp"])
def test_streamed_rows_equal_a_plain_copy(target, dtype, w):
    t = 9
    tdt = getattr(torch, dtype)
    x = (torch.randn(t, w) * 50).to(tdt)
    flat = torch.zeros(t * w + 3 * w + 5, dtype=tdt)
    rows = flat.as_strided((flat.numel() - w + 1, w), (1, 1))
    o = torch.tensor([0, w, 3 * w + 1, 2 * w + 1, 5 * w + 3, 4 * w + 2, 7 * w + 5, 6 * w + 4, 8 * w + 5])
    want = flat.clone()
    for i in range(t):
        want[o[i]:o[i] + w] = x[i]
    tegula.compile(row_copy(w, dtype), target=target)(x, o, rows)
    assert torch.equal(flat, want)


def test_source_streams_only_contiguous_hinted_runs():
    hinted = tegula.compile(row_copy(1792, "int64"), target="c").get_kernel_source()
    assert '#include "tegula_stream.h"' in hinted and "tg_stream_copy(" in hinted and "tg_store_fence();" in hinted
    for policy in (None, "evict_last"):
        plain = tegula.compile(row_copy(1792, "int64", policy), target="c").get_kernel_source()
        assert "tg_stream" not in plain and "tg_store_fence" not in plain

    @T.prim_func
    def tile(X: T.Tensor((64, 64), "float32"), Y: T.Tensor((64, 64), "float32")):
        with T.Kernel(4) as b:
            T.copy(X[b * 16:b * 16 + 16, 0:64], Y[b * 16:b * 16 + 16, 0:64], eviction_policy="evict_first")
    assert "tg_stream" not in tegula.compile(tile, target="c").get_kernel_source()  # 2-D tile: element stores


def test_hint_is_part_of_the_kernel_identity():
    a, b = row_copy(64, "int64").script(), row_copy(64, "int64", None).script()
    assert a != b and "evict_first" in a


def test_bad_policy_is_a_compile_error():
    with pytest.raises(tegula.CompileError, match="eviction_policy"):
        row_copy(64, "int64", "evict_soon")


DRIVER = r"""
#include "tegula_stream.h"
void copy_then_fence(void *d, const void *s, size_t n) { tg_stream_copy(d, s, n); tg_store_fence(); }
"""


@pytest.mark.parametrize("name,undef", paths_below(["__AVX512F__", "__AVX2__", "__SSE2__"]))
def test_prelude_stream_copy_every_path(tmp_path, name, undef):
    fn = build(tmp_path, DRIVER, undef).copy_then_fence
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    src_buf = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    for n in (0, 1, 63, 255, 256, 257, 1000, 3000):
        for d_off in (0, 1, 17, 63):
            for s_off in (0, 5):
                dst = torch.zeros(4096 + 128, dtype=torch.uint8)
                fn(dst.data_ptr() + d_off, src_buf.data_ptr() + s_off, n)
                assert torch.equal(dst[d_off:d_off + n], src_buf[s_off:s_off + n]), (n, d_off, s_off)
                assert not dst[:d_off].any() and not dst[d_off + n:].any(), (n, d_off, s_off)
