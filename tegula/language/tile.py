"""The T.* tile ops: each checks its operands' shapes and appends one IR statement."""
from __future__ import annotations

from tegula.errors import CompileError
from tegula.ir import dtypes as dt
from tegula.ir import expr as E
from tegula.ir import stmt as S
from tegula.ir.buffer import Buffer, Region, as_region
from tegula.language.builder import kernel_builder


def _squeeze(shape) -> tuple:
    return tuple(E.const_value(d) if E.const_value(d) is not None else d for d in shape
                 if E.const_value(d) != 1)


def _shape_str(shape) -> str:
    return "(" + ", ".join(str(E.const_value(d) if E.const_value(d) is not None else d) for d in shape) + ")"


def _const_shape(rg: Region, what: str) -> tuple:
    for e in rg.extents:
        if E.const_value(e) is None:
            raise CompileError(f"{what}: the tile {rg} has a symbolic extent; tile extents must be compile-time "
                               "constants (slice a constant-size tile out of the tensor)")
    return tuple(int(E.const_value(d)) for d in rg.shape)


def _operand_shape(x):
    if isinstance(x, Region):
        return x.shape
    if isinstance(x, Buffer):
        return x.shape
    return None


def copy(src, dst, coalesced_width=None, disable_tma=False, eviction_policy=None, **_hints):
    """Copy a tile: each side is a buffer, a region ``A[a:b, c]`` or a start element ``A[i, j]`` (extent from
    the other side). The dtype converts on the way; global elements outside the tensor read as 0 and are not
    written. ``eviction_policy`` ("evict_normal", "evict_first", "evict_last") is a cache hint that never changes
    the result; on the c target "evict_first" copies a contiguous run into a global tensor with streaming stores
    (the destination is neither read first nor kept in cache: for copies far larger than the cache whose output is
    not read again soon)."""
    if eviction_policy not in (None, "evict_normal", "evict_first", "evict_last"):
        raise CompileError(f"T.copy: eviction_policy must be 'evict_normal', 'evict_first' or 'evict_last', got "
                           f"{eviction_policy!r}")
    b = kernel_builder()
    s_shape, d_shape = _operand_shape(src), _operand_shape(dst)
    if s_shape is None and d_shape is None:
        if not (isinstance(src, E.Load) and isinstance(dst, E.Load)):
            raise CompileError(f"T.copy: expected buffers or regions, got {type(src).__name__} and "
                               f"{type(dst).__name__}")
        s_shape = d_shape = ()
    src = as_region(src, d_shape if s_shape is None else None)
    dst = as_region(dst, s_shape if d_shape is None else src.shape)
    ss, ds = _const_shape(src, "T.copy"), _const_shape(dst, "T.copy")
    if _squeeze(ss) != _squeeze(ds):
        raise CompileError(f"T.copy: source {src.buffer.name} tile {_shape_str(ss)} does not match destination "
                           f"{dst.buffer.name} tile {_shape_str(ds)}")
    b.emit(S.Copy(src, dst, eviction_policy=eviction_policy))


def fill(buffer, value):
    """Set every element of a tile to ``value`` (converted to the tile's dtype)."""
    b = kernel_builder()
    rg = as_region(buffer)
    _const_shape(rg, "T.fill")
    b.emit(S.Fill(rg, E.cast(E.as_expr(value, like=rg.dtype), rg.dtype)))


def clear(buffer):
    """``T.fill(buffer, 0)``."""
    fill(buffer, 0)


def gemm(A, B, C, transpose_A=False, transpose_B=False, policy=None, clear_accum=False, k_pack=1, wg_wait=0,
         **_hints):
    """C += op(A) @ op(B), accumulated in C's dtype. A is (M, K) or (K, M) with transpose_A; B is (K, N) or
    (N, K) with transpose_B; C is (M, N). With clear_accum, C is zeroed first."""
    b = kernel_builder()
    a, bb, c = (as_region(x) for x in (A, B, C))
    sa, sb, sc = (_squeeze(_const_shape(r, "T.gemm")) if len(r.shape) != 2 else _const_shape(r, "T.gemm")
                  for r in (a, bb, c))
    for name, s in (("A", sa), ("B", sb), ("C", sc)):
        if len(s) != 2:
            raise CompileError(f"T.gemm: {name} must be a 2-D tile, got {_shape_str(s)}")
    m, k = (sa[1], sa[0]) if transpose_A else sa
    k2, n = (sb[1], sb[0]) if transpose_B else sb
    if k != k2:
        raise CompileError(f"T.gemm: the K extents differ: A {_shape_str(sa)}{' (transposed)' * bool(transpose_A)} "
                           f"has K={k}, B {_shape_str(sb)}{' (transposed)' * bool(transpose_B)} has K={k2}")
    if (m, n) != tuple(sc):
        raise CompileError(f"T.gemm: C is {_shape_str(sc)} but op(A) @ op(B) is ({m}, {n})")
    if c.buffer.is_global:
        raise CompileError("T.gemm: C must be a fragment or local buffer, not a global tensor")
    for name, r in (("A", a), ("B", bb)):
        if r.buffer.is_global:
            raise CompileError(f"T.gemm: {name} must be in shared memory or a fragment; T.copy it there first")
    hints = {"policy": str(policy)} if policy is not None else {}
    b.emit(S.Gemm(a, bb, c, bool(transpose_A), bool(transpose_B), bool(clear_accum), hints))


