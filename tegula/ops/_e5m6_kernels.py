"""The T.* kernels behind ``tegula.ops.quant.per_token_cast_to_e5m6`` (one scale per row, 8 e5m6 codes per 3 uint32
words, code 0 in the top bits of word 0) and ``cast_back_e5m6`` (at the end of this file).

A row is read as words of two adjacent values (bfloat16: uint32, as tegula.ops._bf16_pairs; float32: int64), so a
lane holds an even and an odd element without shuffles and builds the 24-bit pair (code(even) << 12) | code(odd)
itself; 4 pairs make 3 words. The first pass takes the row's largest and smallest nonzero magnitude as integer bits
(their order is the magnitudes' for non-NaN values). A row of finite values whose nonzero values all scale to at
least 2^-14 (the smallest normal float16) takes ``e5m6_code_normal`` (without its max where no value is 0); the
others (NaN, inf, or values 2^30 below the row's amax) take ``e5m6_code``, exact on every input. A block walks R
rows in a T.Pipelined loop: the pair copy of each chunk prefetches the next row's chunk while this one is coded.
"""
from __future__ import annotations

import tegula.language as T
from tegula.ops._quant_kernels import (
    CLAMP_MIN,
    FMT_MAX,
    PACKED_SF,
    ROUND_SF,
    e5m6_code,
    scale_of,
    sf_from_word,
    subnormals_kept,
)

# per input dtype: (its bits as an integer, the pair word, |x|'s bits mask, +inf's bits)
_BITS = {"bfloat16": ("uint16", "uint32", 0x7FFF, 0x7F80), "float32": ("uint32", "int64", 0x7FFFFFFF, 0x7F800000)}
SIGN28 = 0x10000000


@T.macro
def e5m6_code_normal(v, sign28, zeros=True):
    """``e5m6_code`` of a float32 v >= 0 that is 0 or in [2^-14, 2^16), with the sign bit ``sign28`` (0 or 1 << 28),
    shifted left by 17 (bits 0..16 are not part of it): v's bits rounded to nearest even at bit 17 (the code's last
    place) and rebiased, 0 taken as 2^-15 (whose code is 0; ``zeros`` False: v is not 0); the sum stays below 2^28,
    so the sign is or-ed in. Equal to e5m6_code on every such float32 (checked in C)."""
    y = T.max(T.reinterpret(v, "uint32"), T.cast(0x38000000, "uint32")) if zeros else T.reinterpret(v, "uint32")
    return (y + (0xFFFF - 0x38000000) + ((y >> 17) & 1)) | sign28


@T.macro
def pair_values(w, in_kind):
    """(|even|, |odd|, even's sign at bit 28, odd's) of a pair word, the magnitudes as float32."""
    if in_kind == "bfloat16":
        return (T.reinterpret((w << 16) & 0x7FFF0000, "float32"), T.reinterpret(w & 0x7FFF0000, "float32"),
                (w << 13) & SIGN28, (w >> 3) & SIGN28)
    lo = T.cast(w, "uint32")
    hi = T.cast(w >> 32, "uint32")
    return (T.reinterpret(lo & 0x7FFFFFFF, "float32"), T.reinterpret(hi & 0x7FFFFFFF, "float32"),
            (lo >> 3) & SIGN28, (hi >> 3) & SIGN28)


@T.macro
def signed(a, sign28):
    """The float32 magnitude ``a`` with the sign ``sign28`` (bit 28) put back."""
    return T.reinterpret(T.reinterpret(a, "uint32") | (sign28 << 3), "float32")


@T.macro
def pair_code(w, inv, in_kind, normal, zeros=True):
    """The pair word ``w`` scaled by ``inv`` as (code(even) << 17) | (code(odd) << 5) (24 bits from bit 5: the even
    code stays where e5m6_code_normal leaves it)."""
    e, o, se, so = pair_values(w, in_kind)
    if normal:  # odd: >> 17 << 5 (its bits 0..16 dropped)
        return ((e5m6_code_normal(e * inv, se, zeros) & 0x1FFE0000)
                | ((e5m6_code_normal(o * inv, so, zeros) >> 17) << 5))
    return (e5m6_code(signed(e, se) * inv) << 17) | (e5m6_code(signed(o, so) * inv) << 5)


