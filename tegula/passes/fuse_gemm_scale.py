"""fuse_gemm_scale: on the CPU, DeepGEMM's block-scaled K loop becomes one block-scaled prelude gemm.

An FP8 GEMM with per-block scales multiplies each 128-wide block of K on its own, scales that block's product and
adds it (tegula/ops/_gemm_kernels.py):

    for s in T.serial(n):
        T.gemm(A_t[.., s * kw : s * kw + kw], B_t[.., s * kw : s * kw + kw], blk, transpose_B=True, clear_accum=True)
        for i, j in T.Parallel(bm, bn):
            acc[i, j] += blk[i, j] * (sa[i, s] * sb[s, j])

Where the prelude computes the gemm as dot products along K (few rows of A, B transposed:
tileops.gemm.reads_b_in_place), each call ends with a 16-lane horizontal sum per output, so a decode step pays one
per output per 128 of K. Where the prelude scales the blocks in vector lanes instead (tileops.gemm.scales_in_lanes:
2..8 rows and K >= 2048, or 2..4 rows and K >= 1536, or one row and K <= 4096; one row with longer K, or 8 rows at
K = 1536, measured slower so and keep the loop), the loop is replaced by one call
of ``tg_gemm_<dt>_bscaled`` over the n blocks (an ExternGemm with ``kblock = kw`` and the scale regions
``sa[0:bm, 0:n]``, ``sb[0:n, 0:bn]``): each block's partial sums are scaled in their vector lanes and summed across
lanes once at the end (4 x 2112 x 7168 fp8, 1 thread, weights from DRAM: 1.75-1.92 -> 1.37-1.38 ms). The value is
the same sum of the same scaled block products, added in another order inside fp32 (as any gemm's K order is
unspecified). On tiles of 128 rows or more (tileops.gemm.scales_on_panels: the prelude packs panels) the call
instead scales each register block's product of a block into the accumulator from an L1 tile, the loop's own
expression, so that no cleared ``blk`` is written to L2 and read back per block (4096 x 2112 x 7168 fp8, 1 thread:
0.88 -> 0.95 of tegula's bf16 GEMM).

The pass applies only where it can prove that meaning is kept:
- a serial loop from 0 with a constant trip count n, step 1, whose body is exactly (1) the gemm, or an ``if`` on a
  condition that does not name the loop variable with such a gemm in each branch (elide_staging's versioning), and
  (2) the T.Parallel nest above, whose update is ``acc[i, j] = acc[i, j] + blk[i, j] * (P[i, s] * Q[s, j])`` (the
  factors of either product in either order);
- each gemm: A not transposed, B transposed, ``clear``, C the whole 2-D fp32 buffer ``blk`` of shape (bm, bn), its
  K start affine in the loop variable with coefficient kw (its K extent) and nothing else naming it;
  scales_in_lanes holds for K = n * kw, or scales_on_panels;
- acc (fp32, bm x bn), P (fp32, bm rows, >= n columns) and Q (fp32, >= n rows, bn columns) are on-chip buffers, none
  of them blk, and no T.reshape view of any of these;
- blk is written only by these gemms and read only by this update (its value after the loop is never used).
Runs after elide_staging (so that a gemm reads its tiles in place) and before lower_tile_ops.

Invariant established: an ExternGemm with ``kblock`` > 0 is block-scaled (ir/stmt.py), A not transposed, B
transposed, accumulating into C.
"""
from __future__ import annotations

import dataclasses

from tegula.ir import expr as E
from tegula.ir import stmt as S
from tegula.ir.buffer import Region
from tegula.ir.simplify import linear
from tegula.passes import rewrite
from tegula.tileops.gemm import scales_in_lanes, scales_on_panels, tile2


def run(func: S.PrimFunc, target) -> S.PrimFunc:
    stmts = list(S.walk(func.body))
    aliased = {id(b) for s in stmts if isinstance(s, S.Alloc) and s.buffer.alias is not None
               for b in (s.buffer, s.buffer.alias)}

    def fuse(s):
        return _fuse(s, stmts, aliased) if isinstance(s, S.For) and s.kind == "serial" else None

    return dataclasses.replace(func, body=rewrite.stmt(func.body, fs=fuse))


