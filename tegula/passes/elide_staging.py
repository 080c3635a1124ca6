"""elide_staging: on the CPU, a T.gemm reads a staged tile in place when the tile lies inside its tensor.

A GPU kernel copies global tiles into shared memory because its tensor cores read only shared memory and
registers. Where the CPU's prelude GEMM computes a gemm as dot products read straight from B's rows (few rows
of A, B transposed: a decode step's x @ W^T), staging the tiles first is a second pass over the weights (read
global, write the staging buffer, read it again) that never overlaps the product: there the gemms take the global
tiles themselves (measured on one core at 1 x 2112 x 7168, weights from DRAM: fp8 1.8-2.0 -> 1.1-1.4 ms, bf16
2.7-3.1 -> 1.7-1.9 ms, M = 4 fp8 2.4 -> 2.0 ms). Where the prelude packs B into panels for a few rows, the staged
tile is kept: packing 64 rows x 128 of K in place from a weight matrix was 24% slower at M = 16. Compute-bound
tiles (128 x 128 of C or more, B transposed) read in place too: each packed panel serves 128 rows or more, and the
copy was up to 6% of a 4096-row GEMM (tileops.gemm.reads_in_place).

The pass applies to a copy ``T.copy(G[...], S)`` when it can prove that this changes nothing:
- S is an on-chip buffer (no T.reshape view of it) written whole by this copy and by nothing else, of G's dtype
  (the copy converts nothing), and every read of S anywhere is an A or B operand of a T.gemm that follows the
  copy in the same statement list (or nested in a later statement of it), each of them one the prelude computes
  by dot products or a compute-bound tile (tileops.gemm.reads_in_place);
- the copy's source starts name only loop and block indices, scalar parameters and locals assigned once, and
  loads of global tensors the kernel never writes, so they mean the same at each gemm as at the copy;
- G's elements are 2- or 1-byte and its last dimension is contiguous.
Reads outside the tensor must give zeros, which only the copy provides: when the tile is not provably inside,
the copy runs under ``if (!inside)`` and each gemm is versioned ``if (inside) gemm(G tile) else gemm(S)``, on one
boolean computed at the copy. Runs after prefetch_pipelined (whose prefetches name the copy's next source, not
S) and before lower_tile_ops.

Invariant established: a gemm operand may be a region of a global tensor, with the last dimension contiguous.
"""
from __future__ import annotations

import dataclasses

from tegula.ir import dtypes as dt
from tegula.ir import expr as E
from tegula.ir import stmt as S
from tegula.ir.buffer import Region
from tegula.passes import rewrite
from tegula.tileops.common import tile_in_bounds
from tegula.tileops.gemm import reads_in_place


def run(func: S.PrimFunc, target) -> S.PrimFunc:
    stmts = list(S.walk(func.body))
    facts = _Facts(func, stmts)
    chosen = {id(s) for s in stmts if isinstance(s, S.Copy) and facts.eligible(s)}
    if not chosen:
        return func
    gemms = {}  # staging buffer id -> how many gemms read it
    for g in stmts:
        if isinstance(g, S.Gemm):
            for b in {id(g.a.buffer), id(g.b.buffer)}:
                gemms[b] = gemms.get(b, 0) + 1
    names = iter(range(1, 1 << 30))  # flag names numbered per function: the generated source is deterministic
    body = rewrite.stmt(func.body, fs=lambda s: _rewrite_list(s, chosen, gemms, names))
    return dataclasses.replace(func, body=body)


class _Facts:
    """What the whole function does to buffers and variables."""

    def __init__(self, func, stmts):
        self.stmts = stmts
        self.writes: dict[int, list] = {}
        self.mutated = {id(s.var) for s in stmts if isinstance(s, S.Assign) and not s.declare}
        # buffers that share storage with another (T.reshape views): their reads and writes are not all visible
        self.aliased = {id(b) for s in stmts if isinstance(s, S.Alloc) and s.buffer.alias is not None
                        for b in (s.buffer, s.buffer.alias)}
        for s in stmts:
            for buf in _written(s):
                self.writes.setdefault(id(buf), []).append(s)

    def eligible(self, c: S.Copy) -> bool:
        src, dst = c.src, c.dst
        g, sb = src.buffer, dst.buffer
        if not g.is_global or sb.is_global or g.dtype != sb.dtype or g.dtype.bits not in (8, 16) or \
                g.dtype.kind not in ("float", "int", "uint") or c.eviction_policy is not None:
            return False
        if g.strides is not None and E.const_value(E.as_expr(g.strides[-1])) != 1 or id(sb) in self.aliased:
            return False
        dims = _copy_dims(c)
        if not _covers(dst) or self.writes.get(id(sb)) != [c] or dims is None or dims[-1][1] != g.ndim - 1:
            return False
        readers = _gemm_readers(self.stmts, sb)
        if readers is None or not all(reads_in_place(r) for r in readers):
            return False
        for x in src.starts:
            for e in rewrite.sub_exprs(E.as_expr(x)):
                if isinstance(e, E.Var) and id(e) in self.mutated:
                    return False
                if isinstance(e, E.Load) and (not e.buffer.is_global or id(e.buffer) in self.writes):
                    return False
        return True