@T.macro
def pack_pairs(P, words, ng):
    """words[3g..3g+2] from the pairs P[4g..4g+3] (24 bits from bit 5), g < ng. Three statements of one shape
    (no shift by 0): gcc's SLP makes each 16 words of two two-source permutes, two shifts and an or (with the pairs
    from bit 0 the third word had another shape, and all three were stored word by word)."""
    for g in T.Parallel(ng):
        words[g * 3] = (P[g * 4] << 3) | (P[g * 4 + 1] >> 21)
        words[g * 3 + 1] = (P[g * 4 + 1] << 11) | (P[g * 4 + 2] >> 13)
        words[g * 3 + 2] = (P[g * 4 + 2] << 19) | (P[g * 4 + 3] >> 5)


@T.macro
def row_bits(X, hi, lo, lz, r, hidden, XC, bdt, amask, A):
    """Per lane of A: the largest |x| bits (hi), the smallest nonzero |x| bits - 1 (lo; 0 - 1 wraps to the top) and
    the smallest (lz) over row r."""
    T.fill(hi, 0)
    T.fill(lo, T.max_value(bdt))
    T.fill(lz, T.max_value(bdt))
    na = hidden // A
    for c in T.serial(na):
        if c * A + (A - 1) < XC:  # (always: the form guard_global_access proves the reads from)
            for j in T.Parallel(A):
                a = T.reinterpret(X[r, c * A + j], bdt) & amask
                hi[j] = T.max(hi[j], a)
                lo[j] = T.min(lo[j], T.cast(a - 1, bdt))
                lz[j] = T.min(lz[j], a)
    if na * A < hidden:  # (a loop of its own: fused with the reduction after it, it cost 13% on whole rows)
        for j in T.Parallel(A):
            if na * A + j < hidden:
                a = T.reinterpret(X[r, na * A + j], bdt) & amask
                hi[j] = T.max(hi[j], a)
                lo[j] = T.min(lo[j], T.cast(a - 1, bdt))
                lz[j] = T.min(lz[j], a)


def widths(hidden: int) -> tuple[int, int]:
    """(W, A) of per_row_cast_e5m6 for rows of ``hidden`` values: chunks of 512 where they divide the row, else a
    row of at most 2048 values (a multiple of 64) as one chunk, else 512 and a partial last chunk. A row's fixed costs
    (reductions, scale, the partial chunk and first-pass lanes) weigh on short rows: 465920 x 576 bf16, 1 thread CPU
    time, (W, A) = (512, 256) 1.79 cycles/value, (512, 64) 1.47, (576, 64) 0.75; 131072 x 2048: A 128 / 256 equal,
    W 1024 / 2048 1.08x / 1.02x of 512."""
    if hidden % 512 == 0:
        return 512, 128
    if hidden % 64 == 0 and hidden <= 2048:
        return hidden, 64
    return 512, 64