def _reduce(kind):
    def reduce_op(src, dst, dim=-1, clear=True):
        b = kernel_builder()
        s, d = as_region(src), as_region(dst)
        ss, ds = _const_shape(s, f"T.reduce_{kind}"), _const_shape(d, f"T.reduce_{kind}")
        nd = len(ss)
        if not isinstance(dim, int) or not -nd <= dim < nd:
            raise CompileError(f"T.reduce_{kind}: dim={dim!r} is out of range for a {nd}-D source {_shape_str(ss)}")
        dim %= nd
        want = ss[:dim] + ss[dim + 1:]
        if _squeeze(want) != _squeeze(ds):
            raise CompileError(f"T.reduce_{kind}: reducing {_shape_str(ss)} over dim {dim} gives {_shape_str(want)}, "
                               f"but the destination is {_shape_str(ds)}")
        b.emit(S.Reduce(kind, s, d, dim, bool(clear)))
    reduce_op.__name__ = f"reduce_{kind}"
    reduce_op.__doc__ = (f"dst = {kind} of src over ``dim`` (dst has src's shape without it); clear=False combines "
                         "with dst's current values.")
    return reduce_op


reduce_sum, reduce_max, reduce_min, reduce_abssum, reduce_absmax = (
    _reduce(k) for k in ("sum", "max", "min", "abssum", "absmax"))


def _atomic(kind):
    def atomic_op(dst, value, memory_order=None, return_prev=False, use_tma=False, **_hints):
        b = kernel_builder()
        if return_prev:
            raise CompileError(f"T.atomic_{kind}: return_prev=True is not supported")
        vshape = _operand_shape(value)
        d = as_region(dst, vshape if isinstance(dst, E.Load) and vshape is not None else None)
        if isinstance(dst, E.Load) and vshape is None:
            d = Region(d.buffer, d.starts, (1,) * d.buffer.ndim, (False,) * d.buffer.ndim)
        if vshape is not None:
            v = as_region(value)
            if _squeeze(_const_shape(v, "T.atomic")) != _squeeze(_const_shape(d, "T.atomic")):
                raise CompileError(f"T.atomic_{kind}: value tile {_shape_str(v.shape)} does not match destination "
                                   f"{_shape_str(d.shape)}")
            value = v
        else:
            value = E.cast(E.as_expr(value, like=d.dtype), d.dtype)
        if d.buffer.scope in ("fragment", "local", "local.var"):
            raise CompileError(f"T.atomic_{kind}: the destination must be global or shared memory")
        b.emit(S.Atomic(kind, d, value))
    atomic_op.__name__ = f"atomic_{kind}"
    atomic_op.__doc__ = f"dst = {kind}(dst, value) atomically, elementwise over a tile or on one element."
    return atomic_op


atomic_add, atomic_max, atomic_min = (_atomic(k) for k in ("add", "max", "min"))


def _atomic_add_vector(n):
    def atomic_addxn(dst, value, **_hints):
        if not isinstance(dst, E.Load) or not isinstance(value, E.Load):
            raise CompileError(f"T.atomic_addx{n}(dst, value): both are elements (A[i, j]) that start {n} "
                               "consecutive values along the last dimension")
        for k in range(n):  # n element atomics: they also work inside a T.Parallel body
            d, v = (E.Load(x.buffer, x.indices[:-1] + (E.binop("+", x.indices[-1], k),)) for x in (dst, value))
            atomic_add(d, v)
    atomic_addxn.__name__ = f"atomic_addx{n}"
    atomic_addxn.__doc__ = (f"Atomically add the {n} consecutive values starting at element ``value`` to the {n} "
                            "starting at element ``dst`` (along the last dimension).")
    return atomic_addxn


atomic_addx2, atomic_addx4 = _atomic_add_vector(2), _atomic_add_vector(4)