def _written(s) -> list:
    if isinstance(s, (S.Store, S.AtomicElem)):
        return [s.buffer]
    if isinstance(s, (S.Copy, S.Fill, S.Reduce, S.Atomic)):
        return [s.dst.buffer]
    if isinstance(s, (S.Gemm, S.ExternGemm)):
        return [s.c.buffer]
    return []


def _covers(rg: Region) -> bool:
    """``rg`` is its whole buffer, from the origin."""
    return all(E.const_value(E.as_expr(x)) == 0 for x in rg.starts) and \
        all(E.const_value(E.as_expr(e)) == E.const_value(E.as_expr(n)) for e, n in zip(rg.extents, rg.buffer.shape))


def _gemm_readers(stmts, buf):
    """The T.gemm statements among ``stmts`` that read ``buf`` as their A or B operand, or None when anything else
    reads it (an element load, a copy or reduction from it, a gemm accumulating into it)."""
    readers = []
    for s in stmts:
        if isinstance(s, S.Gemm):
            if s.c.buffer is buf:
                return None
            if buf in (s.a.buffer, s.b.buffer):
                readers.append(s)
            continue
        regions = [getattr(s, f) for f in ("src", "dst", "value") if isinstance(getattr(s, f, None), Region)]
        if any(rg.buffer is buf for rg in regions if rg is not getattr(s, "dst", None)):
            return None
        exprs = rewrite.exprs_of(s) + [x for rg in regions for x in rg.starts if isinstance(x, E.Expr)]
        if any(isinstance(x, E.Load) and x.buffer is buf for e in exprs for x in rewrite.sub_exprs(e)):
            return None
    return readers


def _copy_dims(c: S.Copy):
    """Pairs (dim of the destination buffer, dim of the source) along which the copy's tile extends (extents > 1,
    in order), or None when the two sides' tiles differ."""
    src = [d for d, e in enumerate(c.src.extents) if E.const_value(e) != 1]
    dst = [d for d, e in enumerate(c.dst.extents) if E.const_value(e) != 1]
    if len(src) != len(dst) or not src or \
            any(E.const_value(c.src.extents[i]) != E.const_value(c.dst.extents[j]) for i, j in zip(src, dst)):
        return None
    return list(zip(dst, src))


def _staged_source(rg: Region, c: S.Copy):
    """The region of ``c``'s source that holds what ``rg`` (a region of the buffer ``c`` fills whole) holds after
    ``c``; None if ``rg`` is not inside what ``c`` maps. A tile of one row keeps the source dim just before its
    columns as its row dim."""
    dims = _copy_dims(c)
    starts = [E.as_expr(x) for x in c.src.starts]
    exts = [E.as_expr(e) for e in c.src.extents]
    keep = [False] * len(starts)
    mapped = dict(dims or ())
    for j, x in enumerate(rg.starts):
        if j in mapped:
            i = mapped[j]
            starts[i] = E.binop("+", starts[i], E.as_expr(x))
            exts[i] = E.as_expr(rg.extents[j])
            keep[i] = rg.keep[j]
        elif E.const_value(E.as_expr(x)) != 0:
            return None
    if not dims:
        return None
    for d in range(dims[0][1] - 1, -1, -1):
        if sum(keep) >= 2:
            break
        keep[d] = True
    return Region(c.src.buffer, tuple(starts), tuple(exts), tuple(keep))


def _rewrite_list(s, chosen: set, gemms: dict, names):
    """A statement list holding chosen copies: one flag ``inside`` (every tile inside its tensor) declared before
    the first, each copy under ``if (!inside)`` (dropped when the tiles are provably inside), each later gemm of
    their buffers versioned on the flag. Unchanged if some gemm of those buffers lies elsewhere, or a temporary is
    declared between the copies (the flag is computed before the first)."""
    if not isinstance(s, S.Seq):
        return None
    at = [k for k, x in enumerate(s.body) if id(x) in chosen]
    if not at or any(isinstance(x, S.Assign) for x in s.body[at[0]:at[-1]]):
        return None
    copies = {id(s.body[k].dst.buffer): s.body[k] for k in at}
    later = [g for x in s.body[at[0] + 1:] for g in S.walk(x) if isinstance(g, S.Gemm)]
    for b in copies:
        if sum(1 for g in later if b in (id(g.a.buffer), id(g.b.buffer))) != gemms.get(b, 0):
            return None
    cond = None
    for c in copies.values():
        t = tile_in_bounds(c.src)
        if t is not None:
            cond = t if cond is None else E.logical("and", cond, t)
    flag = None
    if cond is not None:
        flag = E.Var(f"tg_inside{next(names)}", dt.bool_, is_local=True)

    def gemm(g):
        if not isinstance(g, S.Gemm) or not {id(g.a.buffer), id(g.b.buffer)} & copies.keys():
            return None
        a, b = (_staged_source(rg, copies[id(rg.buffer)]) if id(rg.buffer) in copies else rg
                for rg in (g.a, g.b))
        direct = dataclasses.replace(g, a=a, b=b)
        return direct if flag is None else S.If(flag, direct, g, loc=g.loc)

    out = list(s.body[:at[0]])
    if flag is not None:
        out.append(S.Assign(flag, cond, True, loc=s.body[at[0]].loc))
    for x in s.body[at[0]:]:
        if id(x) in chosen:
            if flag is not None:
                out.append(S.If(E.unop("not", flag), x, loc=x.loc))
        else:
            out.append(rewrite.stmt(x, fs=gemm))
    return type(s)(out, loc=s.loc)
