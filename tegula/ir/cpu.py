"""IR nodes of the CPU lowering (the ``c`` target's family).

``StreamCopy`` copies ``count`` elements of one dtype (or float32 rounded to bfloat16) from ``src[src_indices]`` on
to ``dst[dst_indices]`` on, both contiguous runs, with streaming stores into the global ``dst``: what
T.copy(..., eviction_policy="evict_first") of such a run becomes. The result is the copy's; only the caching
differs.

``Prefetch`` asks the memory system to bring the cache line holding ``buffer[indices]`` towards the core (into L2)
before it is read: what ``prefetch_pipelined`` makes of a T.Pipelined loop's copies. It never changes what a
program computes, and an address outside the tensor is harmless (x86 and Arm prefetches do not fault).

``RowAddress`` stores the address of ``buffer[indices]`` into ``table[index]`` (an int64 buffer): where
``read_gathered_rows`` records where each row of a gathered tile lies, for a gemm that reads the rows there.
"""
from __future__ import annotations

from dataclasses import dataclass

from tegula.ir import stmt as S
from tegula.ir.buffer import Buffer


@dataclass(eq=False)
class Prefetch(S.Stmt):
    buffer: Buffer
    indices: tuple
    loc: tuple | None = None

    def ir_text(self) -> str:
        from tegula.ir.printer import expr_str
        return f"prefetch({self.buffer.name}[{', '.join(expr_str(i) for i in self.indices)}])"


@dataclass(eq=False)
class StreamCopy(S.Stmt):
    dst: Buffer
    dst_indices: tuple
    src: Buffer
    src_indices: tuple
    count: int
    loc: tuple | None = None

    def exprs(self) -> list:
        return [i for i in self.dst_indices + self.src_indices if hasattr(i, "dtype")]

    def ir_text(self) -> str:
        from tegula.ir.printer import expr_str
        d = ", ".join(expr_str(i) for i in self.dst_indices)
        s = ", ".join(expr_str(i) for i in self.src_indices)
        return f"stream_copy({self.dst.name}[{d}], {self.src.name}[{s}], {self.count})"


@dataclass(eq=False)
class RowAddress(S.Stmt):
    table: Buffer
    index: object
    buffer: Buffer
    indices: tuple
    loc: tuple | None = None

    def exprs(self) -> list:
        return [self.index] + [i for i in self.indices if hasattr(i, "dtype")]

    def ir_text(self) -> str:
        from tegula.ir.printer import expr_str
        return (f"{self.table.name}[{expr_str(self.index)}] = address_of({self.buffer.name}"
                f"[{', '.join(expr_str(i) for i in self.indices)}])")