def _const(e):
    return E.const_value(E.as_expr(e))


def _fuse(loop: S.For, stmts, aliased):
    body = loop.body.body if isinstance(loop.body, S.Seq) else [loop.body]
    if len(body) != 2 or _const(loop.start) != 0 or getattr(loop, "step", 1) != 1:
        return None
    n = _const(loop.extent)
    if not isinstance(n, int) or n < 1:
        return None
    head, nest = body
    gemms = [head] if isinstance(head, S.Gemm) else None
    if isinstance(head, S.If) and head.orelse is not None and \
            all(isinstance(x, S.Gemm) for x in (head.then, head.orelse)) and not _names(head.cond, loop.var):
        gemms = [head.then, head.orelse]
    if gemms is None:
        return None
    upd = _update(nest)
    if upd is None:
        return None
    acc, blk, p, q, (vi, vj), (pi, qi) = upd
    bm, bn = (int(_const(x)) for x in blk.shape) if blk.ndim == 2 else (None, None)
    if bm is None or any(b.is_global or id(b) in aliased or b.dtype.name != "float32" for b in (acc, blk, p, q)):
        return None
    if len({id(acc), id(blk), id(p), id(q)} - {id(p), id(q)}) != 2 or blk in (p, q):
        return None
    if tuple(_const(x) for x in acc.shape) != (bm, bn) or p.ndim != 2 or q.ndim != 2 or \
            _const(p.shape[0]) != bm or _const(q.shape[1]) != bn or \
            not _const(p.shape[1]) >= n or not _const(q.shape[0]) >= n:
        return None
    if not (_is_var(pi[0], vi) and _is_var(pi[1], loop.var) and _is_var(qi[0], loop.var) and _is_var(qi[1], vj)):
        return None
    kw = None
    out = []
    for g in gemms:
        w = tile2(g.a)[1]
        if g.trans_a or not g.trans_b or not g.clear or g.c.buffer is not blk or not _whole(g.c) or \
                not (scales_in_lanes(g, n * w) or scales_on_panels(g)):
            return None
        if kw not in (None, w):
            return None
        kw = w
        a, b = _blocks(g.a, loop.var, w, n), _blocks(g.b, loop.var, w, n)
        if a is None or b is None or _names_any(g.c, loop.var):
            return None
        out.append(S.ExternGemm(a, b, Region(acc, (0, 0), (bm, bn), (True, True)), False, True, False, loc=g.loc,
                                sa=Region(p, (0, 0), (bm, n), (True, True)),
                                sb=Region(q, (0, 0), (n, bn), (True, True)), kblock=kw))
    # blk: written by these gemms only, read by this update only (``stmts`` are the function's statements before
    # this rewrite, which copies the nest but keeps the gemm statements)
    others = [s for s in stmts if _touches(s, blk) and not any(s is g for g in gemms)]
    if len(others) != 1 or not isinstance(others[0], S.Store) or others[0].buffer is not acc:
        return None
    if len(out) == 1:
        return out[0]
    return dataclasses.replace(head, then=out[0], orelse=out[1])


def _is_var(e, v) -> bool:
    return isinstance(e, E.Var) and e is v


def _names(e, v) -> bool:
    return any(x is v for x in rewrite.sub_exprs(E.as_expr(e)))


def _names_any(rg: Region, v) -> bool:
    return any(_names(x, v) for x in rg.starts)


def _whole(rg: Region) -> bool:
    return all(_const(x) == 0 for x in rg.starts) and \
        all(_const(e) == _const(d) for e, d in zip(rg.extents, rg.buffer.shape))


