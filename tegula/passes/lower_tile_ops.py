"""lower_tile_ops: replace every tile op by its lowering for the target's family (tileops/ registry).

Invariant established: no Copy / Fill / Reduce / Atomic / Gemm remains; what is left is loops, stores,
element atomics and extern GEMM calls.
"""
from __future__ import annotations

import dataclasses

from tegula.errors import CompileError
from tegula.ir import stmt as S
from tegula.tileops import lowering


def _rewrite(s: S.Stmt, family: str) -> S.Stmt:
    if isinstance(s, S.TILE_OPS):
        fn = lowering(type(s), family)
        if fn is None:
            raise CompileError(f"{type(s).__name__} has no lowering for the {family} target family", s.loc)
        return _rewrite(fn(s), family)
    if isinstance(s, S.Seq):
        return S.Seq([_rewrite(c, family) for c in s.body], loc=s.loc)
    if isinstance(s, (S.For, S.While, S.Kernel)):
        return dataclasses.replace(s, body=_rewrite(s.body, family))
    if isinstance(s, S.If):
        return dataclasses.replace(s, then=_rewrite(s.then, family),
                                   orelse=None if s.orelse is None else _rewrite(s.orelse, family))
    return s


def run(func: S.PrimFunc, target) -> S.PrimFunc:
    return dataclasses.replace(func, body=_rewrite(func.body, target.family))
