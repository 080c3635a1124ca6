"""verify: structural invariants of a PrimFunc, run between passes when TEGULA_DEBUG>=2.

Checks: every Var is defined before use (parameter, symbolic dim, block index, loop variable or declared local);
every buffer access has one index per dimension; binary operands share a dtype; stores match the buffer's dtype.
"""
from __future__ import annotations

from tegula.errors import CompileError
from tegula.ir import expr as E
from tegula.ir import stmt as S


def verify(func: S.PrimFunc, after: str = "") -> None:
    defined = {id(p) for p in func.params if isinstance(p, E.Var)}
    for p in func.params:
        for d in getattr(p, "shape", ()):
            if isinstance(d, E.Var):
                defined.add(id(d))
    _stmt(func.body, defined, after)


def _fail(msg, loc, after):
    raise CompileError(f"IR verifier{' after ' + after if after else ''}: {msg}", loc)


def _expr(e, defined, loc, after):
    if isinstance(e, E.Var):
        if id(e) not in defined:
            _fail(f"variable {e.name} is used before it is defined", loc, after)
    elif isinstance(e, E.Load):
        if len(e.indices) != e.buffer.ndim:
            _fail(f"{e.buffer.name} is {e.buffer.ndim}-D but indexed with {len(e.indices)}", loc, after)
        for i in e.indices:
            _expr(i, defined, loc, after)
    elif isinstance(e, E.BinOp):
        if e.a.dtype != e.b.dtype:
            _fail(f"operands of {e.op} have dtypes {e.a.dtype} and {e.b.dtype}", loc, after)
        _expr(e.a, defined, loc, after)
        _expr(e.b, defined, loc, after)
    else:
        for sub in [getattr(e, a, None) for a in ("a", "value", "cond", "b")] + list(getattr(e, "args", ())):
            if isinstance(sub, E.Expr):
                _expr(sub, defined, loc, after)


def _region(rg, defined, loc, after):
    for s in rg.starts:
        if isinstance(s, E.Expr):
            _expr(s, defined, loc, after)


def _stmt(s, defined, after):
    loc = s.loc
    if isinstance(s, S.Seq):
        inner = set(defined)
        for c in s.body:
            _stmt(c, inner, after)
            if isinstance(c, S.Assign) and c.declare:
                inner.add(id(c.var))
        return
    if isinstance(s, S.Assign):
        _expr(s.value, defined, loc, after)
        if not s.declare and id(s.var) not in defined:
            _fail(f"{s.var.name} is assigned before it is declared", loc, after)
        defined.add(id(s.var))
        return
    if isinstance(s, S.For):
        _expr(s.start, defined, loc, after)
        _expr(s.extent, defined, loc, after)
        _stmt(s.body, defined | {id(s.var)}, after)
        return
    if isinstance(s, S.Kernel):
        for g in s.grid:
            _expr(E.as_expr(g), defined, loc, after)
        _stmt(s.body, defined | {id(v) for v in s.block_vars}, after)
        return
    if isinstance(s, (S.While, S.If)):
        _expr(s.cond, defined, loc, after)
        for c in S.children(s):
            _stmt(c, set(defined), after)
        return
    if isinstance(s, (S.Store, S.AtomicElem)):
        if len(s.indices) != s.buffer.ndim:
            _fail(f"{s.buffer.name} is {s.buffer.ndim}-D but stored with {len(s.indices)} indices", loc, after)
        if isinstance(s, S.Store) and s.value.dtype != s.buffer.dtype:
            _fail(f"storing {s.value.dtype} into {s.buffer.dtype} buffer {s.buffer.name}", loc, after)
        for i in s.indices:
            _expr(i, defined, loc, after)
        _expr(s.value, defined, loc, after)
        return
    for rg in (getattr(s, a, None) for a in ("src", "dst", "a", "b", "c")):
        if rg is not None and hasattr(rg, "starts"):
            _region(rg, defined, loc, after)
    for a in ("value",):
        v = getattr(s, a, None)
        if isinstance(v, E.Expr):
            _expr(v, defined, loc, after)
