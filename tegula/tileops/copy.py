"""T.copy on the CPU family: a parallel loop nest; global tiles that may cross the tensor's edge get a
whole-tile bounds test with an unguarded fast path and an element-guarded slow path."""
from __future__ import annotations

from tegula.ir import expr as E
from tegula.ir import stmt as S
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
    fast = parallel_nest(shape, lambda iv: body(iv, False), s.loc)
    if not conds:
        return fast
    cond = conds[0] if len(conds) == 1 else E.logical("and", conds[0], conds[1])
    return guarded(cond, fast, parallel_nest(shape, lambda iv: body(iv, True), s.loc), s.loc)
