"""Statements of the tile IR. Every statement keeps the user's ``loc`` = (file, line)."""
from __future__ import annotations

from dataclasses import dataclass, field

from tegula.ir.buffer import Buffer, Region
from tegula.ir.expr import Expr, Var


class Stmt:
    loc: tuple | None = None


@dataclass(eq=False)
class Seq(Stmt):
    body: list
    loc: tuple | None = None


@dataclass(eq=False)
class For(Stmt):
    """``var`` runs over ``start + k*step`` for k in range(extent).

    kind: ``serial`` | ``unroll`` | ``parallel`` (independent iterations: T.Parallel) |
    ``pipelined`` (serial; copies may overlap compute); annotations hold hints (num_stages...).
    """
    var: Var
    start: Expr
    extent: Expr
    kind: str
    body: Stmt
    step: int = 1
    annotations: dict = field(default_factory=dict)
    loc: tuple | None = None


@dataclass(eq=False)
class While(Stmt):
    cond: Expr
    body: Stmt
    loc: tuple | None = None


@dataclass(eq=False)
class If(Stmt):
    cond: Expr
    then: Stmt
    orelse: Stmt | None = None
    loc: tuple | None = None


@dataclass(eq=False)
class Store(Stmt):
    buffer: Buffer
    indices: tuple
    value: Expr
    loc: tuple | None = None


@dataclass(eq=False)
class Assign(Stmt):
    """A local scalar variable: ``declare`` introduces it (``T x = v``), otherwise it is updated."""
    var: Var
    value: Expr
    declare: bool
    loc: tuple | None = None


@dataclass(eq=False)
class Alloc(Stmt):
    """Declares an on-chip buffer (shared / fragment / local / local.var) of the enclosing kernel."""
    buffer: Buffer
    loc: tuple | None = None


@dataclass(eq=False)
class Kernel(Stmt):
    """A grid of blocks; ``block_vars`` are (bx, by, bz); ``threads`` is the block's thread hint."""
    grid: tuple
    threads: tuple
    block_vars: tuple
    body: Stmt
    loc: tuple | None = None


# tile ops -------------------------------------------------------------------------------------

@dataclass(eq=False)
class Copy(Stmt):
    """dst <- src elementwise over the tile, converting dtype; global accesses outside the tensor are
    masked (reads give 0, writes are dropped). ``eviction_policy``: TileLang's cache hint (None, "evict_normal",
    "evict_first", "evict_last"); it never changes the result."""
    src: Region
    dst: Region
    loc: tuple | None = None
    eviction_policy: str | None = None


@dataclass(eq=False)
class Fill(Stmt):
    dst: Region
    value: Expr
    loc: tuple | None = None


@dataclass(eq=False)
class Gemm(Stmt):
    """C (+)= op(A) @ op(B) accumulated in C's dtype; ``clear`` zeroes C first."""
    a: Region
    b: Region
    c: Region
    trans_a: bool
    trans_b: bool
    clear: bool
    hints: dict = field(default_factory=dict)
    loc: tuple | None = None


@dataclass(eq=False)
class Reduce(Stmt):
    """dst = reduce_kind(src, axis=dim); with ``clear=False`` combined with dst's current value.
    kind: sum | max | min | abssum | absmax."""
    kind: str
    src: Region
    dst: Region
    dim: int
    clear: bool
    loc: tuple | None = None


@dataclass(eq=False)
class Atomic(Stmt):
    """dst (op)= value atomically; dst is a region (an element region for scalar updates); value is an
    expression (broadcast) or a region of the same shape. kind: add | max | min."""
    kind: str
    dst: Region
    value: object
    loc: tuple | None = None


@dataclass(eq=False)
class AtomicElem(Stmt):
    """One atomic read-modify-write of buffer[indices] (what ``Atomic`` lowers to)."""
    kind: str
    buffer: Buffer
    indices: tuple
    value: Expr
    loc: tuple | None = None


@dataclass(eq=False)
class ExternGemm(Stmt):
    """A tile GEMM lowered to a call of the target's prelude routine; operands are regions. With ``kblock`` > 0
    (passes/fuse_gemm_scale, c target) it is block-scaled: C += sum over the blocks t of kblock elements of K of
    sa[i, t] * sb[t, j] * (A[i, block t] . B[j, block t]); sa (rows of C x blocks) and sb (blocks x columns of C)
    are fp32 regions. With ``b_rows`` (passes/read_gathered_rows, c target), B's stored row r is not in ``b``'s buffer
    but at the address held by element r of ``b_rows`` (an int64 region), from ``b``'s first column on."""
    a: Region
    b: Region
    c: Region
    trans_a: bool
    trans_b: bool
    clear: bool
    loc: tuple | None = None
    sa: Region | None = None
    sb: Region | None = None
    kblock: int = 0
    b_rows: Region | None = None


TILE_OPS = (Copy, Fill, Gemm, Reduce, Atomic)


@dataclass(eq=False)
class PrimFunc:
    """A kernel function: ``params`` are global Buffers and scalar Vars, in the user's order."""
    name: str
    params: list
    body: Stmt
    loc: tuple | None = None
    attrs: dict = field(default_factory=dict)

    @property
    def buffers(self) -> list:
        return [p for p in self.params if isinstance(p, Buffer)]

    def script(self) -> str:
        from tegula.ir.printer import func_str
        return func_str(self)


def children(s: Stmt) -> list:
    """Direct sub-statements of ``s``."""
    if isinstance(s, Seq):
        return list(s.body)
    if isinstance(s, (For, While, Kernel)):
        return [s.body]
    if isinstance(s, If):
        return [s.then] + ([s.orelse] if s.orelse is not None else [])
    return []


def walk(s: Stmt):
    """All statements of ``s`` in pre-order."""
    yield s
    for c in children(s):
        yield from walk(c)
