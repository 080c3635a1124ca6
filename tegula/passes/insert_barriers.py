"""insert_barriers: a block barrier wherever one thread may read (or overwrite) what another wrote before.

The kernel body is a sequence of steps at the block level (every thread runs it alike): thread-distributed nests
(ThreadNest), statements guarded by ``tid == 0`` (the serial code's stores), and ordinary statements every thread
runs. Walking the steps in order, the pass keeps what each buffer in shared or global memory has had done to it
since the last barrier, and by whom (thread 0 alone, or all threads); a step that reads what another step wrote,
or writes what another step read or wrote, gets a barrier before it unless both were done by thread 0 alone, or
both are atomics, or both are reads. Loops are walked until what flows around the back edge settles, so a write
at the end of an iteration is ordered before a read at the start of the next. Barriers go only where every
thread arrives (never under a condition or in a loop bound that depends on ``tid``).

Invariant established: every cross-thread dependence through shared or global memory inside the block crosses
a Barrier.
"""
from __future__ import annotations

import dataclasses

from tegula.ir import expr as E
from tegula.ir import simt as X
from tegula.ir import stmt as S
from tegula.passes import rewrite

_MEMORY = ("shared", "global")


def _mentions(exprs, var) -> bool:
    return any(x is var for e in exprs for x in rewrite.sub_exprs(e))


def _root(buf):
    """The buffer whose storage ``buf`` is (a T.reshape / T.view is the same memory)."""
    while getattr(buf, "alias", None) is not None:
        buf = buf.alias
    return buf


def _accesses(s, who) -> list:
    """(buffer, who, kind) for every shared/global access in ``s``; kind is r (read), w (write), a (atomic)."""
    out = []
    for x in S.walk(s):
        for e in rewrite.exprs_of(x):
            for sub in rewrite.sub_exprs(e):
                if isinstance(sub, E.Load) and sub.buffer.scope in _MEMORY:
                    out.append((_root(sub.buffer), who, "r"))
        if isinstance(x, S.Store) and x.buffer.scope in _MEMORY:
            out.append((_root(x.buffer), who, "w"))
        if isinstance(x, S.AtomicElem) and x.buffer.scope in _MEMORY:
            out.append((_root(x.buffer), who, "a"))
    return out


def _expr_accesses(exprs) -> list:
    return [(_root(x.buffer), "all", "r") for e in exprs for x in rewrite.sub_exprs(e)
            if isinstance(x, E.Load) and x.buffer.scope in _MEMORY]


def _clash(a, b) -> bool:
    (_, w1, k1), (_, w2, k2) = a, b
    if k1 == "r" and k2 == "r" or k1 == "a" and k2 == "a":
        return False
    return not (w1 == "t0" and w2 == "t0")


class Placer:
    def __init__(self, tid):
        self.tid = tid

    def divergent(self, s) -> bool:
        if isinstance(s, (S.If, S.While)):
            return _mentions([s.cond], self.tid)
        if isinstance(s, S.For):
            return _mentions([s.start, s.extent], self.tid)
        return True

    def who(self, s) -> str:
        if isinstance(s, S.If) and s.orelse is None and isinstance(s.cond, E.BinOp) and s.cond.op == "==" and \
                s.cond.a is self.tid and E.const_value(s.cond.b) == 0:
            return "t0"
        return "all"

    def step(self, accesses, state: dict) -> bool:
        """Add ``accesses`` to ``state``; True when a barrier must come first (``state`` is then reset)."""
        need = any(_clash(a, b) for a in accesses for b in state.get(id(a[0]), ()))
        if need:
            state.clear()
        for a in accesses:
            state.setdefault(id(a[0]), set()).add(a)
        return need

    def block(self, s, state: dict):
        """-> s with barriers placed, given what happened before it; updates ``state``."""
        if isinstance(s, X.Barrier):
            state.clear()
            return s
        if isinstance(s, X.ThreadNest):  # its parts are steps of their own, every thread taking part in each
            out = []
            for c in s.body:
                if isinstance(c, X.Barrier):
                    state.clear()
                    out.append(c)
                elif self.step(_accesses(c, "all"), state):
                    out += [X.Barrier(loc=c.loc), c]
                else:
                    out.append(c)
            return type(s)(out, loc=s.loc)
        if isinstance(s, S.Seq):
            out = []
            for c in s.body:
                c2 = self.block(c, state)
                out.extend(c2 if isinstance(c2, list) else [c2])
            return type(s)(out, loc=s.loc)
        compound = isinstance(s, (S.If, S.For, S.While)) and not self.divergent(s)
        if not compound:
            if self.step(_accesses(s, self.who(s)), state):
                return [X.Barrier(loc=s.loc), s]
            return s
        head = rewrite.exprs_of(s)
        pre = self.step(_expr_accesses(head), state)
        if isinstance(s, S.If):
            st_then = _copy(state)
            then = self.block(s.then, st_then)
            orelse = None
            if s.orelse is not None:
                st_else = _copy(state)
                orelse = self.block(s.orelse, st_else)
                _merge(st_then, st_else)
            else:
                _merge(st_then, state)
            state.clear()
            state.update(st_then)
            out = dataclasses.replace(s, then=_flat(then), orelse=None if orelse is None else _flat(orelse))
        else:
            entry = _copy(state)
            while True:
                st = _copy(entry)
                body = self.block(s.body, st)
                if isinstance(s, S.While):  # the condition is read again before each trip
                    self.step(_expr_accesses([s.cond]), st)
                merged = _copy(entry)
                _merge(merged, st)
                if _same(merged, entry):
                    break
                entry = merged
            state.clear()
            state.update(entry)
            out = dataclasses.replace(s, body=_flat(body))
        return [X.Barrier(loc=s.loc), out] if pre else out


def _flat(x):
    return S.Seq(x) if isinstance(x, list) else x


def _copy(state):
    return {k: set(v) for k, v in state.items()}


def _merge(into, other):
    for k, v in other.items():
        into.setdefault(k, set()).update(v)


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(a[k] == b[k] for k in a)


def run(func: S.PrimFunc, target) -> S.PrimFunc:
    def place(k):
        if not isinstance(k, X.SimtKernel):
            return k
        return dataclasses.replace(k, body=_flat(Placer(k.tid).block(k.body, {})))

    if isinstance(func.body, S.Seq):
        return dataclasses.replace(func, body=S.Seq([place(k) for k in func.body.body], loc=func.body.loc))
    return dataclasses.replace(func, body=place(func.body))
