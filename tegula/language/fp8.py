"""``T.fp8`` helpers of kernel factories: which FP8 format a name means on tegula's targets (the OCP formats)."""
from __future__ import annotations

from tegula.ir import dtypes as dt


def determine_fp8_type(fp8_format: str = "e4m3") -> dt.DType:
    """``"e4m3"`` -> float8_e4m3fn, ``"e5m2"`` -> float8_e5m2."""
    if fp8_format not in ("e4m3", "e5m2"):
        raise ValueError(f"unsupported FP8 format {fp8_format!r}; expected 'e4m3' or 'e5m2'")
    return dt.float8_e4m3fn if fp8_format == "e4m3" else dt.float8_e5m2


def determine_torch_fp8_type(fp8_format: str = "e4m3"):
    """The matching torch dtype."""
    return determine_fp8_type(fp8_format).as_torch()
