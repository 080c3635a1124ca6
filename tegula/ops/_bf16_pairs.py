"""bfloat16 pairs: a bf16 row read as uint32 words, word i holding elements 2i (low half) and 2i + 1 (high half).

Widening a word's two elements to float32 takes one op each and no cross-lane shuffle (element 2i is the word
shifted left by 16, element 2i + 1 the word with its low half cleared), where a bf16 vector widened element by
element takes a load, a lane extract, two zero-extensions and two shifts per 32 values. Order-free work (a group's
amax) runs on the two halves as they are; results are put back in order by combining the even and odd results in
32-bit lanes and narrowing once: two e4m3 codes to one uint16 (even in the low byte), two bfloat16 to one uint32
(even in the low half), two e2m1 codes to one byte (even in the low nibble: the packed layout).

The caller views the tensor as uint32 words (torch ``x.view(torch.int32)``: last stride 1, even columns, even row
stride and a 4-byte-aligned start) and takes an element-wise path otherwise."""
from __future__ import annotations

import tegula.language as T


@T.macro
def even(w):
    """Element 2i of word ``w`` (uint32) as float32: exact, as the bf16 -> float32 conversion."""
    return T.reinterpret(w << 16, "float32")


@T.macro
def odd(w):
    """Element 2i + 1 of word ``w`` (uint32) as float32."""
    return T.reinterpret(w & 0xFFFF0000, "float32")


@T.macro
def odd_abs(w):
    """|odd(w)|: one and (a product by a positive scale then needs no sign mask: the callers' ``nonneg``)."""
    return T.reinterpret(w & 0x7FFF0000, "float32")


@T.macro
def abs_max(w, m):
    """max(m, |even(w)|, |odd(w)|), each step ``a > m ? a : m`` (NaN ignored, as T.reduce_absmax)."""
    a = T.abs(even(w))
    m1 = T.if_then_else(a > m, a, m)
    b = T.abs(odd(w))
    return T.if_then_else(b > m1, b, m1)


@T.macro
def abs_top(w):
    """A uint32 whose high half is max(|even(w)|, |odd(w)|) as bf16 bits, an integer max (the float order, NaN above
    inf), the low half garbage: the larger of the sign-cleared word and its low half shifted up."""
    m = w & 0x7FFF7FFF
    return T.max(m, m << 16)


@T.macro
def bf16_bits(v):
    """The bfloat16 rounding of float32 ``v`` (nearest even; a NaN gives 0x7fc0, as the prelude's conversion) in the
    high half of a uint32, the low half garbage."""
    x = T.reinterpret(v, "uint32")
    r = x + 0x7FFF + ((x >> 16) & 1)
    return T.if_then_else((x & 0x7FFFFFFF) > 0x7F800000, T.cast(0x7FC00000, "uint32"), r)


@T.macro
def bf16_pair(ve, vo):
    """Two float32 rounded to bfloat16 and packed as one uint32 word (``ve``'s in the low half)."""
    return (bf16_bits(vo) & 0xFFFF0000) | (bf16_bits(ve) >> 16)


@T.macro
def e4m3_sum(v, nonneg=False):
    """The rounded sum s of |v| whose low byte plus bits 20..27 is |v|'s e4m3 code (|v| < 464): |v| plus the float
    2^20 e (e its binade, at least 2^-6, the subnormal codes sharing 2^-6's spacing) and 152 steps of that sum's
    last place, which rounds |v| to nearest even at its code spacing in hardware. ``nonneg``: v's sign bit is 0."""
    a = T.reinterpret(v, "uint32") if nonneg else T.reinterpret(v, "uint32") & 0x7FFFFFFF
    e = T.max(a & 0x7F800000, T.cast(0x3C800000, "uint32"))
    return T.reinterpret(T.reinterpret(a, "float32") + T.reinterpret(e + ((20 << 23) + 152), "float32"), "uint32")


@T.macro
def e4m3_top(v):
    """T.cast(v, "float8_e4m3fn")'s code in bits 24..31 of a uint32 (lower bits garbage) for |v| < 464 or NaN (no
    saturation to 448): bits 24..31 of (s << 24) + (s << 4) are the low byte of s + (s >> 20)."""
    x = T.reinterpret(v, "uint32")
    s = e4m3_sum(v)
    u = T.if_then_else((x & 0x7FFFFFFF) > 0x7F800000, T.cast(0x7F000000, "uint32"), (s << 24) + (s << 4))
    return u | (x & 0x80000000)


@T.macro
def e4m3_pair(ve, vo):
    """Two float32 (|v| < 464 or NaN) cast to e4m3 and packed as one uint16 (``ve``'s code in the low byte)."""
    return T.cast((e4m3_top(ve) >> 24) | ((e4m3_top(vo) >> 16) & 0xFF00), "uint16")


@T.macro
def e4m3_pair_bits(se, so, signs):
    """The e4m3 codes of two e4m3_sum results as one uint16, se's in the low byte: bits 16..23 of (se << 16) + (se
    >> 4) are the low byte of se + (se >> 20), bits 24..31 of (so << 24) + (so << 4) that of so + (so >> 20) (no
    carry into either: the terms below are zero); ``signs`` holds the two signs at bits 23 and 31."""
    c = (((se << 16) + (se >> 4)) & 0x7F0000) | (((so << 24) + (so << 4)) & 0x7F000000) | signs
    return T.cast(c >> 16, "uint16")


@T.macro
def e4m3_pair_values(ve, vo):
    """The e4m3 codes of finite float32 ve, vo (|v| < 464) as one uint16, ve's in the low byte: e4m3_pair_finite
    on two values instead of a word's elements."""
    se = e4m3_sum(ve)
    so = e4m3_sum(vo)
    return e4m3_pair_bits(se, so, ((T.reinterpret(ve, "uint32") >> 8) & 0x800000)
                          | (T.reinterpret(vo, "uint32") & 0x80000000))


@T.macro
def mag_max(ve, vo):
    """The larger of |ve| and |vo| (float32) as float32 bits, an integer max (NaN above inf)."""
    return T.max(T.reinterpret(ve, "uint32") & 0x7FFFFFFF, T.reinterpret(vo, "uint32") & 0x7FFFFFFF)


@T.macro
def e4m3_pair_finite2(w, inv_e, inv_o):
    """e4m3_pair_finite with a scale per element: even(w) * inv_e and odd(w) * inv_o."""
    so = e4m3_sum(odd_abs(w) * inv_o, True)
    se = e4m3_sum(even(w) * inv_e)
    return e4m3_pair_bits(se, so, ((w << 8) & 0x800000) | (w & 0x80000000))


@T.macro
def e4m3_pair_finite(w, inv):
    """The e4m3 codes of even(w) * inv and odd(w) * inv (inv > 0, both products finite and below 464 in magnitude)
    as one uint16, even's in the low byte: the low byte of se + (se >> 20) and bits 8..15 of (so << 8) + (so >>
    12), the signs w's bits 15 and 31 moved to 7 and 15. (The codes built in the high half instead, odd's sign in
    place, took 4 more shifts per 64 values and ran 1.05x slower; gcc narrows these terms to 16-bit lanes one by
    one, 6 permutes per 64 values, and is still faster.)"""
    return e4m3_pair_finite2(w, inv, inv)
