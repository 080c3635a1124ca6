"""SwiGLU fused with the per-token FP8 cast (TileKernels' ``swiglu_forward_and_per_token_cast`` and
``swiglu_backward_and_per_token_cast``), kernels in T.*; exported from ``tegula.ops.quant``.

Numerics, all float32: silu(l) = l / (1 + exp(-l)) with ``exp`` bit-identical to torch's CPU sigmoid / silu (see
``_tk_math``), out = silu(l) * r (* the routing weight); with a clamp c, l <= c and |r| <= c first (and, with
``clamped_count``, the three counts added to it). A bfloat16 left value has 2^16 possible bit patterns, so the
forward reads silu(l) from a table of all of them (silu_table, built once per target by a T.* kernel with the same
formula: the same bits), a gather in place of the exponential and the division. The backward's input gradient
uses 1 + x * (1 - s) as one fused multiply-add; the weight gradient sums grad_out * act over the row in a fixed
order: 32 lanes (lane l takes the columns l, l + 32, ...) accumulated in column order, then the lanes pairwise
(l + 16 into l, then 8, 4, 2, 1).
"""
from __future__ import annotations

import math

import tegula.language as T
from tegula.ops import _bf16_pairs as P
from tegula.ops import _tk
from tegula.ops._quant_kernels import (PACKED_SF, ROUND_SF, e4m3_in_range, group_scales, scale_of,
                                       store_scales)
from tegula.ops._tk_math import exp_f32, exp_mid, fma_f32, silu_f32
from tegula.ops.norm import pair_cast

LANES = 32
MID = 87.0  # rows whose |left| values are all below this take exp_mid (_tk_math: exact below 87)
MID_BF16 = 0x42AE  # 87.0's bfloat16 bits