def _blocks(rg: Region, v, kw: int, n: int):
    """``rg`` (a tile whose last dim is K, extent kw, start affine in ``v`` with coefficient kw) widened to the n
    blocks: the start at v = 0, the extent n * kw; None if it does not have that form."""
    if _const(rg.extents[-1]) != kw or any(_names(x, v) for x in rg.starts[:-1]):
        return None
    lin = linear(E.as_expr(rg.starts[-1]))
    if lin is None:
        return None
    coef = [c for atom, c in lin[0].values() if atom is v]
    others = [atom for atom, c in lin[0].values() if atom is not v]
    if coef != [kw] or any(_names(a, v) for a in others):
        return None
    zero = rewrite.expr(E.as_expr(rg.starts[-1]), lambda x: E.as_expr(0) if x is v else None)
    return Region(rg.buffer, tuple(rg.starts[:-1]) + (zero,), tuple(rg.extents[:-1]) + (E.as_expr(n * kw),),
                  rg.keep)


def _update(nest):
    """(acc, blk, P, Q, (i, j), (P's indices, Q's indices)) of ``for i, j in T.Parallel(bm, bn): acc[i, j] =
    acc[i, j] + blk[i, j] * (P[i, ..] * Q[.., j])`` (factors in either order), else None."""
    outer = nest
    if not (isinstance(outer, S.For) and outer.kind == "parallel" and _const(outer.start) == 0):
        return None
    inner = outer.body.body[0] if isinstance(outer.body, S.Seq) and len(outer.body.body) == 1 else outer.body
    if not (isinstance(inner, S.For) and inner.kind == "parallel" and _const(inner.start) == 0):
        return None
    st = inner.body.body[0] if isinstance(inner.body, S.Seq) and len(inner.body.body) == 1 else inner.body
    vi, vj = outer.var, inner.var
    if not isinstance(st, S.Store) or len(st.indices) != 2 or not _is_var(st.indices[0], vi) or \
            not _is_var(st.indices[1], vj):
        return None
    acc = st.buffer
    v = st.value
    if not (isinstance(v, E.BinOp) and v.op == "+"):
        return None
    for old, prod in ((v.a, v.b), (v.b, v.a)):
        if _load_at(old, acc, vi, vj) and isinstance(prod, E.BinOp) and prod.op == "*":
            for bl, sc in ((prod.a, prod.b), (prod.b, prod.a)):
                if isinstance(bl, E.Load) and _load_at(bl, bl.buffer, vi, vj) and bl.buffer is not acc and \
                        isinstance(sc, E.BinOp) and sc.op == "*":
                    for x, y in ((sc.a, sc.b), (sc.b, sc.a)):
                        if isinstance(x, E.Load) and isinstance(y, E.Load) and len(x.indices) == 2 and \
                                len(y.indices) == 2 and _is_var(x.indices[0], vi) and _is_var(y.indices[1], vj):
                            if _const(outer.extent) != _const(bl.buffer.shape[0]) or \
                                    _const(inner.extent) != _const(bl.buffer.shape[1]):
                                return None
                            return acc, bl.buffer, x.buffer, y.buffer, (vi, vj), (x.indices, y.indices)
    return None


def _load_at(e, buf, vi, vj) -> bool:
    return isinstance(e, E.Load) and e.buffer is buf and len(e.indices) == 2 and _is_var(e.indices[0], vi) and \
        _is_var(e.indices[1], vj)


def _touches(s, buf) -> bool:
    """Whether statement ``s`` itself (not its sub-statements) reads or writes ``buf``."""
    for f in ("src", "dst", "value", "a", "b", "c"):
        rg = getattr(s, f, None)
        if isinstance(rg, Region) and rg.buffer is buf:
            return True
    if isinstance(s, (S.Store, S.AtomicElem)) and s.buffer is buf:
        return True
    exprs = rewrite.exprs_of(s)
    for f in ("src", "dst", "value", "a", "b", "c"):
        rg = getattr(s, f, None)
        if isinstance(rg, Region):
            exprs += [x for x in rg.starts if isinstance(x, E.Expr)]
        elif isinstance(rg, E.Expr):
            exprs.append(rg)
    return any(isinstance(x, E.Load) and x.buffer is buf for e in exprs for x in rewrite.sub_exprs(E.as_expr(e)))

