"""Scalar expressions of the tile IR.

Expressions are immutable and typed. Constructors normalise operands so that every binary
node has operands of one dtype (Python literals adopt the other operand's type, as TileLang
does: ``x * 0.5`` with x float32 stays float32), and fold constants.
"""
from __future__ import annotations

import math
import operator

from tegula.errors import CompileError
from tegula.ir import dtypes as dt
from tegula.ir.dtypes import DType

ARITH = {"+", "-", "*", "/", "//", "%", "&", "|", "^", "<<", ">>", "min", "max"}
COMPARE = {"<", "<=", ">", ">=", "==", "!="}
LOGICAL = {"and", "or"}
UNARY = {"neg", "not", "~"}
INTRINSICS = {
    "exp", "exp2", "log", "log2", "log10", "sqrt", "rsqrt", "sigmoid", "tanh", "erf", "pow", "floor", "ceil",
    "abs", "sin", "cos", "round", "trunc", "fmod", "isnan", "isinf", "popcount", "clz", "fma",
}


class Expr:
    """Base of all scalar expressions. Python operators build IR; ``bool()`` of a runtime value is an error."""
    __slots__ = ("dtype",)
    dtype: DType

    # arithmetic -------------------------------------------------------------------------------
    def __add__(self, o): return binop("+", self, o)
    def __radd__(self, o): return binop("+", o, self)
    def __sub__(self, o): return binop("-", self, o)
    def __rsub__(self, o): return binop("-", o, self)
    def __mul__(self, o): return binop("*", self, o)
    def __rmul__(self, o): return binop("*", o, self)
    def __truediv__(self, o): return binop("/", self, o)
    def __rtruediv__(self, o): return binop("/", o, self)
    def __floordiv__(self, o): return binop("//", self, o)
    def __rfloordiv__(self, o): return binop("//", o, self)
    def __mod__(self, o): return binop("%", self, o)
    def __rmod__(self, o): return binop("%", o, self)
    def __and__(self, o): return binop("&", self, o)
    def __rand__(self, o): return binop("&", o, self)
    def __or__(self, o): return binop("|", self, o)
    def __ror__(self, o): return binop("|", o, self)
    def __xor__(self, o): return binop("^", self, o)
    def __rxor__(self, o): return binop("^", o, self)
    def __lshift__(self, o): return binop("<<", self, o)
    def __rlshift__(self, o): return binop("<<", o, self)
    def __rshift__(self, o): return binop(">>", self, o)
    def __rrshift__(self, o): return binop(">>", o, self)
    def __pow__(self, o): return call("pow", self, o)
    def __rpow__(self, o): return call("pow", o, self)
    def __neg__(self): return unop("neg", self)
    def __pos__(self): return self
    def __invert__(self): return unop("~", self)
    def __abs__(self): return call("abs", self)

    def astype(self, dtype) -> "Expr":
        """``x.astype(T.float32)``: TVM's spelling of ``T.cast(x, dtype)``."""
        return cast(self, dtype)

    # comparisons build expressions; identity is used for hashing
    def __lt__(self, o): return compare("<", self, o)
    def __le__(self, o): return compare("<=", self, o)
    def __gt__(self, o): return compare(">", self, o)
    def __ge__(self, o): return compare(">=", self, o)
    def __eq__(self, o): return compare("==", self, o)
    def __ne__(self, o): return compare("!=", self, o)
    __hash__ = object.__hash__

    def __bool__(self):
        raise CompileError(f"a runtime value ({self}) cannot be used as a Python bool here; "
                           "use it in an if/while of the kernel, or T.if_then_else")

    def __index__(self):
        raise CompileError(f"a runtime value ({self}) cannot be used where Python needs a compile-time int")

    def __str__(self):
        from tegula.ir.printer import expr_str
        return expr_str(self)

    __repr__ = __str__


class Const(Expr):
    __slots__ = ("value",)

    def __init__(self, value, dtype: DType):
        self.dtype = dtype
        if dtype.is_bool:
            value = bool(value)
        elif dtype.is_int:
            value = _wrap_int(int(value), dtype)
        else:
            value = dt.round_to(float(value), dtype)
        self.value = value


class Var(Expr):
    """A named scalar: a loop or block index, a symbolic dimension, a scalar parameter or a local variable."""
    __slots__ = ("name", "is_local")

    def __init__(self, name: str, dtype: DType = dt.int32, is_local: bool = False):
        self.name, self.dtype, self.is_local = name, dtype, is_local


