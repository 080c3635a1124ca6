"""widen_gemm_k: on the CPU, a K loop that stages global tiles for T.gemm makes one gemm call per ~128 of K.

The README GEMM walks K in steps of block_K = 32: each step copies an A and a B tile into shared buffers and calls
the prelude micro-kernel with K = 32, which loads and stores the whole C tile every 32 k-steps. When a serial or
pipelined loop's body is only copies of global tiles into on-chip staging buffers, followed by T.gemms whose A and
B operands are exactly those buffers, U consecutive iterations are merged (U * block_K ~ ``TARGET_K``): the staging
buffers are widened U times along K, each copy reads the U iterations' tiles at once (they are adjacent along K,
checked), and one gemm runs over the widened tiles. The iterations left over (trip count not a multiple of U) run
the original body in a second loop.

Meaning is unchanged: a copy masks each element on its own (reads outside the tensor give 0), so the widened tile
is the U tiles side by side, and a gemm over K = U * block_K is the sum of the U gemms (summed in another order,
within the gemm tolerances; integer GEMMs are exact). The pass applies only where it can prove that:
- the loop steps by 1 and its body is Copy statements (global source -> whole on-chip buffer of the same shape)
  followed by Gemm statements (``clear=False``) whose A and B are whole staging buffers, each used by one gemm;
- each copy's source start along the K dimension of its gemm operand is affine in the loop variable with
  coefficient block_K, and no other start depends on the loop variable;
- nothing else in the function touches a staging buffer (read after the loop, aliased by T.reshape...), and no
  accumulator is a staging buffer.
Anything else is left unchanged. Invariant established: every merged loop is followed by its remainder loop; the
widened buffers are allocated next to the merged loop.
"""
from __future__ import annotations

import dataclasses

from tegula.ir import expr as E
from tegula.ir import stmt as S
from tegula.ir.buffer import Buffer, Region
from tegula.ir.simplify import linear
from tegula.passes import rewrite

TARGET_K = 128  # K per gemm call the merged loop aims at (what the prelude micro-kernels amortise C over)
MAX_WIDE_BYTES = 512 * 1024  # at most this much widened staging per loop (it stays in L2)


def run(func: S.PrimFunc, target) -> S.PrimFunc:
    def widen(s):  # innermost loops first: a widened loop's body is already final
        return _widen(s, func) if isinstance(s, S.For) and s.kind in ("serial", "pipelined") else None
    return dataclasses.replace(func, body=rewrite.stmt(func.body, fs=widen))


