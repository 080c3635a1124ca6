"""Helpers shared by passes: rebuild an IR tree with some expressions or statements replaced.

``expr(e, fn)`` rebuilds ``e`` bottom-up and lets ``fn(node)`` replace each rebuilt node (return None to keep it);
``stmt(s, fe, fs)`` does the same for statements, ``fe`` applied to every expression (indices, values,
conditions, bounds, region starts) and ``fs`` to every rebuilt statement. Nodes are rebuilt with their own
dtypes (no re-folding), and unchanged subtrees are shared, not copied.
"""
from __future__ import annotations

import dataclasses

from tegula.ir import expr as E
from tegula.ir import stmt as S
from tegula.ir.buffer import Region


def expr(e, fn):
    if not isinstance(e, E.Expr):
        return e
    out = e
    if isinstance(e, E.BinOp):
        a, b = expr(e.a, fn), expr(e.b, fn)
        if a is not e.a or b is not e.b:
            out = E.BinOp(e.op, a, b, e.dtype)
    elif isinstance(e, E.UnOp):
        a = expr(e.a, fn)
        if a is not e.a:
            out = E.UnOp(e.op, a, e.dtype)
    elif isinstance(e, E.Call):
        args = tuple(expr(a, fn) for a in e.args)
        if any(x is not y for x, y in zip(args, e.args)):
            out = E.Call(e.name, args, e.dtype)
    elif isinstance(e, E.Cast):
        v = expr(e.value, fn)
        if v is not e.value:
            out = E.Cast(v, e.dtype)
    elif isinstance(e, E.Select):
        c, a, b = expr(e.cond, fn), expr(e.a, fn), expr(e.b, fn)
        if c is not e.cond or a is not e.a or b is not e.b:
            out = E.Select(c, a, b)
    elif isinstance(e, E.Load):
        idx = tuple(expr(i, fn) for i in e.indices)
        if any(x is not y for x, y in zip(idx, e.indices)):
            out = E.Load(e.buffer, idx)
    r = fn(out)
    return out if r is None else r


def substitute(e, mapping: dict):
    """``e`` with each Var whose id is in ``mapping`` replaced by ``mapping[id(var)]``."""
    return expr(e, lambda x: mapping.get(id(x)) if isinstance(x, E.Var) else None)


def region(rg: Region, fe) -> Region:
    starts = tuple(expr(x, fe) if isinstance(x, E.Expr) else x for x in rg.starts)
    return Region(rg.buffer, starts, rg.extents, rg.keep)


def stmt(s, fe=None, fs=None):
    fe = fe or (lambda x: None)
    ex = lambda x: expr(x, fe)  # noqa: E731
    st = lambda x: stmt(x, fe, fs)  # noqa: E731
    if isinstance(s, S.Seq):
        out = type(s)([st(c) for c in s.body], loc=s.loc)
    elif isinstance(s, S.For):
        out = dataclasses.replace(s, start=ex(s.start), extent=ex(s.extent), body=st(s.body))
    elif isinstance(s, S.While):
        out = dataclasses.replace(s, cond=ex(s.cond), body=st(s.body))
    elif isinstance(s, S.If):
        out = dataclasses.replace(s, cond=ex(s.cond), then=st(s.then),
                                  orelse=None if s.orelse is None else st(s.orelse))
    elif isinstance(s, S.Kernel):
        out = dataclasses.replace(s, body=st(s.body))
    elif isinstance(s, (S.Store, S.AtomicElem)):
        out = dataclasses.replace(s, indices=tuple(ex(i) for i in s.indices), value=ex(s.value))
    elif isinstance(s, S.Assign):
        out = dataclasses.replace(s, value=ex(s.value))
    elif isinstance(s, S.ExternGemm):
        out = dataclasses.replace(s, a=region(s.a, fe), b=region(s.b, fe), c=region(s.c, fe),
                                  sa=s.sa and region(s.sa, fe), sb=s.sb and region(s.sb, fe),
                                  b_rows=s.b_rows and region(s.b_rows, fe))
    else:
        out = s
    if fs is not None:
        r = fs(out)
        if r is not None:
            return r
    return out


def exprs_of(s):
    """Every expression directly held by statement ``s`` (not its sub-statements)."""
    if isinstance(s, S.For):
        return [s.start, s.extent]
    if isinstance(s, (S.While, S.If)):
        return [s.cond]
    if isinstance(s, (S.Store, S.AtomicElem)):
        return list(s.indices) + [s.value]
    if isinstance(s, S.Assign):
        return [s.value]
    if isinstance(s, S.ExternGemm):
        return [x for rg in (s.a, s.b, s.c, s.sa, s.sb, s.b_rows) if rg is not None for x in rg.starts
                if isinstance(x, E.Expr)]
    if hasattr(s, "exprs"):  # target-family nodes (ir/simt.py) list their own
        return s.exprs()
    return []


def sub_exprs(e):
    """``e`` and all its sub-expressions, pre-order."""
    yield e
    if isinstance(e, E.BinOp):
        yield from sub_exprs(e.a)
        yield from sub_exprs(e.b)
    elif isinstance(e, E.UnOp):
        yield from sub_exprs(e.a)
    elif isinstance(e, E.Call):
        for a in e.args:
            yield from sub_exprs(a)
    elif isinstance(e, E.Cast):
        yield from sub_exprs(e.value)
    elif isinstance(e, E.Select):
        yield from sub_exprs(e.cond)
        yield from sub_exprs(e.a)
        yield from sub_exprs(e.b)
    elif isinstance(e, E.Load):
        for i in e.indices:
            yield from sub_exprs(i)