def per_row_cast_e5m6(in_kind, W=512, A=128, R=64):
    """X (num_tokens, hidden) float32 / bfloat16 with row stride ``x_stride`` and XW, the same memory as pair words
    (num_tokens, hidden / 2) -> Q (num_tokens, hidden / 8 * 3) uint32 and one scale word per row in S (``flags``:
    ROUND_SF | PACKED_SF, as the other casts). ``hidden`` a multiple of 8. The first pass keeps A lanes, the cast
    takes W values at a time (a partial last chunk element-guarded), a block R rows (see ``widths``). 1 thread
    process CPU time, 37376 x 7168 bf16: W 256 / 512 / 1024, R 16 / 64 equal within 2%; R 1 (no prefetch) 1.08x;
    the words written with plain stores instead of streaming ones 1.37x; the next row's first pass folded into this
    row's chunks (no prefetch, the magnitudes' lanes through memory) 1.65x."""
    NT = T.dynamic("num_tokens")
    XC, XST, WC, WST, QC = (T.dynamic("x_cols"), T.dynamic("x_stride"), T.dynamic("xw_cols"),
                            T.dynamic("xw_stride"), T.dynamic("q_cols"))
    SR, SC, SSM, SSK = T.dynamic("sf_rows"), T.dynamic("sf_cols"), T.dynamic("sf_sm"), T.dynamic("sf_sk")
    bdt, wdt, amask, inf_bits = _BITS[in_kind]
    maxv, cmin = FMT_MAX["e5m6"], CLAMP_MIN["e5m6"]
    shift = 16 if in_kind == "bfloat16" else 0  # magnitude bits -> float32 bits
    NP, NW = W // 2, W // 8 * 3  # pairs and words of a chunk

    @T.prim_func
    def per_row_cast_e5m6(X: T.StridedTensor((NT, XC), (XST, 1), in_kind),
                          XW: T.StridedTensor((NT, WC), (WST, 1), wdt), Q: T.Tensor((NT, QC), "uint32"),
                          S: T.StridedTensor((SR, SC), (SSM, SSK), "int32"), hidden: T.int32, flags: T.int32):
        with T.Kernel(T.ceildiv(NT, R)) as b:
            rnd = (flags & ROUND_SF) != 0
            packed = (flags & PACKED_SF) != 0
            hi = T.alloc_fragment((A,), bdt)
            lo = T.alloc_fragment((A,), bdt)
            lz = T.alloc_fragment((A,), bdt)
            mx = T.alloc_fragment((1,), bdt)
            mn = T.alloc_fragment((1,), bdt)
            mz = T.alloc_fragment((1,), bdt)
            amax = T.alloc_fragment((1,), "float32")
            xw = T.alloc_fragment((NP,), wdt)
            P = T.alloc_fragment((NP,), "uint32")
            words = T.alloc_fragment((NW,), "uint32")
            nfull = hidden // W
            for i in T.Pipelined(R, num_stages=2):  # the pair copies prefetch the next row's chunks
                r = b * R + i
                if r < NT:
                    row_bits(X, hi, lo, lz, r, hidden, XC, bdt, amask, A)
                    T.reduce_max(hi, mx, dim=0)
                    T.reduce_min(lo, mn, dim=0)
                    T.reduce_min(lz, mz, dim=0)
                    amax[0] = T.reinterpret(T.cast(mx[0], "uint32") << shift, "float32")
                    if mx[0] > inf_bits:  # a NaN: the amax of the other values (T.max ignores NaN)
                        amax[0] = 0.0
                        for j in T.serial(hidden):
                            amax[0] = T.max(amax[0], T.abs(T.cast(X[r, j], "float32")))
                    w_, inv, e_ = scale_of(amax[0], maxv, cmin, rnd)
                    S[r, 0] = T.if_then_else(packed, e_, w_)
                    small = T.reinterpret((T.cast(mn[0], "uint32") + 1) << shift, "float32")
                    normal = (mx[0] < inf_bits and amax[0] * inv < 65536.0
                              and (mn[0] == T.max_value(bdt) or small * inv >= 6.103515625e-05))
                    for c in T.serial(nfull):
                        if c * NP + (NP - 1) < WC:  # (always, as above)
                            T.copy(XW[r, c * NP], xw)  # read by nobody (dropped): its prefetch stays
                            if normal and mz[0] != 0:  # no zero: no max to take it to 2^-15 (0.95x)
                                for m in T.Parallel(NP):
                                    P[m] = pair_code(XW[r, c * NP + m], inv, in_kind, True, False)
                            elif normal:
                                for m in T.Parallel(NP):
                                    P[m] = pair_code(XW[r, c * NP + m], inv, in_kind, True)
                            else:
                                for m in T.Parallel(NP):
                                    P[m] = pair_code(XW[r, c * NP + m], inv, in_kind, False)
                            pack_pairs(P, words, W // 8)
                            T.copy(words, Q[r, c * NW], eviction_policy="evict_first")
                    if nfull * W < hidden:  # the last hidden % W values (a multiple of 8)
                        if normal:
                            for m in T.Parallel(NP):
                                if nfull * NP + m < hidden // 2:
                                    P[m] = pair_code(XW[r, nfull * NP + m], inv, in_kind, True)
                        else:
                            for m in T.Parallel(NP):
                                if nfull * NP + m < hidden // 2:
                                    P[m] = pair_code(XW[r, nfull * NP + m], inv, in_kind, False)
                        pack_pairs(P, words, W // 8)
                        for k in T.Parallel(NW):
                            if nfull * NW + k < hidden // 8 * 3:
                                Q[r, nfull * NW + k] = words[k]
    return per_row_cast_e5m6


# the cast back -----------------------------------------------------------------------------------------------------

# pair k of 4 groups (12 words) from bit 4: (k, word a, word b, s), (w[a] << s | w[b] >> (32 - s)) & 0x0FFFFFF0
_UNPACK = tuple((k, k // 4 * 3 + a, k // 4 * 3 + b, s)
                for k, (a, b, s) in enumerate([(1, 0, 28), (0, 1, 20), (1, 2, 12), (2, 0, 4)] * 4))


@T.macro
def unpack_words(Qr, P, ng):
    """P[4g..4g+3] = the 24-bit pairs of words Qr[3g .. 3g + 2] from bit 4 (the inverse of pack_pairs), g < ng (a
    multiple of 4). 16 statements of one shape a loop step, (a << s | b >> (32 - s)) & mask with the two words never
    the same (a rotate is another shape): gcc's SLP builds the 16 pairs of two permutes, two shifts and a ternlog,
    where a group a step took 3-word loads and 4-word stores through ~12 permutes (1.0 -> 0.94 cycles/value)."""
    for g in T.Parallel(ng // 4):
        for k, a, b, s in _UNPACK:
            P[g * 16 + k] = ((Qr[g * 12 + a] << s) | (Qr[g * 12 + b] >> (32 - s))) & 0x0FFFFFF0


@T.macro
def code_value(c, s):
    """The float32 value of the 12-bit code ``c`` (float16 bits 4..15) times ``s`` = the scale * 2^112: its sign and
    magnitude bits placed as float32 bits make the value * 2^-112 (float16 subnormals on float32 subnormals, no
    implicit bit either), exact; the exponent 31 (inf, NaN) is raised to 255, its mantissa kept (x86 quiets a NaN
    in the multiply, as the float16 -> float32 conversion and multiply do)."""
    mag = c & 0x7FF
    bits = ((c & 0x800) << 20) | (mag << 17) | T.if_then_else(mag >= 0x7C0, T.cast(0x70000000, "uint32"),
                                                               T.cast(0, "uint32"))
    return T.reinterpret(bits, "float32") * s


@T.macro
def bf16_top(v):
    """float32 ``v`` rounded to bfloat16 (nearest even; NaN -> 0x7fc0, as tg_f32_to_bf16) in the top 16 bits."""
    b = T.reinterpret(v, "uint32")
    return T.if_then_else(v != v, T.cast(0x7FC00000, "uint32"), b + 0x7FFF + ((b >> 16) & 1))


def cast_back_e5m6(out_kind, bt, in_packed, W=512, R=64):
    """e5m6 words Q (num_tokens, hidden / 8 * 3) and one scale word per bt rows in S -> Out as pair words:
    bfloat16 (uint32, num_tokens x hidden / 2: even element in the low half) or float32 (int64, the even one in the
    low word). A row's scale times 2^112 multiplies the codes' bits (code_value) where it is finite and this thread
    keeps subnormal operands; other rows decode through float16."""
    NT, QC, OC = T.dynamic("num_tokens"), T.dynamic("q_cols"), T.dynamic("out_cols")
    SR, SC, SSM, SSK = T.dynamic("sf_rows"), T.dynamic("sf_cols"), T.dynamic("sf_sm"), T.dynamic("sf_sk")
    odt = "uint32" if out_kind == "bfloat16" else "int64"
    NP, NW = W // 2, W // 8 * 3

    @T.macro
    def out_pair(p, s, fast):
        if fast:  # (code_value keeps the code's 12 bits)
            e, o = code_value(p >> 16, s), code_value(p >> 4, s)
        else:
            e = T.cast(T.reinterpret(T.cast((p >> 12) & 0xFFF0, "uint16"), "float16"), "float32") * s
            o = T.cast(T.reinterpret(T.cast(p & 0xFFF0, "uint16"), "float16"), "float32") * s
        if out_kind == "bfloat16":
            return (bf16_top(o) & 0xFFFF0000) | (bf16_top(e) >> 16)
        return (T.cast(T.reinterpret(o, "uint32"), "int64") << 32) | T.cast(T.reinterpret(e, "uint32"), "int64")

    @T.prim_func
    def cast_back_e5m6(Q: T.Tensor((NT, QC), "uint32"), S: T.StridedTensor((SR, SC), (SSM, SSK), "int32"),
                       Out: T.Tensor((NT, OC), odt), hidden: T.int32):
        with T.Kernel(T.ceildiv(NT, R)) as b:
            P = T.alloc_fragment((NP,), "uint32")
            ow = T.alloc_fragment((NP,), odt)
            qw = T.alloc_fragment((NW,), "uint32")
            nc = T.ceildiv(hidden, W)
            for i in T.Pipelined(R, num_stages=2):  # the word copies prefetch the next row's
                r = b * R + i
                if r < NT:
                    s = sf_from_word(S[r // bt, 0], 0, in_packed)
                    s2 = s * 5.192296858534828e33  # 2^112
                    fast = s2 < T.infinity("float32") and subnormals_kept(hidden)
                    for c in T.serial(nc):
                        T.copy(Q[r, c * NW], qw)
                        unpack_words(qw, P, W // 8)
                        if fast:
                            for m in T.Parallel(NP):
                                ow[m] = out_pair(P[m], s2, True)
                        else:
                            for m in T.Parallel(NP):
                                ow[m] = out_pair(P[m], s, False)
                        T.copy(ow, Out[r, c * NP], eviction_policy="evict_first")
    return cast_back_e5m6