class BinOp(Expr):
    __slots__ = ("op", "a", "b")

    def __init__(self, op: str, a: Expr, b: Expr, dtype: DType):
        self.op, self.a, self.b, self.dtype = op, a, b, dtype


class UnOp(Expr):
    __slots__ = ("op", "a")

    def __init__(self, op: str, a: Expr, dtype: DType):
        self.op, self.a, self.dtype = op, a, dtype


class Call(Expr):
    """A math intrinsic (``exp``, ``sqrt``, ...) computed in the dtype of its arguments."""
    __slots__ = ("name", "args")

    def __init__(self, name: str, args: tuple, dtype: DType):
        self.name, self.args, self.dtype = name, tuple(args), dtype


class Cast(Expr):
    __slots__ = ("value",)

    def __init__(self, value: Expr, dtype: DType):
        self.value, self.dtype = value, dtype


class Select(Expr):
    """``cond ? a : b``; only the chosen side is evaluated (its loads may be out of bounds otherwise)."""
    __slots__ = ("cond", "a", "b")

    def __init__(self, cond: Expr, a: Expr, b: Expr):
        self.cond, self.a, self.b, self.dtype = cond, a, b, a.dtype


class Load(Expr):
    __slots__ = ("buffer", "indices")

    def __init__(self, buffer, indices: tuple):
        self.buffer, self.indices, self.dtype = buffer, tuple(indices), buffer.dtype


# construction helpers --------------------------------------------------------------------------

def _wrap_int(v: int, dtype: DType) -> int:
    bits = dtype.bits
    v &= (1 << bits) - 1
    if dtype.kind == "int" and v >= 1 << (bits - 1):
        v -= 1 << bits
    return v


def is_expr(x) -> bool:
    return isinstance(x, Expr)


def as_expr(x, like: DType | None = None) -> Expr:
    """Turn a Python value into a constant; a literal adopts ``like`` (the other operand's type)."""
    if isinstance(x, Expr):
        return x
    if hasattr(x, "as_expr"):  # a scalar variable buffer (T.alloc_var) read as a value
        return x.as_expr()
    if isinstance(x, bool):
        return Const(x, like if like is not None and not like.is_float else dt.bool_)
    if isinstance(x, int):
        if like is not None and not like.is_bool:
            return Const(x, like)
        return Const(x, dt.int32 if -2**31 <= x < 2**31 else dt.int64)
    if isinstance(x, float):
        if like is not None and like.is_float:
            return Const(x, like if not like.is_narrow_float else like)
        return Const(x, dt.float32)
    if type(x).__module__ == "numpy":  # numpy scalars keep their own dtype
        return Const(x.item(), dt.dtype(x.dtype))
    raise CompileError(f"cannot use {type(x).__name__} value {x!r} in a kernel expression")


def _unify(a, b) -> tuple[Expr, Expr, DType]:
    if not isinstance(a, Expr) and not isinstance(b, Expr):
        raise TypeError("binary IR node needs at least one expression")
    if not isinstance(a, Expr):
        b = as_expr(b)
        a = as_expr(a, like=b.dtype)
    elif not isinstance(b, Expr):
        b = as_expr(b, like=a.dtype)
    t = dt.promote(a.dtype, b.dtype)
    return cast(a, t), cast(b, t), t


_PY_OPS = {
    "+": operator.add, "-": operator.sub, "*": operator.mul, "&": operator.and_, "|": operator.or_,
    "^": operator.xor, "<<": operator.lshift, ">>": operator.rshift, "min": min, "max": max,
    "<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge, "==": operator.eq, "!=": operator.ne,
}


def _fold_int(op, x, y):
    if op == "//":
        return x // y if y else 0
    if op == "%":
        return x % y if y else 0
    if op == "/":
        if not y:
            return 0
        q = abs(x) // abs(y)  # integer '/' truncates toward zero, as in C
        return q if (x >= 0) == (y >= 0) else -q
    return _PY_OPS[op](x, y)


