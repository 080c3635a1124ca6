"""Helpers shared by the tile-op lowerings: loop nests over a tile, region indexing, bounds guards."""
from __future__ import annotations

from tegula.ir import dtypes as dt
from tegula.ir import expr as E
from tegula.ir import stmt as S
from tegula.ir.buffer import Region

_counter = [0]


def fresh_var(base: str, dtype=dt.int32) -> E.Var:
    _counter[0] += 1
    return E.Var(f"{base}", dtype)


def tile_shape(rg: Region) -> tuple:
    """The region's shape with every size-1 dim removed (the common shape both sides of a copy agree on)."""
    return tuple(int(E.const_value(e)) for e in rg.extents if E.const_value(e) != 1)


def index_expr(x) -> E.Expr:
    """An index or extent as int32, or as int64 when it already is one (a start past 2^31 must not wrap)."""
    x = E.as_expr(x)
    return x if x.dtype == dt.int64 else E.cast(x, dt.int32)


def region_index(rg: Region, ivars) -> tuple:
    """Indices into ``rg.buffer`` for a point of the squeezed tile given by ``ivars``."""
    out, k = [], 0
    for s, e in zip(rg.starts, rg.extents):
        if E.const_value(e) == 1:
            out.append(index_expr(s))
        else:
            out.append(E.binop("+", index_expr(s), ivars[k]))
            k += 1
    return tuple(out)


def in_bounds(rg: Region, idx) -> E.Expr | None:
    """The per-element guard of a global region (None when nothing needs guarding)."""
    if not rg.buffer.is_global:
        return None
    cond = None
    for i, n in zip(idx, rg.buffer.shape):
        c = E.logical("and", E.compare(">=", i, 0), E.compare("<", i, index_expr(n)))
        cond = c if cond is None else E.logical("and", cond, c)
    return None if isinstance(cond, E.Const) and cond.value else cond


def tile_in_bounds(rg: Region) -> E.Expr | None:
    """One guard for the whole tile: true when every element of it lies inside the tensor."""
    if not rg.buffer.is_global:
        return None
    cond = None
    for s, e, n in zip(rg.starts, rg.extents, rg.buffer.shape):
        s = index_expr(s)
        c = E.logical("and", E.compare(">=", s, 0),
                      E.compare("<=", E.binop("+", s, int(E.const_value(e))), index_expr(n)))
        cond = c if cond is None else E.logical("and", cond, c)
    return None if isinstance(cond, E.Const) and cond.value else cond


def parallel_nest(shape, make_body, loc) -> S.Stmt:
    """``for i0, i1, ... in T.Parallel(*shape): make_body(ivars)``."""
    ivars = [fresh_var(f"i{d}") for d in range(len(shape))]
    body = make_body(ivars)
    for v, n in reversed(list(zip(ivars, shape))):
        body = S.For(v, E.Const(0, dt.int32), E.Const(n, dt.int32), "parallel", body, loc=loc)
    return body


def guarded(cond, fast: S.Stmt, slow: S.Stmt, loc) -> S.Stmt:
    """``fast`` when the tile-level ``cond`` holds, else the element-guarded ``slow`` version."""
    if cond is None:
        return fast
    return S.If(cond, fast, slow, loc=loc)
