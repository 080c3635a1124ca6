"""The shared C-like emitter: expressions, statements and buffers for C, OpenCL C and CUDA C++.

Subclasses set spellings (type names, the kernel's signature, how the grid and on-chip buffers are laid out).
Narrow floats (bf16, fp16, fp8) live in memory as raw bits and in registers as float: a load widens, a store
narrows, and every arithmetic result is rounded back to the format (``tg_round_*``), the same per-op rounding
as the interp reference.
"""
from __future__ import annotations

import math

from tegula.errors import CompileError
from tegula.ir import dtypes as dt
from tegula.ir import expr as E
from tegula.ir import stmt as S
from tegula.ir.printer import Namer
from tegula.passes.rewrite import sub_exprs
from tegula.tileops.gemm import tile2

STORAGE = {"bool": "bool", "int8": "int8_t", "int16": "int16_t", "int32": "int32_t", "int64": "int64_t",
           "uint8": "uint8_t", "uint16": "uint16_t", "uint32": "uint32_t", "uint64": "uint64_t",
           "float32": "float", "float64": "double", "float16": "tg_f16", "bfloat16": "tg_bf16",
           "float8_e4m3fn": "tg_f8e4m3", "float8_e5m2": "tg_f8e5m2", "float8_e8m0fnu": "tg_f8e8m0"}
SUFFIX = {"float16": "f16", "bfloat16": "bf16", "float8_e4m3fn": "f8e4m3", "float8_e5m2": "f8e5m2",
          "float8_e8m0fnu": "f8e8m0"}
_MATH = {"exp": "exp", "exp2": "exp2", "log": "log", "log2": "log2", "log10": "log10", "sqrt": "sqrt",
         "tanh": "tanh", "erf": "erf", "pow": "pow", "floor": "floor", "ceil": "ceil", "abs": "fabs", "sin": "sin",
         "cos": "cos", "trunc": "trunc", "round": "round", "fmod": "fmod", "fma": "fma"}
_FAST_F32 = {"exp", "exp2", "log", "log2", "tanh"}  # vectorisable prelude versions (tegula_rt.h), <= 2 ulp
_CMP = {"<", "<=", ">", ">=", "==", "!="}
KEYWORDS = {"int", "float", "double", "char", "short", "long", "if", "else", "for", "while", "do", "return", "void",
            "const", "static", "inline", "restrict", "bool", "true", "false", "auto", "break", "case", "continue",
            "default", "enum", "extern", "goto", "register", "signed", "sizeof", "struct", "switch", "typedef",
            "union", "unsigned", "volatile", "main", "half", "kernel", "global", "local", "private", "new", "delete",
            "this", "class", "template", "namespace", "using", "operator", "friend", "public", "virtual"}


def reg_type(d: dt.DType) -> str:
    """The C type a value of ``d`` has in registers."""
    return "float" if d.is_narrow_float else STORAGE[d.name]


def c_float(v: float, d: dt.DType) -> str:
    f = "" if d == dt.float64 else "f"
    if math.isnan(v):
        return "NAN" if f else "((double)NAN)"
    if math.isinf(v):
        return ("INFINITY" if v > 0 else "(-INFINITY)") if f else ("((double)INFINITY)" if v > 0 else
                                                                  "(-(double)INFINITY)")
    return f"{float(v).hex()}{f}" if v >= 0 else f"(-{float(-v).hex()}{f})"