def binop(op: str, a, b) -> Expr:
    a, b, t = _unify(a, b)
    if op in ("&", "|", "^", "<<", ">>") and t.is_float:
        raise CompileError(f"operator {op} needs integer operands, got {t}")
    if isinstance(a, Const) and isinstance(b, Const):
        if t.is_int or t.is_bool:
            if not (op in ("<<", ">>") and not 0 <= b.value < t.bits):
                return Const(_fold_int(op, a.value, b.value), t)
        elif t in (dt.float32, dt.float64) and op in ("+", "-", "*", "/", "min", "max") and (op != "/" or b.value):
            v = a.value / b.value if op == "/" else _PY_OPS[op](a.value, b.value)
            return Const(v if t == dt.float64 else _to_f32(v), t)
    if t.is_int and isinstance(b, Const):  # algebraic identities that keep index expressions small
        if (op in ("+", "-") and b.value == 0) or (op in ("*", "//", "/") and b.value == 1):
            return a
        if op == "*" and b.value == 0:
            return b
    if t.is_int and isinstance(a, Const):
        if op == "+" and a.value == 0 or op == "*" and a.value == 1:
            return b
        if op == "*" and a.value == 0:
            return a
    return BinOp(op, a, b, t)


def compare(op: str, a, b) -> Expr:
    a, b, t = _unify(a, b)
    if isinstance(a, Const) and isinstance(b, Const) and not t.is_narrow_float:
        return Const(_PY_OPS[op](a.value, b.value), dt.bool_)
    return BinOp(op, a, b, dt.bool_)


def logical(op: str, a, b) -> Expr:
    a, b = cast(as_expr(a), dt.bool_), cast(as_expr(b), dt.bool_)
    if isinstance(a, Const):
        if op == "and":
            return b if a.value else a
        return a if a.value else b
    return BinOp(op, a, b, dt.bool_)


def unop(op: str, a) -> Expr:
    a = as_expr(a)
    if op == "not":
        a = cast(a, dt.bool_)
        return Const(not a.value, dt.bool_) if isinstance(a, Const) else UnOp("not", a, dt.bool_)
    if op == "~" and not (a.dtype.is_int or a.dtype.is_bool):
        raise CompileError(f"operator ~ needs an integer operand, got {a.dtype}")
    if isinstance(a, Const) and a.dtype.is_int:
        return Const(-a.value if op == "neg" else ~a.value, a.dtype)
    if isinstance(a, Const) and a.dtype in (dt.float32, dt.float64) and op == "neg":
        return Const(-a.value, a.dtype)
    return UnOp(op, a, a.dtype)


def cast(x, dtype) -> Expr:
    dtype = dt.dtype(dtype)
    x = as_expr(x, like=dtype if not isinstance(x, bool) else None)
    if x.dtype == dtype:
        return x
    if isinstance(x, Const):
        if dtype.is_int or dtype.is_bool:
            v = x.value
            if isinstance(v, float):
                if math.isnan(v) or math.isinf(v):
                    return Cast(x, dtype)
                v = int(v)  # truncation toward zero, as C
            return Const(v, dtype)
        if dtype in (dt.float32, dt.float64) and not x.dtype.is_narrow_float:
            return Const(float(x.value), dtype) if dtype == dt.float64 else Const(_to_f32(x.value), dtype)
    return Cast(x, dtype)


def _to_f32(v: float) -> float:
    import struct
    try:
        return struct.unpack("f", struct.pack("f", v))[0]
    except OverflowError:
        return math.copysign(math.inf, v)


def call(name: str, *args) -> Expr:
    """A math intrinsic; integer arguments of float functions are converted to float32."""
    exprs = [as_expr(a) for a in args]
    if len(exprs) == 2:
        a, b, t = _unify(args[0], args[1])
        exprs = [a, b]
    if len(exprs) == 3:  # fma: one dtype for all three (literals adopt it)
        a, b, _ = _unify(args[0], args[1])
        a, c, t = _unify(a, args[2])
        exprs = [cast(a, t), cast(b, t), c]
    t = exprs[0].dtype
    if name in ("isnan", "isinf"):
        return Call(name, exprs, dt.bool_)
    if name in ("popcount", "clz"):  # bit counts of an integer, in its own width
        if not t.is_int:
            raise CompileError(f"T.{name} needs an integer argument, got {t}")
        return Call(name, exprs, t)
    if name != "abs" and not t.is_float:
        exprs = [cast(e, dt.float32) for e in exprs]
        t = dt.float32
    return Call(name, exprs, t)


def select(cond, a, b) -> Expr:
    cond = cast(as_expr(cond), dt.bool_)
    a, b, _ = _unify(a, b) if (isinstance(a, Expr) or isinstance(b, Expr)) else (as_expr(a), as_expr(b), None)
    if isinstance(cond, Const):
        return a if cond.value else b
    return Select(cond, a, b)


def const_value(x):
    """The Python value of ``x`` when it is a constant (int/float/bool or Const), else None."""
    if isinstance(x, Const):
        return x.value
    if isinstance(x, (int, float, bool)):
        return x
    return None
