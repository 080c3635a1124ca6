"""The two data movements of expert parallelism, written in T.*: moving rows (dispatch) and summing gathered rows
(combine). CPU tensors run the compiled ``c`` kernels; other devices, or a machine without a C compiler, run the
torch versions below, which compute the same thing in the same order."""
from __future__ import annotations

import tegula
import tegula.language as T


@tegula.jit(target="c")
def copy_rows_kernel(dtype: str, W: int):
    """Y[dst[i], :] = X[src[i], :] for i < N: rows of W elements, one row per block, with streaming stores (the
    rows go to another rank's receive region; nobody reads them before they leave the cache). Rows outside X or Y
    are skipped."""
    M = T.dynamic("M")
    N = T.dynamic("N")
    P = T.dynamic("P")

    @T.prim_func
    def copy_rows(X: T.Tensor((M, W), dtype), src: T.Tensor((N,), "int32"), dst: T.Tensor((N,), "int32"),
                  Y: T.Tensor((P, W), dtype)):
        with T.Kernel(N, threads=128) as i:
            s = src[i]
            d = dst[i]
            if s >= 0 and s < M and d >= 0 and d < P:
                T.copy(X[s, 0:W], Y[d, 0:W], eviction_policy="evict_first")

    return copy_rows


@tegula.jit(target="c")
def dispatch_scatter_kernel(word: str, W: int, sword: str, SW: int, K: int, CW: int):
    """Every token's row to every receiver at once (each row is read once, however many ranks it goes to): for
    each token t and rank r with head[t, r] = h >= 0 and base[0, r] >= 0, into the flat ``window`` (views Yx, Ys,
    Yi, Yw, Yz of it, rows allowed to start at any element): Yx row base[0, r] + h * W = X[t] (W words); Ys row
    base[1, r] + h * SW = XS[t] (none if SW == 0); Yi / Yw rows base[2, r] + h * K / base[3, r] + h * K = the
    top-k of t as rank r sees it, experts [r * n_local, (r + 1) * n_local) made local, -1 and weight 0 elsewhere
    (none if K == 0); Yz[base[4, r] + h] = t. Every row is checked against its view once.
    The row goes out ``CW`` words at a time, each piece to every receiver in turn: one load feeds every
    receiver's streaming stores, which keeps the stores at the machine's streaming rate (whole rows one receiver
    after the other are about a fifth slower here)."""
    M = T.dynamic("M")
    Ms = T.dynamic("Ms")
    Mk = T.dynamic("Mk")
    R = T.dynamic("R")
    Px = T.dynamic("Px", "int64")
    Ps = T.dynamic("Ps", "int64")
    Pi = T.dynamic("Pi", "int64")
    Pw = T.dynamic("Pw", "int64")
    Pz = T.dynamic("Pz", "int64")
    Sc, Kc = max(SW, 1), max(K, 1)
    NC, TAIL = W // CW, W % CW

    @T.prim_func
    def dispatch_scatter(X: T.Tensor((M, W), word), XS: T.Tensor((Ms, Sc), sword), TI: T.Tensor((Mk, Kc), "int64"),
                         TW: T.Tensor((Mk, Kc), "float32"), head: T.Tensor((M, R), "int32"),
                         base: T.Tensor((5, R), "int64"), Yx: T.StridedTensor((Px, W), (1, 1), word),
                         Ys: T.StridedTensor((Ps, Sc), (1, 1), sword), Yi: T.StridedTensor((Pi, Kc), (1, 1), "int64"),
                         Yw: T.StridedTensor((Pw, Kc), (1, 1), "float32"), Yz: T.Tensor((Pz,), "int32"),
                         n_local: T.int64):
        with T.Kernel(M, threads=128) as t:
            # streaming stores: nobody reads the rows back before they leave the cache
            for c in T.serial(NC):
                for r in T.serial(R):
                    h = T.cast(head[t, r], "int64")
                    if h >= 0 and base[0, r] >= 0:
                        o = base[0, r] + h * W
                        if o >= 0 and o < Px:
                            T.copy(X[t, c * CW:c * CW + CW], Yx[o, c * CW:c * CW + CW], eviction_policy="evict_first")
            for r in T.serial(R):
                h = T.cast(head[t, r], "int64")
                if h >= 0 and base[0, r] >= 0:
                    if TAIL > 0:
                        o = base[0, r] + h * W
                        if o >= 0 and o < Px:
                            T.copy(X[t, NC * CW:W], Yx[o, NC * CW:W], eviction_policy="evict_first")
                    if SW > 0:
                        os_ = base[1, r] + h * SW
                        if t < Ms and os_ >= 0 and os_ < Ps:
                            for j in T.Parallel(SW):
                                Ys[os_, j] = XS[t, j]
                    if K > 0:
                        oi = base[2, r] + h * K
                        ow = base[3, r] + h * K
                        if t < Mk and oi >= 0 and oi < Pi and ow >= 0 and ow < Pw:
                            for k in T.serial(K):
                                e = TI[t, k] - r * n_local
                                keep = TI[t, k] >= 0 and e >= 0 and e < n_local
                                Yi[oi, k] = T.if_then_else(keep, e, T.int64(-1))
                                Yw[ow, k] = T.if_then_else(keep, TW[t, k], T.float32(0))
                    oz = base[4, r] + h
                    if oz >= 0 and oz < Pz:
                        Yz[oz] = t

    return dispatch_scatter


