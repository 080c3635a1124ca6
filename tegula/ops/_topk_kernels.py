"""The T.* kernels behind ``tegula.ops.topk``: threshold filtering into a candidate buffer, radix select.

Values arrive as raw bits (int16 for bf16/fp16, int32 for fp32; the op views the tensors) and become
order-preserving signed keys: ``key = v ^ ((v >> 31) & low_mask)`` on the sign-extended bits flips the magnitude
of negative numbers, so that integer order is float order (-NaN < -inf < ... < -0 < +0 < ... < +inf < +NaN) and
the map is its own inverse. Each block scans its range in chunks of CHUNK elements: the keys of a chunk go to a
small tile, the maximum of each SUB-element piece is taken with T.reduce_max, and only pieces whose maximum beats
the threshold are appended (in index order, branch-free) to the candidate buffer. When the buffer holds k + b2
entries a radix select (11/11/10-bit digits for 32-bit keys, 8/8 for 16-bit) finds the k-th largest key, keeps
the k largest (ties: lower index first), and that key becomes the threshold. Candidates stay in index order
throughout, so indices come out ascending unless values are sorted (an LSD radix sort, 8-bit digits).

Three kernels: ``rows`` (one block per row), and for rows split over several cores ``parts`` (one block per
(segment, row), writing each segment's top-k keys and indices to a workspace) followed by ``merge`` (one block
per row, filtering the workspace the same way).
"""
from __future__ import annotations

import tegula
import tegula.language as T

KMAX = 4096               # the largest k (DeepSelect's limit)
CHUNK = 512               # elements scanned per step
SUB = 32                  # elements per piece tested against the threshold
NSUB = CHUNK // SUB
B2MAX = 4096              # the largest slack of the candidate buffer before a select
CAP = KMAX + B2MAX + CHUNK
HBINS = 2048
INT_MIN = -(1 << 31)
INT_MAX = (1 << 31) - 1
HIGH_BIT = 1 << 31
NAN_FLAG = 0x3F3F3F3F     # DeepSelect's marker in indices[row, 0] of a row holding NaN

_SORT_SHIFTS = {32: (0, 8, 16, 24), 16: (0, 8)}
_RAW = {16: "int16", 32: "int32"}
_LOW = {16: 0x7FFF, 32: 0x7FFFFFFF}


def _codec(bits):
    """(key of raw bits, raw bits of a key, the key as an unsigned-order uint32, the key of such a uint32)."""
    low = _LOW[bits]

    def key(v):
        v = T.cast(v, "int32")
        return v ^ ((v >> 31) & low)

    def raw(key):
        return T.cast(key ^ ((key >> 31) & low), _RAW[bits])

    bias = INT_MIN if bits == 32 else -32768  # the smallest key maps to 0

    def ukey(key):
        return T.reinterpret(key - bias if bits == 16 else key ^ INT_MIN, "uint32")

    def key_of_u(u):
        return T.reinterpret(u, "int32") + bias if bits == 16 else T.reinterpret(u, "int32") ^ INT_MIN

    return key, raw, ukey, key_of_u