class CFamilyEmitter:
    restrict = "__restrict__"

    def __init__(self, func: S.PrimFunc):
        self.func = func
        self.nm = Namer()
        self.nm.reserve(*KEYWORDS)
        self.lines: list[str] = []
        self.ind = 0
        self.uses_gemm: set[str] = set()
        self.data_vars: set[int] = set()  # locals assigned from memory (wide() widens their sums whole)

    def w(self, line: str) -> None:
        self.lines.append("  " * self.ind + line)

    # expressions -------------------------------------------------------------------------------
    def ex(self, e) -> str:
        if isinstance(e, E.Const):
            return self.const(e)
        if isinstance(e, E.Var):
            return self.nm(e)
        if isinstance(e, E.Load):
            raw = f"{self.nm(e.buffer)}[{self.flat(e.buffer, e.indices)}]"
            return f"tg_{SUFFIX[e.dtype.name]}_to_f32({raw})" if e.dtype.is_narrow_float else raw
        if isinstance(e, E.Cast):
            return self.cast(e)
        if isinstance(e, E.BinOp):
            return self.binop(e)
        if isinstance(e, E.UnOp):
            a = self.ex(e.a)
            if e.op == "not":
                return f"(!{a})"
            if e.op == "neg":
                return f"(-{a})" if e.dtype.is_float or e.dtype.bits >= 32 else f"(({reg_type(e.dtype)})(-{a}))"
            return f"(({reg_type(e.dtype)})(~{a}))"
        if isinstance(e, E.Select):
            return f"({self.ex(e.cond)} ? {self.ex(e.a)} : {self.ex(e.b)})"
        if isinstance(e, E.Call):
            return self.call(e)
        raise CompileError(f"cannot emit {type(e).__name__} as C")

    def const(self, c: E.Const) -> str:
        d = c.dtype
        if d.is_bool:
            return "true" if c.value else "false"
        if d.is_float:
            return c_float(c.value, dt.float64 if d == dt.float64 else dt.float32)
        if d.bits == 64:
            v = c.value
            return f"INT64_C({v})" if d.kind == "int" and v != -(1 << 63) else (
                "INT64_MIN" if d.kind == "int" else f"UINT64_C({v})")
        if d.kind == "int" and c.value == -(1 << 31):
            return "INT32_MIN"
        return f"(({STORAGE[d.name]}){c.value})" if d.bits < 32 else (f"{c.value}u" if d.kind == "uint" else
                                                                       str(c.value))

    def round(self, d: dt.DType, text: str) -> str:
        return f"tg_round_{SUFFIX[d.name]}({text})" if d.is_narrow_float else text

    def binop(self, e: E.BinOp) -> str:
        op, t = e.op, e.a.dtype
        a, b = self.ex(e.a), self.ex(e.b)
        if op == "and":
            return f"({a} && {b})"
        if op == "or":
            return f"({a} || {b})"
        if op in _CMP:
            return f"({a} {op} {b})"
        if t.is_float:
            f = "" if t == dt.float64 else "f"
            if op in ("min", "max"):
                out = f"tg_f{op}f({a}, {b})" if f else f"f{op}({a}, {b})"
            elif op == "//":
                out = f"floor{f}({a} / {b})"
            elif op == "%":
                out = f"tg_pymod{f or 'd'}({a}, {b})"
            else:
                out = f"({a} {op} {b})"
            return self.round(t, out)
        ct = reg_type(t)
        w = "i64" if t.bits == 64 else "i32"
        if op in ("min", "max"):
            out = f"TG_{op.upper()}({a}, {b})"
        elif op == "//":
            out = f"tg_floordiv_{w}({a}, {b})" if t.kind == "int" else f"tg_udiv({a}, {b})"
        elif op == "%":
            out = f"tg_floormod_{w}({a}, {b})" if t.kind == "int" else f"tg_umod({a}, {b})"
        elif op == "/":
            out = f"tg_truncdiv_{w}({a}, {b})" if t.kind == "int" else f"tg_udiv({a}, {b})"
        else:
            out = f"({a} {op} {b})"
        return f"(({ct}){out})" if t.bits < 32 or op in ("//", "%", "/") else out

    def cast(self, e: E.Cast) -> str:
        src, d = e.value.dtype, e.dtype
        a = self.ex(e.value)
        if d.is_bool:
            return f"({a} != 0)"
        if d.is_narrow_float:
            return self.round(d, f"((float){a})")
        if d.is_float:
            return f"(({reg_type(d)}){a})"
        if src.is_float:  # float -> int: truncate toward zero, saturate, NaN gives 0
            lo, hi = dt.min_value(d), dt.max_value(d)
            return f"(({reg_type(d)})tg_f2i((double){a}, {float(lo).hex()}, {float(hi).hex()}))"
        return f"(({reg_type(d)}){a})"

    def reinterpret(self, e: E.Call) -> str:
        src, d = e.args[0].dtype, e.dtype
        x = self.ex(e.args[0])
        w = f"uint{d.bits}_t"
        raw = self.raw_bits(e.args[0], src) if src.is_narrow_float else None
        if raw is not None:  # a stored narrow value (a load, a select of loads...): its bits, not decoded and encoded
            bits = f"(({w}){raw})"
        elif src.is_narrow_float:
            bits = f"tg_f32_to_{SUFFIX[src.name]}({x})"
        elif src.is_float:
            bits = f"tg_f2bits({x})" if src.bits == 32 else f"tg_d2bits({x})"
        else:
            bits = f"(({w}){x})"
        if d.is_narrow_float:
            return f"tg_{SUFFIX[d.name]}_to_f32({bits})"
        if d.is_float:
            return f"tg_bits2f({bits})" if d.bits == 32 else f"tg_bits2d({bits})"
        return f"(({reg_type(d)}){bits})"

    def call(self, e: E.Call) -> str:
        if e.name == "reinterpret":
            return self.reinterpret(e)
        args = [self.ex(a) for a in e.args]
        t = e.dtype
        if e.name in ("isnan", "isinf"):
            return f"{e.name}({args[0]})"
        if e.name in ("popcount", "clz"):  # in the argument's own width: zero-extended, never sign-extended
            w = e.args[0].dtype.bits
            u = f"(uint64_t)(uint{w}_t){args[0]}"
            out = f"__builtin_popcountll({u})" if e.name == "popcount" else f"(tg_clz64({u}) - {64 - w})"
            return f"(({reg_type(t)}){out})"
        if not t.is_float:
            if e.name == "abs":
                return f"TG_ABS({args[0]})"
            raise CompileError(f"T.{e.name} needs a float argument, got {t}")
        f = "" if t == dt.float64 else "f"
        if e.name == "rsqrt":
            out = f"(1.0{f} / sqrt{f}({args[0]}))"
        elif e.name == "sigmoid":
            out = f"(1.0{f} / (1.0{f} + exp{f}(-{args[0]})))" if not f else f"tg_sigmoidf({args[0]})"
        elif f and e.name in _FAST_F32:
            out = f"tg_{e.name}f({args[0]})"
        else:
            out = f"{_MATH[e.name]}{f}({', '.join(args)})"
        return self.round(t, out)

    def flat(self, buf, indices) -> str:
        """Row-major offset of ``indices`` (64-bit arithmetic for global tensors)."""
        dims = [self.ex(E.as_expr(d)) for d in buf.shape]
        idx = [self.ex(i) for i in indices]
        if not idx:
            return "0"
        if buf.is_global:  # each term widened on its own: a loop variable stays affine under -fwrapv (no gathers)
            idx = [self.wide(i) for i in indices]
        if buf.strides is not None:
            return "(" + " + ".join(f"{i} * {self.ex(E.as_expr(st))}" for i, st in zip(idx, buf.strides)) + ")"
        out = idx[0]
        for i, d in zip(idx[1:], dims[1:]):
            out = f"({out} * {d} + {i})"
        return out

    def wide(self, e) -> str:
        """An index as 64-bit C, sums split so that ``(by * W) + j`` becomes ``(int64_t)(by * W) + (int64_t)j``.
        A table lookup, a sum of terms read from memory and constants only (``TB[int32(bits) + 32768]``), is
        widened whole: gcc 12 gathers from a 32-bit index, not from the split form. A sum with any other term
        (``base + j``, base loaded) stays split, so that its loop variable stays affine (contiguous loads)."""
        e = E.as_expr(e)
        if isinstance(e, E.BinOp) and e.op in ("+", "-") and e.dtype.is_int and e.dtype.bits <= 32 and \
                not self.table_index(e):
            return f"({self.wide(e.a)} {e.op} {self.wide(e.b)})"
        return f"(int64_t){self.ex(e)}"

    def table_index(self, e) -> bool:
        """Whether the sum ``e`` reads memory and each of its terms either reads memory or is a constant."""
        terms, stack = [], [e]
        while stack:
            x = stack.pop()
            if isinstance(x, E.BinOp) and x.op in ("+", "-") and x.dtype.is_int:
                stack += [x.a, x.b]
            else:
                terms.append(x)
        return self.reads_memory(e) and all(self.reads_memory(x) or E.const_value(x) is not None for x in terms)

    def reads_memory(self, e) -> bool:
        """Whether ``e`` loads, or reads a local assigned from a load."""
        return any(isinstance(x, E.Load) or isinstance(x, E.Var) and id(x) in self.data_vars for x in sub_exprs(e))

    def store_value(self, buf, value: E.Expr) -> str:
        if not buf.dtype.is_narrow_float:
            return self.ex(value)
        raw = self.raw_bits(value, buf.dtype)
        if raw is not None:
            return raw
        if isinstance(value, E.Cast) and value.value.dtype.is_float:  # narrow once, not round-then-narrow
            value = value.value
        return f"tg_f32_to_{SUFFIX[buf.dtype.name]}((float){self.ex(value)})"

    def raw_bits(self, value: E.Expr, d) -> str | None:
        """The bits of a narrow-float value that needs no conversion to be stored as ``d`` (a load of ``d``,
        possibly cast to ``d`` or selected against +0, as a same-dtype T.copy makes), else None: a plain copy."""
        while isinstance(value, E.Cast) and value.dtype == d:
            value = value.value
        if isinstance(value, E.Load) and value.dtype == d:
            return f"{self.nm(value.buffer)}[{self.flat(value.buffer, value.indices)}]"
        if isinstance(value, E.Select) and value.dtype == d:
            a, b = self.raw_bits(value.a, d), self.raw_bits(value.b, d)
            if a is not None and b is not None:
                return f"({self.ex(value.cond)} ? {a} : {b})"
        if isinstance(value, E.Const) and value.value == 0 and math.copysign(1, value.value) > 0:
            return f"(({STORAGE[d.name]})0)"
        if isinstance(value, E.Call) and value.name == "reinterpret" and value.dtype == d and \
                not value.args[0].dtype.is_float:  # T.reinterpret(code, d) of an integer: the code is the bits
            return f"(({STORAGE[d.name]}){self.ex(value.args[0])})"
        return None

    # statements --------------------------------------------------------------------------------
    def stmt(self, s) -> None:
        try:
            getattr(self, "stmt_" + type(s).__name__)(s)
        except CompileError as err:
            raise err.with_loc(s.loc)

    def stmt_Seq(self, s):
        for c in s.body:
            self.stmt(c)

    def block(self, s) -> None:
        self.ind += 1
        if s is not None:
            self.stmt(s)
        self.ind -= 1

    def stmt_If(self, s: S.If):
        self.w(f"if ({self.ex(s.cond)}) {{")
        self.block(s.then)
        if s.orelse is not None:
            self.w("} else {")
            self.block(s.orelse)
        self.w("}")

    def stmt_While(self, s: S.While):
        self.w(f"while ({self.ex(s.cond)}) {{")
        self.block(s.body)
        self.w("}")

    def stmt_Store(self, s: S.Store):
        self.w(f"{self.nm(s.buffer)}[{self.flat(s.buffer, s.indices)}] = {self.store_value(s.buffer, s.value)};")

    def stmt_Assign(self, s: S.Assign):
        if self.reads_memory(s.value):
            self.data_vars.add(id(s.var))
        decl = f"{reg_type(s.var.dtype)} " if s.declare else ""
        self.w(f"{decl}{self.nm(s.var)} = {self.ex(s.value)};")

    def stmt_Alloc(self, s: S.Alloc):
        b = s.buffer  # on-chip storage is declared by the kernel prologue; a T.reshape view is a pointer to it
        if b.alias is not None:
            ct = STORAGE[b.dtype.name]
            self.w(f"{self.address_space(b.alias)}{ct} *{self.nm(b)} = ({self.address_space(b.alias)}{ct} *)"
                   f"{self.nm(b.alias)};")

    def address_space(self, buf) -> str:
        return ""

    def stmt_For(self, s: S.For):
        for pragma in self.loop_pragmas(s):
            self.w(pragma)
        v = self.nm(s.var)
        start, ext = self.ex(s.start), self.ex(s.extent)
        bound = ext if start == "0" else f"{start} + {ext}"
        self.w(f"for (int32_t {v} = {start}; {v} < {bound}; ++{v}) {{")
        self.block(s.body)
        self.w("}")

    def loop_pragmas(self, s: S.For) -> list[str]:
        return []

    def stmt_AtomicElem(self, s: S.AtomicElem):
        ptr = f"&{self.nm(s.buffer)}[{self.flat(s.buffer, s.indices)}]"
        t = s.buffer.dtype
        if t.is_narrow_float:
            suffix = SUFFIX[t.name]
        elif t.is_float:
            suffix = "f32" if t == dt.float32 else "f64"
        else:
            suffix = ("i" if t.kind == "int" else "u") + str(t.bits)
        self.w(f"tg_atomic_{s.kind}_{suffix}({ptr}, {self.ex(s.value)});")

    def stmt_ExternGemm(self, s: S.ExternGemm):
        a, b, c = s.a, s.b, s.c
        name = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float8_e4m3fn": "f8e4m3",
                "float8_e5m2": "f8e5m2", "int8": "i8"}[a.dtype.name]
        self.uses_gemm.add(name)
        m, n = tile2(c)
        k = tile2(a)[0 if s.trans_a else 1]
        if s.kblock:  # block-scaled (passes/fuse_gemm_scale): A not transposed, B transposed, C accumulated
            self.w(f"tg_gemm_{name}_bscaled({m}, {n}, {k}, {self.operand(a)}, {self.operand(b)}, {self.operand(c)}, "
                   f"{self.operand(s.sa)}, {self.operand(s.sb)}, {s.kblock});")
            return
        if s.b_rows is not None:  # B's rows at the addresses in b_rows (passes/read_gathered_rows), from b's column
            rows = f"&{self.nm(s.b_rows.buffer)}[{self.flat(s.b_rows.buffer, [E.as_expr(x) for x in s.b_rows.starts])}]"
            col = self.ex(E.as_expr(b.starts[-1]))
            self.w(f"tg_gemm_{name}_rows({m}, {n}, {k}, {self.operand(a)}, {int(s.trans_a)}, {rows}, {col}, "
                   f"{int(s.trans_b)}, {self.operand(c)}, {int(s.clear)});")
            return
        self.w(f"tg_gemm_{name}({m}, {n}, {k}, {self.operand(a)}, {int(s.trans_a)}, {self.operand(b)}, "
               f"{int(s.trans_b)}, {self.operand(c)}, {int(s.clear)});")

    def operand(self, rg) -> str:
        """``ptr, ld`` of a 2-D tile of a row-major buffer."""
        buf = rg.buffer
        kept = [d for d, e in enumerate(rg.extents) if E.const_value(e) != 1]
        kept = kept if len(kept) == 2 else [d for d, k in enumerate(rg.keep) if k][-2:]
        if len(kept) != 2 or kept[1] != buf.ndim - 1 and any(
                E.const_value(buf.shape[d]) != 1 for d in range(kept[1] + 1, buf.ndim)):
            raise CompileError(f"T.gemm: the tile of {buf.name} must have its columns along the buffer's last dim")
        if buf.strides is not None:  # a strided global tensor (elide_staging checked its last dim is contiguous)
            ld = self.ex(E.as_expr(buf.strides[kept[0]]))
        else:
            ld = E.as_expr(1)
            for d in range(kept[0] + 1, buf.ndim):
                ld = E.binop("*", ld, E.as_expr(buf.shape[d]))
            ld = self.ex(ld)
        off = self.flat(buf, [E.as_expr(x) for x in rg.starts])
        return f"&{self.nm(buf)}[{off}], {ld}"
