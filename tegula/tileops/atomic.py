"""T.atomic_* on the CPU family: element-wise atomic read-modify-writes (guarded at a global tensor's edge)."""
from __future__ import annotations

from tegula.ir import expr as E
from tegula.ir import stmt as S
from tegula.tileops import lowers
from tegula.tileops.common import in_bounds, parallel_nest, region_index, tile_shape


def atomic_element(s: S.Atomic, ivars) -> S.Stmt:
    """The atomic update of the destination element at ``ivars`` (tile coordinates), guarded at a global edge."""
    dst = s.dst
    di = region_index(dst, ivars)
    if isinstance(s.value, E.Expr):
        v = s.value
    else:
        v = E.cast(E.Load(s.value.buffer, region_index(s.value, ivars)), dst.dtype)
    st = S.AtomicElem(s.kind, dst.buffer, di, v, loc=s.loc)
    g = in_bounds(dst, di)
    return S.If(g, st, loc=s.loc) if g is not None else st


@lowers(S.Atomic, "cpu")
def lower_atomic(s: S.Atomic) -> S.Stmt:
    shape = tile_shape(s.dst)
    if not shape:
        return atomic_element(s, [])
    return parallel_nest(shape, lambda ivars: atomic_element(s, ivars), s.loc)
