"""Tile ops: each file gives one op's lowering for a target family, registered with ``@lowers``.

The meaning of every op is its interp helper (runtime/interp.py); the CPU family lowers ops to loop nests of
scalar loads and stores (which the C emitter vectorises) or to calls of prelude routines (T.gemm).
"""
from __future__ import annotations

LOWERINGS: dict[tuple[type, str], object] = {}


def lowers(op_type: type, family: str):
    """Register ``fn(stmt) -> Stmt`` as the lowering of ``op_type`` for ``family`` (``cpu``, ``simt``)."""
    def deco(fn):
        LOWERINGS[(op_type, family)] = fn
        return fn
    return deco


def lowering(op_type: type, family: str):
    _load()
    return LOWERINGS.get((op_type, family))


def _load():
    from tegula.tileops import atomic, copy, fill, gemm, reduce, simt  # noqa: F401