def _macros(bits):
    key_of, raw_of, ukey, key_of_u = _codec(bits)

    @T.macro
    def select(ck, ci, st, k, hist, und):
        """Keep the k largest of the st[0] candidates ck/ci (in their order; ties: earliest first); st[1]
        becomes the k-th largest key. Radix select over the candidates' own range [st[3], st[2]]: each pass
        histograms up to 11 bits of (u - base) and narrows to the bucket holding the k-th largest."""
        cnt = st[0]
        base = ukey(st[3])
        span = ukey(st[2]) - base
        shift = T.cast(T.max(21 - T.cast(T.clz(span), "int32"), 0), "uint32")   # 32 - clz: the span's bit length
        for i in T.Parallel(cnt):
            und[i] = ukey(ck[i])
        nu = cnt
        need = k
        going = T.cast(1, "int32")
        while going != 0:
            nb = T.cast(span >> shift, "int32") + 1
            for h in T.Parallel(nb):
                hist[h] = 0
            for i in T.serial(nu):
                d = (und[i] - base) >> shift
                hist[d] = hist[d] + 1
            b = nb - 1
            acc = T.cast(0, "int32")
            while acc + hist[b] < need and b > 0:
                acc = acc + hist[b]
                b = b - 1
            need = need - acc
            base = base + (T.cast(b, "uint32") << shift)
            if shift == 0:
                going = 0
            else:
                w = T.cast(0, "int32")
                for i in T.serial(nu):
                    u = und[i]
                    und[w] = u
                    w = w + T.cast(((u - base) >> shift) == 0, "int32")
                nu = w
                span = (T.cast(1, "uint32") << shift) - 1
                shift = T.cast(T.max(21 - T.cast(T.clz(span), "int32"), 0), "uint32")
        kth = key_of_u(base)
        w = T.cast(0, "int32")
        for i in T.serial(cnt):
            kv = ck[i]
            eq = T.cast((kv == kth) & (need > 0), "int32")
            ck[w] = kv
            ci[w] = ci[i]
            w = w + (T.cast(kv > kth, "int32") | eq)
            need = need - eq
        st[0] = w
        st[1] = kth
        st[3] = kth

    @T.macro
    def scan(lo, hi, src, src_idx, row, raw_src, ck, ci, st, kk, fb, masks, mg, k, b2, hist, und):
        """Append the keys of positions [lo, hi) of src[row, :] that beat the threshold st[1] (with their
        indices: the positions, or src_idx[row, p] for a workspace), in order; select when the buffer fills.
        Raw sources are converted to keys and mg keeps the largest magnitude seen (for the NaN check)."""
        nfull = (hi - lo) // CHUNK
        for c in T.serial(nfull):
            base = lo + c * CHUNK
            thr = st[1]
            for s, j in T.Parallel(NSUB, SUB):
                kv = key_of(src[row, base + s * SUB + j]) if raw_src else src[row, base + s * SUB + j]
                kk[s * SUB + j] = kv
                fb[s, j] = T.cast(kv > thr, "uint32") << T.cast(31 - j, "uint32")
                if raw_src:
                    mg[s * SUB + j] = T.max(mg[s * SUB + j], kv ^ (kv >> 31))
            T.reduce_sum(fb, masks, dim=1)   # distinct bits: the sum is the OR, bit 31 - j for item j
            cnt = st[0]
            top = st[2]
            bot = st[3]
            for s in T.serial(NSUB):
                m = masks[s]
                while m != 0:
                    j = T.cast(T.clz(m), "int32")
                    kv = kk[s * SUB + j]
                    ck[cnt] = kv
                    ci[cnt] = base + s * SUB + j if raw_src else src_idx[row, base + s * SUB + j]
                    cnt = cnt + 1
                    top = T.max(top, kv)
                    bot = T.min(bot, kv)
                    m = m ^ (T.cast(HIGH_BIT, "uint32") >> T.cast(j, "uint32"))
            st[0] = cnt
            st[2] = top
            st[3] = bot
            if cnt >= k + b2:
                select(ck, ci, st, k, hist, und)
        tail = lo + nfull * CHUNK
        thr = st[1]
        cnt = st[0]
        top = st[2]
        bot = st[3]
        for j in T.serial(hi - tail):
            kv = key_of(src[row, tail + j]) if raw_src else src[row, tail + j]
            if raw_src:
                mg[0] = T.max(mg[0], kv ^ (kv >> 31))
            if kv > thr:
                ck[cnt] = kv
                ci[cnt] = tail + j if raw_src else src_idx[row, tail + j]
                cnt = cnt + 1
                top = T.max(top, kv)
                bot = T.min(bot, kv)
        st[0] = cnt
        st[2] = top
        st[3] = bot

    @T.macro
    def sort_by_value(ck, ci, tk, ti, cnt, hist):
        """Order ck/ci[0:cnt] by descending key (stable: equal keys keep index order), in place: LSD radix
        sort on 8-bit digits through tk/ti; a pass whose digit is the same for all is a copy."""
        for p, shift in enumerate(_SORT_SHIFTS[bits]):
            sk, sj, dk, dj = (ck, ci, tk, ti) if p % 2 == 0 else (tk, ti, ck, ci)
            for h in T.Parallel(256):
                hist[h] = 0
            for i in T.serial(cnt):
                d = 255 - T.cast((ukey(sk[i]) >> shift) & 255, "int32")
                hist[d] = hist[d] + 1
            if hist[255 - T.cast((ukey(sk[0]) >> shift) & 255, "int32")] == cnt:
                for i in T.Parallel(cnt):
                    dk[i] = sk[i]
                    dj[i] = sj[i]
            else:
                acc = T.cast(0, "int32")
                for h in T.serial(256):
                    c = hist[h]
                    hist[h] = acc
                    acc = acc + c
                for i in T.serial(cnt):
                    kv = sk[i]
                    d = 255 - T.cast((ukey(kv) >> shift) & 255, "int32")
                    pos = hist[d]
                    hist[d] = pos + 1
                    dk[pos] = kv
                    dj[pos] = sj[i]

    @T.macro
    def emit(r, ck, ci, tk, ti, cnt, k, hist, by_value, off, Vals, Idx, idx_fill, val_fill, idx_dtype):
        """Write the cnt (<= k) candidates of row r, then the fill values."""
        if by_value != 0 and cnt > 1:
            sort_by_value(ck, ci, tk, ti, cnt, hist)
        for i in T.Parallel(k):
            if i < cnt:
                Idx[r, i] = T.cast(ci[i] + off, idx_dtype)
                Vals[r, i] = raw_of(ck[i])
            else:
                Idx[r, i] = T.cast(idx_fill, idx_dtype)
                Vals[r, i] = T.cast(val_fill, _RAW[bits])

    return key_of, select, scan, emit