@tegula.jit(target="c")
def send_head_kernel():
    """head[t, r] = the number of tokens before t that go to rank r if token t goes there (flag[t, r] != 0), else
    -1; sent[r] = the number of tokens going to r. One block per rank walks the tokens in order."""
    N = T.dynamic("N")
    R = T.dynamic("R")

    @T.prim_func
    def send_head(flag: T.Tensor((N, R), "uint8"), head: T.Tensor((N, R), "int32"), sent: T.Tensor((R,), "int32")):
        with T.Kernel(R, threads=1) as r:
            n = T.alloc_var("int32", 0)
            for t in T.serial(N):
                go = flag[t, r] != 0
                head[t, r] = T.if_then_else(go, n, -1)
                n = n + T.if_then_else(go, 1, 0)
            sent[r] = n

    return send_head


@tegula.jit(target="c")
def gather_sum_kernel(dtype: str, H: int, weighted: bool, nbias: int, block: int):
    """Y[t, :] = bias0[t] + bias1[t] + sum_s w[t, s] * R(idx[t, s]), summed in float32 in order s = 0..S-1 and
    rounded once to ``dtype``. R(i) is the row A[i] for 0 <= i < Na, and B[i - Na] for Na <= i < Na + Nb, where B
    may overlap itself (strides (1, 1): B[o] is the H elements of a flat tensor from element o, so rows can start
    anywhere); other i add nothing. ``weighted=False`` drops w (every weight 1); ``nbias`` of the two bias tensors
    are read. The row length H is a constant (H % block == 0) and every access is checked once per row, so the
    column loops carry no bounds guards; columns go ``block`` at a time: the accumulator stays in L1."""
    Na = T.dynamic("Na")
    Nb = T.dynamic("Nb", "int64")
    N = T.dynamic("N")
    S = T.dynamic("S")

    @T.prim_func
    def gather_sum(A: T.Tensor((Na, H), dtype), B: T.StridedTensor((Nb, H), (1, 1), dtype),
                   idx: T.Tensor((N, S), "int64"), w: T.Tensor((N, S), "float32"), bias0: T.Tensor((N, H), dtype),
                   bias1: T.Tensor((N, H), dtype), Y: T.Tensor((N, H), dtype)):
        with T.Kernel(N, threads=128) as t:
            acc = T.alloc_fragment((block,), "float32")
            for c in T.serial(H // block):
                if nbias == 2:
                    for j in T.Parallel(block):
                        acc[j] = T.cast(bias0[t, c * block + j], "float32") + T.cast(bias1[t, c * block + j],
                                                                                      "float32")
                elif nbias == 1:
                    for j in T.Parallel(block):
                        acc[j] = T.cast(bias0[t, c * block + j], "float32")
                else:
                    T.clear(acc)
                for s in T.serial(S):
                    i = idx[t, s]
                    if i - Na >= 0 and i - Na < Nb:
                        if weighted:
                            for j in T.Parallel(block):
                                acc[j] += w[t, s] * B[i - Na, c * block + j]
                        else:
                            for j in T.Parallel(block):
                                acc[j] += B[i - Na, c * block + j]
                    elif i >= 0 and i < Na:
                        if weighted:
                            for j in T.Parallel(block):
                                acc[j] += w[t, s] * A[i, c * block + j]
                        else:
                            for j in T.Parallel(block):
                                acc[j] += A[i, c * block + j]
                for j in T.Parallel(block):
                    Y[t, c * block + j] = acc[j]

    return gather_sum


@tegula.jit(target="c")
def cast_to_fp8_kernel(dtype: str, round_scale: bool):
    """Per token and 128 channels: amax = max(|x|, 1e-4) over the group; Q = x * (448 / amax) in e4m3 (RNE,
    saturating), S = amax / 448 (one float32 division each). ``round_scale``: S = 2^ceil(log2(amax / 448)) from
    the bits, Q = x / S."""
    N = T.dynamic("N")
    H = T.dynamic("H")
    G = T.dynamic("G")

    @T.prim_func
    def cast_to_fp8(X: T.Tensor((N, H), dtype), Q: T.Tensor((N, H), "float8_e4m3fn"), S: T.Tensor((N, G), "float32")):
        with T.Kernel(N, threads=128) as t:
            v = T.alloc_fragment((128,), "float32")
            amax = T.alloc_fragment((1,), "float32")
            for g in T.serial(G):
                for j in T.Parallel(128):
                    v[j] = X[t, g * 128 + j]
                T.reduce_absmax(v, amax, dim=0)
                a = T.max(amax[0], T.float32(1e-4))
                if round_scale:
                    bits = T.reinterpret(a / T.float32(448.0), "int32")
                    e = ((bits >> 23) & 255) - 127 + T.if_then_else((bits & 8388607) != 0, 1, 0)
                    S[t, g] = T.reinterpret((e + 127) << 23, "float32")
                    scale = T.reinterpret((127 - e) << 23, "float32")
                    for j in T.Parallel(128):
                        Q[t, g * 128 + j] = v[j] * scale
                else:
                    S[t, g] = a / T.float32(448.0)
                    scale = T.float32(448.0) / a
                    for j in T.Parallel(128):
                        Q[t, g * 128 + j] = v[j] * scale

    return cast_to_fp8


_COMPILED: dict = {}
_THP_BYTES = 4 << 20


def _compiled(tensor) -> bool:
    """Whether the ``c`` kernels serve this tensor: a CPU tensor on a machine where they build."""
    if tensor.device.type != "cpu":
        return False
    ok = _COMPILED.get("c")
    if ok is None:
        from tegula.errors import CompileError
        from tegula.runtime import cpu
        try:
            cpu._compiler_info(cpu.compiler())
            ok = True
        except CompileError:  # no working C compiler here: the torch versions serve
            ok = False
        if ok:  # with a compiler, a kernel that fails to build is a bug to report, not a reason to run slowly
            copy_rows_kernel("uint8", 64)
        _COMPILED["c"] = ok
    return ok


def empty(shape, dtype, device):
    """An uninitialised tensor. Large CPU ones come from a small cache of anonymous mappings (backed by transparent
    huge pages where the kernel offers them): fresh memory is faulted in at about a fifth of the speed it is then
    written, so an output of tens of MB costs more in page faults than in being computed. A mapping is handed out
    again only once nothing refers to it any more (no tensor, view or storage made from it: each holds a reference
    to the mapping), as torch's caching allocators do on GPUs."""
    import mmap

    import torch
    n = 1
    for d in shape:
        n *= d
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes < _THP_BYTES:
        return torch.empty(shape, dtype=dtype, device=device)
    idle = _idle()
    hit = [i for i in idle if len(_POOL[i]) == nbytes]
    if hit:
        m = _POOL.pop(hit[-1])  # the most recently used
    else:
        m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            m.madvise(mmap.MADV_HUGEPAGE)
        if len(_POOL) >= _POOL_SIZE:  # forget the oldest idle mapping, else the oldest (its tensors keep it alive)
            del _POOL[idle[0] if idle else 0]
    _POOL.append(m)
    return torch.frombuffer(m, dtype=dtype).view(shape)


_POOL: list = []  # cached mappings of empty(), least recently used first
_POOL_SIZE = 4


def _idle() -> list[int]:
    """Positions in the pool of the mappings nothing else refers to. A tensor made by torch.frombuffer holds a
    reference to its mapping for as long as its storage lives (through any view); an idle one has two: the pool's
    and getrefcount's argument."""
    import sys
    return [i for i in range(len(_POOL)) if sys.getrefcount(_POOL[i]) == 2]


def _word_view(t, row_bytes):
    """``t`` (contiguous rows of ``row_bytes``) as rows of the widest integer word dividing them."""
    import torch
    for size, word in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if row_bytes % size == 0:
            return t.view(torch.uint8).view(-1, row_bytes).view(word)
    return t.view(torch.uint8).view(-1, row_bytes)


def copy_rows(x, src, dst, y) -> None:
    """y[dst[i]] = x[src[i]] for every i: rows of contiguous tensors of one dtype (row = all but the first
    dimension), int32 indices."""
    n = src.numel()
    if n == 0:
        return
    if not _compiled(x):
        y.index_copy_(0, dst.long(), x.index_select(0, src.long()))
        return
    row = x[0].numel() * x.element_size() if x.shape[0] else y[0].numel() * y.element_size()
    xv, yv = _word_view(x, row), _word_view(y, row)
    copy_rows_kernel(str(xv.dtype)[6:], xv.shape[1])(xv, src, dst, yv)


def dispatch_scatter(x, x_scales, topk_idx, topk_weights, send_head, window, dests, n_local: int,
                     cache=None) -> bool:
    """Dispatch's rows into every receiver this rank writes, in one pass over its tokens (each row read once).
    ``dests``: {rank r: ({name: where r's array of that name begins in the uint8 tensor ``window``, in bytes} for
    x, x_scales, topk_idx, topk_weights and src_idx; the row where this rank's rows begin there)}. Token t goes to
    r at that row + send_head[t, r] (int32 [T, R], -1: not sent), with its scales, its top-k made local to r's
    experts [r * n_local, (r + 1) * n_local) (-1 and weight 0 elsewhere) and its id. x_scales and the top-k may
    be None. Returns False, doing nothing, where the compiled kernel does not serve (the caller moves the rows
    another way).
    ``cache``: a dict owned by the caller (who keeps ``window`` alive while it holds the dict) where the kernel,
    bound once per window and shapes, is kept: a later call of the same shapes launches it without checking or
    converting any argument again."""
    if not _compiled(x) or window is None:
        return False
    t, r_n = send_head.shape
    if t == 0 or not dests:
        return True
    xw = _word_view(x, x.shape[1] * x.element_size())
    sw = None if x_scales is None else _word_view(x_scales, x_scales.shape[1] * x_scales.element_size())
    key = (window.data_ptr(), window.numel(), xw.dtype, tuple(xw.shape), r_n, n_local, send_head.dtype) + (
        () if sw is None else (sw.dtype, tuple(sw.shape))) + (
        () if topk_idx is None else (topk_idx.dtype, topk_weights.dtype, tuple(topk_idx.shape),
                                     tuple(topk_weights.shape)))
    launch = None if cache is None else cache.get(key)
    if launch is None:
        launch = _ScatterLaunch(xw, sw, topk_idx, topk_weights, send_head, window, n_local)
        if cache is not None:
            if len(cache) >= 8:  # shapes seen long ago: drop them rather than grow without bound
                cache.clear()
            cache[key] = launch
    launch(xw, sw, topk_idx, topk_weights, send_head, dests)
    return True


_PIECE_BYTES = 512  # dispatch rows go out in pieces of this many bytes, each to every receiver in turn


class _ScatterLaunch:
    """dispatch_scatter_kernel bound to one window and one set of shapes: the window's row views, the stand-ins
    of absent arrays and the table of where each receiver's rows begin are made (and checked) once; a call fills
    the table in and launches with the varying tensors' addresses."""

    _NAMES = ("x", "x_scales", "topk_idx", "topk_weights", "src_idx")

    def __init__(self, xw, sw, topk_idx, topk_weights, send_head, window, n_local):
        import torch
        r_n = send_head.shape[1]
        # an absent array is a one-word stand-in, never read (the kernel is built without it)
        self.stand_in = (torch.zeros((1, 1), dtype=torch.int32), torch.zeros((1, 1), dtype=torch.int64),
                         torch.zeros((1, 1), dtype=torch.float32))
        src = (xw, self.stand_in[0] if sw is None else sw, self.stand_in[1] if topk_idx is None else topk_idx,
               self.stand_in[2] if topk_weights is None else topk_weights)
        win = [window.view(a.dtype) for a in src] + [window.view(torch.int32)]
        self.width = [a.shape[1] for a in src] + [1]
        self.esize = [w.element_size() for w in win]
        self.base = torch.full((5, r_n), -1, dtype=torch.int64)  # row 0 of this rank's rows at each receiver
        self.base_np = self.base.numpy()
        rows = [w.as_strided((w.numel() - n + 1, n), (1, 1)) for w, n in zip(win[:4], self.width)]  # every start
        k = dispatch_scatter_kernel(str(xw.dtype)[6:], self.width[0], str(src[1].dtype)[6:],
                                    0 if sw is None else self.width[1], 0 if topk_idx is None else self.width[2],
                                    max(1, min(self.width[0], _PIECE_BYTES // xw.element_size())))
        self.launch = k.bind(*src, send_head.contiguous(), self.base, *rows, win[4], n_local, vary=range(5))

    def __call__(self, xw, sw, topk_idx, topk_weights, send_head, dests):
        base = self.base_np
        base.fill(-1)
        for r, (at, row0) in dests.items():
            for i, n in enumerate(self._NAMES):
                v = at.get(n)
                if v is not None:
                    base[i, r] = v // self.esize[i] + row0 * self.width[i]
        self.launch(xw.contiguous(), self.stand_in[0] if sw is None else sw.contiguous(),
                    self.stand_in[1] if topk_idx is None else topk_idx.contiguous(),
                    self.stand_in[2] if topk_weights is None else topk_weights.contiguous(), send_head.contiguous())


def send_head(is_token_in_rank):
    """-> (send_head [T, R] int32: token t's place among the tokens sent to rank r, in token order, -1 when not
    sent; the number of tokens sent to each rank [R] int32), as layout.send_head_of, in one kernel launch (a
    launcher bound per shape) instead of five torch operations."""
    import torch
    t, r = is_token_in_rank.shape
    if t == 0 or not _compiled(is_token_in_rank):
        from tegula.ep.layout import send_head_of
        return send_head_of(is_token_in_rank)
    flag = is_token_in_rank.contiguous().view(torch.uint8)
    head = torch.empty((t, r), dtype=torch.int32)
    sent = torch.empty(r, dtype=torch.int32)
    launch = _SEND_HEAD_LAUNCHES.get((t, r))
    if launch is None:
        if len(_SEND_HEAD_LAUNCHES) >= 16:  # shapes seen long ago: drop them rather than grow without bound
            _SEND_HEAD_LAUNCHES.clear()
        launch = _SEND_HEAD_LAUNCHES[(t, r)] = send_head_kernel().bind(flag, head, sent)
    launch(flag, head, sent)
    return head, sent


_SEND_HEAD_LAUNCHES: dict = {}  # send_head_kernel bound per [T, R]


def gather_sum(a, b, idx, w=None, bias=(), out=None):
    """out[t] = sum(bias) + sum_s w[t, s] * row(idx[t, s]) in float32, in order, rounded once to a's dtype.
    row(i) is a[i] for 0 <= i < a.shape[0]; for larger i the H elements of the flat ``b`` from element
    i - a.shape[0] (so b can be any memory holding rows, such as the window of every segment); i < 0, and i past
    b's last whole row, add nothing.
    Shapes: a [Na, H], b 1-D, idx [N, S] int64, w [N, S] float32 or None (weights 1), bias: up to two [N, H]
    tensors; all contiguous."""
    import torch
    n, s = idx.shape
    h = a.shape[1]
    if out is None:
        out = empty((n, h), a.dtype, a.device)
    if n == 0:
        return out
    if not _compiled(a):
        return _gather_sum_torch(a, b, idx, w, bias, out)
    na = a.shape[0]
    if na == 0:  # the kernel wants a row: borrow the output's first (never read, no index is below Na = 1)
        a, idx = out[:1], torch.where(idx >= 0, idx + 1, idx)
    if b.numel() < h:  # no row of b: any row will do (no index reaches it)
        b = a.view(-1)
    rows = b.as_strided((b.numel() - h + 1, h), (1, 1))  # rows starting at every element of b
    # the kernel's w and bias when they are not used: any tensors of their shapes
    unread = idx.view(torch.float32).view(-1)[:n * s].view(n, s) if w is None else w
    args = (a, rows, idx, unread, bias[0] if bias else out, bias[1] if len(bias) > 1 else out, out)
    key = (a.dtype, h, w is not None, len(bias), a.shape[0], rows.shape[0], n, s)
    launch = _GATHER_LAUNCHES.get(key)
    if launch is not None and all(t.is_contiguous() for t in args if t is not rows):
        launch(*args)
        return out
    block = next(c for c in (256, 32, 8, 1) if h % c == 0)
    k = gather_sum_kernel(str(a.dtype)[6:], h, w is not None, len(bias), block)
    if not all(t.is_contiguous() for t in args if t is not rows):
        k(*args)  # checked as any call (a strided argument is an error there)
        return out
    if len(_GATHER_LAUNCHES) >= 16:  # shapes seen long ago: drop them rather than grow without bound
        _GATHER_LAUNCHES.clear()
    # every tensor varies (the launcher keeps none alive); a later call of the same shapes, with contiguous
    # tensors and b's rows made as here, launches with their addresses alone
    launch = _GATHER_LAUNCHES[key] = k.bind(*args)
    launch(*args)
    return out


_GATHER_LAUNCHES: dict = {}  # gather_sum_kernel bound per dtype, row length, weights, biases and shapes


def cast_to_fp8(x, round_scale: bool = False):
    """x [T, H] (H % 128 == 0) -> (fp8 e4m3 [T, H], float32 scales [T, H/128]): each 128-channel group of a token
    scaled by 448 / max(|x|, 1e-4), one float32 division (torch's ``448.0 / t`` multiplies by a reciprocal instead);
    the scale kept is amax / 448. ``round_scale``: a power of two, 2^ceil(log2(amax / 448))."""
    import torch
    t, h = x.shape
    q = torch.empty((t, h), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((t, h // 128), dtype=torch.float32, device=x.device)
    if t == 0:
        return q, s
    if _compiled(x):
        cast_to_fp8_kernel(str(x.dtype)[6:], bool(round_scale))(x.contiguous(), q, s)
        return q, s
    xf = x.float().view(t, h // 128, 128)
    amax = xf.abs().amax(dim=2).clamp(min=1e-4)
    if round_scale:
        s.copy_(torch.exp2(torch.ceil(torch.log2(amax / 448.0))))
        scale = torch.exp2(-torch.log2(s))
    else:
        s.copy_(amax / 448.0)
        scale = torch.full_like(amax, 448.0) / amax
    q.copy_((xf * scale.unsqueeze(2)).view(t, h))
    return q, s


def _gather_sum_torch(a, b, idx, w, bias, out):
    import torch
    acc = torch.zeros(tuple(out.shape), dtype=torch.float32, device=out.device)
    for bi in bias:
        acc += bi.float()
    na, h = a.shape
    for s in range(idx.shape[1]):
        i = idx[:, s]
        for hit, rows in (((i >= 0) & (i < na), lambda at: a.index_select(0, at)),
                          ((i >= na) & (i - na <= b.numel() - h),
                           lambda at: b[(at - na).unsqueeze(1) + torch.arange(h, device=b.device)])):
            hit = hit.nonzero().squeeze(1)
            if hit.numel():
                v = rows(i[hit]).float()
                if w is not None:
                    v = v * w[hit, s].unsqueeze(1)
                acc.index_add_(0, hit, v)
    out.copy_(acc)
    return out
