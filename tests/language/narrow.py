"""The reference for float32 -> narrow float casts, independent of the torch version.

tegula's float8_e4m3fn cast saturates: every finite |x| >= 464 and +-inf give +-448 (TILELANG_SEMANTICS.md).
torch 2.13 on the CPU does the same, but earlier versions (2.11, say) give NaN there, so the tests' reference
clamps first: 448 is exact in e4m3, so values inside the range round as torch rounds them, and NaN stays NaN.
"""
import torch


def narrow_reference(a: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.float8_e4m3fn:
        a = a.clamp(-448.0, 448.0)  # clamp keeps NaN
    return a.to(dtype)
