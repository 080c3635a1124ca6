"""T.reinterpret between integer bits and a narrow float, both ways: a store of T.reinterpret(integer bits, narrow
float) writes those bits, and T.reinterpret(stored narrow value, integer) reads its code: every bfloat16 and
float8_e4m3fn code, NaN payloads and signs included (the c family of emitters moves the integer directly, no decode
and re-encode)."""
import numpy as np
import pytest
import torch

import tegula
import tegula.language as T


@pytest.mark.parametrize("bits, narrow, torch_int", [("uint16", "bfloat16", torch.int16), ("uint8", "float8_e4m3fn",
                                                                                           torch.uint8)])
def test_store_reinterpreted_bits(target, bits, narrow, torch_int):
    n = 1 << (16 if bits == "uint16" else 8)

    @T.prim_func
    def main(C: T.Tensor((n,), "int32"), Y: T.Tensor((n,), narrow)):
        with T.Kernel(1):
            for i in T.Parallel(n):
                Y[i] = T.reinterpret(T.cast(C[i], bits), narrow)

    codes = torch.arange(n, dtype=torch.int32)
    y = tegula.compile(main, out_idx=[1], target=target)(codes)
    got = torch.as_tensor(np.asarray(y)) if not isinstance(y, torch.Tensor) else y
    assert torch.equal(got.view(torch_int).to(torch.int32) & (n - 1), codes)


@pytest.mark.parametrize("bits, narrow, torch_int", [("uint16", "bfloat16", torch.int16), ("uint8", "float8_e4m3fn",
                                                                                           torch.uint8)])
def test_reinterpret_loaded_code(target, bits, narrow, torch_int):
    # the other way: T.reinterpret of a stored narrow value reads its bits (the c family read the code, decoded it
    # and encoded it again, which turned bf16 NaN payloads into 0x7fc0)
    n = 1 << (16 if bits == "uint16" else 8)

    @T.prim_func
    def main(X: T.Tensor((n,), narrow), C: T.Tensor((n,), "int32")):
        with T.Kernel(1):
            for i in T.Parallel(n):
                C[i] = T.cast(T.reinterpret(X[i], bits), "int32")

    codes = torch.arange(n, dtype=torch.int32)
    x = codes.to(torch_int).view(torch.bfloat16 if bits == "uint16" else torch.float8_e4m3fn)
    c = tegula.compile(main, out_idx=[1], target=target)(x)
    got = torch.as_tensor(np.asarray(c)) if not isinstance(c, torch.Tensor) else c
    assert torch.equal(got.to(torch.int32), codes)
