"""A stable text form of the IR. It is what the cache key hashes and what TEGULA_DUMP writes as name.ir."""
from __future__ import annotations

import threading

from tegula.ir import expr as E
from tegula.ir import stmt as S

_local = threading.local()


class Namer:
    """Unique, stable names for Vars and Buffers (a user may reuse ``i`` in two loops)."""

    def __init__(self):
        self.names: dict[int, str] = {}
        self.used: set[str] = set()

    def __call__(self, obj) -> str:
        key = id(obj)
        if key not in self.names:
            base = "".join(c if c.isalnum() or c == "_" else "_" for c in obj.name) or "v"
            name, n = base, 0
            while name in self.used:
                n += 1
                name = f"{base}_{n}"
            self.used.add(name)
            self.names[key] = name
        return self.names[key]

    def reserve(self, *names: str) -> None:
        self.used.update(names)


def _namer() -> Namer:
    n = getattr(_local, "namer", None)
    return n if n is not None else Namer()


_BIN = {"and": "&&", "or": "||"}


def expr_str(e, nm: Namer | None = None) -> str:
    nm = nm or _namer()
    r = lambda x: expr_str(x, nm)  # noqa: E731
    if isinstance(e, E.Const):
        v = e.value
        return f"{v!r}:{e.dtype}" if e.dtype.name not in ("int32", "bool", "float32") else repr(v) + (
            "f" if e.dtype.is_float else "")
    if isinstance(e, E.Var):
        return nm(e)
    if isinstance(e, E.BinOp):
        if e.op in ("min", "max"):
            return f"{e.op}({r(e.a)}, {r(e.b)})"
        return f"({r(e.a)} {_BIN.get(e.op, e.op)} {r(e.b)})"
    if isinstance(e, E.UnOp):
        return {"neg": "-", "not": "!", "~": "~"}[e.op] + r(e.a)
    if isinstance(e, E.Call):
        return f"{e.name}({', '.join(r(a) for a in e.args)})"
    if isinstance(e, E.Cast):
        return f"{e.dtype}({r(e.value)})"
    if isinstance(e, E.Select):
        return f"select({r(e.cond)}, {r(e.a)}, {r(e.b)})"
    if isinstance(e, E.Load):
        return f"{nm(e.buffer)}[{', '.join(r(i) for i in e.indices)}]"
    if isinstance(e, (int, float, bool)):
        return repr(e)
    if hasattr(e, "ir_text"):
        return e.ir_text()
    return f"<{type(e).__name__}>"


def region_str(rg, nm: Namer | None = None) -> str:
    nm = nm or _namer()
    parts = []
    for s, x, k in zip(rg.starts, rg.extents, rg.keep):
        s = expr_str(E.as_expr(s), nm)
        parts.append(f"{s}+:{expr_str(E.as_expr(x), nm)}" if k else s)
    return f"{nm(rg.buffer)}[{', '.join(parts)}]"


def _shape(shape, nm) -> str:
    return "(" + ", ".join(expr_str(E.as_expr(d), nm) for d in shape) + ")"


