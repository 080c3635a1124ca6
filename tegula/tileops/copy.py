"""T.copy on the CPU family: a parallel loop nest; global tiles that may cross the tensor's edge get a
whole-tile bounds test with an unguarded fast path and an element-guarded slow path. With
eviction_policy="evict_first", a contiguous run copied into a global tensor is one StreamCopy (streaming stores),
float32 -> bfloat16 runs included (a converting stream copy)."""
from __future__ import annotations

from tegula.ir import dtypes as dt
from tegula.ir import expr as E
from tegula.ir import stmt as S
from tegula.ir.cpu import StreamCopy
from tegula.tileops import lowers
from tegula.tileops.common import guarded, in_bounds, parallel_nest, region_index, tile_in_bounds, tile_shape


@lowers(S.Copy, "cpu")
def lower_copy(s: S.Copy) -> S.Stmt:
    src, dst = s.src, s.dst
    shape = tile_shape(src)

    def body(ivars, guard: bool):
        si, di = region_index(src, ivars), region_index(dst, ivars)
        val = E.cast(E.Load(src.buffer, si), dst.dtype)
        if guard:
            g = in_bounds(src, si)
            if g is not None:
                val = E.select(g, val, E.cast(E.as_expr(0), dst.dtype))
        st = S.Store(dst.buffer, di, val, loc=s.loc)
        g = in_bounds(dst, di) if guard else None
        return S.If(g, st, loc=s.loc) if g is not None else st

    conds = [c for c in (tile_in_bounds(src), tile_in_bounds(dst)) if c is not None]
    fast = _stream(s, shape) or parallel_nest(shape, lambda iv: body(iv, False), s.loc)
    if not conds:
        return fast
    cond = conds[0] if len(conds) == 1 else E.logical("and", conds[0], conds[1])
    return guarded(cond, fast, parallel_nest(shape, lambda iv: body(iv, True), s.loc), s.loc)


def _stream(s: S.Copy, shape):
    """The copy as one StreamCopy, when it is hinted "evict_first" and moves one contiguous run of a dtype, or of
    float32 rounded to bfloat16, into a global tensor (the last dimension of both sides, unit stride); else None."""
    src, dst = s.src, s.dst
    same = src.buffer.dtype == dst.buffer.dtype
    if s.eviction_policy != "evict_first" or not dst.buffer.is_global or len(shape) != 1 \
            or not (same or (src.buffer.dtype, dst.buffer.dtype) == (dt.float32, dt.bfloat16)) \
            or dst.buffer.dtype.bits % 8:
        return None
    for rg in (src, dst):
        ext = [E.const_value(e) for e in rg.extents]
        strides = rg.buffer.strides
        if ext[-1] != shape[0] or any(e != 1 for e in ext[:-1]) or \
                strides is not None and E.const_value(E.as_expr(strides[-1])) != 1:
            return None
    zero = [E.Const(0, dt.int32)]
    return StreamCopy(dst.buffer, region_index(dst, zero), src.buffer, region_index(src, zero), shape[0], loc=s.loc)
