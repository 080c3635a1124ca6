"""The T.* kernels behind ``tegula.ops.quant``: per-token / per-block / per-channel casts to e4m3 and e2m1 (FP4),
the casts back, and the e5m6 code (its kernels are in _e5m6_kernels).

Shapes are symbolic (``T.dynamic``): one compiled kernel serves every token count and hidden size; what is compiled
in is the input dtype, the output format, the scaling-group shape and the input scales' block shape. A block covers
BM rows x W columns (W a multiple of every group width), the x axis of the grid walks along a row so consecutive
blocks touch consecutive memory. Global reads past the tensor give 0 (T.copy), so a partial last group is scaled by
the amax of its real elements, as TileKernels' zero-padded reference does.

Numerics (TileKernels'): amax clamped below (1e-4 for e4m3 / e5m6, 6 * 2**-126 for e2m1); sf = amax / max and
inv = max / amax (two float32 divisions); with round_sf, sf = 2**ceil(log2(sf)) from its bits and inv = 1 / sf
exactly; q = x * inv cast with saturation (e4m3: RNE to +-448; e2m1: RNE to +-6, two codes per byte, low nibble
first; e5m6: float16 rounded toward zero, then RNE on the top 12 bits). Re-quantising an e4m3 / e2m1 input with
scales xs: amax over x * xs (elementwise float32 products), q = x * (xs * inv) (TileKernels' kernel order).
Scale factors are written as 32-bit words through runtime strides: float32 bits (row- or column-major), or packed
UE8M0 (4 exponent bytes of consecutive groups per int32, low byte first, unused bytes 0).
"""
from __future__ import annotations

import tegula.language as T
from tegula.ops import _bf16_pairs as P

FMT_MAX = {"e4m3": 448.0, "e2m1": 6.0, "e5m6": 65024.0}
CLAMP_MIN = {"e4m3": 1e-4, "e2m1": 6.0 * 2.0 ** -126, "e5m6": 1e-4}
IN_DTYPE = {"float32": "float32", "bfloat16": "bfloat16", "e4m3": "float8_e4m3fn", "e2m1": "uint8"}
OUT_DTYPE = {"e4m3": "float8_e4m3fn", "e2m1": "uint8", "e5m6": "uint32"}
ROUND_SF, PACKED_SF = 1, 2  # bits of the ``flags`` argument
TWO_120 = 2.0 ** 120  # e4m3 codes as float32 bits are 2^-120 times their value


# per-element and per-group helpers --------------------------------------------------------------------------------

@T.macro
def scale_of(amax, maxv, clamp_min, rnd):
    """(the sf word: float32 bits, the inverse scale, the sf's biased exponent (UE8M0)) of a group's amax."""
    a = T.max(amax, clamp_min)
    sf = a / maxv
    bits = T.reinterpret(sf, "int32")
    eb = ((bits - 1) >> 23) + 1  # ceil(log2(sf)) + 127: a > 0 is normal, so bits - 1 never borrows the sign
    word = T.if_then_else(rnd, eb << 23, bits)
    inv = T.if_then_else(rnd, T.reinterpret((254 - eb) << 23, "float32"), maxv / a)
    return word, inv, eb


@T.macro
def group_scales(amax, word, inv, eb, maxv, clamp_min, rnd, BM, GB):
    """scale_of over a (BM, GB) tile of group amaxes: the sf words, inverse scales and UE8M0 exponents."""
    for i, g in T.Parallel(BM, GB):
        w_, v_, e_ = scale_of(amax[i, g], maxv, clamp_min, rnd)
        word[i, g] = w_
        inv[i, g] = v_
        eb[i, g] = e_


@T.macro
def sf_from_word(word, packed_byte, packed):
    """A float32 scale from its stored word: float bits, or a UE8M0 byte (``packed_byte`` = which byte)."""
    return T.if_then_else(packed, T.reinterpret(((word >> (packed_byte * 8)) & 255) << 23, "float32"),
                          T.reinterpret(word, "float32"))


@T.macro
def e2m1_code(v):
    """The 4-bit e2m1 code of a float32 (RNE; |v| > 5, inf and NaN saturate to 6), sign in bit 3, higher bits 0.
    |v| (clamped to 6; NaN's bits clamp there too) plus the float 2^22 * e, e its binade (at least 1: the subnormal
    codes share 1's spacing 0.5), rounds to nearest even at e's code spacing e / 2 in hardware; the sum s is 2^22 * e
    plus k steps of its last place, its exponent field e's + 22, and the code 2 * log2(e) + k = k + 2 * (s's field)
    - 298: the low 3 bits of s + (s >> 22) once the magic carries 6 = -298 mod 16 in its low bits (6 more steps of
    the same grid: the rounding does not move). Identical to the RNE compare chain for all 2^32 inputs (and to the
    earlier s - e + (e >> 22) - const form, checked exhaustively in C), half its ops."""
    s = e2m1_sum(v)
    return T.cast(((s + (s >> 22)) & 7) | ((T.reinterpret(v, "uint32") >> 31) << 3), "int32")


