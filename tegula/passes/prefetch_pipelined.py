"""prefetch_pipelined: on the CPU, a T.Pipelined loop's copies of later iterations overlap compute by prefetching.

A CPU block has no asynchronous copy engine, so ``T.Pipelined(n, num_stages=k)`` with k >= 2 is realised as its
plain loop plus software prefetch: before each T.copy from a global tensor in the loop body, the region that same
copy will read one iteration later is prefetched (one prefetch per 64-byte line, into L2), so that the next tile
streams in while this one is computed.

A burst of prefetches before the copy stalls the core until most of them are in flight, so it overlaps little
with the compute that follows. Where a copy fills a staging buffer that only T.gemm operands read in the loop
body (the usual ``copy A, copy B, gemm`` step), its prefetches are instead handed to those gemms: each gemm gets,
per staged operand, the slice of the copy's next source that becomes its operand next iteration
(``Gemm.hints["next"]``: (operand, region, guard)), and the prelude routine issues those lines a few at a time
between its register blocks.

Invariant established: every such copy is preceded by a guarded nest of ``Prefetch`` nodes (ir/cpu.py) for its
source region with the loop variable advanced by one iteration, or each gemm reading its staging buffer carries
the matching slice in ``hints["next"]``. Scalar temporaries the body declares before the
copy are inlined into the advanced region (``t0 = k * 64`` then ``A[t0:...]`` prefetches ``A[(k + 1) * 64:...]``);
the guard requires the next iteration to exist and every tensor element the advanced start expressions read
(``block_table[b, k + 1]``) to be inside its tensor. Prefetches only warm caches: results do not change.
"""
from __future__ import annotations

import dataclasses

from tegula.ir import dtypes as dt
from tegula.ir import expr as E
from tegula.ir import stmt as S
from tegula.ir.buffer import Region
from tegula.ir.cpu import Prefetch
from tegula.passes import rewrite

LINE = 64  # bytes per prefetch


def run(func: S.PrimFunc, target) -> S.PrimFunc:
    return dataclasses.replace(func, body=_visit(func.body))


def _visit(s):
    if isinstance(s, S.For) and s.kind == "pipelined" and int(s.annotations.get("num_stages", 0) or 0) >= 2:
        body = _visit(s.body)
        return dataclasses.replace(s, body=_insert(body, s, {}, _Staging(body)))
    if isinstance(s, S.Seq):
        return S.Seq([_visit(c) for c in s.body], loc=s.loc)
    if isinstance(s, (S.For, S.While, S.Kernel)):
        return dataclasses.replace(s, body=_visit(s.body))
    if isinstance(s, S.If):
        return dataclasses.replace(s, then=_visit(s.then), orelse=None if s.orelse is None else _visit(s.orelse))
    return s


class _Staging:
    """The copies of a pipelined loop body whose staging buffer only gemm operands read there (by id), and, once
    ``_insert`` has passed each of them, its advanced source start and guard (by id of the staging buffer)."""

    def __init__(self, body):
        stmts = list(S.walk(body))
        self.copies = {
            id(c) for c in stmts if isinstance(c, S.Copy) and c.src.buffer.is_global and c.src.dtype.bits in (8, 16)
            and rewrite.covers(c.dst) and rewrite.gemm_readers(stmts, c.dst.buffer)}
        self.next = {}


def _insert(s, loop: S.For, env: dict, staging: _Staging):
    """``s`` (part of ``loop``'s body) with prefetches before its global copies, or handed to the gemms that read
    what they stage; ``env`` maps the temporaries declared so far in the body (by id) to their values, in terms of
    the loop variable."""
    if isinstance(s, S.Copy) and s.src.buffer.is_global:
        starts, guard = _advanced(s, loop, env)
        if id(s) in staging.copies:
            staging.next[id(s.dst.buffer)] = (s, starts, guard)
            return s
        return S.Seq([_prefetch(s, starts, guard), s], loc=s.loc)
    if isinstance(s, S.Gemm):
        nxt = tuple(n for n in (_slice_next(w, rg, staging, loop) for w, rg in (("a", s.a), ("b", s.b))) if n)
        return dataclasses.replace(s, hints={**s.hints, "next": nxt}) if nxt else s
    if isinstance(s, S.Seq):
        env = dict(env)
        out = []
        for c in s.body:
            out.append(_insert(c, loop, env, staging))
            if isinstance(c, S.Assign):
                if c.declare:
                    env[id(c.var)] = rewrite.substitute(c.value, env)
                else:
                    env.pop(id(c.var), None)  # reassigned: its value at the next iteration is unknown
        return S.Seq(out, loc=s.loc)
    if isinstance(s, S.If):
        return dataclasses.replace(s, then=_insert(s.then, loop, env, staging),
                                   orelse=None if s.orelse is None else _insert(s.orelse, loop, env, staging))
    if isinstance(s, S.For) and s.kind != "pipelined":
        return dataclasses.replace(s, body=_insert(s.body, loop, env, staging))
    return s


