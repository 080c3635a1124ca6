"""T.reduce_* on the CPU family: for each output element, a serial reduction loop over ``dim`` into a local
accumulator (float32 for narrow floats), marked so the emitter vectorises it as an OpenMP simd reduction."""
from __future__ import annotations

import math

from tegula.errors import CompileError
from tegula.ir import dtypes as dt
from tegula.ir import expr as E
from tegula.ir import stmt as S
from tegula.tileops import lowers
from tegula.tileops.common import fresh_var, parallel_nest

_COMBINE = {"sum": "+", "abssum": "+", "max": "max", "absmax": "max", "min": "min"}


def _init(kind, t):
    if kind in ("sum", "abssum"):
        return E.Const(0, t)
    if t.is_float:
        return E.Const(-math.inf if kind in ("max", "absmax") else math.inf, t)
    return E.Const(dt.min_value(t) if kind in ("max", "absmax") else dt.max_value(t), t)


def _combine(kind, a, b):
    op = _COMBINE[kind]
    return E.binop(op, a, b)


@lowers(S.Reduce, "cpu")
def lower_reduce(s: S.Reduce) -> S.Stmt:
    src, dst = s.src, s.dst
    if any(E.const_value(e) is None for e in src.extents):
        raise CompileError("T.reduce: the source tile needs constant extents")
    kept = [d for d, k in enumerate(src.keep) if k]          # buffer dims of the tile's axes
    rdim = kept[s.dim]
    acc_t = dt.float32 if dst.dtype.is_narrow_float else dst.dtype
    n = int(E.const_value(src.extents[rdim]))
    out_shape = tuple(int(E.const_value(src.extents[d])) for d in kept if d != rdim)
    out_shape_sq = tuple(x for x in out_shape if x != 1)

    def body(ivars):
        acc = fresh_var("acc", acc_t)
        acc.is_local = True
        r = fresh_var("r")
        # map the squeezed output point back onto the source's dims
        it = iter(ivars)
        sidx = []
        for d, (st, ex) in enumerate(zip(src.starts, src.extents)):
            st = E.cast(E.as_expr(st), dt.int32)
            if d == rdim:
                sidx.append(E.binop("+", st, r))
            elif E.const_value(ex) == 1:
                sidx.append(st)
            else:
                sidx.append(E.binop("+", st, next(it)))
        it = iter(ivars)
        didx = []
        for st, ex in zip(dst.starts, dst.extents):
            st = E.cast(E.as_expr(st), dt.int32)
            didx.append(st if E.const_value(ex) == 1 else E.binop("+", st, next(it)))
        x = E.cast(E.Load(src.buffer, tuple(sidx)), acc_t)
        if s.kind in ("abssum", "absmax"):
            x = E.call("abs", x)
        if s.kind in ("absmax", "max", "min") and acc_t.is_float:
            # One compare-select on the accumulator instead of the NaN-ignoring max / min (tg_fmaxf: two selects
            # on the loop-carried value make the reduction latency-bound), with the same result, as acc starts at
            # -inf / +inf and never holds a NaN: tg_fmaxf(acc, x) == (x >= acc ? x : acc) for every x, NaN
            # included (2x faster); for absmax |x| > acc ? |x| : acc, one maxps (4x), as |x| is never -0.
            ax = fresh_var("ax", acc_t)
            ax.is_local = True
            cmp = {"absmax": ">", "max": ">=", "min": "<="}[s.kind]
            step = S.Seq([S.Assign(ax, x, True, loc=s.loc),
                          S.Assign(acc, E.select(E.compare(cmp, ax, acc), ax, acc), False, loc=s.loc)], loc=s.loc)
        else:
            step = S.Assign(acc, _combine(s.kind, acc, x), False, loc=s.loc)
        loop = S.For(r, E.Const(0, dt.int32), E.Const(n, dt.int32), "serial", step,
                     annotations={"reduction": (_COMBINE[s.kind], acc)}, loc=s.loc)
        result = acc
        if not s.clear:
            result = _combine(s.kind, E.cast(E.Load(dst.buffer, tuple(didx)), acc_t), acc)
        return S.Seq([S.Assign(acc, _init(s.kind, acc_t), True, loc=s.loc), loop,
                      S.Store(dst.buffer, tuple(didx), E.cast(result, dst.dtype), loc=s.loc)], loc=s.loc)

    return parallel_nest(out_shape_sq, body, s.loc)
