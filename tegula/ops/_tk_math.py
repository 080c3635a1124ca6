"""Float math in T.* whose every bit is pinned down, shared by the TileKernels-style ops.

TileKernels' kernels are checked bit for bit against torch. On the CPU, torch's ``sigmoid`` and ``silu`` compute
``exp`` with SLEEF's ``expf_u10`` (the vectorised path; ``torch.exp`` itself calls MKL's VML, which differs in about
1% of results), and TileKernels' CUDA code contracts ``a * b + c`` into one FMA where its references do the same. So:

- ``exp_f32(x)``: SLEEF's expf_u10 step by step (Cody-Waite reduction by ln 2, a degree-6 polynomial, two
  power-of-two scalings), so that ``1 / (1 + exp_f32(-x))`` equals ``torch.sigmoid(x)`` and ``x / (1 +
  exp_f32(-x))`` equals ``torch.nn.functional.silu(x)`` in every bit.
- ``fma_f32(a, b, c)``: a * b + c rounded once (``T.fma``: the CPU's FMA instruction, the same bits everywhere).

Macros inline at their call site: arguments are float32 expressions.
"""
from __future__ import annotations

import tegula.language as T

_R_LN2 = 1.442695040888963407359924681001892137426645954152985934135449406931
_L2U = 0.693145751953125
_L2L = 1.428606765330187045e-06
_EXP_POLY = (0.000198527617612853646278381, 0.00139304355252534151077271, 0.00833336077630519866943359,
             0.0416664853692054748535156, 0.166666671633720397949219, 0.5)
_RINT_MAGIC = 12582912.0  # 1.5 * 2**23: (x + M) - M rounds |x| < 2**22 to the nearest integer, ties to even


@T.macro
def fma_f32(a, b, c):
    return T.fma(a, b, c)


@T.macro
def _exp_poly(s):
    """exp(s) for the reduced argument |s| <= ln 2 / 2: 1 + s + s^2 P(s)."""
    u = fma_f32(T.cast(_EXP_POLY[0], "float32"), s, _EXP_POLY[1])
    u = fma_f32(u, s, _EXP_POLY[2])
    u = fma_f32(u, s, _EXP_POLY[3])
    u = fma_f32(u, s, _EXP_POLY[4])
    u = fma_f32(u, s, _EXP_POLY[5])
    return 1.0 + fma_f32(s * s, u, s)


@T.macro
def exp_f32(d):
    t = d * _R_LN2 + _RINT_MAGIC  # the nearest integer to d / ln 2 sits in t's low mantissa bits
    qf = t - _RINT_MAGIC
    q = T.reinterpret(t, "int32") - 0x4B400000  # (a bit read, not a float -> int conversion: stays vectorised)
    u = _exp_poly(fma_f32(qf, -_L2L, fma_f32(qf, -_L2U, d)))
    h = q >> 1
    u = u * T.reinterpret((h + 127) << 23, "float32") * T.reinterpret((q - h + 127) << 23, "float32")
    u = T.if_then_else(d < -104.0, T.cast(0.0, "float32"), u)
    return T.if_then_else(d > 100.0, T.infinity("float32"), u)


@T.macro
def exp_mid(d):
    """exp_f32(d) for |d| < 87, bit for bit (checked in C on every such float32): the power of two 2^q (|q| <= 126)
    is one normal float, so u * 2^q needs one multiply (exp_f32's two, u * 2^h * 2^(q - h), give the same bits:
    the first is exact, and where the result is subnormal both round the same product once), and the range
    selects for d < -104 and d > 100 fall away."""
    t = d * _R_LN2 + _RINT_MAGIC
    qf = t - _RINT_MAGIC
    u = _exp_poly(fma_f32(qf, -_L2L, fma_f32(qf, -_L2U, d)))
    return u * T.reinterpret((T.reinterpret(t, "int32") - (0x4B400000 - 127)) << 23, "float32")


@T.macro
def sigmoid_f32(x):
    return 1.0 / (1.0 + exp_f32(-x))


@T.macro
def silu_f32(x):
    return x / (1.0 + exp_f32(-x))
