"""check_program: the rules every target shares, so interp never accepts what a compiled target rejects.

Invariant established: every T.gemm has a supported dtype combination; every on-chip buffer lives inside a
T.Kernel; the block's on-chip memory fits the target's limit.
"""
from __future__ import annotations

from tegula.errors import CompileError
from tegula.ir import stmt as S
from tegula.tileops.gemm import check_gemm_dtypes


def run(func: S.PrimFunc, target) -> S.PrimFunc:
    for k in S.walk(func.body):
        if isinstance(k, S.Gemm):
            check_gemm_dtypes(k)
        if isinstance(k, S.Kernel):
            _check_kernel(k, target)
    _check_outside(func.body)
    return func


def _check_outside(s) -> None:
    """On-chip buffers and tile ops exist only inside a kernel."""
    if isinstance(s, S.Kernel):
        return
    if isinstance(s, S.Alloc) and s.buffer.is_global:
        return  # T.alloc_global: a workspace of the whole function
    if isinstance(s, (S.Alloc,) + S.TILE_OPS):
        raise CompileError("tile buffers and tile ops must be inside a `with T.Kernel(...)` block", s.loc)
    for c in S.children(s):
        _check_outside(c)


def _check_kernel(k: S.Kernel, target) -> None:
    total = 0
    for s in S.walk(k.body):
        if isinstance(s, S.Alloc) and s.buffer.alias is None:
            n = 1
            for d in s.buffer.shape:
                n *= int(d)
            total += n * s.buffer.dtype.itemsize
        if isinstance(s, S.Kernel):
            raise CompileError("T.Kernel blocks cannot be nested", s.loc)
    limit = getattr(target, "max_block_bytes", None)
    if limit is not None and total > limit:
        raise CompileError(f"the block's on-chip buffers take {total} bytes, more than the {target.name} target's "
                           f"limit of {limit}", k.loc)
