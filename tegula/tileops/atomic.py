"""T.atomic_* on the CPU family: element-wise atomic read-modify-writes (guarded at a global tensor's edge)."""
from __future__ import annotations

from tegula.ir import expr as E
from tegula.ir import stmt as S
from tegula.tileops import lowers
from tegula.tileops.common import in_bounds, parallel_nest, region_index, tile_shape


@lowers(S.Atomic, "cpu")
def lower_atomic(s: S.Atomic) -> S.Stmt:
    dst = s.dst

    def body(ivars):
        di = region_index(dst, ivars)
        if isinstance(s.value, E.Expr):
            v = s.value
        else:
            v = E.cast(E.Load(s.value.buffer, region_index(s.value, ivars)), dst.dtype)
        st = S.AtomicElem(s.kind, dst.buffer, di, v, loc=s.loc)
        g = in_bounds(dst, di)
        return S.If(g, st, loc=s.loc) if g is not None else st

    shape = tile_shape(dst)
    if not shape:
        return body([])
    return parallel_nest(shape, body, s.loc)