@T.macro
def lane_sum(p, acc, BM, H):
    """acc[i, 0] = sum over j of p[i, j] in the lane order of the module docstring (p is (BM, H), H % 32 == 0)."""
    pv = T.reshape(p, (BM, H // LANES, LANES))
    T.fill(acc, 0.0)
    for c in T.serial(H // LANES):
        for i, lane in T.Parallel(BM, LANES):
            acc[i, lane] = acc[i, lane] + pv[i, c, lane]
    for step in T.unroll(5):
        half = 16 >> step
        for i, lane in T.Parallel(BM, 16):
            if lane < half:
                acc[i, lane] = acc[i, lane] + acc[i, lane + half]


@T.macro
def left_top(X, r0, big, top, clamp, BM, H, use_clamp):
    """top[0] = the rows' largest |left| (clamped; NaN skipped: exp_mid and exp_f32 agree on NaN, inf is not < MID),
    read from X in place."""
    if X.dtype == "bfloat16" and not use_clamp:  # |left|'s bits in 16-bit lanes (NaN's are above MID's: exp_f32)
        b16 = T.alloc_fragment((BM, 2 * LANES), "uint16")
        t16 = T.alloc_fragment((1,), "uint16")
        T.fill(b16, 0)
        for c in T.serial(H // (2 * LANES)):
            for i, lane in T.Parallel(BM, 2 * LANES):
                a16 = T.reinterpret(X[r0 + i, c * 2 * LANES + lane], "uint16") & 0x7FFF
                b16[i, lane] = T.max(b16[i, lane], a16)
        T.reduce_max(T.reshape(b16, (1, BM * 2 * LANES)), t16, dim=1)
        top[0] = T.if_then_else(t16[0] < MID_BF16, 0.0, MID)
    else:
        T.fill(big, 0.0)
        for c in T.serial(H // LANES):
            for i, lane in T.Parallel(BM, LANES):
                lx = T.cast(X[r0 + i, c * LANES + lane], "float32")
                a = T.abs(T.min(lx, clamp) if use_clamp else lx)
                big[i, lane] = T.if_then_else(a > big[i, lane], a, big[i, lane])
        T.reduce_max(T.reshape(big, (1, BM * LANES)), top, dim=1)


TABLE = 1 << 16  # silu_table's entries: one per bfloat16 bit pattern
TABLE_MID = 1 << 15  # entry of the bits b: int16(b) + TABLE_MID (sign-extended: gcc gathers with such an index)


def silu_table():
    """TB[e] = silu(l) in float32 for the bfloat16 l whose bits are e ^ 0x8000 (e = int16(bits) + TABLE_MID), by
    the forward's formula (exp_f32: exp_mid where |l| < MID gives the same bits)."""
    @T.prim_func
    def silu_table(TB: T.Tensor((TABLE,), "float32")):
        with T.Kernel(TABLE // 1024) as b:
            for e in T.Parallel(1024):
                bits = T.cast((b * 1024 + e) ^ TABLE_MID, "uint16")
                lv = T.cast(T.reinterpret(bits, "bfloat16"), "float32")
                TB[b * 1024 + e] = silu_f32(lv)
    return silu_table


_TABLES: dict = {}


def _silu_table():
    """silu_table's values for the current target, built on first use."""
    t = _tk.torch()
    tgt = _tk.target()
    tb = _TABLES.get(tgt)
    if tb is None:
        tb = t.empty(TABLE, dtype=t.float32)
        _tk.kernel(silu_table)(tb)
        _TABLES[tgt] = tb
    return tb


@T.macro
def silu_of_bits(TB, s):
    """silu of the bfloat16 whose bits, sign-extended to int32, are ``s``, from silu_table."""
    return TB[s + TABLE_MID]


@T.macro
def swiglu_rows(X, r0, yv, wr, ok, clamp, BM, H, with_weight, use_clamp, mid, TB=None, silu_c=None):
    """yv = silu(left) * right (* wr) of rows r0.., read from X in place, 0 in rows not ok; mid: every |left| <
    MID (exp_mid); TB: silu from silu_table (bfloat16 X; silu_c = silu(clamp)). In steps of CW columns, each
    prefetching the next rows' left and right columns of the next step (T.Pipelined: the copies into pf are
    dropped): on an Intel Xeon the right half's first read stalled 18% of the kernel without it (see b5e25a8)."""
    CW = math.gcd(H, 256)
    pf = T.alloc_fragment((BM, CW), X.dtype)
    for c in T.Pipelined(H // CW, num_stages=2):
        T.copy(X[r0 + BM, c * CW], pf)
        T.copy(X[r0 + BM, H + c * CW], pf)
        for i, jj in T.Parallel(BM, CW):
            j = c * CW + jj
            rv = T.cast(X[r0 + i, H + j], "float32")
            if use_clamp:
                rv = T.if_then_else(rv > clamp, clamp, T.if_then_else(rv < -clamp, -clamp, rv))
            if TB is not None:
                sv = silu_of_bits(TB, T.cast(T.reinterpret(X[r0 + i, j], "int16"), "int32"))
                if use_clamp:
                    sv = T.if_then_else(T.cast(X[r0 + i, j], "float32") > clamp, silu_c[0], sv)
                v = sv * rv
            else:
                lv = T.cast(X[r0 + i, j], "float32")
                if use_clamp:
                    lv = T.if_then_else(lv > clamp, clamp, lv)
                v = lv / (1.0 + (exp_mid(-lv) if mid else exp_f32(-lv))) * rv
            if with_weight:
                v = v * wr[i]
            yv[i, j] = T.if_then_else(ok[i] != 0, v, 0.0)


@T.macro
def swiglu_block(X, r0, yv, big, top, wr, ok, clamp, BM, H, with_weight, use_clamp, TB, silu_c):
    if X.dtype == "bfloat16":  # silu from the table: no range pass
        swiglu_rows(X, r0, yv, wr, ok, clamp, BM, H, with_weight, use_clamp, False, TB, silu_c)
    else:
        left_top(X, r0, big, top, clamp, BM, H, use_clamp)
        if top[0] < MID:
            swiglu_rows(X, r0, yv, wr, ok, clamp, BM, H, with_weight, use_clamp, True)
        else:
            swiglu_rows(X, r0, yv, wr, ok, clamp, BM, H, with_weight, use_clamp, False)


def swiglu_forward(H, G, in_dtype, with_weight, with_p2e, use_clamp, count_clamp, BM=1, RB=32):
    """X (num_tokens, 2H) -> Q e4m3 (num_tokens, H), S: silu(X[:, :H]) * X[:, H:] (* TW[P2T[row]]), one scale per G
    columns. Rows with P2E < 0 are not computed: zeros, and the smallest scale."""
    NT, XST = T.dynamic("num_tokens"), T.dynamic("x_stride")
    NP, NW, NE = T.dynamic("np"), T.dynamic("nw"), T.dynamic("ne")
    SR, SC, SSM, SSK = T.dynamic("sf_rows"), T.dynamic("sf_cols"), T.dynamic("sf_sm"), T.dynamic("sf_sk")
    GB = H // G
    NTB = TABLE if in_dtype == "bfloat16" else 1  # silu_table's values (float32 X: unused)

    @T.prim_func
    def swiglu_forward(X: T.StridedTensor((NT, 2 * H), (XST, 1), in_dtype), Q: T.Tensor((NT, H), "float8_e4m3fn"),
                       S: T.StridedTensor((SR, SC), (SSM, SSK), "int32"), P2T: T.Tensor((NP,), "int32"),
                       TW: T.Tensor((NW,), "float32"), P2E: T.Tensor((NE,), "int32"), CNT: T.Tensor((3,), "int64"),
                       TB: T.Tensor((NTB,), "float32"), clamp: T.float32, sf_min: T.float32, flags: T.int32):
        with T.Kernel(T.ceildiv(NT, BM * RB)) as by:
            rnd = (flags & ROUND_SF) != 0
            packed = (flags & PACKED_SF) != 0
            silu_c = T.alloc_fragment((1,), "float32")  # silu(clamp): the value of every clamped left
            silu_c[0] = silu_f32(clamp)
            # RB row groups a block; X is read in place (no staged copy; swiglu_rows prefetches the next row)
            for it in T.serial(RB):
                r0 = (by * RB + it) * BM
                if r0 < NT:  # the last block's rows past the end: nothing to do
                    ok = T.alloc_fragment((BM,), "int32")
                    wr = T.alloc_fragment((BM,), "float32")
                    for i in T.Parallel(BM):
                        r = T.min(r0 + i, NT - 1)
                        ok[i] = T.cast(r0 + i < NT, "int32")
                        if with_p2e:
                            ok[i] = ok[i] * T.cast(P2E[r] >= 0, "int32")
                        if with_weight:
                            p = P2T[r]
                            wr[i] = T.if_then_else(p >= 0, TW[T.max(p, 0)], 0.0)
                    if use_clamp and count_clamp:
                        flg = T.alloc_fragment((BM, 3, H), "int32")
                        for i, j in T.Parallel(BM, H):
                            lx = T.cast(X[r0 + i, j], "float32")
                            rx = T.cast(X[r0 + i, H + j], "float32")
                            flg[i, 0, j] = T.cast(lx > clamp, "int32") * ok[i]
                            flg[i, 1, j] = T.cast(rx > clamp, "int32") * ok[i]
                            flg[i, 2, j] = T.cast(rx < -clamp, "int32") * ok[i]
                        per_row = T.alloc_fragment((BM, 3), "int32")
                        total = T.alloc_fragment((3,), "int32")
                        T.reduce_sum(flg, per_row, dim=2)
                        T.reduce_sum(per_row, total, dim=0)
                        for k in T.serial(3):
                            T.atomic_add(CNT[k], T.cast(total[k], "int64"))
                    y = T.alloc_fragment((BM, GB, G), "float32")
                    yv = T.reshape(y, (BM, H))
                    big = T.alloc_fragment((BM, LANES), "float32")
                    top = T.alloc_fragment((1,), "float32")
                    if r0 + (BM - 1) < NT:  # whole rows: X read without bounds checks
                        swiglu_block(X, r0, yv, big, top, wr, ok, clamp, BM, H, with_weight, use_clamp, TB, silu_c)
                    else:
                        swiglu_block(X, r0, yv, big, top, wr, ok, clamp, BM, H, with_weight, use_clamp, TB, silu_c)
                    amax = T.alloc_fragment((BM, GB), "float32")
                    inv = T.alloc_fragment((BM, GB), "float32")
                    word = T.alloc_fragment((BM, GB), "int32")
                    eb = T.alloc_fragment((BM, GB), "int32")
                    T.reduce_absmax(y, amax, dim=2)
                    group_scales(amax, word, inv, eb, 448.0, sf_min, rnd, BM, GB)
                    store_scales(S, word, eb, r0, 0, NT, GB, packed, BM, GB)
                    ytop = T.alloc_fragment((1,), "float32")
                    T.reduce_max(T.reshape(amax, (1, BM * GB)), ytop, dim=1)
                    # y * inv is within 448 (1 + 2^-22) or NaN unless round_sf meets an infinite amax: the full
                    # cast then
                    if r0 + (BM - 1) < NT and ((flags & ROUND_SF) == 0 or ytop[0] < T.infinity("float32")):
                        for i, g, k in T.Parallel(BM, GB, G):
                            Q[r0 + i, g * G + k] = e4m3_in_range(y[i, g, k] * inv[i, g])
                    elif r0 + (BM - 1) < NT:  # whole rows: scale, narrow and store into Q in one pass
                        for i, g, k in T.Parallel(BM, GB, G):
                            Q[r0 + i, g * G + k] = T.cast(y[i, g, k] * inv[i, g], "float8_e4m3fn")
                    else:
                        q = T.alloc_fragment((BM, GB, G), "float8_e4m3fn")
                        for i, g, k in T.Parallel(BM, GB, G):
                            q[i, g, k] = y[i, g, k] * inv[i, g]
                        T.copy(T.reshape(q, (BM, H)), Q[r0, 0])
    return swiglu_forward


def swiglu_forward_pairs(H, G, with_weight, with_p2e, use_clamp, RB=32, SW=64):
    """swiglu_forward for bfloat16 X read as uint32 words of two elements (_bf16_pairs; X (num_tokens, H) words:
    left H / 2, then right H / 2) with Q written as uint16 pairs of e4m3 codes (norm.pair_cast, the same bits as
    swiglu_forward's cast): silu of each half-word gathered from silu_table, the products kept as even and odd
    halves with each group's running magnitude max (no float32 row pass for the amax, one narrowing per two
    codes). Rows in steps of SW words, each step prefetching the next row's words of the next step (the copies
    into pf are dropped). No clamped_count (swiglu_forward counts).
    On an Intel Xeon (2 vCPUs, KVM, 2 MiB L2), 131040 x 4096, 2 threads, alternating processes, the generated C
    edited (not kept): the prefetch into L1 (T0) instead of L2 19.5-20.6 vs 19.8-20.5 GB/s; every other line
    prefetched 16.7-17.0 vs 20.0-20.3; none 17.9 vs 20.1; the next row's codes prefetched for writing 19.6-19.9 both.
    There the two 16-lane gathers of a 16-word step cost 12.8 TSC cycles of the ~29.5 the step takes from cache;
    silu computed instead (exp_mid, 1 + e, a division: the table's bits) 20.6."""
    NT, XST = T.dynamic("num_tokens"), T.dynamic("x_stride2")
    NP, NW, NE = T.dynamic("np"), T.dynamic("nw"), T.dynamic("ne")
    SR, SC, SSM, SSK = T.dynamic("sf_rows"), T.dynamic("sf_cols"), T.dynamic("sf_sm"), T.dynamic("sf_sk")
    H2, GB, GH = H // 2, H // G, G // 2
    L = 16  # lanes of a group's running max (GH is a multiple of SW = 64 words)
    assert GH % SW == 0 and SW % L == 0

    @T.prim_func
    def swiglu_forward_pairs(X: T.StridedTensor((NT, H), (XST, 1), "uint32"), Q: T.Tensor((NT, H2), "uint16"),
                             S: T.StridedTensor((SR, SC), (SSM, SSK), "int32"), P2T: T.Tensor((NP,), "int32"),
                             TW: T.Tensor((NW,), "float32"), P2E: T.Tensor((NE,), "int32"),
                             TB: T.Tensor((TABLE,), "float32"), clamp: T.float32, sf_min: T.float32,
                             flags: T.int32):
        with T.Kernel(T.ceildiv(NT, RB)) as by:
            silu_c = T.alloc_fragment((1,), "float32")  # silu(clamp): the value of every clamped left
            silu_c[0] = silu_f32(clamp)
            xe = T.alloc_fragment((1, GB, GH), "float32")
            xo = T.alloc_fragment((1, GB, GH), "float32")
            xev = T.reshape(xe, (1, H2))
            xov = T.reshape(xo, (1, H2))
            ab = T.alloc_fragment((1, GB, L), "uint32")
            pf = T.alloc_fragment((1, SW), "uint32")  # read by nobody: the copies go, their prefetches stay
            wr = T.alloc_fragment((1,), "float32")
            for it in T.serial(RB):
                r0 = by * RB + it
                if r0 < NT:
                    if with_weight:
                        p = P2T[r0]
                        wr[0] = T.if_then_else(p >= 0, TW[T.max(p, 0)], 0.0)
                    T.fill(ab, 0)
                    for s in T.Pipelined(H2 // SW, num_stages=2):
                        T.copy(X[r0 + 1, s * SW], pf)
                        T.copy(X[r0 + 1, H2 + s * SW], pf)
                        g = (s * SW) // GH
                        for i, l in T.Parallel(1, L):
                            for j in T.unroll(SW // L):
                                k = s * SW + j * L + l
                                wl = X[r0, k]
                                wv = X[r0, H2 + k]
                                se = silu_of_bits(TB, T.reinterpret(wl << 16, "int32") >> 16)
                                so = silu_of_bits(TB, T.reinterpret(wl, "int32") >> 16)
                                re = P.even(wv)
                                ro = P.odd(wv)
                                if use_clamp:
                                    se = T.if_then_else(P.even(wl) > clamp, silu_c[0], se)
                                    so = T.if_then_else(P.odd(wl) > clamp, silu_c[0], so)
                                    re = T.if_then_else(re > clamp, clamp, T.if_then_else(re < -clamp, -clamp, re))
                                    ro = T.if_then_else(ro > clamp, clamp, T.if_then_else(ro < -clamp, -clamp, ro))
                                ve = se * re
                                vo = so * ro
                                if with_weight:
                                    ve = ve * wr[0]
                                    vo = vo * wr[0]
                                if with_p2e:  # rows not routed: zeros
                                    ve = T.if_then_else(P2E[r0] >= 0, ve, 0.0)
                                    vo = T.if_then_else(P2E[r0] >= 0, vo, 0.0)
                                xev[i, k] = ve
                                xov[i, k] = vo
                                ab[i, g, l] = T.max(ab[i, g, l], P.mag_max(ve, vo))
                    pair_cast(Q, S, xe, xo, ab, r0, 0, 0, NT, GB, True, 448.0, sf_min, flags, 1, GB, GH)
    return swiglu_forward_pairs


def swiglu_backward(H, G, use_clamp, BM=1):
    """The SwiGLU backward of TileKernels with the e4m3 per-token cast of the input gradient."""
    NT, NK = T.dynamic("num_expand_tokens"), T.dynamic("num_token_topk")
    GB2 = 2 * H // G

    @T.prim_func
    def swiglu_backward(XQ: T.Tensor((NT, 2 * H), "float8_e4m3fn"), XS: T.Tensor((NT, GB2), "float32"),
                        GO: T.Tensor((NT, H), "bfloat16"), WT: T.Tensor((NK,), "float32"),
                        P2T: T.Tensor((NT,), "int32"), TTP: T.Tensor((NK,), "int32"),
                        OUT: T.Tensor((NT, H), "bfloat16"), GQ: T.Tensor((NT, 2 * H), "float8_e4m3fn"),
                        GS: T.Tensor((NT, GB2), "float32"), XG: T.Tensor((NT, 2 * H), "bfloat16"),
                        WG: T.Tensor((NK,), "float32"), clamp: T.float32, flags: T.int32):
        with T.Kernel(T.ceildiv(T.max(NT, NK), BM)) as by:
            r0 = by * BM
            rnd = (flags & ROUND_SF) != 0
            for i in T.Parallel(BM):
                if r0 + i < NK:
                    if TTP[r0 + i] == -1:
                        WG[r0 + i] = 0.0
            if r0 < NT:
                idx = T.alloc_fragment((BM,), "int32")
                wr = T.alloc_fragment((BM,), "float32")
                for i in T.Parallel(BM):
                    idx[i] = T.if_then_else(r0 + i < NT, P2T[T.min(r0 + i, NT - 1)], -1)
                    wr[i] = T.if_then_else(idx[i] >= 0, WT[T.max(idx[i], 0)], 0.0)
                xq = T.alloc_fragment((BM, 2, GB2 // 2, G), "float32")
                xs = T.alloc_fragment((BM, 2, GB2 // 2), "float32")
                go = T.alloc_fragment((BM, H), "float32")
                T.copy(XQ[r0, 0], T.reshape(xq, (BM, 2 * H)))
                T.copy(XS[r0, 0], T.reshape(xs, (BM, GB2)))
                T.copy(GO[r0, 0], go)
                xv = T.reshape(xq, (BM, 2, H))
                for i, h, g, k in T.Parallel(BM, 2, GB2 // 2, G):
                    xq[i, h, g, k] = xq[i, h, g, k] * xs[i, h, g]
                grad = T.alloc_fragment((BM, 2, GB2 // 2, G), "float32")
                gv = T.reshape(grad, (BM, 2, H))
                prod = T.alloc_fragment((BM, H), "float32")
                out = T.alloc_fragment((BM, H), "float32")
                for i, j in T.Parallel(BM, H):
                    x = xv[i, 0, j]
                    y = xv[i, 1, j]
                    cx = x > clamp if use_clamp else False
                    cyu = y > clamp if use_clamp else False
                    cyl = y < -clamp if use_clamp else False
                    if use_clamp:
                        x = T.if_then_else(cx, clamp, x)
                        y = T.if_then_else(cyu, clamp, T.if_then_else(cyl, -clamp, y))
                    g = go[i, j]
                    tmp = 1.0 + exp_f32(-x)
                    act = x / tmp * y
                    s = 1.0 / tmp
                    gws = g * wr[i] * s
                    prod[i, j] = g * act
                    out[i, j] = act * wr[i]
                    gx = gws * y * fma_f32(x, 1.0 - s, 1.0)
                    gy = gws * x
                    if use_clamp:
                        gx = T.if_then_else(cx, 0.0, gx)
                        gy = T.if_then_else(cyu or cyl, 0.0, gy)
                    gv[i, 0, j] = gx
                    gv[i, 1, j] = gy
                T.copy(out, OUT[r0, 0])
                T.copy(T.reshape(grad, (BM, 2 * H)), XG[r0, 0])
                acc = T.alloc_fragment((BM, LANES), "float32")
                lane_sum(prod, acc, BM, H)
                for i in T.Parallel(BM):
                    if idx[i] >= 0:
                        WG[idx[i]] = acc[i, 0]
                amax = T.alloc_fragment((BM, 2, GB2 // 2), "float32")
                inv = T.alloc_fragment((BM, 2, GB2 // 2), "float32")
                T.reduce_absmax(grad, amax, dim=3)
                for i, h, g in T.Parallel(BM, 2, GB2 // 2):
                    w_, v_, e_ = scale_of(amax[i, h, g], 448.0, 1e-4, rnd)
                    inv[i, h, g] = v_
                    if r0 + i < NT:
                        GS[r0 + i, h * (GB2 // 2) + g] = T.reinterpret(w_, "float32")
                q = T.alloc_fragment((BM, 2, GB2 // 2, G), "float8_e4m3fn")
                for i, h, g, k in T.Parallel(BM, 2, GB2 // 2, G):
                    q[i, h, g, k] = grad[i, h, g, k] * inv[i, h, g]
                T.copy(T.reshape(q, (BM, 2 * H)), GQ[r0, 0])
    return swiglu_backward


# the ops -----------------------------------------------------------------------------------------------------------

def _int32_vector(x, name, n=None):
    t = _tk.torch()
    _tk.check_tensor(x, name, (t.int32, t.int64), 1)
    if n is not None and x.shape[0] != n:
        raise ValueError(f"{name} must have {n} entries, got {x.shape[0]}")
    return x.to(t.int32).contiguous()


def swiglu_forward_and_per_token_cast(x, fmt: str, num_per_channels: int, pos_to_token_topk=None, topk_weights=None,
                                      pos_to_expert=None, use_tma_aligned_col_major_sf: bool = False,
                                      round_sf: bool = False, use_packed_ue8m0: bool = False,
                                      swiglu_clamp_value=None, clamped_count=None, sf_clamp_min=None):
    """SwiGLU of x (num_expanded_tokens, 2 * hidden) fused with the per-token e4m3 cast: ``(out, sf)`` with
    out * sf ~= silu(x[:, :hidden]) * x[:, hidden:], times ``topk_weights.view(-1)[pos_to_token_topk[row]]`` when
    given (0 where the position is < 0). Rows whose ``pos_to_expert`` is < 0 are skipped (zeros). With
    ``swiglu_clamp_value`` c: left <= c and |right| <= c first; ``clamped_count`` (int64 (3,)) gets the counts of
    left > c, right > c and right < -c added. ``sf_clamp_min``: the amax floor (default 1e-4)."""
    t = _tk.torch()
    _tk.check_choice(fmt, "fmt", ("e4m3",))
    flags = _tk.check_sf_flags(use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)
    _tk.check_tensor(x, "x", (t.bfloat16, t.float32), 2)
    if x.shape[1] % 256:
        raise ValueError(f"x: the width 2 * hidden must be a multiple of 256, got {x.shape[1]}")
    x = _tk.rows_stride1(x)
    n, hidden = x.shape[0], x.shape[1] // 2
    G = _tk.check_int(num_per_channels, "num_per_channels")
    if G not in (128, hidden):
        raise ValueError(f"num_per_channels must be 128 or hidden ({hidden}), got {G}")
    with_weight = pos_to_token_topk is not None
    if with_weight != (topk_weights is not None):
        raise ValueError("pos_to_token_topk and topk_weights come together")
    if with_weight:
        p2t = _int32_vector(pos_to_token_topk, "pos_to_token_topk", n)
        _tk.check_tensor(topk_weights, "topk_weights", (t.float32,), 2)
        tw = topk_weights.contiguous().view(-1)
    else:
        p2t, tw = t.zeros(1, dtype=t.int32), t.zeros(1, dtype=t.float32)
    p2e = _int32_vector(pos_to_expert, "pos_to_expert", n) if pos_to_expert is not None else t.zeros(1, dtype=t.int32)
    clamp = 0.0 if swiglu_clamp_value is None else _tk.check_float(swiglu_clamp_value, "swiglu_clamp_value")
    if clamped_count is not None:
        if swiglu_clamp_value is None:
            raise ValueError("clamped_count needs swiglu_clamp_value")
        _tk.check_tensor(clamped_count, "clamped_count", (t.int64,), 1)
        _tk.check_shape(clamped_count, "clamped_count", (3,))
        if not clamped_count.is_contiguous():
            raise ValueError("clamped_count must be contiguous")
    cnt = clamped_count if clamped_count is not None else t.zeros(3, dtype=t.int64)
    sf_min = 1e-4 if sf_clamp_min is None else _tk.check_float(sf_clamp_min, "sf_clamp_min")
    out = t.empty((n, hidden), dtype=t.float8_e4m3fn)
    sf_user, sf_k = _tk.alloc_sf(n, hidden // G, use_tma_aligned_col_major_sf, use_packed_ue8m0)
    if n > 0:
        bf16 = x.dtype == t.bfloat16
        words = _tk.pair_words(x) if bf16 and clamped_count is None else None
        if words is not None:
            k = _tk.kernel(swiglu_forward_pairs, hidden, G, with_weight, pos_to_expert is not None,
                           swiglu_clamp_value is not None)
            k(words, out.view(t.uint16), sf_k, p2t, tw, p2e, _silu_table(), clamp, sf_min, flags)
            return out, sf_user
        k = _tk.kernel(swiglu_forward, hidden, G, "bfloat16" if bf16 else "float32", with_weight,
                       pos_to_expert is not None, swiglu_clamp_value is not None, clamped_count is not None)
        k(x, out, sf_k, p2t, tw, p2e, cnt, _silu_table() if bf16 else t.zeros(1), clamp, sf_min, flags)
    return out, sf_user


def swiglu_backward_and_per_token_cast(x, grad_out, weight, pos_to_token_topk, token_topk_to_pos,
                                       num_per_channels: int, round_sf: bool = False, swiglu_clamp_value=None):
    """SwiGLU backward from the e4m3 forward input ``x = (q, sf)`` (num_expand_tokens, 2 * hidden), sf float32
    (num_expand_tokens, 2 * hidden / num_per_channels); grad_out bf16 (num_expand_tokens, hidden); weight float32
    (num_tokens, num_topk). Returns ``(out, (x_grad_fp8, x_grad_sf), x_grad, weight_grad)``: out = silu(l) * r * w
    (bf16), x_grad bf16 and its per-token e4m3 cast, weight_grad = sum over the row of grad_out * silu(l) * r."""
    t = _tk.torch()
    G = _tk.check_int(num_per_channels, "num_per_channels", choices=(32, 128))
    flags = _tk.check_sf_flags(False, round_sf, False)
    if not isinstance(x, tuple) or len(x) != 2:
        raise TypeError("x must be a pair (q, sf)")
    q, sf = x
    _tk.check_tensor(q, "x[0]", (t.float8_e4m3fn,), (2, 3))
    q = q.reshape(-1, q.shape[-1]).contiguous()
    if q.shape[1] % (2 * G):
        raise ValueError(f"x[0]: the width must be a multiple of 2 * num_per_channels, got {q.shape[1]}")
    n, hidden = q.shape[0], q.shape[1] // 2
    if hidden % 32:
        raise ValueError(f"x[0]: hidden must be a multiple of 32, got {hidden}")
    _tk.check_tensor(sf, "x[1]", (t.float32,), 2)
    _tk.check_shape(sf, "x[1]", (n, 2 * hidden // G))
    _tk.check_tensor(grad_out, "grad_out", (t.bfloat16,))
    grad_out = grad_out.reshape(-1, grad_out.shape[-1]).contiguous()
    _tk.check_shape(grad_out, "grad_out", (n, hidden))
    _tk.check_tensor(weight, "weight", (t.float32,), 2)
    _tk.check_tensor(token_topk_to_pos, "token_topk_to_pos", (t.int32, t.int64), 2)
    _tk.check_shape(token_topk_to_pos, "token_topk_to_pos", tuple(weight.shape))
    p2t = _int32_vector(pos_to_token_topk, "pos_to_token_topk", n)
    clamp = 0.0 if swiglu_clamp_value is None else _tk.check_float(swiglu_clamp_value, "swiglu_clamp_value")
    out = t.empty((n, hidden), dtype=t.bfloat16)
    gq = t.empty((n, 2 * hidden), dtype=t.float8_e4m3fn)
    gs = t.empty((n, 2 * hidden // G), dtype=t.float32)
    xg = t.empty((n, 2 * hidden), dtype=t.bfloat16)
    wg = t.empty(weight.shape, dtype=t.float32)
    if max(n, weight.numel()) > 0:
        k = _tk.kernel(swiglu_backward, hidden, G, swiglu_clamp_value is not None)
        k(q, sf.contiguous(), grad_out, weight.contiguous().view(-1), p2t,
          token_topk_to_pos.to(t.int32).contiguous().view(-1), out, gq, gs, xg, wg.view(-1), clamp, flags)
    return out, (gq, gs), xg, wg
