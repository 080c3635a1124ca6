"""Affine simplification of integer index expressions: enough to see that ``(bx + 1) * 64 - bx * 64`` is 64."""
from __future__ import annotations

from tegula.ir import expr as E


def linear(e) -> tuple[dict, int] | None:
    """``e`` as (atom -> coefficient, constant) when it is affine in its atoms, else None. Atoms are Vars and
    any non-affine sub-expression, keyed by their printed text."""
    if isinstance(e, (int, bool)):
        return {}, int(e)
    if not isinstance(e, E.Expr) or not (e.dtype.is_int or e.dtype.is_bool):
        return None
    if isinstance(e, E.Const):
        return {}, int(e.value)
    if isinstance(e, E.Cast) and e.value.dtype.is_int:
        return linear(e.value)
    if isinstance(e, E.BinOp) and e.op in ("+", "-"):
        a, b = linear(e.a), linear(e.b)
        if a is None or b is None:
            return _atom(e)
        sign = 1 if e.op == "+" else -1
        terms = dict(a[0])
        for k, (atom, c) in b[0].items():
            old = terms.get(k, (atom, 0))[1]
            terms[k] = (atom, old + sign * c)
        return {k: v for k, v in terms.items() if v[1] != 0}, a[1] + sign * b[1]
    if isinstance(e, E.BinOp) and e.op == "*":
        a, b = linear(e.a), linear(e.b)
        if a is not None and b is not None:
            if not b[0]:
                a, b = b, a
            if not a[0]:
                k = a[1]
                return {key: (atom, c * k) for key, (atom, c) in b[0].items() if c * k}, b[1] * k
    return _atom(e)


def _atom(e):
    key = f"{e}@{id(e)}" if isinstance(e, E.Var) else str(e)
    return {key: (e, 1)}, 0


def const_difference(hi, lo) -> int | None:
    """``hi - lo`` when it is a compile-time constant, else None."""
    a, b = linear(hi), linear(lo)
    if a is None or b is None:
        return None
    keys = set(a[0]) | set(b[0])
    for k in keys:
        if a[0].get(k, (None, 0))[1] != b[0].get(k, (None, 0))[1]:
            return None
    return a[1] - b[1]
