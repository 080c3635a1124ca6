"""The statement builder the frontend and the T.* functions append to while a kernel is parsed."""
from __future__ import annotations

import threading

from tegula.errors import CompileError
from tegula.ir import expr as E
from tegula.ir import stmt as S

_state = threading.local()


class Builder:
    def __init__(self):
        self.blocks: list[list] = [[]]
        self.loc: tuple | None = None
        self.in_kernel = 0
        self.counter = 0
        self.eager: EagerState | None = None
        self.symbol_ids: set[int] = set()  # T.dynamic / T.const symbols made while parsing: names alias them
        self.block_vars: tuple = ()         # the block indices of the T.Kernel being parsed

    def emit(self, stmt: S.Stmt) -> None:
        if stmt.loc is None:
            stmt.loc = self.loc
        self.blocks[-1].append(stmt)

    def push(self) -> None:
        self.blocks.append([])

    def pop(self) -> S.Stmt:
        body = self.blocks.pop()
        return body[0] if len(body) == 1 else S.Seq(body, loc=self.loc)

    def fresh(self, base: str) -> str:
        self.counter += 1
        return f"{base}{self.counter}"


class EagerState:
    """What the body of an eager @tegula.jit function declares. Phase 1 reads its declarations only: T.const gives
    symbols, to be matched against the arguments' shapes; phase 2 parses it all with the constants' values."""

    def __init__(self, phase: int, values: dict | None = None):
        self.phase, self.values = phase, dict(values or {})
        self.symbols: dict = {}   # T.const name -> Var (phase 1)
        self.params: dict = {}    # parameter name -> Buffer (tensor) or Var (scalar), from annotations
        self.outputs: list = []   # T.empty buffers, in order


def current() -> Builder:
    b = getattr(_state, "builder", None)
    if b is None:
        raise CompileError("T.* operations can only be used inside a @T.prim_func kernel body")
    return b


def kernel_builder() -> Builder:
    b = current()
    if not b.in_kernel:
        raise CompileError("this operation must be inside a `with T.Kernel(...)` block")
    return b


def activate(b: Builder | None) -> Builder | None:
    prev = getattr(_state, "builder", None)
    _state.builder = b
    return prev


def emit_store(buffer, idx, value) -> None:
    idx = idx if isinstance(idx, tuple) else (idx,)
    load = buffer[idx]
    if not isinstance(load, E.Load):
        raise CompileError(f"assignment to a slice of {buffer.name} is not supported; use T.fill or T.copy, "
                           "or a T.Parallel loop")
    current().emit(S.Store(buffer, load.indices, E.cast(E.as_expr(value, like=buffer.dtype), buffer.dtype)))


def _install_store_hook():
    from tegula.ir.buffer import Buffer
    Buffer.store_hook = staticmethod(emit_store)


_install_store_hook()
