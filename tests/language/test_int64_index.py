"""Tile copies whose start is a 64-bit expression keep 64-bit arithmetic (a start past 2^31 must not wrap), on
tensors whose length is a 64-bit T.dynamic dim; the edge guard still reads zeros past the end."""
import torch

import tegula
import tegula.language as T


def window(W=8):
    n = T.dynamic("n", "int64")

    @T.prim_func
    def main(A: T.Tensor((n,), "float32"), B: T.Tensor((W,), "float32"), base: T.int64):
        with T.Kernel(1):
            s = T.alloc_shared((W,), "float32")
            T.copy(A[base * 3 - base * 2:base * 3 - base * 2 + W], s)   # a 64-bit start (base * 3 may pass 2^31)
            T.copy(s, B)
    return main


def test_int64_copy_start_is_not_truncated(target):
    src = tegula.lower(window(), target="c").kernel_source
    assert "(int32_t)(((base" not in src and "(int32_t)((base" not in src
    a = torch.arange(100.0)
    for base, want in ((90, torch.arange(90.0, 98.0)), (95, torch.tensor([95.0, 96, 97, 98, 99, 0, 0, 0]))):
        b = torch.empty(8)
        tegula.compile(window(), target=target)(a, b, base)
        assert torch.equal(b, want)