def _widen(loop: S.For, func: S.PrimFunc):
    """``loop`` merged U iterations at a time plus its remainder, or None when the pass does not apply."""
    if loop.step != 1:
        return None
    body = loop.body.body if isinstance(loop.body, S.Seq) else [loop.body]
    copies = [c for c in body if isinstance(c, S.Copy)]
    gemms = [g for g in body if isinstance(g, S.Gemm)]
    if not gemms or len(copies) + len(gemms) != len(body) or body.index(gemms[0]) != len(copies):
        return None  # only copies, then gemms
    staged = {}  # id(buffer) -> copy
    for c in copies:
        dst, src = c.dst, c.src
        if not src.buffer.is_global or dst.buffer.is_global or dst.buffer.alias is not None:
            return None
        if dst.buffer.ndim != 2 or not dst.is_full() or src.shape != tuple(dst.buffer.shape):
            return None
        if id(dst.buffer) in staged:
            return None
        staged[id(dst.buffer)] = c
    roles = {}  # id(buffer) -> K axis of the staging buffer
    for g in gemms:
        if g.clear or g.c.buffer.is_global or id(g.c.buffer) in staged:
            return None
        for rg, k_axis in ((g.a, 0 if g.trans_a else 1), (g.b, 1 if g.trans_b else 0)):
            if id(rg.buffer) not in staged or id(rg.buffer) in roles or not rg.is_full():
                return None
            roles[id(rg.buffer)] = k_axis
    if len(roles) != len(staged):
        return None  # a copy whose buffer no gemm reads
    bks = {int(staged[b].dst.buffer.shape[ax]) for b, ax in roles.items()}
    if len(bks) != 1:
        return None
    bk = bks.pop()
    n = E.const_value(loop.extent)
    u = max(1, TARGET_K // bk)
    if n is not None:
        u = min(u, int(n))
    wide_bytes = sum(_numel(c.dst.buffer) * c.dst.buffer.dtype.itemsize for c in copies)
    while u > 1 and u * wide_bytes > MAX_WIDE_BYTES:
        u //= 2
    if u <= 1:
        return None
    for b, ax in roles.items():
        if not _steps_along_k(staged[b].src, ax, loop.var, bk):
            return None
    if not _only_uses(func.body, {b for b in staged}, loop):
        return None

    # the merged loop: iteration ko covers k = start + ko*U ... start + ko*U + U - 1
    ko = E.Var(f"{loop.var.name}o", loop.var.dtype)
    k0 = E.binop("+", loop.start, E.binop("*", ko, u)) if E.const_value(loop.start) != 0 else E.binop("*", ko, u)
    wide, allocs, new = {}, [], []
    for c in copies:
        old, ax = c.dst.buffer, roles[id(c.dst.buffer)]
        shape = list(old.shape)
        shape[ax] = shape[ax] * u
        nb = Buffer(f"{old.name}_k{u}", shape, old.dtype, old.scope, loc=old.loc)
        wide[id(old)] = nb
        allocs.append(S.Alloc(nb, loc=old.loc))
        src_dim = _src_dim(c.src, ax)
        starts = [rewrite.substitute(E.as_expr(x), {id(loop.var): k0}) for x in c.src.starts]
        exts = list(c.src.extents)
        exts[src_dim] = int(E.const_value(exts[src_dim])) * u
        new.append(S.Copy(Region(c.src.buffer, starts, exts, c.src.keep), Region.full(nb), loc=c.loc))
    for g in gemms:
        new.append(dataclasses.replace(g, a=Region.full(wide[id(g.a.buffer)]), b=Region.full(wide[id(g.b.buffer)])))
    ext = loop.extent if n is not None else E.binop("max", loop.extent, 0)  # a negative trip count runs nothing
    trips = E.binop("//", ext, u)
    merged = S.For(ko, E.Const(0, ko.dtype), trips, loop.kind, S.Seq(new, loc=loop.loc),
                   annotations=dict(loop.annotations, merged_k=u), loc=loop.loc)
    out = allocs + [merged]
    done = E.binop("*", trips, u)
    rest = E.binop("-", ext, done)
    if E.const_value(rest) != 0:
        out.append(S.For(loop.var, E.binop("+", loop.start, done), rest, loop.kind, loop.body,
                         annotations=dict(loop.annotations), loc=loop.loc))  # the original loop, last iterations
    return S.Seq(out, loc=loop.loc)


def _numel(b) -> int:
    n = 1
    for d in b.shape:
        n *= int(d)
    return n


def _src_dim(src: Region, tile_axis: int) -> int:
    """The source tensor dimension that is the tile's ``tile_axis``."""
    kept = [d for d, k in enumerate(src.keep) if k]
    return kept[tile_axis]


def _steps_along_k(src: Region, tile_axis: int, var, bk: int) -> bool:
    """The source start along the tile's K axis is ``bk * var + (terms free of var)``; other starts are free of
    var; so U consecutive iterations read U adjacent tiles along K."""
    kd = _src_dim(src, tile_axis)
    if int(E.const_value(src.extents[kd])) != bk:
        return False
    for d, x in enumerate(src.starts):
        x = E.as_expr(x)
        if d != kd:
            if _mentions(x, var):
                return False
            continue
        lin = linear(x)
        if lin is None:
            return False
        coef = 0
        for atom, c in lin[0].values():
            if atom is var:
                coef = c
            elif _mentions(atom, var):
                return False
        if coef != bk:
            return False
    return True


def _mentions(e, var) -> bool:
    return any(x is var for x in rewrite.sub_exprs(E.as_expr(e)))


def _only_uses(root, bufs: set, loop: S.For) -> bool:
    """Nothing outside ``loop``'s copies and gemms, and their Allocs, refers to a buffer of ``bufs`` (by id)."""
    mine = loop.body.body if isinstance(loop.body, S.Seq) else [loop.body]
    mine = {id(s) for s in mine}
    for s in S.walk(root):
        if id(s) in mine:
            continue
        if isinstance(s, S.Alloc):
            if s.buffer.alias is not None and id(s.buffer.alias) in bufs:
                return False
            continue
        if _refs(s) & bufs:
            return False
    return True


def _refs(s) -> set:
    """ids of the buffers statement ``s`` itself refers to (not its sub-statements)."""
    out = set()
    for name in ("src", "dst", "a", "b", "c", "value"):
        rg = getattr(s, name, None)
        if isinstance(rg, Region):
            out.add(id(rg.buffer))
    for name in ("buffer",):
        b = getattr(s, name, None)
        if isinstance(b, Buffer):
            out.add(id(b))
    for e in rewrite.exprs_of(s):
        out.update(_expr_refs(e))
    for name in ("src", "dst", "a", "b", "c", "value"):
        rg = getattr(s, name, None)
        if isinstance(rg, Region):  # a buffer read inside a start expression
            for x in rg.starts:
                if isinstance(x, E.Expr):
                    out.update(_expr_refs(x))
    if isinstance(s, S.Fill) or isinstance(s, S.Atomic):
        if isinstance(s.value, E.Expr):
            out.update(_expr_refs(s.value))
    return out


def _expr_refs(e) -> set:
    return {id(x.buffer) for x in rewrite.sub_exprs(e) if isinstance(x, E.Load)}
