"""short_row, the exact top k of a short 16-bit row with k >= n / 8 (part of ``_topk_kernels``' macros, split out
of that module for size): the row's keys are loaded once, those above a rank searched on a sample are kept with
their positions (bk / bp), the k-th largest key is found by counting passes over those, and the keys above it,
then the first ties, are kept by compressing stores of 16-bit keys and positions (k16 / p16), which emit16 writes
out in index order or widen16 turns into candidates."""
from __future__ import annotations

import tegula.language as T
from tegula.ops._topk_kernels import CHUNK, SAMPLE, SAMPLE_VEC, SUB16, nth_in_words


def short_macros(m):
    """(short_row, widen16, emit16) on the shared macros and per-width values of ``_topk_kernels._macros``
    (``m``: key_raw, search_kth, LANES, raw_t, low, KEY_MIN, KEY_END, rows, rows_after_first)."""
    key_raw, search_kth = m.key_raw, m.search_kth
    LANES, raw_t, low, KEY_MIN, KEY_END = m.LANES, m.raw_t, m.low, m.KEY_MIN, m.KEY_END
    _ROWS, _ROWS_AFTER_FIRST = m.rows, m.rows_after_first
    _QUART = tuple(range(len(_ROWS) // 4))

    @T.macro
    def load_keys(b, src, row, length):
        """The keys of src[row, :length] (16-bit, length <= SHORT_MAX) into b.rk, padded with KEY_MIN to whole
        CHUNKs, whose count it returns; b.mg takes in the raw magnitudes (the NaN check). Whole chunks are read in
        place (no staging copy into xs); making the keys where bracket_keys and the sample read them instead of
        storing rk was slower (kernel 2.56 -> 2.76 us: the bracket pass reading the row, not rk)."""
        nfull = length // CHUNK
        for c in T.serial(nfull):
            # read in place, no staging copy; the test always holds (length <= n) and lets the reads go unguarded
            if c * CHUNK + (CHUNK - 1) < src.shape[1]:
                for lane in T.Parallel(LANES):
                    mag = b.mg[lane]
                    for j in _ROWS:
                        v = src[row, c * CHUNK + j * LANES + lane]
                        b.rk[c * CHUNK + j * LANES + lane] = key_raw(v)
                        mag = T.max(mag, v & low)
                    b.mg[lane] = mag
        nch = nfull
        if length > nfull * CHUNK:
            for j in T.Parallel(CHUNK):
                b.rk[nfull * CHUNK + j] = T.cast(KEY_MIN, raw_t)
            for j in T.serial(length - nfull * CHUNK):
                v = src[row, nfull * CHUNK + j]
                b.rk[nfull * CHUNK + j] = key_raw(v)
                b.mg[0] = T.max(b.mg[0], v & low)
            nch = nfull + 1
        return nch

    @T.macro
    def count_keys(b, keys, nch, length, t):
        """How many of the length keys in keys (padded with KEY_MIN to nch CHUNKs: b.bk) are >= t, counted per
        lane in 16 bits (vectorised; the padding is taken off where t <= KEY_MIN), on four counts per lane: over
        the few chunks of bk a count is latency-bound, and the chain of masked adds is a quarter as long (b1 8K
        k2048 kernel, one count 2.70, two 2.61 us, four ~2.55; over whole rows, as lane_count, a second count had
        lost)."""
        tr = T.cast(T.max(t, KEY_MIN), raw_t)
        for lane in T.Parallel(4 * LANES):
            b.lcnt[lane] = 0
        for c in T.serial(nch):
            for lane in T.Parallel(LANES):
                a0 = b.lcnt[lane]
                a1 = b.lcnt[LANES + lane]
                a2 = b.lcnt[2 * LANES + lane]
                a3 = b.lcnt[3 * LANES + lane]
                for j in _QUART:
                    a0 = T.if_then_else(keys[c * CHUNK + (4 * j) * LANES + lane] >= tr, a0 + T.cast(1, raw_t), a0)
                    a1 = T.if_then_else(keys[c * CHUNK + (4 * j + 1) * LANES + lane] >= tr, a1 + T.cast(1, raw_t), a1)
                    a2 = T.if_then_else(keys[c * CHUNK + (4 * j + 2) * LANES + lane] >= tr, a2 + T.cast(1, raw_t), a2)
                    a3 = T.if_then_else(keys[c * CHUNK + (4 * j + 3) * LANES + lane] >= tr, a3 + T.cast(1, raw_t), a3)
                b.lcnt[lane] = a0
                b.lcnt[LANES + lane] = a1
                b.lcnt[2 * LANES + lane] = a2
                b.lcnt[3 * LANES + lane] = a3
        T.reduce_sum(b.lcnt[0:4 * LANES], b.ext[0:1], dim=0)
        return b.ext[0] - T.cast(t <= KEY_MIN, "int32") * (nch * CHUNK - length)

    @T.macro
    def sample_floor(b, a0, z0, r):
        """A key <= the r-th largest of the sample's keys (b.smp), at most 8 below it, from [a0, z0) with
        count(>= a0) >= r > count(>= z0): rounds that split the range in 4 parts and keep the one holding it,
        each counting the sample against 3 keys at once (independent vector counts): ~6 rounds at b1 8K k2048,
        where search_kth's exact rank took ~14 latency-bound single counts (kernel 2.81 -> 2.68 us)."""
        a = T.cast(a0, "int32")
        z = T.cast(z0, "int32")
        while z - a > 8:
            w = z - a
            for q in (0, 1, 2):   # (a tuple: unrolled, the three counts interleave)
                t = T.cast(a + ((q + 1) * w) // 4, raw_t)
                for lane in T.Parallel(LANES):
                    acc = T.cast(0, raw_t)
                    for j in _ROWS:
                        acc = T.if_then_else(b.smp[j * LANES + lane] >= t, acc + T.cast(1, raw_t), acc)
                    b.qc[q, lane] = acc
            T.reduce_sum(b.qc, b.qs, dim=1)
            # the last part whose lower end has count >= r (the counts fall with q)
            best = T.cast(b.qs[0] >= r, "int32") + T.cast(b.qs[1] >= r, "int32") + T.cast(b.qs[2] >= r, "int32")
            na = a + (best * w) // 4
            z = T.if_then_else(best == 3, z, a + ((best + 1) * w) // 4)
            a = na
        return a

    @T.macro
    def key_count(args, t):
        """search_kth's count for short_row: the bracket's keys (b.bk) >= t (args = (b, nch, length))."""
        return count_keys(args[0], args[0].bk, args[1], args[2], t)

    @T.macro
    def short_row(b, src, row, length, k):
        """The top k of src[row, :length] for k < length <= SHORT_MAX and 16-bit keys, into the candidates in
        index order. The row's keys are made once (b.rk); a rank of a sample below the k-th largest key (lo), and
        one pass (compressing stores) keeps the keys >= it with their positions (bk / bp: about a third of the
        row at k / n = 1/4). The k-th largest key itself is found there, by searching the key range for the point
        where the count of keys >= it falls below k: each count is one vectorised pass over the kept keys (not
        the row: b1 8K k2048 kernel 3.85 -> 3.11 us), stepping by interpolation of the counts alternating with
        bisection. One more pass then keeps the keys above it and the first ones equal to it: no select."""
        nch = load_keys(b, src, row, length)
        mu = T.cast(SAMPLE * k, "float32") / T.cast(length, "float32")
        stride = length // SAMPLE
        # the sample's rank below the k-th key, searched for by counts over the 16-bit sample (sample_floor)
        for g, j in T.Parallel(SAMPLE // SAMPLE_VEC, SAMPLE_VEC):
            b.smp[g * SAMPLE_VEC + j] = b.rk[g * (stride * SAMPLE_VEC) + j]
        # its range from per-lane maxima / minima in 16-bit lanes (a reduction fused into the strided copy ran
        # one element at a time)
        for lane in T.Parallel(LANES):
            top = b.smp[lane]
            bot = b.smp[lane]
            for j in _ROWS_AFTER_FIRST:
                top = T.max(top, b.smp[j * LANES + lane])
                bot = T.min(bot, b.smp[j * LANES + lane])
            b.lmax[lane] = T.cast(top, "int32")
            b.lmax[LANES + lane] = T.cast(bot, "int32")
        T.reduce_max(b.lmax[0:LANES], b.ext[0:1], dim=0)
        T.reduce_min(b.lmax[LANES:2 * LANES], b.ext[1:2], dim=0)
        smax = b.ext[0]
        smin = b.ext[1]
        rank = T.min(T.cast(mu + 3.0 * T.sqrt(mu) + 2.0, "int32"), SAMPLE)
        lo = sample_floor(b, smin, smax + 1, rank)
        # the k-th key's range is searched from [lo, smax + 1): a second rank searched on the sample as its upper
        # end saved ~0.6 of a step of the counts over bk for its ~9 (b1 8K k2048 kernel 3.24 -> 2.79 us)
        hi = smax + 1
        # the keys >= lo (and their positions) in one pass, into bk / bp; where fewer than k pass (the sample
        # misled), every key: the k-th is then below lo
        flo = lo
        m = T.cast(0, "int32")
        for attempt in T.serial(2):
            if (attempt == 0) | (m < k):
                m = bracket_keys(b, nch, length, flo)
                if m < k:
                    hi = lo
                    lo = KEY_MIN
                    flo = KEY_MIN
        mch = (m + CHUNK - 1) // CHUNK
        # invariant: count(>= lo) = c_lo >= k > count(>= hi) = c_hi, with KEY_END (no key) as hi at worst,
        # counted over the m keys in bk
        c_lo = m
        c_hi = count_keys(b, b.bk, mch, m, hi)
        if c_hi >= k:
            lo = hi
            c_lo = c_hi
            hi = KEY_END
            c_hi = 0
        lo, c_lo, c_hi = search_kth(lo, hi, c_lo, c_hi, k, key_count, (b, mch, m), "int32")
        keep_dense(b, m, mch, k, lo, c_lo, c_hi)

    @T.macro
    def bracket_keys(b, nch, length, t):
        """The keys of the row (b.rk, nch CHUNKs, length of them) >= t and their positions - 2^15, in index
        order, into bk / bp (compressing stores), bk padded with KEY_MIN to whole CHUNKs; returns their count.
        Every key passes where t is KEY_MIN: the padding then follows the row's keys and is not counted."""
        tr = T.cast(t, raw_t)
        w = T.cast(0, "int32")
        p0 = T.cast(-32768, raw_t)
        for g in T.serial(nch * (CHUNK // 32)):
            # groups of 32 on a carried 16-bit position base, as keep_dense
            for l in T.serial(32):
                kv = b.rk[g * 32 + l]
                p = p0 + T.cast(l, raw_t)
                if kv >= tr:
                    b.bk[w] = kv
                    b.bp[w] = p
                    w = w + 1
            p0 = p0 + T.cast(32, raw_t)
        m = T.min(w, length)
        for j in T.Parallel(CHUNK):
            b.bk[m + j] = T.cast(KEY_MIN, raw_t)
        return m

    @T.macro
    def keep_dense(b, m, mch, k, lo, c_lo, c_hi):
        """short_row's last pass: of the m keys in bk (padded to mch CHUNKs; positions in bp), those above lo, the
        k-th largest key, and the first k - c_hi equal to it (c_lo, c_hi: the counts of keys >= lo, > lo), in
        index order, into k16 / p16."""
        # keep all keys above lo and the first `need` equal to it, those up to place lim of bk (all of them
        # when every key equal to lo is kept)
        need = k - c_hi
        lim = m - 1
        if need < c_lo - c_hi:
            lim = nth_equal(b, mch, lo, need)
        # loops in the compress form over 16-bit keys and positions (m <= SHORT_MAX = 2^16): the c target
        # appends 32 at a time with compressing stores (vpcompressw), where walking set bits costs a branch and
        # a mispredict per kept key. Left in k16 / p16: emit16 writes them out (widen16 first where sorted).
        # Three loops, each on one compare: the groups of 32 wholly up to place lim keep every key >= lo, the
        # group holding lim (and lim + 1) compares places too, the later ones keep the keys above lo (one loop
        # on the whole condition: 3 compares a group, b1 8K k2048 ~14 cycles a group against ~9)
        lo_raw = T.cast(lo, raw_t)
        ng = (m + 31) // 32
        gl = (lim + 1) // 32
        w = T.cast(0, "int32")
        for g in T.serial(gl):
            for l in T.serial(32):
                kv = b.bk[g * 32 + l]
                pv = b.bp[g * 32 + l]   # (a local: the compress form computes its stored values for every key)
                if kv >= lo_raw:
                    b.k16[w] = kv
                    b.p16[w] = pv
                    w = w + 1
        # places in bk as int16, offset by 2^15 (the order of q is that of q - 2^15), compared in 16-bit lanes;
        # the padding past m never passes (lim < m)
        lim_q = T.cast(lim - 32768, raw_t)
        q0 = T.cast(gl * 32 - 32768, raw_t)
        for g in T.serial(gl, T.min(gl + 1, ng)):
            for l in T.serial(32):
                kv = b.bk[T.cast(gl, "int64") * 32 + l]
                pv = b.bp[T.cast(gl, "int64") * 32 + l]
                q = q0 + T.cast(l, raw_t)
                if (kv > lo_raw) | ((kv == lo_raw) & (q <= lim_q)):
                    b.k16[w] = kv
                    b.p16[w] = pv
                    w = w + 1
        for g in T.serial(gl + 1, ng):
            for l in T.serial(32):
                # (the place in 64 bits: gcc, under -fwrapv, left (g + gl + 1) * 32 + l in 32 bits unvectorised)
                kv = b.bk[T.cast(g, "int64") * 32 + l]
                pv = b.bp[T.cast(g, "int64") * 32 + l]
                if kv > lo_raw:
                    b.k16[w] = kv
                    b.p16[w] = pv
                    w = w + 1
        b.st[0] = w

    @T.macro
    def widen16(b):
        """short_row's st[0] kept keys and positions (k16, p16) as the candidates (ck, ci)."""
        for i in T.Parallel(b.st[0]):
            b.ck[i] = T.cast(b.k16[i], "int32")
            b.ci[i] = T.cast(b.p16[i], "int32") + 32768

    @T.macro
    def emit16(b, r, k, off, Vals, Idx, idx_fill, val_fill, idx_dtype):
        """emit for short_row's st[0] (<= k) kept keys and positions in index order, from their 16-bit copies
        (k16, p16): no pass widening them to the candidates first (b1 8K k2048 kernel -6%)."""
        cnt = b.st[0]
        for i in T.Parallel(k):
            if i < cnt:
                Idx[r, i] = T.cast(T.cast(b.p16[i], "int32") + (off + 32768), idx_dtype)
                Vals[r, i] = key_raw(b.k16[i])
            else:
                Idx[r, i] = T.cast(idx_fill, idx_dtype)
                Vals[r, i] = T.cast(val_fill, raw_t)

    @T.macro
    def nth_equal(b, nch, kv, nth):
        """The place of the nth (1-based) key equal to kv in bk (nch CHUNKs, which hold at least nth before the
        padding): one bit mask per SUB16 keys compared in their own width (a ballot) and its popcount per step,
        the word that holds it walked; chunks after it are skipped."""
        kr = T.cast(kv, raw_t)
        left = nth
        pos = T.cast(nch * CHUNK - 1, "int32")
        for c in T.serial(nch):
            if left > 0:
                for s, j in T.Parallel(CHUNK // SUB16, SUB16):
                    b.fb16[s, j] = T.cast(b.bk[c * CHUNK + s * SUB16 + j] == kr, "uint64") << T.cast(j, "uint64")
                T.reduce_sum(b.fb16, b.masks16, dim=1)
                left, pos = nth_in_words(b.masks16, CHUNK // SUB16, SUB16, c * CHUNK, left, pos)
        return pos

    return short_row, widen16, emit16