@T.macro
def e2m1_sum(v, nonneg=False):
    """e2m1_code's sum s, whose s + (s >> 22) holds |v|'s code in its low 3 bits. ``nonneg``: v's sign bit is 0."""
    c = T.min(T.reinterpret(v, "uint32") if nonneg else T.reinterpret(v, "uint32") & 0x7FFFFFFF,
              T.cast(0x40C00000, "uint32"))
    e = T.max(c & 0x7F800000, T.cast(0x3F800000, "uint32"))
    return T.reinterpret(T.reinterpret(c, "float32") + T.reinterpret(e + ((22 << 23) + 6), "float32"), "uint32")


@T.macro
def e4m3_in_range(v, one_narrow=True):
    """T.cast(v, "float8_e4m3fn") for |v| < 464 or NaN, without the saturation to 448 that larger values need (one
    min fewer than the prelude's tg_f32_to_f8e4m3, the same rounding: checked equal in C on every such float32).
    The code, the low byte of s + (s >> 20), is taken as bits 24..31 of (s << 24) + (s << 4) (bits 20..27 of
    s + (s << 20), no carry into them) with the sign or-ed at bit 31, one shift right by 24: gcc then narrows one
    32-bit value per lane (3 permutes per 64 values) where the or of two shifted terms was narrowed term by term (9);
    byte-equal on all 2^32 inputs (C), the loop 0.120 -> 0.113 ns/value from L1. ``one_narrow`` False: the earlier
    two-term form (see per_token_cast)."""
    if one_narrow:
        return T.reinterpret(T.cast(P.e4m3_top(v) >> 24, "uint8"), "float8_e4m3fn")
    x = T.reinterpret(v, "uint32")
    s = P.e4m3_sum(v)
    r = T.if_then_else((x & 0x7FFFFFFF) > 0x7F800000, T.cast(0x7F, "uint32"), s + (s >> 20))
    return T.reinterpret(T.cast(((x >> 24) & 0x80) | r, "uint8"), "float8_e4m3fn")


@T.macro
def e4m3_value(q):
    """T.cast(q, "float32") of an e4m3 value in a multiply: its sign and 7 magnitude bits placed as float32 bits 31
    and 26..20 make the float32 2^-120 q (the subnormal codes fall on float32 subnormals, which have no implicit bit
    either), times 2^120, exact; 0x7f / 0xff (NaN) give +-0x7ff00000 as the prelude's conversion does. Wrong where
    the thread treats subnormal operands as zero (MXCSR.DAZ, torch.set_flush_denormal(True)): callers test
    ``subnormals_kept`` first."""
    b = T.cast(T.reinterpret(q, "uint8"), "uint32")
    sgn = (b << 24) & 0x80000000
    v = T.reinterpret(sgn | ((b << 20) & 0x07F00000), "float32") * TWO_120
    return T.if_then_else((b & 0x7F) == 0x7F, T.reinterpret(sgn | 0x7FF00000, "float32"), v)


@T.macro
def subnormals_kept(n):
    """True where this thread's float multiply keeps a subnormal operand (no DAZ); ``n`` a non-negative runtime
    integer (the compiler must not fold the product: it would not see the thread's mode)."""
    return T.reinterpret((n >> 31) | 1, "float32") * TWO_120 > 0.0


@T.macro
def e4m3_scaled(q, s):
    """e4m3_value(q) * (s / 2^120) for a code that is not NaN and s = 2^120 sf finite: q's byte sign-extended to 32
    bits and shifted by 20 places its magnitude bits at float32 bits 26..20 and its sign at 31..27, the mask keeps
    bit 31: the float32 2^-120 q (as e4m3_value's), times s. The same exact product as e4m3_value(q) * sf, rounded
    once (2^120 sf is exact where finite); under the same condition (subnormals_kept)."""
    b = T.cast(T.reinterpret(q, "int8"), "uint32")
    return T.reinterpret((b << 20) & 0x87F00000, "float32") * s