def _state():
    """The per-block buffers every kernel uses; st = (count, threshold, largest, smallest candidate key)."""
    ck = T.alloc_shared((CAP,), "int32")
    ci = T.alloc_shared((CAP,), "int32")
    und = T.alloc_shared((CAP,), "uint32")
    tk = T.alloc_shared((KMAX,), "int32")
    ti = T.alloc_shared((KMAX,), "int32")
    hist = T.alloc_shared((HBINS,), "int32")
    kk = T.alloc_fragment((CHUNK,), "int32")
    fb = T.alloc_fragment((NSUB, SUB), "uint32")
    masks = T.alloc_fragment((NSUB,), "uint32")
    mg = T.alloc_fragment((CHUNK,), "int32")
    st = T.alloc_local((4,), "int32")
    st[0] = 0
    st[1] = INT_MIN
    st[2] = INT_MIN
    st[3] = INT_MAX
    return ck, ci, und, tk, ti, hist, kk, fb, masks, mg, st


def rows_kernel(bits, idx_dtype):
    """One block per row: Vals/Idx[r, :k] = the top k of X[r, :End[r]]. Flag[0] becomes 1 when a row longer
    than k holds NaN (its Idx[r, 0] is NAN_FLAG), Flag[1] when some End[r] is outside [0, n]."""
    key_of, select, scan, emit = _macros(bits)
    batch, n, k = T.dynamic("batch"), T.dynamic("n"), T.dynamic("k")
    raw = _RAW[bits]

    @T.prim_func
    def topk_rows(X: T.Tensor((batch, n), raw), End: T.Tensor((batch,), "int32"), Off: T.Tensor((batch,), "int32"),
                  Vals: T.Tensor((batch, k), raw), Idx: T.Tensor((batch, k), idx_dtype),
                  Flag: T.Tensor((2,), "int32"), by_value: T.int32, b2: T.int32, idx_fill: T.int32,
                  val_fill: T.int32, inf_mag: T.int32):
        with T.Kernel(batch, threads=1) as r:
            ck, ci, und, tk, ti, hist, kk, fb, masks, mg, st = _state()
            length = T.min(T.max(End[r], 0), n)
            if length != End[r]:
                T.atomic_max(Flag[1], 1)
            if length <= k:
                for i in T.Parallel(length):
                    ck[i] = key_of(X[r, i])
                    ci[i] = i
                st[0] = length
            else:
                for i in T.Parallel(CHUNK):
                    mg[i] = 0
                scan(0, length, X, X, r, True, ck, ci, st, kk, fb, masks, mg, k, b2, hist, und)
                if st[0] > k:
                    select(ck, ci, st, k, hist, und)
            emit(r, ck, ci, tk, ti, st[0], k, hist, by_value, Off[r], Vals, Idx, idx_fill, val_fill, idx_dtype)
            if length > k:
                T.reduce_max(mg, kk[0:1], dim=0)
                if kk[0] > inf_mag:
                    Idx[r, 0] = T.cast(NAN_FLAG, idx_dtype)
                    T.atomic_max(Flag[0], 1)

    return topk_rows


def parts_kernel(bits):
    """One block per (segment, row): the top k of X[r, s*seg_len : min((s+1)*seg_len, End[r])] as keys and
    indices in WK/WI[r, s*k : (s+1)*k] (INT_MIN keys past a short segment's end); WM[r, s] its largest
    magnitude."""
    key_of, select, scan, emit = _macros(bits)
    batch, n, nseg, wlen = (T.dynamic(s) for s in ("batch", "n", "nseg", "wlen"))
    raw = _RAW[bits]

    @T.prim_func
    def topk_parts(X: T.Tensor((batch, n), raw), End: T.Tensor((batch,), "int32"),
                   WK: T.Tensor((batch, wlen), "int32"), WI: T.Tensor((batch, wlen), "int32"),
                   WM: T.Tensor((batch, nseg), "int32"), k: T.int32, seg_len: T.int32, b2: T.int32):
        with T.Kernel(nseg, batch, threads=1) as (s, r):
            ck, ci, und, tk, ti, hist, kk, fb, masks, mg, st = _state()
            length = T.min(T.max(End[r], 0), n)
            lo = T.min(s * seg_len, length)
            hi = T.min(lo + seg_len, length)
            for i in T.Parallel(CHUNK):
                mg[i] = 0
            scan(lo, hi, X, X, r, True, ck, ci, st, kk, fb, masks, mg, k, b2, hist, und)
            if st[0] > k:
                select(ck, ci, st, k, hist, und)
            cnt = st[0]
            for i in T.Parallel(k):
                WK[r, s * k + i] = T.if_then_else(i < cnt, ck[i], INT_MIN)
                WI[r, s * k + i] = T.if_then_else(i < cnt, ci[i], 0)
            T.reduce_max(mg, kk[0:1], dim=0)
            WM[r, s] = kk[0]

    return topk_parts


