"""The T.* kernels behind ``tegula.ops.topk``: threshold filtering into a candidate buffer, select by counting.

Values are read as raw bits (int16 for bf16/fp16, int32 for fp32) and become order-preserving signed keys:
``key = v ^ ((v >> 31) & low_mask)`` on the sign-extended bits flips the magnitude of negative numbers, so that
integer order is float order (-NaN < -inf < ... < -0 < +0 < ... < +inf < +NaN) and the map is its own inverse.

A block reads its range in BLOCKs (16-bit rows in place; 32-bit rows copied through a T.Pipelined loop: the CPU
target prefetches the next one) and filters them in chunks of CHUNK keys. A first vectorised pass takes each lane's
largest key; only a chunk whose largest key beats the threshold gets a second pass, which builds one bit mask per
SUB keys (SUB16 for 16-bit rows; T.reduce_sum of distinct bits) whose set bits T.clz walks, appending exactly the
survivors, in index order, to the candidate buffer (16-bit rows where a sampled threshold lets many keys pass:
compressing stores instead, pass2_dense). When the buffer holds k + b2 entries a select finds the k-th largest key
(a search over the candidates' own key range, each step one vectorised count of the candidates above a key), keeps
the k largest (ties: lower index first) and makes that key the threshold (DeepSelect's scheme). Rows up to
SAMPLE * k long start from a threshold estimated on SAMPLE evenly spaced keys (in short runs); short 16-bit rows
with k >= n / 8 instead find the exact k-th key by counting passes over the row and keep their top k in one more
pass (short_row, in _topk_short; by compressing stores of 16-bit keys and positions). Candidates stay in index order, so
indices come out ascending unless values are sorted (an LSD radix sort on 8-bit digits, stable).

Three kernels: ``rows`` (one block per row), and for rows split over several cores ``parts`` (one block per
(segment, row), writing each segment's top-k keys and indices to a workspace) followed by ``merge`` (one block
per row, appending each segment's keys above the threshold by compressing stores, selecting as the buffer fills).
"""
from __future__ import annotations

from types import SimpleNamespace

import tegula
import tegula.language as T
from tegula.runtime import cpu

KMAX = 4096               # the largest k (DeepSelect's limit)
CHUNK = 512               # keys scanned per step
SUB = 32                  # keys per bit mask
SUB16 = 64                # keys per bit mask of 16-bit keys read in place (pass2's narrow form): half the
                          # words of SUB, so half the mispredicted exits of the walk's inner loop
BLOCK = 4 * CHUNK         # keys copied (and prefetched) at once
NSUB = CHUNK // SUB
SAMPLE = CHUNK            # keys sampled for a first threshold
SAMPLE_MU = 4.0          # 16-bit rows longer than SAMPLE * k / SAMPLE_MU sample up to SAMPLE_MAX * SAMPLE keys,
SAMPLE_MAX = 4            # in runs of SAMPLE_RUN adjacent keys (one 64-byte line each): a sampled threshold
SAMPLE_RUN = 32           # where one SAMPLE would hold < 1 of the top k (b1 1M k512), a tighter one where < 4
SAMPLE_VEC = 8            # a single SAMPLE (and short_row's) is read in runs of this many adjacent keys (16 bytes
                          # of a 16-bit row): a vector copy; single keys at a stride were one scalar load each
                          # (b1 8K k512 kernel -8%, k2048 -4%)
DENSE = 0.08              # 16-bit rows whose sampled threshold lets about this share of the keys pass or more
                          # append them by compressing stores (pass2_dense), the others by walking set bits
                          # (b1 8K k512, ~10%: kernel -7%; at ~6% both alike, at ~3.6% the walk 1.2-1.4x faster,
                          # on a Zen 4). By CPU vendor where it differs (DENSE_BY_VENDOR):
DENSE_BY_VENDOR = {"GenuineIntel": 0.004}   # an Intel Xeon: from ~0.5% the compressing stores won (2 threads,
                          # bench.topk alternated twice: b8 / b64 128K 0.21-0.26 / 1.59-1.77 ms against 0.30-0.32 /
                          # 1.95-2.97, b1 1M k2048 0.24 against 0.26-0.27; mispredicted exits of the walk cost more)
WG = 16                   # pass2_dense widens its survivors WG at a time
B2MAX = 4096              # the largest slack of the candidate buffer before a select
CAP = KMAX + B2MAX + CHUNK
PAD = CHUNK + 256         # ck, ci are CAP + PAD long: room for a last whole chunk, and 1 KiB apart modulo
                          # 4 KiB from each other and from tk/ti, so stores do not falsely alias loads (4K aliasing)
SHORT_MAX = 1 << 16       # rows of 16-bit keys up to this long with k >= SHORT_MU / SAMPLE of them (k/n >= 1/8)
SHORT_MU = 64             # find their k-th key by counting passes (short_row); below, top_range is faster
INT_MIN = -(1 << 31)
INT_MAX = (1 << 31) - 1
TOP_UNKNOWN = INT_MAX     # st[2] of 16-bit candidates whose largest key is not known yet (no 16-bit key is this)
NAN_FLAG = 0x3F3F3F3F     # DeepSelect's marker in indices[row, 0] of a row holding NaN

_SORT_SHIFTS = {32: (0, 8, 16, 24), 16: (0, 8)}
_RAW = {16: "int16", 32: "int32"}
_LOW = {16: 0x7FFF, 32: 0x7FFFFFFF}