def stmt_lines(s, nm: Namer, ind: int = 0) -> list[str]:
    p = "  " * ind
    ex = lambda x: expr_str(x, nm)  # noqa: E731
    rg = lambda x: region_str(x, nm)  # noqa: E731
    if isinstance(s, S.Seq):
        return [line for c in s.body for line in stmt_lines(c, nm, ind)]
    if isinstance(s, S.For):
        ann = "".join(f", {k}={v!r}" for k, v in sorted(s.annotations.items()))
        step = f", step={s.step}" if s.step != 1 else ""
        head = f"{p}for {nm(s.var)} in {s.kind}({ex(s.start)}, +{ex(s.extent)}{step}{ann}):"
        return [head] + stmt_lines(s.body, nm, ind + 1)
    if isinstance(s, S.While):
        return [f"{p}while {ex(s.cond)}:"] + stmt_lines(s.body, nm, ind + 1)
    if isinstance(s, S.If):
        out = [f"{p}if {ex(s.cond)}:"] + stmt_lines(s.then, nm, ind + 1)
        if s.orelse is not None:
            out += [f"{p}else:"] + stmt_lines(s.orelse, nm, ind + 1)
        return out
    if isinstance(s, S.Store):
        return [f"{p}{nm(s.buffer)}[{', '.join(ex(i) for i in s.indices)}] = {ex(s.value)}"]
    if isinstance(s, S.Assign):
        return [f"{p}{'let ' if s.declare else ''}{nm(s.var)}: {s.var.dtype} = {ex(s.value)}"]
    if isinstance(s, S.Alloc):
        b = s.buffer
        if b.alias is not None:
            return [f"{p}{nm(b)} = reshape({nm(b.alias)}, {_shape(b.shape, nm)})"]
        return [f"{p}{nm(b)} = alloc_{b.scope}({_shape(b.shape, nm)}, {b.dtype})"]
    if isinstance(s, S.Kernel):
        grid = ", ".join(ex(E.as_expr(g)) for g in s.grid)
        bv = ", ".join(nm(v) for v in s.block_vars)
        return [f"{p}with kernel(grid=({grid}), threads={s.threads}) as ({bv}):"] + stmt_lines(s.body, nm, ind + 1)
    if isinstance(s, S.Copy):
        hint = f", eviction_policy={s.eviction_policy!r}" if s.eviction_policy else ""
        return [f"{p}copy({rg(s.src)}, {rg(s.dst)}{hint})"]
    if isinstance(s, S.Fill):
        return [f"{p}fill({rg(s.dst)}, {ex(s.value)})"]
    if isinstance(s, (S.Gemm, S.ExternGemm)):
        name = "gemm" if isinstance(s, S.Gemm) else "extern_gemm"
        scaled = f", sa={rg(s.sa)}, sb={rg(s.sb)}, kblock={s.kblock}" if getattr(s, "kblock", 0) else ""
        scaled += f", b_rows={rg(s.b_rows)}" if getattr(s, "b_rows", None) is not None else ""
        return [f"{p}{name}({rg(s.a)}, {rg(s.b)}, {rg(s.c)}, trans_a={s.trans_a}, trans_b={s.trans_b}, "
                f"clear={s.clear}{scaled})"]
    if isinstance(s, S.Reduce):
        return [f"{p}reduce_{s.kind}({rg(s.src)}, {rg(s.dst)}, dim={s.dim}, clear={s.clear})"]
    if isinstance(s, S.Atomic):
        v = rg(s.value) if hasattr(s.value, "buffer") and hasattr(s.value, "keep") else ex(s.value)
        return [f"{p}atomic_{s.kind}({rg(s.dst)}, {v})"]
    if isinstance(s, S.AtomicElem):
        return [f"{p}atomic_{s.kind}({nm(s.buffer)}[{', '.join(ex(i) for i in s.indices)}], {ex(s.value)})"]
    if hasattr(s, "ir_text"):  # target-family nodes (ir/simt.py) print themselves
        return [f"{p}{s.ir_text()}"]
    return [f"{p}<{type(s).__name__}>"]


def func_str(f: S.PrimFunc) -> str:
    nm = Namer()
    _local.namer = nm
    try:
        params = []
        for prm in f.params:
            if isinstance(prm, E.Var):
                params.append(f"{nm(prm)}: {prm.dtype}")
            else:
                strides = f", strides={_shape(prm.strides, nm)}" if prm.strides is not None else ""
                params.append(f"{nm(prm)}: Tensor[{_shape(prm.shape, nm)}, {prm.dtype}{strides}]")
        lines = [f"def {f.name}({', '.join(params)}):"] + stmt_lines(f.body, nm, 1)
        return "\n".join(lines) + "\n"
    finally:
        _local.namer = None
