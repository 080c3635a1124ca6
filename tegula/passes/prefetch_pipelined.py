"""prefetch_pipelined: on the CPU, a T.Pipelined loop's copies of later iterations overlap compute by prefetching.

A CPU block has no asynchronous copy engine, so ``T.Pipelined(n, num_stages=k)`` with k >= 2 is realised as its
plain loop plus software prefetch: before each T.copy from a global tensor in the loop body, the region that same
copy will read one iteration later is prefetched (one prefetch per 64-byte line, into L2), so that the next tile
streams in while this one is computed.

Invariant established: every such copy is preceded, in the same statement list, by a guarded nest of
``Prefetch`` nodes (ir/cpu.py) for its source region with the loop variable advanced by one iteration. Scalar
temporaries the body declares before the copy are inlined into the advanced region (``t0 = k * 64`` then
``A[t0:...]`` prefetches ``A[(k + 1) * 64:...]``); the guard requires the next iteration to exist and every
tensor element the advanced start expressions read (``block_table[b, k + 1]``) to be inside its tensor.
Prefetches only warm caches: results do not change.
"""
from __future__ import annotations

import dataclasses

from tegula.ir import dtypes as dt
from tegula.ir import expr as E
from tegula.ir import stmt as S
from tegula.ir.cpu import Prefetch
from tegula.passes import rewrite

LINE = 64  # bytes per prefetch


def run(func: S.PrimFunc, target) -> S.PrimFunc:
    return dataclasses.replace(func, body=_visit(func.body))


def _visit(s):
    if isinstance(s, S.For) and s.kind == "pipelined" and int(s.annotations.get("num_stages", 0) or 0) >= 2:
        return dataclasses.replace(s, body=_insert(_visit(s.body), s, {}))
    if isinstance(s, S.Seq):
        return S.Seq([_visit(c) for c in s.body], loc=s.loc)
    if isinstance(s, (S.For, S.While, S.Kernel)):
        return dataclasses.replace(s, body=_visit(s.body))
    if isinstance(s, S.If):
        return dataclasses.replace(s, then=_visit(s.then), orelse=None if s.orelse is None else _visit(s.orelse))
    return s


def _insert(s, loop: S.For, env: dict):
    """``s`` (part of ``loop``'s body) with prefetches before its global copies; ``env`` maps the temporaries
    declared so far in the body (by id) to their values, in terms of the loop variable."""
    if isinstance(s, S.Copy) and s.src.buffer.is_global:
        return S.Seq([_prefetch(s, loop, env), s], loc=s.loc)
    if isinstance(s, S.Seq):
        env = dict(env)
        out = []
        for c in s.body:
            r = _insert(c, loop, env)
            # a copy's prefetches and the copy side by side in this list (elide_staging looks for the copy here)
            out.extend(r.body if isinstance(c, S.Copy) and isinstance(r, S.Seq) else [r])
            if isinstance(c, S.Assign):
                if c.declare:
                    env[id(c.var)] = rewrite.substitute(c.value, env)
                else:
                    env.pop(id(c.var), None)  # reassigned: its value at the next iteration is unknown
        return S.Seq(out, loc=s.loc)
    if isinstance(s, S.If):
        return dataclasses.replace(s, then=_insert(s.then, loop, env),
                                   orelse=None if s.orelse is None else _insert(s.orelse, loop, env))
    if isinstance(s, S.For) and s.kind != "pipelined":
        return dataclasses.replace(s, body=_insert(s.body, loop, env))
    return s


def _prefetch(c: S.Copy, loop: S.For, env: dict) -> S.Stmt:
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
    buf = c.src.buffer
    exts = [int(E.const_value(e)) for e in c.src.extents]
    step = max(1, LINE // buf.dtype.itemsize)
    # a row of the region's last dim: one prefetch every `step` elements from its start (ceil(ext / step) of them,
    # all inside the row: plain offsets from one address, no clamp), then one of its last element, whose line the
    # others miss where the row does not start on a line
    ivars, outer = [], []
    for d, (st, ext) in enumerate(zip(starts[:-1], exts[:-1])):
        v = E.Var(f"pf{d}", dt.int32)
        ivars.append((v, ext))
        outer.append(E.binop("+", st, v) if ext > 1 else st)
    st, ext = starts[-1], exts[-1]
    v = E.Var(f"pf{len(exts) - 1}", dt.int32)
    body = S.Seq([S.For(v, E.Const(0, dt.int32), E.Const(-(-ext // step), dt.int32), "serial",
                        Prefetch(buf, tuple(outer) + (E.binop("+", st, E.binop("*", v, step)),), loc=c.loc),
                        loc=c.loc),
                  Prefetch(buf, tuple(outer) + (E.binop("+", st, ext - 1),), loc=c.loc)], loc=c.loc)
    for v, n in reversed(ivars):
        if n > 1:
            body = S.For(v, E.Const(0, dt.int32), E.Const(n, dt.int32), "serial", body, loc=c.loc)
    return S.If(guard, body, loc=c.loc)