def im2col(img, col, nhw_step, c_step, kernel, stride, dilation, pad, eviction_policy=None, **_hints):
    """Fill ``col`` (a 2-D tile: pixels x patch elements) with one tile of the im2col matrix of ``img`` (N, H, W, C)
    for a ``kernel`` x ``kernel`` convolution: row i is output pixel ``nhw_step * rows + i`` (over N, OH, OW),
    column j is patch element ``c_step * cols + j`` (over KH, KW, C, C fastest). Taps in the padding, and pixels
    past the last image, read 0."""
    b = kernel_builder()
    src, dst = as_region(img), as_region(col)
    if src.buffer.ndim != 4 or not src.is_full():
        raise CompileError("T.im2col: the image must be a whole 4-D (N, H, W, C) tensor")
    shape = _const_shape(dst, "T.im2col")
    if len(shape) != 2:
        raise CompileError(f"T.im2col: the column tile must be 2-D, got {_shape_str(shape)}")
    rows, cols = shape
    _, H, W, C = src.buffer.shape
    OH = (H + 2 * pad - dilation * (kernel - 1) - 1) // stride + 1
    OW = (W + 2 * pad - dilation * (kernel - 1) - 1) // stride + 1
    i, j = E.Var("i", dt.int32), E.Var("j", dt.int32)
    p, k = nhw_step * rows + i, c_step * cols + j
    n, oh, ow = p // (OH * OW), p % (OH * OW) // OW, p % OW
    c, kw, kh = k % C, k // C % kernel, k // (C * kernel)
    h, w = oh * stride + kh * dilation - pad, ow * stride + kw * dilation - pad
    ok = E.logical("and", E.logical("and", h >= 0, h < H), E.logical("and", w >= 0, w < W))
    value = E.select(ok, E.Load(src.buffer, (n, h, w, c)), E.cast(E.as_expr(0), src.dtype))
    kept = [d for d, keep in enumerate(dst.keep) if keep]
    idx = list(dst.starts)
    idx[kept[0]], idx[kept[1]] = E.binop("+", dst.starts[kept[0]], i), E.binop("+", dst.starts[kept[1]], j)
    store = S.Store(dst.buffer, tuple(E.as_expr(x) for x in idx), E.cast(value, dst.dtype), loc=b.loc)
    zero = E.Const(0, dt.int32)
    inner = S.For(j, zero, E.Const(cols, dt.int32), "parallel", store, loc=b.loc)
    b.emit(S.For(i, zero, E.Const(rows, dt.int32), "parallel", inner, loc=b.loc))


c2d_im2col = im2col


def cumsum(src, dst=None, dim=0, reverse=False, **_hints):
    """Inclusive prefix sum of ``src`` along ``dim`` into ``dst`` (in place when dst is None); ``reverse`` sums
    from the end. Accumulates in the destination's dtype."""
    b = kernel_builder()
    s = as_region(src)
    d = as_region(dst) if dst is not None else s
    ss, ds = _const_shape(s, "T.cumsum"), _const_shape(d, "T.cumsum")
    if _squeeze(ss) != _squeeze(ds):
        raise CompileError(f"T.cumsum: source tile {_shape_str(ss)} does not match destination {_shape_str(ds)}")
    nd = len(ss)
    if not isinstance(dim, int) or not -nd <= dim < nd:
        raise CompileError(f"T.cumsum: dim={dim!r} is out of range for a {nd}-D tile")
    dim %= nd
    # the scan dimension runs serially outside; the others are an elementwise T.Parallel nest inside
    k = E.Var("k", dt.int32)
    pos = E.binop("-", ss[dim] - 1, k) if reverse else k
    prev = E.binop("+", pos, 1) if reverse else E.binop("-", pos, 1)
    ivars = [E.Var(f"i{a}", dt.int32) for a in range(nd)]
    at = [pos if a == dim else ivars[a] for a in range(nd)]
    before = [prev if a == dim else ivars[a] for a in range(nd)]

    def index(rg, pt):
        kept = [a for a, keep in enumerate(rg.keep) if keep]
        idx = [E.as_expr(x) for x in rg.starts]
        for a, p in zip(kept, pt):
            idx[a] = E.binop("+", idx[a], p)
        return tuple(idx)

    cur = E.cast(E.Load(s.buffer, index(s, at)), d.dtype)
    acc = E.select(E.compare(">", k, 0), E.binop("+", E.Load(d.buffer, index(d, before)), cur), cur)
    body = S.Store(d.buffer, index(d, at), acc, loc=b.loc)
    for a in reversed(range(nd)):
        if a != dim:
            body = S.For(ivars[a], E.Const(0, dt.int32), E.Const(ss[a], dt.int32), "parallel", body, loc=b.loc)
    b.emit(S.For(k, E.Const(0, dt.int32), E.Const(ss[dim], dt.int32), "serial", body, loc=b.loc))
