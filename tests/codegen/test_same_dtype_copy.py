"""A T.copy between buffers of one narrow-float dtype moves bits: no widening to float and narrowing back (which
costs a rounding per element and would rewrite NaN payloads), on the c target; interp agrees bit for bit."""
import pytest
import torch

import tegula
import tegula.language as T


def staged_copy(n=64, dtype="float8_e4m3fn"):
    @T.prim_func
    def staged(X: T.Tensor((n,), dtype), Y: T.Tensor((n,), dtype)):
        with T.Kernel(T.ceildiv(n, 48)) as bx:
            s = T.alloc_shared((48,), dtype)
            T.copy(X[bx * 48], s)   # the second block reads past the end: zeros
            T.copy(s, Y[bx * 48])   # and its writes past the end are dropped
    return staged


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2", "bfloat16", "float16"])
@pytest.mark.parametrize("target", ["interp", "c"])
def test_bits_survive(target, dtype):
    torch_dtype = getattr(torch, dtype)
    bits = torch.arange(64, dtype=torch.int32) * 1021 % (256 if "float8" in dtype else 65536)
    x = bits.to(torch.uint8).view(torch_dtype) if "float8" in dtype else bits.to(torch.uint16).view(torch_dtype)
    x = x.contiguous()
    y = torch.zeros_like(x)
    tegula.compile(staged_copy(64, dtype), target=target)(x, y)
    view = torch.uint8 if "float8" in dtype else torch.int16
    nan = torch.isnan(x.float())
    assert torch.equal(y.view(view)[~nan], x.view(view)[~nan])
    assert torch.isnan(y.float()[nan]).all()


def test_c_source_has_no_conversion():
    src = tegula.compile(staged_copy(), target="c").get_kernel_source()
    body = src.split("tg_staged", 1)[1]
    assert "tg_f32_to_f8e4m3" not in body and "tg_f8e4m3_to_f32" not in body
