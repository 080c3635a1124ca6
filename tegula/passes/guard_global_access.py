"""guard_global_access: element reads and writes of global tensors are safe at the tensor's edge.

TileLang's meaning, which kernels rely on when a grid overhangs a tensor (the last block of ``ceildiv(M, 64)``
blocks, say): an element load of a global tensor outside its shape reads 0, and an element store (or atomic)
outside it does nothing. Tile ops already behave so (their lowerings mask); this pass gives element accesses
written in the kernel the same meaning.

Invariant established: every element Load of a global buffer is either provably inside the buffer's shape, or
wrapped in ``Select(in_bounds, load, 0)``; every Store to a global buffer is provably inside, or under
``If(in_bounds)``. The proof is an interval bound of each index over the ranges of the block indices and loop
variables around it, plus the conditions of enclosing ifs and selects (``i < M``), so kernels whose tiles divide
the tensor get no guard at all. Runs before lower_tile_ops: the tile ops' own masks are not guarded twice.
"""
from __future__ import annotations

import dataclasses

from tegula.ir import dtypes as dt
from tegula.ir import expr as E
from tegula.ir import stmt as S
from tegula.ir.buffer import Region
from tegula.ir.simplify import const_difference, linear

_FLIP = {"<": ">", "<=": ">=", ">": "<", ">=": "<="}


