"""distribute_threads: spell out what each thread of a block does.

The kernel body becomes the program of one thread (``tid`` its index), every thread running it:
- A T.Parallel nest that touches a register fragment runs each iteration on the threads its layout gives
  (infer_layouts): every loop variable becomes ``slot * count + digit(tid)`` with the slot loops unrolled, and
  each fragment access an access of the thread's register array. A reduction loop inside it (T.reduce_*) is
  split the same way; the partial results of the threads that share an output are combined across them, with
  warp shuffles where the target has them and the lanes sit in one warp, else through shared memory. Stores to
  shared or global memory and atomics are done by one of the threads holding a replicated element.
- Any other T.Parallel nest is flattened and its iterations dealt out round-robin (iteration f on thread
  f mod threads).
- T.gemm becomes the portable per-thread micro-tile GEMM: each thread accumulates the C elements its layout
  gives it, reading a column of A and a row of B from shared memory per step of K.
- Serial code runs on every thread alike (its scalars are uniform); its stores to shared or global memory and
  its atomics are done by thread 0 only (insert_barriers makes them visible to the others).

Invariant established: the kernel is a ``SimtKernel``; no T.Parallel loop and no ExternGemm remains; register
fragments are per-thread ``local`` arrays.
"""
from __future__ import annotations

import dataclasses
import math

from tegula.errors import CompileError
from tegula.ir import dtypes as dt
from tegula.ir import expr as E
from tegula.ir import simt as X
from tegula.ir import stmt as S
from tegula.ir.buffer import Buffer
from tegula.passes import rewrite
from tegula.passes.infer_layouts import (
    collect_nest,
    derive,
    gemm_layout,
    gemm_mnk,
    mma_layout,
    reduction_threads,
    tile_dims,
    uses_mma,
)

_KIND = {"+": "sum", "max": "max", "min": "min"}


def _i32(v) -> E.Expr:
    return E.Const(v, dt.int32)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def udiv(e, c: int):
    """``e // c`` for ``e >= 0``."""
    if c == 1:
        return e
    return E.binop(">>", e, c.bit_length() - 1) if _pow2(c) else E.binop("//", e, c)


def umod(e, c: int):
    """``e % c`` for ``e >= 0``."""
    if c == 1:
        return _i32(0)
    return E.binop("&", e, c - 1) if _pow2(c) else E.binop("%", e, c)