@T.macro
def e4m3_plain_tile(Q, xs, xs2, ok, r0, c0, BM, NB, W):
    """ok[0] = 1 where the BM x W e4m3 tile of Q at (r0, c0) holds no NaN code (magnitude bits 0x7f) and every
    scale of xs times 2^120 (into xs2) is finite: the tile e4m3_scaled decodes (a byte max per 64 codes)."""
    qm = T.alloc_fragment((64,), "uint8")
    qt = T.alloc_fragment((1,), "uint8")
    big = T.alloc_fragment((1,), "float32")
    T.fill(qm, 0)
    for i in T.serial(BM):
        for j in T.serial(W // 64):
            for m in T.Parallel(64):
                qm[m] = T.max(qm[m], T.reinterpret(Q[r0 + i, c0 + j * 64 + m], "uint8") & 0x7F)
    T.reduce_max(T.reshape(qm, (1, 64)), qt, dim=1)
    for i, c in T.Parallel(BM, NB):
        xs2[i, c] = xs[i, c] * TWO_120
    T.reduce_absmax(T.reshape(xs2, (1, BM * NB)), big, dim=1)
    if qt[0] < 0x7F and big[0] < T.infinity("float32"):
        ok[0] = 1


@T.macro
def e2m1_value(code):
    """The float32 value of a 4-bit e2m1 code (an int32 in 0..15)."""
    m = code & 7
    mag = T.if_then_else(m < 2, T.cast(m, "float32") * 0.5,
                         T.reinterpret((((m >> 1) + 126) << 23) | ((m & 1) << 22), "float32"))
    return T.if_then_else(code >= 8, -mag, mag)


@T.macro
def load_tile(X, xf, r0, c0, in_kind, BM, W):
    """x[r0:r0+BM, c0:c0+W] as float32 into ``xf`` (e2m1 input: packed bytes, decoded)."""
    if in_kind == "e2m1":
        xb = T.alloc_fragment((BM, W // 2), "uint8")
        T.copy(X[r0, c0 // 2], xb)
        for i, j in T.Parallel(BM, W):
            xf[i, j] = e2m1_value(T.cast(xb[i, j // 2] >> ((j % 2) * 4), "int32") & 15)
    else:
        T.copy(X[r0, c0], xf)


@T.macro
def load_in_scales(XS, xs, r0, c0, NT, hidden, xbt, xbc, in_packed, BM, NB):
    """The input's scales for rows r0.. and the NB blocks of xbc columns from c0, as float32 (clamped indices:
    rows / blocks past the end repeat the last one, their elements are zeros anyway)."""
    nxb = T.ceildiv(hidden, xbc)
    for i, c in T.Parallel(BM, NB):
        r = T.min(r0 + i, NT - 1) // xbt
        k = T.min(c0 // xbc + c, nxb - 1)
        if in_packed:
            xs[i, c] = sf_from_word(XS[r, k // 4], k % 4, True)
        else:
            xs[i, c] = T.reinterpret(XS[r, k], "float32")


@T.macro
def store_scales(S, word, eb, r0, g0, NT, ngroups, packed, BM, GB):
    """Write the BM x GB scale words of groups g0.. (packed: ceil(GB / 4) words of 4 exponent bytes, bytes of groups
    past ``ngroups`` 0; g0 a multiple of 4)."""
    if packed:
        for i, w in T.Parallel(BM, (GB + 3) // 4):
            g = g0 + w * 4
            v = (T.if_then_else(g < ngroups, eb[i, T.min(w * 4, GB - 1)], 0)
                 | (T.if_then_else(g + 1 < ngroups, eb[i, T.min(w * 4 + 1, GB - 1)], 0) << 8)
                 | (T.if_then_else(g + 2 < ngroups, eb[i, T.min(w * 4 + 2, GB - 1)], 0) << 16)
                 | (T.if_then_else(g + 3 < ngroups, eb[i, T.min(w * 4 + 3, GB - 1)], 0) << 24))
            if r0 + i < NT and g < ngroups:
                S[r0 + i, g // 4] = v
    else:
        for i, g in T.Parallel(BM, GB):
            if r0 + i < NT and g0 + g < ngroups:
                S[r0 + i, g0 + g] = word[i, g]


@T.macro
def column_absmax(xf, out, R, W):
    """out[j] = max over the R rows of |xf[r, j]| (row by row, so that the loop runs along contiguous columns)."""
    T.fill(out, 0.0)
    for r in T.serial(R):
        for j in T.Parallel(W):
            a = T.abs(xf[r, j])  # a > out ? a : out: max ignoring NaN (out is never NaN nor -0), one maxps
            out[j] = T.if_then_else(a > out[j], a, out[j])


@T.macro
def scaled(xg, xs, inv, i, g, k, G, xbc, requant):
    """Element (i, g, k) of the (BM, GB, G) tile ``xg`` times its group's inverse scale (a re-quantised input: times
    its input scale first, TileKernels' order)."""
    if requant:  # input blocks covering whole groups: one input scale per group, no per-element division
        return xg[i, g, k] * (xs[i, (g * G) // xbc if xbc % G == 0 else (g * G + k) // xbc] * inv[i, g])
    return xg[i, g, k] * inv[i, g]


@T.macro
def store_quantized(Q, v, r0, c0, fmt, BM, W):
    """Cast the float32 tile ``v`` (already scaled) to ``fmt`` and store it at Q[r0, c0] (e2m1: byte columns)."""
    if fmt == "e4m3":
        T.copy(v, Q[r0, c0])
    else:
        qp = T.alloc_fragment((BM, W // 2), "uint8")
        for i, j in T.Parallel(BM, W // 2):
            qp[i, j] = T.cast(e2m1_code(v[i, j * 2]) & 15 | ((e2m1_code(v[i, j * 2 + 1]) & 15) << 4), "uint8")
        T.copy(qp, Q[r0, c0 // 2])


# kernels ----------------------------------------------------------------------------------------------------------

def per_token_cast(in_kind, fmt, G, mode="cast", xb=(1, 1), in_packed=False, W=2048, BM=1):
    """X (num_tokens, x_cols) with row stride ``x_stride`` -> Q, S: one scale per G consecutive columns of a row.
    ``in_kind``: float32 / bfloat16, or e4m3 / e2m1 (packed bytes) with scales XS over blocks ``xb`` (tokens,
    channels). ``mode``: 'cast' (Q and S), 'sf_only' (S), 'with_sf' (Q from the scales given in S).
    ``flags``: ROUND_SF | PACKED_SF (PACKED_SF needs W a multiple of 4 * G: a block writes whole scale words)."""
    NT = T.dynamic("num_tokens")
    XC, XST, QR, QC = T.dynamic("x_cols"), T.dynamic("x_stride"), T.dynamic("q_rows"), T.dynamic("q_cols")
    SR, SC, SSM, SSK = T.dynamic("sf_rows"), T.dynamic("sf_cols"), T.dynamic("sf_sm"), T.dynamic("sf_sk")
    IR, IC, ISM, ISK = T.dynamic("xsf_rows"), T.dynamic("xsf_cols"), T.dynamic("xsf_sm"), T.dynamic("xsf_sk")
    xdt, qdt = IN_DTYPE[in_kind], OUT_DTYPE[fmt]
    requant = in_kind in ("e4m3", "e2m1")
    GB = W // G
    xbt, xbc = xb
    NB = W // xbc if requant else 1
    maxv, cmin = FMT_MAX[fmt], CLAMP_MIN[fmt]

    @T.prim_func
    def per_token_cast(X: T.StridedTensor((NT, XC), (XST, 1), xdt), XS: T.StridedTensor((IR, IC), (ISM, ISK), "int32"),
                       Q: T.Tensor((QR, QC), qdt), S: T.StridedTensor((SR, SC), (SSM, SSK), "int32"),
                       hidden: T.int32, flags: T.int32):
        with T.Kernel(T.ceildiv(hidden, W), T.ceildiv(NT, BM)) as (bx, by):
            r0, c0, g0 = by * BM, bx * W, bx * GB
            ngroups = T.ceildiv(hidden, G)
            rnd = (flags & ROUND_SF) != 0
            packed = (flags & PACKED_SF) != 0
            xf = T.alloc_fragment((BM, W), "float32")
            xs = T.alloc_fragment((BM, NB), "float32")
            inv = T.alloc_fragment((BM, GB), "float32")
            if in_kind == "e4m3" and r0 + (BM - 1) < NT and c0 + (W - 1) < XC and subnormals_kept(hidden):
                for i, j in T.Parallel(BM, W):  # a whole tile: decoded by a multiply
                    xf[i, j] = e4m3_value(X[r0 + i, c0 + j])
            else:
                load_tile(X, xf, r0, c0, in_kind, BM, W)
            if requant:
                load_in_scales(XS, xs, r0, c0, NT, hidden, xbt, xbc, in_packed, BM, NB)
            if mode == "with_sf":
                for i, g in T.Parallel(BM, GB):
                    ok = r0 + i < NT and g0 + g < ngroups
                    inv[i, g] = 1.0 / T.if_then_else(ok, T.reinterpret(S[T.min(r0 + i, NT - 1),
                                                                         T.min(g0 + g, ngroups - 1)], "float32"), 1.0)
            else:
                amax = T.alloc_fragment((BM, GB), "float32")
                if requant:
                    xd = T.alloc_fragment((BM, W), "float32")
                    for i, c, k in T.Parallel(BM, NB, xbc):  # (block, column in it): no per-element division
                        xd[i, c * xbc + k] = xf[i, c * xbc + k] * xs[i, c]
                    T.reduce_absmax(T.reshape(xd, (BM, GB, G)), amax, dim=2)
                else:
                    T.reduce_absmax(T.reshape(xf, (BM, GB, G)), amax, dim=2)
                top = T.alloc_fragment((1,), "float32")  # the block's largest amax: finite -> |q| <= 448 (1 + 2^-22)
                T.reduce_max(T.reshape(amax, (1, BM * GB)), top, dim=1)
                word = T.alloc_fragment((BM, GB), "int32")
                eb = T.alloc_fragment((BM, GB), "int32")
                group_scales(amax, word, inv, eb, maxv, cmin, rnd, BM, GB)
                store_scales(S, word, eb, r0, g0, NT, ngroups, packed, BM, GB)
            if mode != "sf_only":
                xg = T.reshape(xf, (BM, GB, G))
                if fmt == "e4m3":  # scale and narrow in one pass, straight into Q (a whole block) or through q
                    # x * (448 / amax) is at most 448 (1 + 2^-22), or NaN (x NaN, or x = inf: amax = inf, inv = 0),
                    # unless round_sf meets amax = inf (inv = -inf): then, and for given scales, the full cast
                    if mode == "cast" and r0 + (BM - 1) < QR and c0 + (W - 1) < QC and (
                            (flags & ROUND_SF) == 0 or top[0] < T.infinity("float32")):
                        for i, g, k in T.Parallel(BM, GB, G):  # (blocks of 1024 columns: the two-term narrowing,
                            # measured 1.15-1.23x faster there from memory, X's loads stalling 4x less, unexplained;
                            # 512, 1792, 2048 and 3584 columns are faster with one narrowing, 1024 in cache too)
                            Q[r0 + i, c0 + g * G + k] = e4m3_in_range(scaled(xg, xs, inv, i, g, k, G, xbc, requant),
                                                                      W != 1024)
                    elif r0 + (BM - 1) < QR and c0 + (W - 1) < QC:  # (the form guard_global_access proves from)
                        for i, g, k in T.Parallel(BM, GB, G):
                            Q[r0 + i, c0 + g * G + k] = scaled(xg, xs, inv, i, g, k, G, xbc, requant)
                    else:
                        q = T.alloc_fragment((BM, GB, G), "float8_e4m3fn")
                        for i, g, k in T.Parallel(BM, GB, G):
                            q[i, g, k] = scaled(xg, xs, inv, i, g, k, G, xbc, requant)
                        T.copy(T.reshape(q, (BM, W)), Q[r0, c0])
                else:
                    for i, g, k in T.Parallel(BM, GB, G):
                        xg[i, g, k] = scaled(xg, xs, inv, i, g, k, G, xbc, requant)
                    store_quantized(Q, xf, r0, c0, fmt, BM, W)
    return per_token_cast


def per_row_cast(in_kind, fmt, W=128, BM=1):
    """One scale per row (num_per_channels == hidden): the row's amax over chunks of W (a running max per
    column of the chunk, one reduction per row: a reduction per chunk measured 7% slower on e5m6), then the cast chunk
    by chunk. ``fmt`` e4m3 / e2m1 (e5m6 has its own kernel, _e5m6_kernels). W = 128 measured fastest (bf16
    7168-wide rows, 1 thread CPU time, W = 1024 -> 128: e4m3 59 -> 44 ms; 256 and 512 in between, 32 and 64 slower
    again)."""
    NT = T.dynamic("num_tokens")
    XC, XST, QC = T.dynamic("x_cols"), T.dynamic("x_stride"), T.dynamic("q_cols")
    SR, SC, SSM, SSK = T.dynamic("sf_rows"), T.dynamic("sf_cols"), T.dynamic("sf_sm"), T.dynamic("sf_sk")
    xdt, qdt = IN_DTYPE[in_kind], OUT_DTYPE[fmt]
    maxv, cmin = FMT_MAX[fmt], CLAMP_MIN[fmt]

    @T.prim_func
    def per_row_cast(X: T.StridedTensor((NT, XC), (XST, 1), xdt), Q: T.Tensor((NT, QC), qdt),
                     S: T.StridedTensor((SR, SC), (SSM, SSK), "int32"), hidden: T.int32, flags: T.int32):
        with T.Kernel(T.ceildiv(NT, BM)) as by:
            r0 = by * BM
            rnd = (flags & ROUND_SF) != 0
            packed = (flags & PACKED_SF) != 0
            xf = T.alloc_fragment((BM, W), "float32")
            amax = T.alloc_fragment((BM,), "float32")
            inv = T.alloc_fragment((BM,), "float32")
            lm = T.alloc_fragment((BM, W), "float32")  # per column of a chunk: the row's amax, lane by lane
            T.fill(lm, 0.0)
            for c in T.serial(T.ceildiv(hidden, W)):
                if c * W + (W - 1) < XC:  # a whole chunk: read in place
                    for i, j in T.Parallel(BM, W):
                        a = T.abs(T.cast(X[r0 + i, c * W + j], "float32"))  # a > m ? a : m: max ignoring NaN
                        lm[i, j] = T.if_then_else(a > lm[i, j], a, lm[i, j])
                else:
                    T.copy(X[r0, c * W], xf)
                    for i, j in T.Parallel(BM, W):
                        a = T.abs(xf[i, j])
                        lm[i, j] = T.if_then_else(a > lm[i, j], a, lm[i, j])
            T.reduce_absmax(lm, amax, dim=1)
            for i in T.Parallel(BM):
                w_, v_, e_ = scale_of(amax[i], maxv, cmin, rnd)
                inv[i] = v_
                if r0 + i < NT:
                    S[r0 + i, 0] = T.if_then_else(packed, e_, w_)
            for c in T.serial(T.ceildiv(hidden, W)):
                T.copy(X[r0, c * W], xf)
                for i, j in T.Parallel(BM, W):
                    xf[i, j] = xf[i, j] * inv[i]
                store_quantized(Q, xf, r0, c * W, fmt, BM, W)
    return per_row_cast


@T.macro
def e5m6_code(v):
    """The 12-bit e5m6 code of a float32: its float16 rounded toward zero (top 12 of 16 bits kept), then rounded to
    nearest even on the float32 bits below the kept mantissa (TileKernels' definition, subnormals included).
    Unconditional selects: below 2^-14 the truncated float16 code >> 4 is the significand >> (130 - exponent) (0 for
    shifts >= 24, the unsigned difference clamped to 31 covers both ends); from 2^-14 it is |v|'s bits >> 17
    rebiased, |v| clamped to 2^16 so that every float16 overflow (inf too) gives the infinity code 0x7C0; NaN gives
    0x7FF. Identical to the reference's case split for all 2^32 inputs."""
    xb = T.reinterpret(v, "uint32")
    r = xb & 0x7FFFFFFF
    sub = ((r & 0x7FFFFF) | 0x800000) >> T.min(T.cast(130, "uint32") - (r >> 23), T.cast(31, "uint32"))
    norm = (T.min(r, T.cast(0x47800000, "uint32")) >> 17) - 0x1C00
    c = T.if_then_else(r > 0x7F800000, T.cast(0x7FF, "uint32"), T.if_then_else(r < 0x38800000, sub, norm))
    up = T.cast((c & 1) + (xb & 0x1FFFF) > 0x10000, "uint32")
    return (c + up + ((xb >> 20) & 0x800)) & 0xFFF


def per_block_cast(in_kind, fmt, bt, bc, HP, mode="cast"):
    """One scale per bt x bc block (TileKernels' per_block_cast). A block of the grid is a band of bt whole rows (HP
    columns compiled in, a multiple of bc and >= hidden): the column absmax streams the band row by row, the groups
    of bc columns reduce it, then the cast reads the band again row by row (from the last-level cache by then), as
    per_channel_cast does (128 x 128 blocks, 18688 x 7168 bf16, 1 thread CPU time: 65-68 -> 51-56 ms)."""
    NT, XC, QR, QC = T.dynamic("num_tokens"), T.dynamic("x_cols"), T.dynamic("q_rows"), T.dynamic("q_cols")
    SR, SC, SSM, SSK = T.dynamic("sf_rows"), T.dynamic("sf_cols"), T.dynamic("sf_sm"), T.dynamic("sf_sk")
    xdt, qdt = IN_DTYPE[in_kind], OUT_DTYPE[fmt]
    GB = HP // bc
    maxv, cmin = FMT_MAX[fmt], CLAMP_MIN[fmt]

    # e4m3: Q's shape is X's (one bounds check), so a row's copy in, cast and copy out fuse into one loop
    QS = (NT, XC) if fmt == "e4m3" and mode != "sf_only" else (QR, QC)

    @T.prim_func
    def per_block_cast(X: T.Tensor((NT, XC), xdt), Q: T.Tensor(QS, qdt),
                       S: T.StridedTensor((SR, SC), (SSM, SSK), "int32"), hidden: T.int32, flags: T.int32):
        with T.Kernel(T.ceildiv(NT, bt)) as by:
            r0 = by * bt
            ngroups = T.ceildiv(hidden, bc)
            rnd = (flags & ROUND_SF) != 0
            packed = (flags & PACKED_SF) != 0
            xr = T.alloc_fragment((1, HP), xdt)  # one row in the input's dtype, widened where read
            inv = T.alloc_fragment((1, GB), "float32")
            if mode == "with_sf":
                for i, g in T.Parallel(1, GB):
                    ok = g < ngroups
                    inv[i, g] = 1.0 / T.if_then_else(ok, T.reinterpret(S[by, T.min(g, ngroups - 1)], "float32"), 1.0)
            else:
                cols = T.alloc_fragment((HP,), "float32")
                amax = T.alloc_fragment((1, GB), "float32")
                T.fill(cols, 0.0)
                if bt % 4 == 0 and r0 + (bt - 1) < NT and HP - 1 < XC:  # a whole band: 4 rows a pass, in place
                    for r in T.serial(bt // 4):
                        for j in T.Parallel(HP):
                            cols[j] = _rows_absmax(X, r0 + r * 4, j, cols[j], 4)
                else:
                    for r in T.serial(bt):
                        T.copy(X[r0 + r, 0], xr)
                        for j in T.Parallel(HP):
                            a = T.abs(T.cast(xr[0, j], "float32"))  # a > out ? a : out: max ignoring NaN, one maxps
                            cols[j] = T.if_then_else(a > cols[j], a, cols[j])
                T.reduce_absmax(T.reshape(cols, (1, GB, bc)), amax, dim=2)
                top = T.alloc_fragment((1,), "float32")
                T.reduce_max(amax, top, dim=1)
                word = T.alloc_fragment((1, GB), "int32")
                eb = T.alloc_fragment((1, GB), "int32")
                group_scales(amax, word, inv, eb, maxv, cmin, rnd, 1, GB)
                store_scales(S, word, eb, by, 0, T.ceildiv(NT, bt), ngroups, packed, 1, GB)
            if mode != "sf_only":
                invc = T.alloc_fragment((1, GB, bc), "float32")  # per column: the row loops below stay one loop each
                for i, g, k in T.Parallel(1, GB, bc):
                    invc[i, g, k] = inv[0, g]
                ic = T.reshape(invc, (HP,))
                if fmt == "e4m3" and mode == "cast" and r0 + (bt - 1) < NT and HP - 1 < XC and (
                        (flags & ROUND_SF) == 0 or top[0] < T.infinity("float32")):  # values within 448 (1 + 2^-22)
                    for r in T.serial(bt):  # the group's scale hoisted per bc columns (a per-column ic[j] load
                        for g, k in T.Parallel(GB, bc):  # per value measured 6% slower from memory)
                            Q[r0 + r, g * bc + k] = e4m3_in_range(
                                T.cast(X[r0 + r, g * bc + k], "float32") * inv[0, g])
                elif fmt == "e4m3" and r0 + (bt - 1) < NT and HP - 1 < XC:  # a whole band: read, cast, store in place
                    for r in T.serial(bt):
                        for j in T.Parallel(HP):
                            Q[r0 + r, j] = T.cast(T.cast(X[r0 + r, j], "float32") * ic[j], "float8_e4m3fn")
                else:
                    for r in T.serial(bt):
                        T.copy(X[r0 + r, 0], xr)
                        if fmt == "e4m3":
                            q = T.alloc_fragment((1, HP), "float8_e4m3fn")
                            for j in T.Parallel(HP):
                                q[0, j] = T.cast(xr[0, j], "float32") * ic[j]
                            T.copy(q, Q[r0 + r, 0])
                        else:
                            v = T.alloc_fragment((1, HP), "float32")
                            for j in T.Parallel(HP):
                                v[0, j] = T.cast(xr[0, j], "float32") * ic[j]
                            store_quantized(Q, v, r0 + r, 0, fmt, 1, HP)
    return per_block_cast


def _rows_absmax(X, r, j, m, n):
    """max(m, |X[r, j]|, ..., |X[r + n - 1, j]|) as one expression, each step ``a > m ? a : m`` (NaN ignored)."""
    for u in range(n):
        a = T.abs(T.cast(X[r + u, j], "float32"))
        m = T.if_then_else(a > m, a, m)
    return m


def per_channel_cast(in_kind, HP, bt=128):
    """One scale per column per bt rows (TileKernels' per_channel_cast, e4m3): S (num_tokens / bt, hidden) float32.
    A block is a band of bt whole rows (HP >= hidden columns, compiled in): the column absmax streams the band row by
    row from memory, then the cast reads it again row by row (from the last-level cache by then). Tiles of bt rows x
    512 columns read 128 short runs at a time instead: 62-65 -> 55 ms at 18688 x 7168 bf16, 1 thread CPU time."""
    NT, H, SR = T.dynamic("num_tokens"), T.dynamic("hidden"), T.dynamic("sf_rows")
    xdt = IN_DTYPE[in_kind]

    @T.prim_func
    def per_channel_cast(X: T.Tensor((NT, H), xdt), Q: T.Tensor((NT, H), "float8_e4m3fn"),
                         S: T.Tensor((SR, H), "int32"), flags: T.int32):
        with T.Kernel(T.ceildiv(NT, bt)) as by:
            rnd = (flags & ROUND_SF) != 0
            xr = T.alloc_fragment((1, HP), xdt)  # one row in the input's dtype, widened where read
            amax = T.alloc_fragment((HP,), "float32")
            inv = T.alloc_fragment((HP,), "float32")
            q = T.alloc_fragment((1, HP), "float8_e4m3fn")
            r0 = by * bt
            if r0 + (bt - 1) < NT and HP - 1 < H:  # a whole band: X read where it lies, 4 rows a pass for the max
                T.fill(amax, 0.0)
                for r in T.serial(bt // 4):
                    for j in T.Parallel(HP):
                        amax[j] = _rows_absmax(X, r0 + r * 4, j, amax[j], 4)
                for j in T.Parallel(HP):
                    w_, v_, e_ = scale_of(amax[j], 448.0, 1e-4, rnd)
                    inv[j] = v_
                    S[by, j] = w_
                top = T.alloc_fragment((1,), "float32")  # finite (or no round_sf): values within 448 (1 + 2^-22)
                T.reduce_max(T.reshape(amax, (1, HP)), top, dim=1)
                if (flags & ROUND_SF) == 0 or top[0] < T.infinity("float32"):
                    for r in T.serial(bt):
                        for j in T.Parallel(HP):
                            Q[r0 + r, j] = e4m3_in_range(T.cast(X[r0 + r, j], "float32") * inv[j])
                else:
                    for r in T.serial(bt):
                        for j in T.Parallel(HP):
                            Q[r0 + r, j] = T.cast(T.cast(X[r0 + r, j], "float32") * inv[j], "float8_e4m3fn")
            else:
                T.fill(amax, 0.0)
                for r in T.serial(bt):
                    T.copy(X[by * bt + r, 0], xr)
                    for j in T.Parallel(HP):
                        a = T.abs(T.cast(xr[0, j], "float32"))  # a > out ? a : out: max ignoring NaN, one maxps
                        amax[j] = T.if_then_else(a > amax[j], a, amax[j])
                for j in T.Parallel(HP):
                    w_, v_, e_ = scale_of(amax[j], 448.0, 1e-4, rnd)
                    inv[j] = v_
                    if j < H:
                        S[by, j] = w_
                for r in T.serial(bt):
                    T.copy(X[by * bt + r, 0], xr)
                    for j in T.Parallel(HP):
                        q[0, j] = T.cast(xr[0, j], "float32") * inv[j]
                    T.copy(q, Q[by * bt + r, 0])
    return per_channel_cast


def cast_back(in_fmt, out_dtype, bt, bc, in_packed, W=2048, BM=1):
    """Q (e4m3, or e2m1 bytes) and its scales over bt x bc blocks -> Out = q * sf in ``out_dtype``. ``bc`` 0: one
    scale per row (column index 0)."""
    NT, QC, OC = T.dynamic("num_tokens"), T.dynamic("q_cols"), T.dynamic("out_cols")
    SR, SC, SSM, SSK = T.dynamic("sf_rows"), T.dynamic("sf_cols"), T.dynamic("sf_sm"), T.dynamic("sf_sk")
    qdt = IN_DTYPE[in_fmt]
    NB = 1 if bc == 0 else W // bc

    @T.prim_func
    def cast_back(Q: T.Tensor((NT, QC), qdt), S: T.StridedTensor((SR, SC), (SSM, SSK), "int32"),
                  Out: T.Tensor((NT, OC), out_dtype), hidden: T.int32):
        with T.Kernel(T.ceildiv(hidden, W), T.ceildiv(NT, BM)) as (bx, by):
            r0, c0 = by * BM, bx * W
            xf = T.alloc_fragment((BM, W), "float32")
            xs = T.alloc_fragment((BM, NB), "float32")
            if in_fmt == "e4m3" and bc != 0 and r0 + (BM - 1) < NT and c0 + (W - 1) < QC and c0 + (W - 1) < OC:
                # a whole tile. bfloat16: read and scale into a float32 tile, then one converting streaming copy per
                # row (tegula_stream.h: rounded in hardware where the ISA has it, Out's lines not read before they
                # are written); float32: read, scale and store in one pass (a streaming copy measured slower).
                # Both decode e4m3 by a multiply unless the thread flushes subnormal operands: a tile with no NaN
                # code whose scales times 2^120 are finite by e4m3_scaled (one multiply, no select), others by
                # e4m3_value
                load_in_scales(S, xs, r0, c0, NT, hidden, bt, bc, in_packed, BM, NB)
                xs2 = T.alloc_fragment((BM, NB), "float32")
                plain = T.alloc_fragment((1,), "int32")
                plain[0] = 0
                if subnormals_kept(hidden):
                    e4m3_plain_tile(Q, xs, xs2, plain, r0, c0, BM, NB, W)
                if out_dtype == "bfloat16":
                    if plain[0] == 1:
                        for i, c, k in T.Parallel(BM, NB, bc):
                            xf[i, c * bc + k] = e4m3_scaled(Q[r0 + i, c0 + c * bc + k], xs2[i, c])
                    elif subnormals_kept(hidden):
                        for i, c, k in T.Parallel(BM, NB, bc):
                            xf[i, c * bc + k] = e4m3_value(Q[r0 + i, c0 + c * bc + k]) * xs[i, c]
                    else:
                        for i, c, k in T.Parallel(BM, NB, bc):
                            xf[i, c * bc + k] = T.cast(Q[r0 + i, c0 + c * bc + k], "float32") * xs[i, c]
                    for i in T.serial(BM):
                        T.copy(xf[i, 0:W], Out[r0 + i, c0:c0 + W], eviction_policy="evict_first")
                elif plain[0] == 1:
                    for i, c, k in T.Parallel(BM, NB, bc):
                        Out[r0 + i, c0 + c * bc + k] = e4m3_scaled(Q[r0 + i, c0 + c * bc + k], xs2[i, c])
                elif subnormals_kept(hidden):
                    for i, c, k in T.Parallel(BM, NB, bc):
                        Out[r0 + i, c0 + c * bc + k] = e4m3_value(Q[r0 + i, c0 + c * bc + k]) * xs[i, c]
                else:
                    for i, c, k in T.Parallel(BM, NB, bc):
                        Out[r0 + i, c0 + c * bc + k] = T.cast(T.cast(Q[r0 + i, c0 + c * bc + k], "float32") * xs[i, c],
                                                              out_dtype)
            else:
                load_tile(Q, xf, r0, c0, in_fmt, BM, W)
                if bc == 0:
                    for i, c in T.Parallel(BM, NB):
                        xs[i, c] = sf_from_word(S[T.min(r0 + i, NT - 1) // bt, 0], 0, in_packed)
                    for i, j in T.Parallel(BM, W):
                        xf[i, j] = xf[i, j] * xs[i, 0]
                else:
                    load_in_scales(S, xs, r0, c0, NT, hidden, bt, bc, in_packed, BM, NB)
                    xb = T.reshape(xf, (BM, NB, bc))
                    for i, c, k in T.Parallel(BM, NB, bc):
                        xb[i, c, k] = xb[i, c, k] * xs[i, c]
                T.copy(xf, Out[r0, c0])
    return cast_back


def e2m1_unpack(W=2048, BM=1):
    """Packed e2m1 bytes (num_tokens, cols) -> float32 (num_tokens, 2 * cols)."""
    NT, QC, OC = T.dynamic("num_tokens"), T.dynamic("q_cols"), T.dynamic("out_cols")

    @T.prim_func
    def e2m1_unpack(Q: T.Tensor((NT, QC), "uint8"), Out: T.Tensor((NT, OC), "float32")):
        with T.Kernel(T.ceildiv(OC, W), T.ceildiv(NT, BM)) as (bx, by):
            xf = T.alloc_fragment((BM, W), "float32")
            load_tile(Q, xf, by * BM, bx * W, "e2m1", BM, W)
            T.copy(xf, Out[by * BM, bx * W])
    return e2m1_unpack