class _Ctx:
    """What is known at a point of the program: variable ranges and conditions that hold."""

    def __init__(self, ranges: dict, facts: tuple, dims: set, mutated: set, defs: dict):
        self.ranges, self.facts, self.dims, self.mutated, self.defs = ranges, facts, dims, mutated, defs

    def with_range(self, var, lo, hi) -> "_Ctx":
        return _Ctx({**self.ranges, id(var): (lo, hi)}, self.facts, self.dims, self.mutated, self.defs)

    def with_fact(self, cond) -> "_Ctx":
        facts = list(self.facts)
        self.collect_facts(cond, facts)
        return _Ctx(self.ranges, tuple(facts), self.dims, self.mutated, self.defs)

    def collect_facts(self, cond, out: list) -> None:
        if isinstance(cond, E.Var) and id(cond) in self.defs:  # a boolean local: what it was defined as
            self.collect_facts(self.defs[id(cond)], out)
        elif isinstance(cond, E.BinOp) and cond.op == "and":
            self.collect_facts(cond.a, out)
            self.collect_facts(cond.b, out)
        elif isinstance(cond, E.BinOp) and cond.op in _FLIP and cond.a.dtype.is_int:
            out.append((cond.a, cond.op, cond.b))
            out.append((cond.b, _FLIP[cond.op], cond.a))

    def after(self, s) -> "_Ctx":
        """The context after statement ``s``: a local assigned once keeps the bounds (an integer) or the meaning
        (a condition) of its value, as a let binding does."""
        if not (isinstance(s, S.Assign) and s.declare) or id(s.var) in self.mutated:
            return self
        if s.var.dtype.is_bool and self.pure(s.value):
            return _Ctx(self.ranges, self.facts, self.dims, self.mutated, {**self.defs, id(s.var): s.value})
        if not s.var.dtype.is_int:
            return self
        lo, hi = self.bounds(s.value)
        if not (self.pure(lo) and self.pure(hi)):
            return self
        return self.with_range(s.var, lo, hi)

    def pure(self, e) -> bool:
        """``e`` means the same wherever it is read: no loads, no variable that is assigned again."""
        from tegula.passes.rewrite import sub_exprs
        if not isinstance(e, E.Expr):
            return True
        return not any(isinstance(x, E.Load) or isinstance(x, E.Var) and id(x) in self.mutated for x in sub_exprs(e))

    # bounds ------------------------------------------------------------------------------------
    def bounds(self, e):
        """(lo, hi) expressions with lo <= e <= hi wherever this context holds (hi may be a min/max node)."""
        if isinstance(e, (int, bool)):
            return e, e
        if isinstance(e, E.Const):
            return e.value, e.value
        if isinstance(e, E.Var):
            if id(e) in self.ranges:
                return self.ranges[id(e)]
            return (0 if id(e) in self.dims else e), e
        if isinstance(e, E.Cast) and e.dtype.is_int and e.value.dtype.is_int:
            lo, hi = self.bounds(e.value)
            rng = _narrow_range(e.value.dtype, e.dtype)
            if rng is None or (isinstance(lo, int) and isinstance(hi, int) and rng[0] <= lo <= hi <= rng[1]):
                return lo, hi
            return rng
        if isinstance(e, E.Select):
            (la, ha), (lb, hb) = self.bounds(e.a), self.bounds(e.b)
            return _op("min", la, lb), _op("max", ha, hb)
        if not isinstance(e, E.BinOp) or not e.dtype.is_int:
            return e, e
        (la, ha), (lb, hb) = self.bounds(e.a), self.bounds(e.b)
        c = E.const_value(e.b)
        if e.op == "+":
            return _op("+", la, lb), _op("+", ha, hb)
        if e.op == "-":
            return _op("-", la, hb), _op("-", ha, lb)
        if e.op == "*" and isinstance(c, int):
            return (_op("*", la, c), _op("*", ha, c)) if c >= 0 else (_op("*", ha, c),
                                                                              _op("*", la, c))
        if e.op == "*" and isinstance(E.const_value(e.a), int) and E.const_value(e.a) >= 0:
            k = E.const_value(e.a)
            return _op("*", k, lb), _op("*", k, hb)
        if e.op == "//" and isinstance(c, int) and c > 0:
            return _op("//", la, c), _op("//", ha, c)
        if e.op == "%" and isinstance(c, int) and c > 0:
            return 0, c - 1
        if e.op == ">>" and isinstance(c, int) and 0 <= c < e.dtype.bits:  # within the shifted type's range
            if isinstance(la, int) and isinstance(ha, int):
                return la >> c, ha >> c
            return int(dt.min_value(e.a.dtype)) >> c, int(dt.max_value(e.a.dtype)) >> c
        if e.op in ("min", "max"):
            return _op(e.op, la, lb), _op(e.op, ha, hb)
        return e, e

    def nonneg(self, x) -> bool:
        v = E.const_value(x)
        if v is not None:
            return v >= 0
        if isinstance(x, E.Var):
            lo = self.ranges.get(id(x), (None,))[0]
            return id(x) in self.dims or (lo is not None and lo is not x and self.nonneg(lo))
        if isinstance(x, E.Cast) and x.value.dtype.is_int:
            return self.nonneg(x.value)
        if isinstance(x, E.BinOp):
            if x.op in ("+", "*", "min"):
                return self.nonneg(x.a) and self.nonneg(x.b)
            if x.op == "max":
                return self.nonneg(x.a) or self.nonneg(x.b)
            if x.op == "//":
                return self.nonneg(x.a) and self.nonneg(x.b)
        return False

    def below(self, x, n) -> bool:
        """x < n, for a bound x."""
        if isinstance(x, E.BinOp) and x.op == "min":
            return self.below(x.a, n) or self.below(x.b, n)
        if isinstance(x, E.BinOp) and x.op == "max":
            return self.below(x.a, n) and self.below(x.b, n)
        d = const_difference(n, x)
        return d is not None and d >= 1

    # proofs ------------------------------------------------------------------------------------
    def inside(self, i, n) -> tuple[bool, bool]:
        """Whether 0 <= i, and whether i < n, provably hold here."""
        lo, hi = self.bounds(i)
        low = self.nonneg(lo) or any(_same(a, i) and op == ">=" and self.nonneg(b) or
                                     _same(a, i) and op == ">" and self.nonneg(_op("+", b, 1))
                                     for a, op, b in self.facts)
        high = self.below(hi, n) or any(
            (_same(a, i) or _same(a, hi) or self.at_most(i, a)) and
            (op == "<" and (_same(b, n) or self.below(_op("-", b, 1), n)) or op == "<=" and self.below(b, n))
            for a, op, b in self.facts)
        return low, high

    def at_most(self, i, a) -> bool:
        """i <= a, where i - a is affine in loops of constant range (``c * 64 + j`` against ``c * 64 + 63``)."""
        li, la = linear(i), linear(a)
        if li is None or la is None:
            return False
        terms = dict(li[0])
        for k, (atom, c) in la[0].items():
            terms[k] = (atom, terms.get(k, (atom, 0))[1] - c)
        top = li[1] - la[1]
        for atom, c in terms.values():
            if c == 0:
                continue
            lo, hi = self.ranges.get(id(atom), (None, None)) if isinstance(atom, E.Var) else (None, None)
            lo, hi = E.const_value(lo), E.const_value(hi)
            if not isinstance(lo, int) or not isinstance(hi, int):
                return False
            top += c * (hi if c > 0 else lo)
        return top <= 0

    def guard(self, buffer, indices):
        """The in-bounds condition of an access, or None when it is provably inside."""
        conds = []
        for i, n in zip(indices, buffer.shape):
            low, high = self.inside(i, n)
            if not low:
                conds.append(E.compare(">=", i, 0))
            if not high:
                conds.append(E.compare("<", i, E.cast(E.as_expr(n), E.as_expr(i).dtype)))
        cond = None
        for c in conds:
            cond = c if cond is None else E.logical("and", cond, c)
        return cond


