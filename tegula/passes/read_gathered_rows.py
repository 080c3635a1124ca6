"""read_gathered_rows: on the CPU, a T.gemm reads the rows of a gathered tile where they lie, not a copy of them.

A kernel that attends to scattered keys (sparse attention, a paged cache) gathers them first, a T.copy of one row
per key into an on-chip tile, and then multiplies by that tile. The prelude GEMM packs B into panels anyway, so the
copy is a pass over the rows that only moves them: here each row's copy instead records the row's address in a
table (``RowAddress``, ir/cpu.py), and the gemms that read the tile as B pack its rows from those addresses
(``ExternGemm.b_rows``: tg_gemm_<dt>_rows). Measured (1 thread, process CPU time, with and without the pass
alternated): sparse MLA prefill (s_q 128, h 64, top-k 2048, bf16) -2.4%, sparse decode (b 32, h 64) -2.0%.

The pass applies to a copy ``T.copy(G[...], K[i, 0:W])`` when it can prove that this changes nothing:
- K is a 2-D on-chip bf16 buffer of R x W (no T.reshape view of it), the copy fills its whole row i, where i is the
  variable of a serial loop over 0..R that holds the copy; the source is a contiguous run of W elements of a global
  tensor of K's dtype that the kernel never writes;
- K is written by nothing else than that copy and stores to its row i in the else branch of an ``if`` that holds
  the copy (the zeros of an invalid row), and read only as the B operand of T.gemms that follow the loop in the
  same statement list (or nested in a later statement of it) and that the prelude computes on packed panels (the
  dot-product path reads B in place already: tileops.gemm.reads_b_in_place) for fewer than ROWS_MAX rows of C
  (dense MLA decode's 128-row gemms measured 1.4% slower reading the rows in place).
Each iteration of the loop first records the row of K (``&K[i, 0]``), then, at the copy, the source row instead
when it lies inside its tensor (the copy is skipped); otherwise the copy runs (zeros outside the tensor) and the
row of K stays recorded, as it does for the rows the else branch zeroes. Runs after elide_staging and before
fuse_gemm_scale and lower_tile_ops.

Invariant established: an ExternGemm with ``b_rows`` reads its B rows at the addresses in ``b_rows``; every element
of that table was written (RowAddress) before the gemm, each pointing at a row that holds what the copy gave K.
"""
from __future__ import annotations

import dataclasses

from tegula.ir import dtypes as dt
from tegula.ir import expr as E
from tegula.ir import stmt as S
from tegula.ir.buffer import Buffer, Region
from tegula.ir.cpu import RowAddress
from tegula.passes import rewrite
from tegula.passes.elide_staging import _gemm_readers, _written
from tegula.tileops.common import tile_in_bounds
from tegula.tileops.gemm import check_gemm_dtypes, reads_b_in_place, tile2

ROWS_MAX = 128  # gemms of this many rows of C or more keep the copy (dense MLA decode, 128 rows: +1.4% in place)


