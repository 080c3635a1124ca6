"""Element types of the tile language.

A ``DType`` compares equal to its name and to its aliases (``"float8_e4m3"`` is
``float8_e4m3fn``), so user code may mix strings and ``T.float32``-style objects.
"""
from __future__ import annotations

_ALIASES = {
    "float8_e4m3": "float8_e4m3fn", "float": "float32", "half": "float16", "bf16": "bfloat16",
    "fp32": "float32", "fp16": "float16", "int": "int32", "double": "float64", "float8_e8m0": "float8_e8m0fnu",
    "long": "int64", "short": "int16", "uint": "uint32", "ulong": "uint64",
    "tfloat32": "float32",  # stored as float32; tegula's GEMMs are at least as precise as TF32
}


class DType(str):
    """An element type. It is also the ``str`` of its name, as TileLang's dtypes are (``getattr(torch, T.float16)``
    and f-strings work), and compares equal to its aliases."""

    def __new__(cls, name: str, kind: str, bits: int):
        self = super().__new__(cls, name)
        self.name, self.kind, self.bits = name, kind, bits
        return self

    def __reduce__(self):
        return dtype, (self.name,)

    @property
    def is_float(self) -> bool:
        return self.kind == "float"

    @property
    def is_int(self) -> bool:
        """Signed or unsigned integer (not bool)."""
        return self.kind in ("int", "uint")

    @property
    def is_bool(self) -> bool:
        return self.kind == "bool"

    @property
    def is_narrow_float(self) -> bool:
        """A float stored in fewer than 32 bits: arithmetic computes in float32 and rounds per op."""
        return self.is_float and self.bits < 32

    @property
    def itemsize(self) -> int:
        return max(1, self.bits // 8)

    bytes = itemsize  # TileLang's name

    def as_torch(self):
        """The matching ``torch.dtype`` (imports torch on first use)."""
        import torch
        return getattr(torch, {"bool": "bool"}.get(self.name, self.name))

    def __eq__(self, other) -> bool:
        if isinstance(other, DType):
            return self.name == other.name
        if isinstance(other, str):
            return self.name == _ALIASES.get(other, other)
        return NotImplemented

    def __ne__(self, other) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __hash__(self) -> int:
        return hash(self.name)

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"T.{self.name}"

    def __call__(self, value=0):
        """``T.float32(0)``: a typed constant (or a cast when given an expression)."""
        from tegula.ir.expr import as_expr, cast
        return cast(as_expr(value), self)


_ALL = [
    DType("bool", "bool", 8),
    DType("int8", "int", 8), DType("int16", "int", 16), DType("int32", "int", 32), DType("int64", "int", 64),
    DType("uint8", "uint", 8), DType("uint16", "uint", 16), DType("uint32", "uint", 32), DType("uint64", "uint", 64),
    DType("float16", "float", 16), DType("bfloat16", "float", 16), DType("float32", "float", 32),
    DType("float64", "float", 64), DType("float8_e4m3fn", "float", 8), DType("float8_e5m2", "float", 8),
    DType("float8_e8m0fnu", "float", 8),
]
DTYPES: dict[str, DType] = {d.name: d for d in _ALL}

bool_ = DTYPES["bool"]
int8, int16, int32, int64 = (DTYPES[n] for n in ("int8", "int16", "int32", "int64"))
uint8, uint16, uint32, uint64 = (DTYPES[n] for n in ("uint8", "uint16", "uint32", "uint64"))
float16, bfloat16, float32, float64 = (DTYPES[n] for n in ("float16", "bfloat16", "float32", "float64"))
float8_e4m3fn, float8_e5m2, float8_e8m0fnu = (DTYPES[n] for n in ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu"))


def dtype(x) -> DType:
    """Normalise a dtype given as a DType, a string alias, a numpy/torch dtype or a Python type."""
    if isinstance(x, DType):
        return x
    if x is bool:
        return bool_
    if x is int:
        return int32
    if x is float:
        return float32
    name = str(x)
    for prefix in ("torch.", "T."):
        if name.startswith(prefix):
            name = name[len(prefix):]
    name = _ALIASES.get(name, name)
    if name in DTYPES:
        return DTYPES[name]
    raise TypeError(f"unknown dtype {x!r}; expected one of {', '.join(DTYPES)}")


def promote(a: DType, b: DType) -> DType:
    """The type of a binary operation on two typed operands (C-like, without promotion of narrow floats to int)."""
    if a == b:
        return a
    if a.is_float or b.is_float:
        if not (a.is_float and b.is_float):
            return a if a.is_float else b
        if a.bits != b.bits:
            return a if a.bits > b.bits else b
        return float32  # float16 with bfloat16, or two different fp8 formats: compute in float32
    if a.is_bool:
        return b
    if b.is_bool:
        return a
    if a.bits != b.bits:
        return a if a.bits > b.bits else b
    return a if a.kind == "uint" else b  # same width, one unsigned: unsigned wins as in C


def max_value(dt: DType) -> float | int:
    """Largest finite value of ``dt``."""
    dt = dtype(dt)
    finite = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38, "float32": 3.4028234663852886e38,
              "float64": 1.7976931348623157e308, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0,
              "float8_e8m0fnu": 1.7014118346046923e38}
    if dt.name in finite:
        return finite[dt.name]
    if dt.is_bool:
        return True
    return (1 << (dt.bits - 1)) - 1 if dt.kind == "int" else (1 << dt.bits) - 1


def min_value(dt: DType) -> float | int:
    """Smallest (most negative) finite value of ``dt``."""
    dt = dtype(dt)
    if dt.is_float:
        return 2.0 ** -127 if dt.name == "float8_e8m0fnu" else -max_value(dt)
    if dt.is_bool:
        return False
    return -(1 << (dt.bits - 1)) if dt.kind == "int" else 0


# exact rounding of Python floats to narrow formats (for typed constants), without numpy -----------------

_FORMATS = {  # name: (exponent bits, mantissa bits, saturate on overflow, has infinity)
    "float16": (5, 10, False, True), "bfloat16": (8, 7, False, True),
    "float8_e4m3fn": (4, 3, True, False), "float8_e5m2": (5, 2, False, True),
}


def round_to(value: float, d: DType) -> float:
    """``value`` rounded to nearest even in ``d`` (float32 first, as a float32 kernel value would be)."""
    import math
    import struct
    if d.name == "float64" or not d.is_float:
        return value
    try:
        value = struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        value = math.copysign(math.inf, value)
    if d.name == "float32" or math.isnan(value):
        return value
    if d.name == "float8_e8m0fnu":  # torch: sign dropped, exponent rounded half-up (ties stay at code 0)
        bits = struct.unpack("I", struct.pack("f", value))[0] & 0x7FFFFFFF
        e, m = bits >> 23, bits & 0x7FFFFF
        e += (m > 0x400000) or (m == 0x400000 and e > 0)
        return math.nan if e >= 255 else 2.0 ** (e - 127)
    ebits, mbits, saturate, has_inf = _FORMATS[d.name]
    bias = (1 << (ebits - 1)) - 1
    top = max_value(d)
    if math.isinf(value):
        return math.copysign(top, value) if saturate else value
    a = abs(value)
    if a == 0:
        return value
    e = max(math.frexp(a)[1] - 1, 1 - bias)  # exponent of the leading bit, clamped to the subnormal range
    q = a / 2.0 ** (e - mbits)               # the value in units of the last mantissa bit
    r = math.floor(q)
    if q - r > 0.5 or (q - r == 0.5 and r % 2 == 1):
        r += 1
    out = r * 2.0 ** (e - mbits)
    if out > top:
        out = top if saturate else (math.inf if has_inf else math.nan)
    return math.copysign(out, value)