_PY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "//": lambda a, b: a // b,
       "min": min, "max": max}


def _narrow_range(src, dst):
    """The range every int cast from ``src`` to ``dst`` lands in where a 16-bit or narrower type bounds it (a
    narrowing cast wraps into dst's range; a widening one keeps src's values), else None."""
    if dst.bits < src.bits and dst.bits <= 16:
        return int(dt.min_value(dst)), int(dt.max_value(dst))
    if src.bits < dst.bits and src.bits <= 16 and (dst.kind == "int" or src.kind == "uint"):
        return int(dt.min_value(src)), int(dt.max_value(src))
    return None


def _op(op, a, b):
    """``a op b`` on bounds that may be Python ints or expressions."""
    if isinstance(a, int) and isinstance(b, int):
        return _PY[op](a, b)
    return E.binop(op, a, b)


def _same(a, b) -> bool:
    return a is b or const_difference(a, b) == 0


def _negate(cond):
    if isinstance(cond, E.BinOp) and cond.op in _FLIP and cond.a.dtype.is_int:
        return E.BinOp({"<": ">=", "<=": ">", ">": "<=", ">=": "<"}[cond.op], cond.a, cond.b, dt.bool_)
    return None


# expressions ----------------------------------------------------------------------------------------

def _expr(e, ctx: _Ctx):
    if not isinstance(e, E.Expr):
        return e
    if isinstance(e, E.Load):
        idx = tuple(_expr(i, ctx) for i in e.indices)
        load = e if all(a is b for a, b in zip(idx, e.indices)) else E.Load(e.buffer, idx)
        if not e.buffer.is_global:
            return load
        g = ctx.guard(e.buffer, idx)
        return load if g is None else E.Select(g, load, E.cast(E.as_expr(0), e.dtype))
    if isinstance(e, E.Select):
        c = _expr(e.cond, ctx)
        a = _expr(e.a, ctx.with_fact(e.cond))
        neg = _negate(e.cond)
        b = _expr(e.b, ctx.with_fact(neg) if neg is not None else ctx)
        return e if c is e.cond and a is e.a and b is e.b else E.Select(c, a, b)
    if isinstance(e, E.BinOp):
        a = _expr(e.a, ctx)
        b = _expr(e.b, ctx.with_fact(e.a) if e.op == "and" else ctx)
        return e if a is e.a and b is e.b else E.BinOp(e.op, a, b, e.dtype)
    if isinstance(e, E.UnOp):
        a = _expr(e.a, ctx)
        return e if a is e.a else E.UnOp(e.op, a, e.dtype)
    if isinstance(e, E.Cast):
        v = _expr(e.value, ctx)
        return e if v is e.value else E.Cast(v, e.dtype)
    if isinstance(e, E.Call):
        args = tuple(_expr(a, ctx) for a in e.args)
        return e if all(a is b for a, b in zip(args, e.args)) else E.Call(e.name, args, e.dtype)
    return e


