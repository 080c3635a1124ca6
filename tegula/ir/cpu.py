"""IR nodes of the CPU lowering (the ``c`` target's family).

``Prefetch`` asks the memory system to bring the cache line holding ``buffer[indices]`` towards the core (into L2)
before it is read: what ``prefetch_pipelined`` makes of a T.Pipelined loop's copies. It never changes what a
program computes, and an address outside the tensor is harmless (x86 and Arm prefetches do not fault).
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
