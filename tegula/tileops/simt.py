"""Tile ops on the SIMT family (``opencl``, ``cuda``): each becomes a T.Parallel nest over its tile, which
``infer_layouts`` and ``distribute_threads`` then spread over the block's threads.

Global accesses are guarded per element (a thread's element is either inside the tensor or not; there is no
whole-tile fast path to pick, unlike the CPU's SIMD loops). A tile of zero dimensions still gets a one-iteration
T.Parallel loop, so that every tile op reaches the thread distribution as a nest. T.reduce_* keeps the CPU
family's form, a nest over the output with an inner loop marked ``reduction`` (distribute_threads splits that
loop over threads and adds the cross-thread combine); T.gemm stays one statement (ExternGemm) until its C
fragment has a layout.
"""
from __future__ import annotations

from tegula.ir import dtypes as dt
from tegula.ir import expr as E
from tegula.ir import stmt as S
from tegula.tileops import lowers
from tegula.tileops.atomic import atomic_element
from tegula.tileops.common import fresh_var, in_bounds, parallel_nest, region_index, tile_shape
from tegula.tileops.reduce import lower_reduce


def nest(shape, make_body, loc) -> S.Stmt:
    """``parallel_nest``, with one unit loop for a zero-dimensional tile."""
    if shape:
        return parallel_nest(shape, make_body, loc)
    v = fresh_var("i0")
    return S.For(v, E.Const(0, dt.int32), E.Const(1, dt.int32), "parallel", make_body([]), loc=loc)


def _guard(cond, st, loc):
    return S.If(cond, st, loc=loc) if cond is not None else st


@lowers(S.Copy, "simt")
def lower_copy(s: S.Copy) -> S.Stmt:
    src, dst = s.src, s.dst

    def body(ivars):
        si, di = region_index(src, ivars), region_index(dst, ivars)
        val = E.cast(E.Load(src.buffer, si), dst.dtype)
        g = in_bounds(src, si)
        if g is not None:
            val = E.select(g, val, E.cast(E.as_expr(0), dst.dtype))
        return _guard(in_bounds(dst, di), S.Store(dst.buffer, di, val, loc=s.loc), s.loc)

    return nest(tile_shape(src), body, s.loc)


@lowers(S.Fill, "simt")
def lower_fill(s: S.Fill) -> S.Stmt:
    dst = s.dst

    def body(ivars):
        di = region_index(dst, ivars)
        return _guard(in_bounds(dst, di), S.Store(dst.buffer, di, E.cast(s.value, dst.dtype), loc=s.loc), s.loc)

    return nest(tile_shape(dst), body, s.loc)


@lowers(S.Atomic, "simt")
def lower_atomic(s: S.Atomic) -> S.Stmt:
    return nest(tile_shape(s.dst), lambda ivars: atomic_element(s, ivars), s.loc)


@lowers(S.Reduce, "simt")
def lower_reduce_simt(s: S.Reduce) -> S.Stmt:
    out = lower_reduce(s)
    if isinstance(out, S.For) and out.kind == "parallel":
        return out
    return nest((), lambda _: out, s.loc)


@lowers(S.Gemm, "simt")
def lower_gemm(s: S.Gemm) -> S.Stmt:
    return S.ExternGemm(s.a, s.b, s.c, s.trans_a, s.trans_b, s.clear, loc=s.loc)