def _region(rg: Region, ctx: _Ctx) -> Region:
    starts = tuple(_expr(s, ctx) for s in rg.starts)
    return rg if all(a is b for a, b in zip(starts, rg.starts)) else Region(rg.buffer, starts, rg.extents, rg.keep)


# statements -----------------------------------------------------------------------------------------

def _stmt(s, ctx: _Ctx):
    rep = dataclasses.replace
    if isinstance(s, S.Seq):
        body = []
        for c in s.body:
            body.append(_stmt(c, ctx))
            ctx = ctx.after(c)
        return S.Seq(body, loc=s.loc)
    if isinstance(s, S.Kernel):
        inner = ctx
        for v, g in zip(s.block_vars, s.grid):
            inner = inner.with_range(v, 0, _op("-", _strip_max0(g), 1))
        return rep(s, body=_stmt(s.body, inner))
    if isinstance(s, S.For):
        start, extent = _expr(s.start, ctx), _expr(s.extent, ctx)
        lo = start
        hi = _op("+", start, _op("*", _op("-", _strip_max0(extent), 1), s.step))
        if s.step < 0:
            lo, hi = hi, lo
        return rep(s, start=start, extent=extent, body=_stmt(s.body, ctx.with_range(s.var, lo, hi)))
    if isinstance(s, S.While):
        return rep(s, cond=_expr(s.cond, ctx), body=_stmt(s.body, ctx.with_fact(s.cond)))
    if isinstance(s, S.If):
        neg = _negate(s.cond)
        orelse = None if s.orelse is None else _stmt(s.orelse, ctx.with_fact(neg) if neg is not None else ctx)
        return rep(s, cond=_expr(s.cond, ctx), then=_stmt(s.then, ctx.with_fact(s.cond)), orelse=orelse)
    if isinstance(s, (S.Store, S.AtomicElem)):
        idx = tuple(_expr(i, ctx) for i in s.indices)
        out = rep(s, indices=idx, value=_expr(s.value, ctx))
        g = ctx.guard(s.buffer, idx) if s.buffer.is_global else None
        return out if g is None else S.If(g, out, loc=s.loc)
    if isinstance(s, S.Assign):
        return rep(s, value=_expr(s.value, ctx))
    if isinstance(s, S.Copy):
        return rep(s, src=_region(s.src, ctx), dst=_region(s.dst, ctx))
    if isinstance(s, S.Fill):
        return rep(s, dst=_region(s.dst, ctx), value=_expr(s.value, ctx))
    if isinstance(s, S.Gemm):
        return rep(s, a=_region(s.a, ctx), b=_region(s.b, ctx), c=_region(s.c, ctx))
    if isinstance(s, S.Reduce):
        return rep(s, src=_region(s.src, ctx), dst=_region(s.dst, ctx))
    if isinstance(s, S.Atomic):
        value = _region(s.value, ctx) if isinstance(s.value, Region) else _expr(s.value, ctx)
        out = rep(s, dst=_region(s.dst, ctx), value=value)
        d = out.dst
        if d.buffer.is_global and all(E.const_value(x) == 1 for x in d.extents):  # one element: guard it here
            g = ctx.guard(d.buffer, tuple(E.as_expr(x) for x in d.starts))
            return out if g is None else S.If(g, out, loc=s.loc)
        return out
    return s


def _strip_max0(e):
    """A loop or grid extent ``max(n, 0)`` runs n times when it runs at all: inside, the index is < n."""
    if isinstance(e, E.Cast) and e.value.dtype.is_int:
        return _strip_max0(e.value)
    if isinstance(e, E.BinOp) and e.op == "max" and E.const_value(e.b) == 0:
        return e.a
    return e


def run(func: S.PrimFunc, target) -> S.PrimFunc:
    dims = {id(d) for p in func.buffers for d in p.shape if isinstance(d, E.Var)}
    mutated = {id(x.var) for x in S.walk(func.body) if isinstance(x, S.Assign) and not x.declare}
    return dataclasses.replace(func, body=_stmt(func.body, _Ctx({}, (), dims, mutated, {})))
