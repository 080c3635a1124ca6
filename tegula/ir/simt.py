"""IR nodes of the SIMT lowering (targets whose blocks are groups of threads: ``opencl``, ``cuda``).

After ``distribute_threads`` a kernel is a ``SimtKernel``: its body runs on every thread of the block, ``tid`` is
the thread's index in the block, and what one thread does is spelled out with ordinary statements. The nodes
here are what that needs beyond the common IR: the thread index, a block barrier, a region of thread-distributed
work (one unit for barrier placement), and an all-reduce over lanes of a warp (targets with warp shuffles).
"""
from __future__ import annotations

from dataclasses import dataclass

from tegula.ir import dtypes as dt
from tegula.ir import expr as E
from tegula.ir import stmt as S


class ThreadIdx(E.Expr):
    """The index of the executing thread in its block (0 .. threads-1), an int32."""
    __slots__ = ()

    def __init__(self):
        self.dtype = dt.int32

    def ir_text(self) -> str:
        return "thread_idx()"


@dataclass(eq=False)
class SimtKernel(S.Kernel):
    """A ``Kernel`` after thread distribution: ``nthreads`` threads per block, ``tid`` the (declared) thread index."""
    tid: E.Var | None = None
    nthreads: int = 1


@dataclass(eq=False)
class Barrier(S.Stmt):
    """Every thread of the block waits here; shared and global writes before it are visible after it."""
    loc: tuple | None = None

    def ir_text(self) -> str:
        return "barrier()"


class ThreadNest(S.Seq):
    """Statements that together run one T.Parallel nest (or tile op) over the block's threads. Its threads touch
    different elements, so barrier placement treats the whole nest as one step."""


@dataclass(eq=False)
class WarpAllReduce(S.Stmt):
    """``var = op(var over the lanes l = base + k*stride, k < count)``, every such lane getting the result, for
    lanes inside one warp. kind: sum | max | min (abs variants are applied before)."""
    kind: str
    var: E.Var
    stride: int
    count: int
    loc: tuple | None = None

    def ir_text(self) -> str:
        v = self.var.name
        return f"{v} = warp_allreduce_{self.kind}({v}, stride={self.stride}, count={self.count})"


@dataclass(eq=False)
class MmaSync(S.Stmt):
    """``C += A @ B`` with warp MMA (PTX mma.sync m16n8k16, fp16/bf16 in, fp32 accumulate) on a C in registers
    laid out by infer_layouts.mma_layout: warp w computes rows ``w*8 + g + 8*warps*a`` (g = lane / 4) and every
    column. Operand elements are read one by one from their buffers: ``a_lo``/``a_hi`` are A's elements at
    (row ``r``, column ``k``) and (``r``, ``k + 1``), ``b_lo``/``b_hi`` B's at (``k``, ``n``) and (``k + 1``, ``n``),
    over the variables ``r``, ``k``, ``n`` the emitter binds."""
    c: object          # the per-thread accumulator array
    m: int
    n: int
    k: int
    dtype: str         # operand dtype: float16 | bfloat16
    tid: E.Var
    r: E.Var
    kv: E.Var
    nv: E.Var
    a_lo: E.Expr
    a_hi: E.Expr
    b_lo: E.Expr
    b_hi: E.Expr
    loc: tuple | None = None

    def exprs(self) -> list:
        return [self.a_lo, self.a_hi, self.b_lo, self.b_hi]

    def ir_text(self) -> str:
        return f"mma_sync_m16n8k16({self.c.name}, m={self.m}, n={self.n}, k={self.k}, {self.dtype})"