def _codec(bits):
    """(key of raw bits, raw bits of a key, the key as an unsigned-order uint32)."""
    low = _LOW[bits]

    def key(v):
        v = T.cast(v, "int32")
        return v ^ ((v >> 31) & low)

    def raw(key):
        return T.cast(key ^ ((key >> 31) & low), _RAW[bits])

    if bits == 32:
        return key, raw, (lambda k: T.reinterpret(k ^ INT_MIN, "uint32"))
    return key, raw, (lambda k: T.reinterpret(k + 32768, "uint32"))


def _state(raw, short=False):
    """The per-block buffers (``_init`` them); st = (candidate count, threshold, largest and smallest candidate
    key, whether the last chunk scanned had survivors). ``short``: also short_row's copy of a row's keys."""
    b = SimpleNamespace(
        ck=T.alloc_shared((CAP + PAD,), "int32"),   # candidate keys
        ci=T.alloc_shared((CAP + PAD,), "int32"),   # candidate indices
        tk=T.alloc_shared((KMAX + 1,), "int32"),    # select's output and sort's other half (+1: the
        ti=T.alloc_shared((KMAX + 1,), "int32"),    # branch-free compaction stores one past the last kept)
        hist=T.alloc_shared((256,), "int32"),       # sort_by_value's digit counts
        xs=T.alloc_fragment((BLOCK,), raw),         # one block of the input (raw values)
        kk=T.alloc_fragment((CHUNK,), "int32"),     # the keys of one chunk
        fb=T.alloc_fragment((NSUB, SUB), "uint32"),
        masks=T.alloc_fragment((NSUB,), "uint32"),
        lmax=T.alloc_fragment((CHUNK,), "int32"),   # the largest key per lane of a chunk; select's counts
        lcnt=T.alloc_fragment((CHUNK,), raw),       # counts per lane
        mg=T.alloc_fragment((CHUNK,), raw),         # the largest raw magnitude per lane (NaN check)
        ext=T.alloc_fragment((2,), "int32"),
        st=T.alloc_local((5,), "int32"))
    if raw == "int16":   # pass2's masks over 16-bit keys read in place: SUB16 keys each
        b.fb16 = T.alloc_fragment((CHUNK // SUB16, SUB16), "uint64")
        b.masks16 = T.alloc_fragment((CHUNK // SUB16,), "uint64")
        b.k16 = T.alloc_fragment((KMAX,), "int16")   # short_row's kept keys and positions (- 2^15), 16-bit
        b.p16 = T.alloc_fragment((KMAX,), "int16")
        if short:   # the keys of a short row, padded with KEY_MIN to whole chunks, and a sample of them
            b.rk = T.alloc_shared((SHORT_MAX + CHUNK,), "int16")
            b.bk = T.alloc_shared((SHORT_MAX + CHUNK,), "int16")   # the keys in its bracket and their positions
            b.bp = T.alloc_shared((SHORT_MAX + CHUNK,), "int16")
            b.smp = T.alloc_fragment((SAMPLE,), "int16")
            b.qc = T.alloc_fragment((3, 32), "int16")   # its counts against 3 keys per lane, and in all
            b.qs = T.alloc_fragment((3,), "int32")
    return b


@T.macro
def nth_in_words(masks, nwords, width, base, left, pos):
    """Ballot words masks[0:nwords] of ``width`` bits (bit j of word s: item base + s * width + j), walked while
    left > 0: the word holding the left-th set item sets pos to that item, else its popcount comes off left.
    Returns (left, pos): left 0 once found."""
    for s in T.serial(nwords):
        m = masks[s]
        pc = T.cast(T.popcount(m), "int32")
        if left > 0:
            if pc >= left:
                while left > 1:
                    m = m & (m - 1)
                    left = left - 1
                pos = base + s * width + (width - 1) - T.cast(T.clz(m & (0 - m)), "int32")
                left = 0
            else:
                left = left - pc
    return left, pos


class _RowView:
    """src[row, base + i] as xb[i]: a row of the input read in place by chunk's macros."""

    def __init__(self, src, row, base):
        self.src, self.row, self.base = src, row, base

    def __getitem__(self, i):
        return self.src[self.row, self.base + i]


@T.macro
def _init(b):
    for i in T.Parallel(CHUNK):
        b.mg[i] = 0
    b.st[4] = 0
    _reset(b)


@T.macro
def _reset(b):
    b.st[0] = 0
    b.st[1] = INT_MIN
    b.st[2] = INT_MIN
    b.st[3] = INT_MAX


def _macros(bits):
    key_of, raw_of, ukey = _codec(bits)
    low = _LOW[bits]
    LANES = 512 // bits                       # one 512-bit vector of raw values
    _ROWS_AFTER_FIRST = tuple(range(1, CHUNK // LANES))   # tuples: the loops over them are unrolled
    _ROWS = tuple(range(CHUNK // LANES))
    raw_t = _RAW[bits]
    KEY_MIN, KEY_END = (-32768, 32768) if bits == 16 else (INT_MIN, None)
    dense_share = DENSE_BY_VENDOR.get(cpu.host_vendor(), DENSE)

    def key_raw(v):
        """The key in the raw values' own width (int16 or int32)."""
        return v ^ ((v >> (bits - 1)) & low)

    @T.macro
    def keep(b, cnt, kth, need):
        """Keep, of the candidates [0, cnt), the keys above kth and the first ``need`` equal to it, in order, and
        make kth the threshold. The position of the need-th key equal to kth is found first, from one bit mask
        per SUB candidates (a ballot) and their popcounts, and only the word holding it is walked; then one
        loop keeps the keys above kth and those equal up to that position, into tk/ti and back: the form the c
        target runs 16 keys at a time with compressing stores (about half the candidates are kept, where
        walking the set bits of masks cost a branch and a mispredict per word)."""
        left = need
        lim = T.cast(-1, "int32")
        for c in T.serial((cnt + CHUNK - 1) // CHUNK):
            if left > 0:
                for s, j in T.Parallel(NSUB, SUB):
                    p = c * CHUNK + s * SUB + j
                    b.fb[s, j] = T.cast((b.ck[p] == kth) & (p < cnt), "uint32") << T.cast(j, "uint32")
                T.reduce_sum(b.fb, b.masks, dim=1)
                left, lim = nth_in_words(b.masks, NSUB, SUB, c * CHUNK, left, lim)
        w = T.cast(0, "int32")
        for p in T.serial(cnt):
            kv = b.ck[p]
            ix = b.ci[p]
            if (kv > kth) | ((kv == kth) & (p <= lim)):
                b.tk[w] = kv
                b.ti[w] = ix
                w = w + 1
        for i in T.Parallel(w):
            b.ck[i] = b.tk[i]
            b.ci[i] = b.ti[i]
        b.st[0] = w
        b.st[1] = kth
        b.st[3] = kth

    @T.macro
    def lane_count(b, src, cnt, nch, t, cnt_t):
        """How many of the values in the first nch CHUNKs of src are >= t, counted per lane in cnt (of cnt_t:
        vectorised), into b.ext[0]."""
        for lane in T.Parallel(LANES):
            cnt[lane] = 0
        for c in T.serial(nch):
            for lane in T.Parallel(LANES):
                acc = cnt[lane]
                for j in _ROWS:
                    # a select of acc + 1: one merge-masked add per vector (acc + the compare cast to 0 / 1 took
                    # a zeroing masked move and a subtract): b1 8K k2048 kernel -4%
                    acc = T.if_then_else(src[c * CHUNK + j * LANES + lane] >= t, acc + T.cast(1, cnt_t), acc)
                cnt[lane] = acc
        T.reduce_sum(cnt[0:LANES], b.ext[0:1], dim=0)

    @T.macro
    def count_top(b, nch, t):
        """How many of the candidates in the first nch CHUNKs of ck are >= t, counted per lane (vectorised)."""
        lane_count(b, b.ck, b.lmax, nch, t, "int32")
        return b.ext[0]

    @T.macro
    def search_kth(lo0, hi0, c_lo0, c_hi0, k, count, args, dtype):
        """(the largest key lo with count(args, lo) >= k, count(args, lo), count(args, hi) for the key hi above
        it), searched in
        [lo0, hi0) by keys of ``dtype`` from count(args, lo0) = c_lo0 >= k > count(args, hi0) = c_hi0:
        interpolation of the counts alternating with bisection (a step that does not halve the range is
        followed by a bisection)."""
        lo = T.cast(lo0, dtype)
        hi = T.cast(hi0, dtype)
        c_lo = T.cast(c_lo0, "int32")
        c_hi = T.cast(c_hi0, "int32")
        bisect = T.cast(0, "int32")
        while hi - lo > 1:
            mid = lo + (hi - lo) // 2
            if bisect == 0:
                step = T.cast(T.cast(hi - lo, "float32") * T.cast(c_lo - k, "float32") /
                              T.cast(c_lo - c_hi, "float32"), dtype)
                mid = lo + T.min(T.max(step, 1), hi - lo - 1)
            width = hi - lo
            c = count(args, mid)
            if c >= k:
                lo = mid
                c_lo = c
            else:
                hi = mid
                c_hi = c
            bisect = T.cast(2 * (hi - lo) > width, "int32") * (1 - bisect)
        return lo, c_lo, c_hi

    @T.macro
    def top_count(args, t):
        """search_kth's count for kth_key: candidates with keys >= t (args = (b, nch))."""
        return count_top(args[0], args[1], T.cast(t, "int32"))

    @T.macro
    def kth_key(b, k):
        """(the k-th largest of the b.st[0] candidates' keys, how many are above it), int64 and int32: searched
        for in the candidates' range [st[3], st[2]] by vectorised counts of the candidates >= a key
        (interpolation alternating with bisection, as short_row does on a row). A radix select's histograms
        cost more: increments of equal digits wait on each other (b1 8K k512 kernel 7.3 -> 5.8 us, 1M k2048
        246 -> 220 us)."""
        cnt = b.st[0]
        nch = (cnt + CHUNK - 1) // CHUNK
        # the last chunk's tail counts for nothing. Its index in 64 bits: ck[cnt + i] in 32-bit arithmetic (which
        # may wrap) was one masked scatter per 16 keys, not a contiguous store
        for i in T.Parallel(nch * CHUNK - cnt):
            b.ck[T.cast(cnt, "int64") + i] = INT_MIN
        if bits == 16:
            if b.st[2] == TOP_UNKNOWN:   # after pass2_dense: the top from the candidates (padded with INT_MIN)
                for lane in T.Parallel(LANES):
                    b.lmax[lane] = INT_MIN
                for c in T.serial(nch):
                    for lane in T.Parallel(LANES):
                        top = b.lmax[lane]
                        for j in _ROWS:
                            top = T.max(top, b.ck[c * CHUNK + j * LANES + lane])
                        b.lmax[lane] = top
                T.reduce_max(b.lmax[0:LANES], b.ext[0:1], dim=0)
                b.st[2] = b.ext[0]
        # the search runs in int64: 32-bit keys span up to 2^32
        kth, _, above = search_kth(T.cast(b.st[3], "int64"), T.cast(b.st[2], "int64") + 1, cnt, T.cast(0, "int32"),
                                   k, top_count, (b, nch), "int64")
        return kth, above

    @T.macro
    def select(b, k):
        """Keep the k largest of the b.st[0] candidates (in their order; ties: earliest first); st[1] becomes
        the k-th largest key (kth_key, then ``keep``)."""
        kth, above = kth_key(b, k)
        keep(b, b.st[0], T.cast(kth, "int32"), k - above)

    @T.macro
    def pass2_dense(b, xb, off, base, thr):
        """pass2 for 16-bit keys read in place where many pass (top_range's dense scan): the keys above thr
        and their positions in the chunk appended in the compress form (the c target: 32 at a time, vpcompressw)
        to k16 / p16, then widened onto the candidates: no bit walk (a mispredicted exit per word), no ballot."""
        thr_raw = T.cast(T.min(T.max(thr + 1, KEY_MIN), 32767), raw_t)
        w = T.cast(0, "int32")
        for j in T.serial(CHUNK):
            kr = key_raw(xb[off + j])
            if kr >= thr_raw:
                b.k16[w] = kr
                b.p16[w] = T.cast(j, raw_t)
                w = w + 1
        cnt = b.st[0]
        b.st[4] = T.cast(w > 0, "int32")
        if w > 0:
            # widened WG at a time (whole vectors: entries past cnt + w are overwritten later or never read). No
            # range here: every key is above thr, and the top is left unknown (TOP_UNKNOWN) for kth_key to take
            # from the candidates; a running max / min per lane (gcc: a masked load and store of it per group,
            # which waited on the last group's store) was ~0.3 us of b1 8K k512's ~2.9 us kernel
            for g in T.serial((w + WG - 1) // WG):
                for i in T.Parallel(WG):
                    b.ck[T.cast(cnt, "int64") + g * WG + i] = T.cast(b.k16[g * WG + i], "int32")
                    b.ci[T.cast(cnt, "int64") + g * WG + i] = base + T.cast(b.p16[g * WG + i], "int32")
            b.st[0] = cnt + w
            b.st[2] = TOP_UNKNOWN
            b.st[3] = T.min(b.st[3], thr + 1)

    @T.macro
    def pass2(b, xb, off, base, thr):
        """Append the keys of xb[off : off + CHUNK] above thr: a bit mask per SUB keys (a ballot) whose set bits
        T.clz walks, in order."""
        # 16-bit keys are compared in their own width (twice the lanes per vector): key > thr is key >= thr + 1,
        # clamped to the keys' range (callers make sure thr < 32767)
        thr_raw = T.cast(T.min(T.max(thr + 1, KEY_MIN), 32767), raw_t) if bits == 16 else thr
        narrow = bits == 16   # the walk then takes each survivor's key from xb itself
        sub, mt = (SUB16, "uint64") if narrow else (SUB, "uint32")
        fb, masks = (b.fb16, b.masks16) if narrow else (b.fb, b.masks)
        for s, j in T.Parallel(CHUNK // sub, sub):
            if narrow:
                fb[s, j] = T.cast(key_raw(xb[off + s * sub + j]) >= thr_raw, mt) << T.cast(j, mt)
            else:
                kv = key_of(xb[off + s * SUB + j])
                b.kk[s * SUB + j] = kv
                b.fb[s, j] = T.cast(kv > thr, "uint32") << T.cast(j, "uint32")
        T.reduce_sum(fb, masks, dim=1)   # distinct bits: the sum is the OR, bit j for key j
        cnt = b.st[0]
        top = b.st[2]
        bot = b.st[3]
        for s in T.serial(CHUNK // sub):
            m = masks[s]
            while m != 0:
                # the lowest set bit (keys stay in order); only m & (m - 1) is on the critical path
                j = sub - 1 - T.cast(T.clz(m & (0 - m)), "int32")
                m = m & (m - 1)
                kv = key_of(xb[off + s * sub + j]) if narrow else b.kk[s * SUB + j]
                b.ck[cnt] = kv
                b.ci[cnt] = base + s * sub + j
                cnt = cnt + 1
                top = T.max(top, kv)
                bot = T.min(bot, kv)
        b.st[4] = T.cast(cnt > b.st[0], "int32")
        b.st[0] = cnt
        b.st[2] = top
        b.st[3] = bot

    @T.macro
    def chunk(b, xb, off, base, k, b2, dense=False):
        """Append the keys of xb[off : off + CHUNK] (positions base...) that beat the threshold st[1]. A first
        cheap pass finds whether any does (each lane's largest key), and only then the ballot pass (pass2)
        runs; 16-bit rows skip the first pass while the previous chunk had survivors (st[4]), as most chunks
        of a long row do, and keep only its magnitudes (the NaN check)."""
        thr = b.st[1]
        if bits == 16 and b.st[4] != 0:
            for lane in T.Parallel(LANES):
                mag = b.mg[lane]
                for j in _ROWS:
                    mag = T.max(mag, xb[off + j * LANES + lane] & low)
                b.mg[lane] = mag
            if thr < 32767:
                if dense:
                    pass2_dense(b, xb, off, base, thr)
                else:
                    pass2(b, xb, off, base, thr)
            else:
                b.st[4] = 0
        else:
            # pass 1, cheap: each lane's largest key (and raw magnitude) over the chunk, in the keys' own width
            for lane in T.Parallel(LANES):
                v = xb[off + lane]
                top_key = key_raw(v)
                mag = T.max(b.mg[lane], v & low)
                for j in _ROWS_AFTER_FIRST:
                    v = xb[off + j * LANES + lane]
                    top_key = T.max(top_key, key_raw(v))
                    mag = T.max(mag, v & low)
                b.lmax[lane] = T.cast(top_key, "int32")
                b.mg[lane] = mag
            T.reduce_max(b.lmax[0:LANES], b.ext[0:1], dim=0)
            if b.ext[0] > thr:
                if dense:
                    pass2_dense(b, xb, off, base, thr)
                else:
                    pass2(b, xb, off, base, thr)
        if b.st[0] >= k + b2:
            select(b, k)

    @T.macro
    def scan(b, lo, hi, src, row, k, b2, dense=False):
        """Append the keys of positions [lo, hi) of the input row src[row, :] that beat the threshold st[1] (with
        their positions), in order; select when the buffer fills. b.mg keeps the largest raw magnitudes (for the
        NaN check). The input comes in BLOCKs: 16-bit rows read in place, the rest copied to xb through a
        T.Pipelined loop (the CPU target prefetches the next block meanwhile)."""
        xb = b.xs
        nblk = (hi - lo) // BLOCK
        # 16-bit rows: a plain loop; the software prefetch of the next block cost more than it saved there
        # (1 thread CPU time: b1 32K k2048 -4%, b1 1M -5..-10%, from DRAM too), not so for 32-bit rows (b8 fp32
        # sampler from DRAM +5% without it)
        pipe = bits != 16
        for blk in (T.Pipelined(nblk, num_stages=2) if pipe else T.serial(nblk)):
            if bits == 16:
                # the row is read in place, no staging copy to xb: pass2_dense's scan first (b1 8K k512 kernel
                # -7..-20% on a Zen 4), then all (on an Intel Xeon the copy, glibc's rep movsb of 4 KiB, took 2/3
                # of b16 1M k512's time and 1/2 of b1 1M's segments; 1 thread: b16 1M k512 5.49 -> 4.71 ms, k2048
                # 6.23 -> 4.99, b64 128K k512 3.74 -> 2.96). The test always holds (hi <= n) and lets the element
                # reads go unguarded; no other branch (a copying one beside it made the other scans' code 5-9%
                # slower)
                if lo + blk * BLOCK + (BLOCK - 1) < src.shape[1]:
                    xr = _RowView(src, row, lo + blk * BLOCK)
                    for q in T.serial(BLOCK // CHUNK):
                        chunk(b, xr, q * CHUNK, lo + blk * BLOCK + q * CHUNK, k, b2, dense)
            else:
                T.copy(src[row, lo + blk * BLOCK], xb)   # a whole-tile copy: one bounds test, not one per element
                for q in T.serial(BLOCK // CHUNK):
                    chunk(b, xb, q * CHUNK, lo + blk * BLOCK + q * CHUNK, k, b2, dense)
        nfull = (hi - lo) // CHUNK
        for c in T.serial(nblk * (BLOCK // CHUNK), nfull):
            T.copy(src[row, lo + c * CHUNK], xb[0:CHUNK])
            chunk(b, xb, 0, lo + c * CHUNK, k, b2, dense)
        tail = lo + nfull * CHUNK
        thr = b.st[1]
        cnt = b.st[0]
        top = b.st[2]
        bot = b.st[3]
        for j in T.serial(hi - tail):
            kv = key_of(src[row, tail + j])
            b.mg[0] = T.max(b.mg[0], src[row, tail + j] & low)
            if kv > thr:
                b.ck[cnt] = kv
                b.ci[cnt] = tail + j
                cnt = cnt + 1
                top = T.max(top, kv)
                bot = T.min(bot, kv)
        b.st[0] = cnt
        b.st[2] = top
        b.st[3] = bot

    @T.macro
    def append_part(b, WK, WI, row, s, k):
        """Append the keys of part s of a merge's workspace row (WK/WI[row, s*k : (s+1)*k]) above the threshold
        st[1], in order (INT_MIN fills a short part's end: never above it), and their range: one loop in the
        compress form (16 keys at a time) where scan's ballot and bit walk went key by key through a workspace
        nearly all of whose keys pass (b1 1M k2048: 4096 keys, merge ~15 -> ~4 us)."""
        thr = b.st[1]
        first = b.st[0]
        cnt = first
        top = b.st[2]
        bot = b.st[3]
        if s * k + (k - 1) < WK.shape[1]:   # (always: the fact that lets the loop's reads go unguarded)
            for i in T.serial(k):
                kv = WK[row, s * k + i]
                ix = WI[row, s * k + i]   # (read for every key: the compress form's values are)
                if kv > thr:
                    b.ck[cnt] = kv
                    b.ci[cnt] = ix
                    cnt = cnt + 1
        # their range in a loop of its own (in the one above, a reduction across each group's lanes per group)
        for i in T.serial(cnt - first):
            top = T.max(top, b.ck[first + i])
            bot = T.min(bot, b.ck[first + i])
        b.st[0] = cnt
        b.st[2] = top
        b.st[3] = bot

    @T.macro
    def sample(b, src, row, start, stride):
        """SAMPLE keys as the candidates (indices i), their range in st[2:4]: runs of SAMPLE_VEC adjacent keys,
        src[row, start + g * stride * SAMPLE_VEC + j] (j < SAMPLE_VEC), a vector copy each."""
        for g, j in T.Parallel(SAMPLE // SAMPLE_VEC, SAMPLE_VEC):
            b.ck[g * SAMPLE_VEC + j] = key_of(src[row, start + g * (stride * SAMPLE_VEC) + j])
            b.ci[g * SAMPLE_VEC + j] = g * SAMPLE_VEC + j
        # the range from per-lane maxima / minima (reductions fused into the strided reads ran one key at a time)
        for lane in T.Parallel(LANES):
            top = b.ck[lane]
            bot = b.ck[lane]
            for j in _ROWS_AFTER_FIRST:   # (SAMPLE = CHUNK keys)
                top = T.max(top, b.ck[j * LANES + lane])
                bot = T.min(bot, b.ck[j * LANES + lane])
            b.lmax[lane] = top
            b.lmax[LANES + lane] = bot
        T.reduce_max(b.lmax[0:LANES], b.ext[0:1], dim=0)
        T.reduce_min(b.lmax[LANES:2 * LANES], b.ext[1:2], dim=0)
        b.st[0] = SAMPLE
        b.st[2] = b.ext[0]
        b.st[3] = b.ext[1]

    @T.macro
    def sample_runs(b, src, row, start, stride, nsmp):
        """nsmp * SAMPLE keys as the candidates: runs of SAMPLE_RUN adjacent keys at src[row, start + g * stride]
        (g = 0, 1, ...), their range in st[2:4]. Runs, not single keys: each strided key of a row in DRAM is a
        miss of its own, which costs more than the tighter threshold saves (b1 1M k512, 4096 single keys:
        1 thread CPU 177 -> 225 us; in runs of 32: 164 us). Each run is one vector load under a test the bounds
        prover reads (its last key inside the row: always, as length >= 2 SAMPLE nsmp makes stride >= 64): the
        keys at i // SAMPLE_RUN, i % SAMPLE_RUN were guarded loads gcc kept scalar, ~8% of b1 1M's parts kernel
        stalled on their cold lines (2 threads, b1 1M k512, separate processes alternated: 0.243-0.264 -> 0.207-
        0.213 ms)."""
        top = T.cast(INT_MIN, "int32")
        bot = T.cast(INT_MAX, "int32")
        for c in T.serial(nsmp):
            for g in T.serial(SAMPLE // SAMPLE_RUN):
                rs = start + (c * (SAMPLE // SAMPLE_RUN) + g) * T.max(stride, 0)  # a run's start
                if rs + (SAMPLE_RUN - 1) < src.shape[1]:  # (always: the fact that lets its reads go unguarded)
                    for j in T.Parallel(SAMPLE_RUN):  # one vector load a run
                        b.kk[g * SAMPLE_RUN + j] = key_of(src[row, rs + j])
            T.reduce_max(b.kk, b.ext[0:1], dim=0)
            T.reduce_min(b.kk, b.ext[1:2], dim=0)
            top = T.max(top, b.ext[0])
            bot = T.min(bot, b.ext[1])
            for i in T.Parallel(SAMPLE):
                b.ck[c * SAMPLE + i] = b.kk[i]
        b.st[0] = nsmp * SAMPLE
        b.st[2] = top
        b.st[3] = bot

    @T.macro
    def top_range(b, lo, hi, src, row, k, b2):
        """The top k of src[row, lo:hi] into the candidates (st[0] = min(k, hi - lo)), in index order.

        The threshold starts at the r-th largest of S evenly spaced keys (short runs), r = mu + 3 sqrt(mu) + 2 with
        mu = S * k / (hi - lo) the expected count of the true top k in the sample: about 1.3 k keys pass instead
        of the k (1 + ln(n / k)) of a rising threshold. S = SAMPLE keys (in runs of SAMPLE_VEC), or for long 16-bit
        ranges (mu < SAMPLE_MU with SAMPLE keys) up to SAMPLE_MAX * SAMPLE keys in runs (sample_runs); a range whose
        sample still has mu < 1 keeps the rising threshold.
        If fewer than k pass after all (rare), the range is scanned again from scratch."""
        length = hi - lo
        mu1 = T.cast(SAMPLE * k, "float32") / T.cast(T.max(length, 1), "float32")
        if bits == 16:   # 32-bit rows (the fp32 sampler, 129280 long) lost with more samples: b8 426 -> 450-471 us
            nsmp = T.min(T.max(T.cast(SAMPLE_MU / mu1 + 0.999, "int32"), 1), SAMPLE_MAX)
        else:
            nsmp = T.cast(1, "int32")
        mu = mu1 * T.cast(nsmp, "float32")
        sampled = T.cast(0, "int32")
        dense = T.cast(0, "int32")
        if mu >= 1.0 and length >= 2 * SAMPLE * nsmp:
            if nsmp == 1:
                sample(b, src, row, lo, length // SAMPLE)
            else:
                sample_runs(b, src, row, lo, length // (nsmp * (SAMPLE // SAMPLE_RUN)), nsmp)
            t0, _ = kth_key(b, T.cast(mu + 3.0 * T.sqrt(mu) + 2.0, "int32"))   # the sample itself is not kept
            _reset(b)
            b.st[1] = T.max(T.cast(t0, "int32"), INT_MIN + 1) - 1
            sampled = 1
            if bits == 16:   # pass2_dense where the expected share of keys passing is large
                dense = T.cast((mu + 3.0 * T.sqrt(mu) + 2.0) >= dense_share * T.cast(nsmp * SAMPLE, "float32"),
                               "int32")
        again = T.cast(1, "int32")
        while again != 0:
            if bits == 16 and dense != 0:   # a scan of its own: the other keeps its code as it was
                scan(b, lo, hi, src, row, k, b2, True)
            else:
                scan(b, lo, hi, src, row, k, b2)
            again = 0
            if sampled != 0 and b.st[0] < k:
                sampled = 0
                again = 1
                _reset(b)
        if b.st[0] > k:
            select(b, k)

    from tegula.ops._topk_short import short_macros  # (it imports this module's constants)
    short_row, widen16, emit16 = short_macros(SimpleNamespace(
        key_raw=key_raw, search_kth=search_kth, LANES=LANES, raw_t=raw_t,
        low=low, KEY_MIN=KEY_MIN, KEY_END=KEY_END, rows=_ROWS, rows_after_first=_ROWS_AFTER_FIRST))

    @T.macro
    def sort_by_value(b, cnt):
        """Order the candidates [0, cnt) by descending key (stable: equal keys keep index order), in place: LSD
        radix sort on 8-bit digits through tk/ti; a pass whose digit is the same for all is a copy."""
        for p, shift in enumerate(_SORT_SHIFTS[bits]):
            sk, sj, dk, dj = (b.ck, b.ci, b.tk, b.ti) if p % 2 == 0 else (b.tk, b.ti, b.ck, b.ci)
            for h in T.Parallel(256):
                b.hist[h] = 0
            for i in T.serial(cnt):
                d = 255 - T.cast((ukey(sk[i]) >> shift) & 255, "int32")
                b.hist[d] = b.hist[d] + 1
            if b.hist[255 - T.cast((ukey(sk[0]) >> shift) & 255, "int32")] == cnt:
                for i in T.Parallel(cnt):
                    dk[i] = sk[i]
                    dj[i] = sj[i]
            else:
                acc = T.cast(0, "int32")
                for h in T.serial(256):
                    c = b.hist[h]
                    b.hist[h] = acc
                    acc = acc + c
                for i in T.serial(cnt):
                    kv = sk[i]
                    d = 255 - T.cast((ukey(kv) >> shift) & 255, "int32")
                    pos = b.hist[d]
                    b.hist[d] = pos + 1
                    dk[pos] = kv
                    dj[pos] = sj[i]

    @T.macro
    def emit(b, r, k, by_value, off, Vals, Idx, idx_fill, val_fill, idx_dtype):
        """Write the st[0] (<= k) candidates as row r of the outputs, then the fill values."""
        cnt = b.st[0]
        if by_value != 0 and cnt > 1:
            sort_by_value(b, cnt)
        for i in T.Parallel(k):
            if i < cnt:
                Idx[r, i] = T.cast(b.ci[i] + off, idx_dtype)
                Vals[r, i] = raw_of(b.ck[i])
            else:
                Idx[r, i] = T.cast(idx_fill, idx_dtype)
                Vals[r, i] = T.cast(val_fill, _RAW[bits])

    @T.macro
    def flag_nan(b, r, Idx, Flag, inf_mag, idx_dtype):
        """Mark row r when the largest raw magnitude seen is above +inf's: a NaN."""
        T.reduce_max(b.mg, b.ext[0:1], dim=0)
        if b.ext[0] > inf_mag:
            Idx[r, 0] = T.cast(NAN_FLAG, idx_dtype)
            T.atomic_max(Flag[0], 1)

    return SimpleNamespace(key_of=key_of, scan=scan, select=select, top_range=top_range, short_row=short_row,
                           widen16=widen16, emit16=emit16, emit=emit, flag_nan=flag_nan, append_part=append_part)


def rows_kernel(bits, idx_dtype):
    """One block per row: Vals/Idx[r, :k] = the top k of X[r, :End[r]]. Flag[0] becomes 1 when a row longer
    than k holds NaN (its Idx[r, 0] is NAN_FLAG), Flag[1] when some End[r] is outside [0, n]."""
    M = _macros(bits)
    batch, n, k = T.dynamic("batch"), T.dynamic("n"), T.dynamic("k")
    raw = _RAW[bits]

    @T.prim_func
    def topk_rows(X: T.Tensor((batch, n), raw), End: T.Tensor((batch,), "int32"), Off: T.Tensor((batch,), "int32"),
                  Vals: T.Tensor((batch, k), raw), Idx: T.Tensor((batch, k), idx_dtype),
                  Flag: T.Tensor((2,), "int32"), by_value: T.int32, b2: T.int32, idx_fill: T.int32,
                  val_fill: T.int32, inf_mag: T.int32):
        with T.Kernel(batch, threads=1) as r:
            b = _state(raw, short=bits == 16)
            _init(b)
            length = T.min(T.max(End[r], 0), n)
            if length != End[r]:
                T.atomic_max(Flag[1], 1)
            short = T.cast(0, "int32")   # whether short_row kept the row's top k (in k16 / p16)
            if length <= k:
                for i in T.Parallel(length):
                    b.ck[i] = M.key_of(X[r, i])
                    b.ci[i] = i
                b.st[0] = length
            elif bits == 16 and length <= SHORT_MAX and length >= 4 * SAMPLE and length * SHORT_MU <= SAMPLE * k:
                M.short_row(b, X, r, length, k)
                short = 1
            else:
                M.top_range(b, 0, length, X, r, k, b2)
            if bits == 16 and short != 0 and by_value == 0:
                M.emit16(b, r, k, Off[r], Vals, Idx, idx_fill, val_fill, idx_dtype)
            else:
                if bits == 16 and short != 0:
                    M.widen16(b)
                M.emit(b, r, k, by_value, Off[r], Vals, Idx, idx_fill, val_fill, idx_dtype)
            if length > k:
                M.flag_nan(b, r, Idx, Flag, inf_mag, idx_dtype)

    return topk_rows


def parts_kernel(bits):
    """One block per (segment, row): the top k of X[r, s*seg_len : min((s+1)*seg_len, End[r])] as keys and
    indices in WK/WI[r, s*k : (s+1)*k] (INT_MIN keys past a short segment's end); WM[r, s] its largest
    magnitude."""
    M = _macros(bits)
    batch, n, nseg, wlen = (T.dynamic(s) for s in ("batch", "n", "nseg", "wlen"))
    raw = _RAW[bits]

    @T.prim_func
    def topk_parts(X: T.Tensor((batch, n), raw), End: T.Tensor((batch,), "int32"),
                   WK: T.Tensor((batch, wlen), "int32"), WI: T.Tensor((batch, wlen), "int32"),
                   WM: T.Tensor((batch, nseg), "int32"), k: T.int32, seg_len: T.int32, b2: T.int32):
        with T.Kernel(nseg, batch, threads=1) as (s, r):
            b = _state(raw)
            _init(b)
            length = T.min(T.max(End[r], 0), n)
            # lo in a form guard_global_access reads as >= 0 (seg_len > 0 and length >= 0 always: the maxima change
            # nothing), so that the scan's in-place reads go unguarded (s * seg_len: a per-element bounds test and
            # masked load, ~20% of b1 1M's samples)
            lo = T.min(s * T.max(seg_len, 0), T.max(length, 0))
            hi = T.min(lo + seg_len, length)
            M.top_range(b, lo, hi, X, r, k, b2)
            cnt = b.st[0]
            for i in T.Parallel(k):
                WK[r, s * k + i] = T.if_then_else(i < cnt, b.ck[i], INT_MIN)
                WI[r, s * k + i] = T.if_then_else(i < cnt, b.ci[i], 0)
            T.reduce_max(b.mg, b.ext[0:1], dim=0)
            WM[r, s] = b.ext[0]

    return topk_parts


def merge_kernel(bits, idx_dtype):
    """One block per row: the top k of the workspace rows written by ``parts``, emitted as ``rows`` does."""
    M = _macros(bits)
    batch, k, nseg, wlen = (T.dynamic(s) for s in ("batch", "k", "nseg", "wlen"))
    raw = _RAW[bits]

    @T.prim_func
    def topk_merge(WK: T.Tensor((batch, wlen), "int32"), WI: T.Tensor((batch, wlen), "int32"),
                   WM: T.Tensor((batch, nseg), "int32"), End: T.Tensor((batch,), "int32"),
                   Off: T.Tensor((batch,), "int32"), Vals: T.Tensor((batch, k), raw),
                   Idx: T.Tensor((batch, k), idx_dtype), Flag: T.Tensor((2,), "int32"), n: T.int32,
                   by_value: T.int32, b2: T.int32, idx_fill: T.int32, val_fill: T.int32, inf_mag: T.int32):
        with T.Kernel(batch, threads=1) as r:
            b = _state(raw)
            _init(b)
            length = T.min(T.max(End[r], 0), n)
            if length != End[r]:
                T.atomic_max(Flag[1], 1)
            for s in T.serial(nseg):
                M.append_part(b, WK, WI, r, s, k)
                if b.st[0] + k > CAP or s == nseg - 1:
                    if b.st[0] > k:
                        M.select(b, k)
            M.emit(b, r, k, by_value, Off[r], Vals, Idx, idx_fill, val_fill, idx_dtype)
            big = T.cast(0, "int32")
            for s in T.serial(nseg):
                big = T.max(big, WM[r, s])
            if length > k and big > inf_mag:
                Idx[r, 0] = T.cast(NAN_FLAG, idx_dtype)
                T.atomic_max(Flag[0], 1)

    return topk_merge


_FACTORIES = {"rows": rows_kernel, "parts": parts_kernel, "merge": merge_kernel}
_JIT: dict = {}
_KERNELS: dict = {}


def get(kind: str, target: str, *args):
    """The ``kind`` kernel ("rows", "parts", "merge") for ``target``, compiled by its tegula.jit factory once per
    argument tuple."""
    key = (kind, target, *args)
    k = _KERNELS.get(key)
    if k is None:
        fac = _JIT.get((kind, target))
        if fac is None:
            fac = _JIT[(kind, target)] = tegula.jit(_FACTORIES[kind], target=target)
        k = _KERNELS[key] = fac(*args)
    return k


def bind(kernel, args, vary):
    """``kernel.bind`` for the op layer, which has checked every argument and passes tensors of the input's own
    dtype: they are bound as views of the kernel's declared dtypes (the raw bits), and launches take them as
    they are."""
    from tegula.jit.binding import torch_dtype
    args = [a.view(torch_dtype(p.dtype.name)) if hasattr(p, "shape") else a for a, p in zip(args, kernel.func.params)]
    return kernel.bind(*args, vary=vary)