def merge_kernel(bits, idx_dtype):
    """One block per row: the top k of the workspace rows written by ``parts``, emitted as ``rows`` does."""
    key_of, select, scan, emit = _macros(bits)
    batch, k, nseg, wlen = (T.dynamic(s) for s in ("batch", "k", "nseg", "wlen"))
    raw = _RAW[bits]

    @T.prim_func
    def topk_merge(WK: T.Tensor((batch, wlen), "int32"), WI: T.Tensor((batch, wlen), "int32"),
                   WM: T.Tensor((batch, nseg), "int32"), End: T.Tensor((batch,), "int32"),
                   Off: T.Tensor((batch,), "int32"), Vals: T.Tensor((batch, k), raw),
                   Idx: T.Tensor((batch, k), idx_dtype), Flag: T.Tensor((2,), "int32"), n: T.int32,
                   by_value: T.int32, b2: T.int32, idx_fill: T.int32, val_fill: T.int32, inf_mag: T.int32):
        with T.Kernel(batch, threads=1) as r:
            ck, ci, und, tk, ti, hist, kk, fb, masks, mg, st = _state()
            length = T.min(T.max(End[r], 0), n)
            if length != End[r]:
                T.atomic_max(Flag[1], 1)
            scan(0, wlen, WK, WI, r, False, ck, ci, st, kk, fb, masks, mg, k, b2, hist, und)
            if st[0] > k:
                select(ck, ci, st, k, hist, und)
            emit(r, ck, ci, tk, ti, st[0], k, hist, by_value, Off[r], Vals, Idx, idx_fill, val_fill, idx_dtype)
            big = T.cast(0, "int32")
            for s in T.serial(nseg):
                big = T.max(big, WM[r, s])
            if big > inf_mag and length > k:
                Idx[r, 0] = T.cast(NAN_FLAG, idx_dtype)
                T.atomic_max(Flag[0], 1)

    return topk_merge


_FACTORIES = {"rows": rows_kernel, "parts": parts_kernel, "merge": merge_kernel}
_JIT: dict = {}
_KERNELS: dict = {}


class Launcher:
    """A compiled kernel and how to start it from the op layer, which has already checked every argument:
    ``launcher(args, symbols)`` with the parameters in order and the symbolic dims in ``_SYMBOLS[kind]`` order.
    Pointer targets get the tensors' addresses straight away (no per-call binding); the others (interp) get the
    tensors viewed as the declared dtypes through the ordinary call."""

    def __init__(self, kernel, symbol_names):
        from tegula.jit.binding import torch_dtype
        self.kernel, self.launch = kernel, getattr(kernel.program, "launch", None)
        self.pointer = kernel.target.args == "pointer"
        self.dtypes = [torch_dtype(p.dtype.name) if hasattr(p, "shape") else None for p in kernel.func.params]
        self.tensors = [i for i, d in enumerate(self.dtypes) if d is not None]
        order = [v.name for v in kernel.symbols]
        self.perm = None if order == list(symbol_names) else [list(symbol_names).index(s) for s in order]

    def __call__(self, args, symbols):
        if self.perm is not None:
            symbols = [symbols[i] for i in self.perm]
        if self.pointer:
            args = list(args)
            for i in self.tensors:
                args[i] = args[i].data_ptr()
            self.launch(*args, *symbols)
        else:
            self.kernel(*[a.view(d) if d is not None and a.dtype != d else a for a, d in zip(args, self.dtypes)])


_SYMBOLS = {"rows": ("batch", "n", "k"), "parts": ("batch", "n", "nseg", "wlen"),
            "merge": ("batch", "nseg", "wlen", "k")}


def get(kind: str, target: str, *args) -> Launcher:
    """The ``kind`` kernel ("rows", "parts", "merge") for ``target``, compiled by its tegula.jit factory once per
    argument tuple."""
    key = (kind, target, *args)
    k = _KERNELS.get(key)
    if k is None:
        fac = _JIT.get((kind, target))
        if fac is None:
            fac = _JIT[(kind, target)] = tegula.jit(_FACTORIES[kind], target=target)
        k = _KERNELS[key] = Launcher(fac(*args), _SYMBOLS[kind])
    return k
