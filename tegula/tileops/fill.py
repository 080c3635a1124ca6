"""T.fill / T.clear on the CPU family: a parallel loop nest of stores (guarded at a global tensor's edge)."""
from __future__ import annotations

from tegula.ir import stmt as S
from tegula.tileops import lowers
from tegula.tileops.common import guarded, in_bounds, parallel_nest, region_index, tile_in_bounds, tile_shape


@lowers(S.Fill, "cpu")
def lower_fill(s: S.Fill) -> S.Stmt:
    dst = s.dst

    def body(ivars, guard):
        di = region_index(dst, ivars)
        st = S.Store(dst.buffer, di, s.value, loc=s.loc)
        g = in_bounds(dst, di) if guard else None
        return S.If(g, st, loc=s.loc) if g is not None else st

    shape = tile_shape(dst)
    fast = parallel_nest(shape, lambda iv: body(iv, False), s.loc)
    return guarded(tile_in_bounds(dst), fast, parallel_nest(shape, lambda iv: body(iv, True), s.loc), s.loc)