def _slice_next(which: str, rg: Region, staging: _Staging, loop: S.For):
    """``(which, region, guard)``: the part of a staging copy's next source that becomes the gemm operand ``rg``
    (a slice of the staging buffer) next iteration; None if ``rg`` is not staged so or the slice is not rows of
    contiguous elements."""
    if id(rg.buffer) not in staging.next:
        return None
    copy, starts, guard = staging.next[id(rg.buffer)]
    loop_vars = {id(v) for v in _vars_bound_inside(loop)}
    for x in rg.starts:  # the slice's place in the buffer must be the same next iteration
        if any(isinstance(v, E.Var) and id(v) not in loop_vars for v in rewrite.sub_exprs(E.as_expr(x))):
            return None
    nxt = rewrite.staged_source(rg, copy, starts)
    if nxt is None:
        return None
    buf = nxt.buffer
    kept = [d for d, e in enumerate(nxt.extents) if E.const_value(e) != 1]
    strides = buf.strides
    if len(kept) > 2 or kept and kept[-1] != buf.ndim - 1 or \
            strides is not None and E.const_value(E.as_expr(strides[-1])) != 1:
        return None
    return which, nxt, guard


def _vars_bound_inside(loop: S.For):
    """The loop variables of the loops nested in ``loop`` (their values repeat every iteration of it)."""
    return [x.var for x in S.walk(loop.body) if isinstance(x, S.For)]


def _advanced(c: S.Copy, loop: S.For, env: dict):
    """The start of ``c``'s source one iteration of ``loop`` later, and the condition that it is read then."""
    nxt = {id(loop.var): E.binop("+", loop.var, 1)}
    starts = [rewrite.substitute(rewrite.substitute(E.as_expr(x), env), nxt) for x in c.src.starts]
    end = loop.extent if E.const_value(loop.start) == 0 else E.binop("+", loop.start, loop.extent)
    guard = E.compare("<", E.binop("+", loop.var, 1), end)
    for x in starts:
        for sub in reversed(list(rewrite.sub_exprs(x))):  # inner loads first: && evaluates left to right
            if isinstance(sub, E.Load) and sub.buffer.is_global:
                for i, n in zip(sub.indices, sub.buffer.shape):
                    i = E.cast(i, dt.int64)
                    ok = E.logical("and", E.compare(">=", i, 0), E.compare("<", i, E.cast(E.as_expr(n), dt.int64)))
                    guard = E.logical("and", guard, ok)
    return starts, guard


def _prefetch(c: S.Copy, starts, guard) -> S.Stmt:
    buf = c.src.buffer
    exts = [int(E.const_value(e)) for e in c.src.extents]
    step = max(1, LINE // buf.dtype.itemsize)
    ivars, idx = [], []
    for d, (st, ext) in enumerate(zip(starts, exts)):
        if d < len(exts) - 1:
            v = E.Var(f"pf{d}", dt.int32)
            ivars.append((v, ext))
            idx.append(E.binop("+", st, v) if ext > 1 else st)
        else:
            v = E.Var(f"pf{d}", dt.int32)
            lines = -(-ext // step) + 1
            ivars.append((v, lines))
            last = E.binop("+", st, ext - 1)
            idx.append(E.binop("min", E.binop("+", st, E.binop("*", v, step)), last))
    body = Prefetch(buf, tuple(idx), loc=c.loc)
    for v, n in reversed(ivars):
        if n > 1 or v is ivars[-1][0]:
            body = S.For(v, E.Const(0, dt.int32), E.Const(n, dt.int32), "serial", body, loc=c.loc)
    return S.If(guard, body, loc=c.loc)