class Distributor:
    def __init__(self, nthreads: int, warp_size, red_cap: int, loc, mma_dtypes=()):
        self.T, self.warp, self.red_cap, self.loc = nthreads, warp_size, red_cap, loc
        self.mma_dtypes = mma_dtypes
        self.tid = E.Var("tid", dt.int32, is_local=True)
        self.allocs: list = []        # buffers the distribution adds (scratch, GEMM registers)
        self.scratch: dict = {}       # dtype name -> shared (T,) buffer for cross-thread reductions
        self.regs: dict = {}          # register fragment -> its per-thread local array

    def digit(self, stride: int, count: int):
        if count == 1:
            return _i32(0)
        q = udiv(self.tid, stride)
        return q if stride * count == self.T else umod(q, count)

    def local_of(self, buf: Buffer) -> Buffer:
        if buf not in self.regs:
            self.regs[buf] = Buffer(buf.name, (buf.layout.slots,), buf.dtype, "local", buf.loc)
        return self.regs[buf]

    # the block level -----------------------------------------------------------------------
    def uniform(self, s):
        if isinstance(s, S.For) and s.kind == "parallel":
            return self.nest(s)
        if isinstance(s, S.Seq):
            return type(s)([self.uniform(c) for c in s.body], loc=s.loc)
        if isinstance(s, (S.For, S.While)):
            return dataclasses.replace(s, body=self.uniform(s.body))
        if isinstance(s, S.If):
            return dataclasses.replace(s, then=self.uniform(s.then),
                                       orelse=None if s.orelse is None else self.uniform(s.orelse))
        if isinstance(s, (S.Store, S.AtomicElem)) and s.buffer.scope in ("shared", "global"):
            return S.If(E.compare("==", self.tid, 0), s, loc=s.loc)
        if isinstance(s, S.AtomicElem):
            raise CompileError(f"atomics on {s.buffer.scope} buffer {s.buffer.name} are not supported", s.loc)
        if isinstance(s, S.ExternGemm):
            return self.gemm(s)
        if isinstance(s, S.Alloc) and getattr(s.buffer, "layout", None) is not None:
            return S.Alloc(self.local_of(s.buffer), loc=s.loc)
        if isinstance(s, S.Kernel):
            raise CompileError("T.Kernel blocks cannot be nested", s.loc)
        return s

    # T.Parallel nests ----------------------------------------------------------------------
    def nest(self, f: S.For):
        n = collect_nest(f)
        if n.accesses:
            return X.ThreadNest([self.strided(n)], loc=f.loc)
        return X.ThreadNest([self.flat(n)], loc=f.loc)

    def flat(self, n) -> S.Stmt:
        """Iteration f of the flattened nest on thread f mod T, for nests without register fragments."""
        exts = [E.cast(E.as_expr(lp.extent), dt.int32) for lp in n.loops]
        total = exts[0]
        for x in exts[1:]:
            total = E.binop("*", total, x)
        fv = E.Var("f", dt.int32, is_local=True)
        mapping, stride = {}, _i32(1)
        for lp, x in reversed(list(zip(n.loops, exts))):
            cs, cx = E.const_value(stride), E.const_value(x)
            q = udiv(fv, cs) if cs is not None else E.binop("//", fv, stride)
            idx = q if lp is n.loops[0] else (umod(q, cx) if cx is not None else E.binop("%", q, x))
            mapping[id(lp.var)] = E.binop("+", E.cast(E.as_expr(lp.start), dt.int32), idx)
            stride = E.binop("*", stride, x)
        body = rewrite.stmt(_serial_inner(n.body), lambda e: mapping.get(id(e)) if isinstance(e, E.Var) else None)
        loc = n.loops[0].loc
        cn = E.const_value(total)
        if cn is not None and cn <= self.T:
            inner = S.Seq([S.Assign(fv, self.tid, True, loc=loc), body], loc=loc)
            return inner if cn == self.T else S.If(E.compare("<", self.tid, total), inner, loc=loc)
        k = E.Var("k", dt.int32)
        trips = E.binop("//", E.binop("+", total, self.T - 1), self.T)
        whole = cn is not None and cn % self.T == 0  # every trip has work for every thread: no test
        step = S.Seq([S.Assign(fv, E.binop("+", E.binop("*", k, self.T), self.tid), True, loc=loc),
                      body if whole else S.If(E.compare("<", fv, total), body, loc=loc)], loc=loc)
        return S.For(k, _i32(0), trips, "serial", step, loc=loc)

    def strided(self, n) -> S.Stmt:
        layouts = {b: b.layout for b, _ in n.accesses}
        mapping, _ = derive(n, layouts, self.T, False, self.red_cap)
        loc = n.loops[0].loc
        slot_var, value = {}, {}
        for v, ext in n.all_vars():
            s, c = mapping[id(v)]
            t = self.digit(s, c)
            if ext // c > 1:
                a = E.Var(f"{v.name}_s", dt.int32)
                slot_var[id(v)] = a
                value[id(v)] = E.binop("+", E.binop("*", a, c), t) if c > 1 else a
            else:
                value[id(v)] = t

        def slot(buf, idx):
            lay, out, mult = buf.layout, _i32(0), 1
            for d in reversed(range(len(idx))):
                ix = idx[d]
                a = slot_var.get(id(ix), _i32(0)) if isinstance(ix, E.Var) else ix
                out = E.binop("+", out, E.binop("*", a, mult))
                mult *= lay.slot_shape[d]
            return (out,)

        def fe(e):
            if isinstance(e, E.Load) and getattr(e.buffer, "layout", None) is not None:
                return E.Load(self.local_of(e.buffer), slot(e.buffer, e.indices))
            return None

        used = [mapping[id(v)] for v in n.vars]
        owner = None
        if math.prod(c for _, c in used) != self.T:
            total = _i32(0)
            for (s, c) in used:
                if c > 1:
                    total = E.binop("+", total, E.binop("*", self.digit(s, c), s))
            owner = E.compare("==", self.tid, total)

        def fs(s):
            if isinstance(s, S.Store) and getattr(s.buffer, "layout", None) is not None:
                return S.Store(self.local_of(s.buffer), slot(s.buffer, s.indices), s.value, loc=s.loc)
            if isinstance(s, (S.Store, S.AtomicElem)) and owner is not None and s.buffer.scope in ("shared", "global"):
                return S.If(owner, s, loc=s.loc)
            return None

        body = rewrite.stmt(_serial_inner(n.body), fe, fs)
        slot_exts = [(v, ext // mapping[id(v)][1]) for v, ext in zip(n.vars, n.extents)]

        def over_slots(b):
            for v, m in reversed(slot_exts):
                if id(v) in slot_var:
                    b = S.For(slot_var[id(v)], _i32(0), _i32(m), "unroll", b, loc=loc)
            return b

        if n.red is None:
            out = over_slots(body)
        else:
            out = self.reduction(body, n, mapping, slot_var, slot_exts, over_slots)
        return rewrite.stmt(out, lambda e: value.get(id(e)) if isinstance(e, E.Var) else None)

    def warp_ok(self, s: int, c: int) -> bool:
        return bool(self.warp) and s * c <= self.warp and _pow2(c) and _pow2(s) and self.T % self.warp == 0

    def reduction(self, body, n, mapping, slot_var, slot_exts, over_slots):
        """A nest holding T.reduce_*: each thread reduces its share of the range; when that range is spread over
        threads, their partial results are combined, by warp shuffles per output, or else through shared memory
        for all of the thread's outputs at once (so the barriers are not inside loops)."""
        red = n.red
        s, c = mapping[id(red.var)]
        op, acc = red.annotations["reduction"]
        part, rest = [], []
        stmts = body.body if isinstance(body, S.Seq) else [body]
        for k, x in enumerate(stmts):
            if isinstance(x, S.For) and x.var is red.var:
                a = slot_var.get(id(red.var))
                part = stmts[:k] + [dataclasses.replace(x, var=a, extent=_i32(_const(red.extent) // c), kind="unroll",
                                                        annotations={}) if a is not None else x.body]
                rest = stmts[k + 1:]
                break
        loc = red.loc
        if c == 1:
            return over_slots(S.Seq(part + rest, loc=loc))
        if self.warp_ok(s, c):
            return over_slots(S.Seq(part + [X.WarpAllReduce(_KIND[op], acc, s, c, loc=loc)] + rest, loc=loc))
        nslots = math.prod(m for _, m in slot_exts)
        buf = self.scratch_buffer(acc.dtype, nslots * self.T)
        flat = _i32(0)
        for v, m in slot_exts:
            flat = E.binop("*", flat, m)
            if id(v) in slot_var:
                flat = E.binop("+", flat, slot_var[id(v)])
        row = E.binop("*", flat, self.T)
        t = self.digit(s, c)
        base = E.binop("+", row, E.binop("-", self.tid, E.binop("*", t, s)))
        me = (E.binop("+", row, self.tid),)
        # acc is declared once, outside the loops over outputs, since both of them use it
        decl = [S.Assign(acc, x.value, True, loc=loc) for x in part if isinstance(x, S.Assign) and x.var is acc][:1]
        part = [S.Assign(acc, x.value, False, loc=loc) if isinstance(x, S.Assign) and x.var is acc else x for x in part]
        out = decl + [over_slots(S.Seq(part + [S.Store(buf, me, acc, loc=loc)], loc=loc)), X.Barrier(loc=loc)]
        if _pow2(c) and c > 16:  # a tree: log2(c) steps, each over all of the thread's outputs
            off = c // 2
            while off >= 1:
                other = E.Load(buf, (E.binop("+", me[0], off * s),))
                step = S.If(E.compare("<", t, off), S.Store(buf, me, E.binop(op, E.Load(buf, me), other), loc=loc),
                            loc=loc)
                out += [over_slots(step), X.Barrier(loc=loc)]
                off //= 2
            total = E.Load(buf, (base,))
        else:  # every thread reads the c partial results, in one order, so all get the same value
            total = E.Load(buf, (base,))
            for k in range(1, c):
                total = E.binop(op, total, E.Load(buf, (E.binop("+", base, k * s),)))
        out.append(over_slots(S.Seq([S.Assign(acc, total, False, loc=loc)] + rest, loc=loc)))
        return S.Seq(out, loc=loc)  # insert_barriers orders the next use of the scratch after these reads

    def scratch_buffer(self, dtype, size: int) -> Buffer:
        """The block's shared scratch for cross-thread reductions of ``dtype``, at least ``size`` elements."""
        buf = self.scratch.get(dtype.name)
        if buf is None:
            buf = Buffer(f"red_{dtype.name}", (size,), dtype, "shared")
            self.scratch[dtype.name] = buf
            self.allocs.append(buf)
        buf.shape = (max(buf.shape[0], size),)
        return buf

    # T.gemm ----------------------------------------------------------------------------------
    def gemm(self, g: S.ExternGemm) -> S.Stmt:
        c_buf = g.c.buffer
        m, n, k = gemm_mnk(g)
        lay = getattr(c_buf, "layout", None)
        in_regs = lay is not None
        if in_regs and uses_mma(g, self.T, self.mma_dtypes) and lay == mma_layout(m, n, self.T):
            return self.mma(g, m, n, k)
        if not in_regs:
            lay = gemm_layout(m, n, self.T)
        (rs, ty), (cs, tx) = lay.dims
        tm, tn = m // ty, n // tx
        acc_t = c_buf.dtype
        ra = Buffer("a_reg", (tm,), acc_t, "local")
        rb = Buffer("b_reg", (tn,), acc_t, "local")
        self.allocs += [ra, rb]
        trow, tcol = self.digit(rs, ty), self.digit(cs, tx)
        av, bv, kv = E.Var("mi", dt.int32), E.Var("ni", dt.int32), E.Var("kk", dt.int32)
        row = E.binop("+", E.binop("*", av, ty), trow)
        col = E.binop("+", E.binop("*", bv, tx), tcol)
        loc = g.loc
        owner = None
        if not in_regs and ty * tx != self.T:
            owner = E.compare("==", self.tid, E.binop("+", E.binop("*", trow, rs), E.binop("*", tcol, cs)))

        def c_load():
            if in_regs:
                return E.Load(self.local_of(c_buf), (E.binop("+", E.binop("*", av, tn), bv),))
            return E.Load(c_buf, _tile_index(g.c, row, col))

        def c_store(v):
            if in_regs:
                return S.Store(self.local_of(c_buf), (E.binop("+", E.binop("*", av, tn), bv),), v, loc=loc)
            st = S.Store(c_buf, _tile_index(g.c, row, col), v, loc=loc)
            return S.If(owner, st, loc=loc) if owner is not None else st

        def over_c(body):
            return S.For(av, _i32(0), _i32(tm), "unroll", S.For(bv, _i32(0), _i32(tn), "unroll", body, loc=loc),
                         loc=loc)

        a_idx = _tile_index(g.a, kv, row) if g.trans_a else _tile_index(g.a, row, kv)
        b_idx = _tile_index(g.b, col, kv) if g.trans_b else _tile_index(g.b, kv, col)
        x, y = E.Load(ra, (av,)), E.Load(rb, (bv,))
        mac = E.Call("fma", (x, y, c_load()), acc_t) if acc_t.is_float else E.binop("+", c_load(), E.binop("*", x, y))
        step = S.Seq([
            S.For(av, _i32(0), _i32(tm), "unroll", S.Store(ra, (av,), E.cast(E.Load(g.a.buffer, a_idx), acc_t),
                                                           loc=loc), loc=loc),
            S.For(bv, _i32(0), _i32(tn), "unroll", S.Store(rb, (bv,), E.cast(E.Load(g.b.buffer, b_idx), acc_t),
                                                           loc=loc), loc=loc),
            over_c(c_store(mac)),
        ], loc=loc)
        body = [over_c(c_store(E.Const(0, acc_t)))] if g.clear else []
        body.append(S.For(kv, _i32(0), _i32(k), "serial", step, loc=loc))
        return X.ThreadNest(body, loc=loc)


    def mma(self, g: S.ExternGemm, m: int, n: int, k: int) -> S.Stmt:
        """T.gemm on warp MMA: the thread's C registers are the MMA accumulators (mma_layout); the emitter
        gathers each MMA's A and B fragments from the operands' elements."""
        c = self.local_of(g.c.buffer)
        r, kv, nv = (E.Var(x, dt.int32) for x in ("mma_r", "mma_k", "mma_n"))
        k1 = E.binop("+", kv, 1)

        def a_at(row, col):
            return E.Load(g.a.buffer, _tile_index(g.a, col, row) if g.trans_a else _tile_index(g.a, row, col))

        def b_at(row, col):
            return E.Load(g.b.buffer, _tile_index(g.b, col, row) if g.trans_b else _tile_index(g.b, row, col))

        body = []
        if g.clear:
            body.append(self.clear_slots(c, g.loc))
        body.append(X.MmaSync(c, m, n, k, g.a.dtype.name, self.tid, r, kv, nv, a_at(r, kv), a_at(r, k1),
                              b_at(kv, nv), b_at(k1, nv), loc=g.loc))
        return X.ThreadNest(body, loc=g.loc)

    def clear_slots(self, buf, loc) -> S.Stmt:
        v = E.Var("ci", dt.int32)
        return S.For(v, _i32(0), _i32(buf.shape[0]), "unroll", S.Store(buf, (v,), E.Const(0, buf.dtype), loc=loc),
                     loc=loc)


def _const(e):
    return E.const_value(e)


def _tile_index(rg, i, j) -> tuple:
    d0, d1 = tile_dims(rg)
    idx = [E.cast(E.as_expr(x), dt.int32) for x in rg.starts]
    idx[d0] = E.binop("+", idx[d0], i)
    idx[d1] = E.binop("+", idx[d1], j)
    return tuple(idx)


def _serial_inner(s):
    """Parallel loops nested inside a nest's body run serially on the thread (the reduction loop stays)."""
    def fs(x):
        if isinstance(x, S.For) and x.kind == "parallel":
            return dataclasses.replace(x, kind="serial")
        return None
    return rewrite.stmt(s, None, fs)


def run(func: S.PrimFunc, target) -> S.PrimFunc:
    """Each T.Kernel of the function becomes a SimtKernel (launched one after another, in order); the function's
    body may hold nothing else but T.alloc_global workspaces."""
    body = func.body
    top = body.body if isinstance(body, S.Seq) else [body]
    kernels = [s for s in top if isinstance(s, S.Kernel)]
    for s in top:
        if not isinstance(s, S.Kernel) and not (isinstance(s, S.Alloc) and s.buffer.is_global):
            raise CompileError(f"on the {target.name} target everything a function does must be inside a T.Kernel",
                               s.loc or func.loc)
    out = [s if not isinstance(s, S.Kernel) else _distribute(s, target) for s in top]
    if not kernels:
        return func
    return dataclasses.replace(func, body=out[0] if len(out) == 1 else S.Seq(out, loc=body.loc))


def _distribute(k: S.Kernel, target) -> X.SimtKernel:
    nthreads = math.prod(int(t) for t in k.threads)
    limit = getattr(target, "max_threads", None)
    if limit and nthreads > limit:
        raise CompileError(f"T.Kernel: {nthreads} threads per block is more than the {target.name} target's limit "
                           f"of {limit}", k.loc)
    d = Distributor(nthreads, getattr(target, "warp_size", None), reduction_threads(target), k.loc,
                    getattr(target, "mma", ()))
    inner = d.uniform(k.body)
    prologue = [S.Assign(d.tid, X.ThreadIdx(), True, loc=k.loc)] + [S.Alloc(b, loc=k.loc) for b in d.allocs]
    return X.SimtKernel(k.grid, k.threads, k.block_vars, S.Seq(prologue + [inner], loc=k.loc), loc=k.loc,
                        tid=d.tid, nthreads=nthreads)