def run(func: S.PrimFunc, target) -> S.PrimFunc:
    stmts = list(S.walk(func.body))
    writes: dict[int, list] = {}
    for s in stmts:
        for buf in _written(s):
            writes.setdefault(id(buf), []).append(s)
    aliased = {id(b) for s in stmts if isinstance(s, S.Alloc) and s.buffer.alias is not None
               for b in (s.buffer, s.buffer.alias)}
    plans = {}  # id(copy) -> (loop, table)
    for loop in stmts:
        if not isinstance(loop, S.For) or loop.kind != "serial" or E.const_value(E.as_expr(loop.start)) != 0:
            continue
        for c in S.walk(loop.body):
            if isinstance(c, S.Copy) and _eligible(c, loop, stmts, writes, aliased):
                k = c.dst.buffer
                plans[id(c)] = (loop, Buffer(f"{k.name}_rows", (int(E.const_value(k.shape[0])),), dt.int64,
                                             "fragment", loc=k.loc))
    if not plans:
        return func
    tables = {id(c.dst.buffer): (c, loop, table) for c in stmts if id(c) in plans
              for loop, table in [plans[id(c)]]}
    loops = {id(loop.var): (c, table) for c, loop, table in tables.values()}

    def fs(s):
        if isinstance(s, S.Copy) and id(s) in plans:  # the row where it lies when inside its tensor, else the copy
            table = plans[id(s)][1]
            here = RowAddress(table, s.dst.starts[0], s.src.buffer, tuple(E.as_expr(x) for x in s.src.starts),
                              loc=s.loc)
            inside = tile_in_bounds(s.src)
            return here if inside is None else S.If(inside, here, s, loc=s.loc)
        if isinstance(s, S.For) and id(s.var) in loops:  # first the row of the tile
            c, table = loops[id(s.var)]
            first = RowAddress(table, s.var, c.dst.buffer, (s.var, E.Const(0, dt.int32)), loc=s.loc)
            return dataclasses.replace(s, body=S.Seq([first, s.body], loc=s.loc))
        if isinstance(s, S.Gemm) and id(s.b.buffer) in tables:
            table = tables[id(s.b.buffer)][2]
            check_gemm_dtypes(s)
            rows = Region(table, (s.b.starts[0],), (s.b.extents[0],), (True,))
            return S.ExternGemm(s.a, s.b, s.c, s.trans_a, s.trans_b, s.clear, loc=s.loc, b_rows=rows)
        if isinstance(s, S.Seq) and any(isinstance(x, S.Alloc) and id(x.buffer) in tables for x in s.body):
            out = []
            for x in s.body:
                out.append(x)
                if isinstance(x, S.Alloc) and id(x.buffer) in tables:
                    out.append(S.Alloc(tables[id(x.buffer)][2], loc=x.loc))
            return type(s)(out, loc=s.loc)
        return None

    return dataclasses.replace(func, body=rewrite.stmt(func.body, fs=fs))


def _eligible(c: S.Copy, loop: S.For, stmts, writes, aliased) -> bool:
    src, dst = c.src, c.dst
    g, k = src.buffer, dst.buffer
    if not g.is_global or k.is_global or k.ndim != 2 or g.dtype != k.dtype or k.dtype != dt.bfloat16 or \
            c.eviction_policy is not None or id(k) in aliased or k.alias is not None:
        return False
    rows, width = (E.const_value(E.as_expr(n)) for n in k.shape)
    if rows is None or width is None or E.const_value(E.as_expr(loop.extent)) != rows:
        return False
    if dst.starts[0] is not loop.var or E.const_value(E.as_expr(dst.starts[1])) != 0 or \
            [E.const_value(E.as_expr(e)) for e in dst.extents] != [1, width]:
        return False
    if g.strides is not None and E.const_value(E.as_expr(g.strides[-1])) != 1:
        return False
    ext = [E.const_value(E.as_expr(e)) for e in src.extents]
    if ext[-1] != width or any(e != 1 for e in ext[:-1]) or id(g) in writes:
        return False
    # K's other writes: stores to its row i in the else branch of an if that holds the copy
    zeroing = {id(x) for s in S.walk(loop.body) if isinstance(s, S.If) and s.orelse is not None
               and any(x is c for x in S.walk(s.then)) for x in S.walk(s.orelse)}
    for w in writes.get(id(k), []):
        if w is c:
            continue
        if not (isinstance(w, S.Store) and id(w) in zeroing and w.indices[0] is loop.var):
            return False
    readers = _gemm_readers(stmts, k)
    if not readers or any(r.b.buffer is not k or r.a.buffer is k or reads_b_in_place(r) or
                          tile2(r.c)[0] >= ROWS_MAX for r in readers):
        return False
    # every reader follows the loop in the statement list that holds it
    for s in stmts:
        if isinstance(s, S.Seq) and any(x is loop for x in s.body):
            later = {id(x) for y in s.body[[i for i, x in enumerate(s.body) if x is loop][0] + 1:] for x in S.walk(y)}
            return all(id(r) in later for r in readers)
    return False
