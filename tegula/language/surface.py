"""The T.* constructs that are not tile ops: annotations, the kernel, buffers, loops, math, macros."""
from __future__ import annotations

import math

from tegula.errors import CompileError
from tegula.ir import dtypes as dt
from tegula.ir import expr as E
from tegula.ir.buffer import Buffer, BufferData
from tegula.language.builder import current, kernel_builder

# parameters ------------------------------------------------------------------------------------

class TensorType:
    """``T.Tensor(shape, dtype, data=None, strides=None)``: a global tensor parameter. Row-major and contiguous
    unless ``strides`` (in elements; ints or T.dynamic symbols bound at call time) are given.

    Inside a kernel, ``T.Tensor(shape, dtype, buf.data)`` is a view of ``buf``'s storage with another shape
    (TVM's buffer declaration over existing data), as ``T.reshape(buf, shape)``."""

    def __new__(cls, shape=None, dtype="float32", data=None, strides=None, **_ignored):
        if data is None:
            return super().__new__(cls)
        if not isinstance(data, BufferData):
            raise CompileError(f"T.Tensor: data= must be another buffer's .data, got {type(data).__name__}")
        if dt.dtype(dtype) != data.buffer.dtype:
            raise CompileError(f"T.Tensor over {data.buffer.name}.data: the dtype {dt.dtype(dtype)} differs from "
                               f"{data.buffer.dtype}; reinterpreting storage is not supported")
        return reshape(data.buffer, shape)

    def __init__(self, shape, dtype="float32", data=None, strides=None, **_ignored):
        shape = (shape,) if isinstance(shape, (int, E.Expr)) else tuple(shape)
        for d in shape:
            if not (isinstance(d, int) or (isinstance(d, E.Expr) and d.dtype.is_int)):
                raise CompileError(f"T.Tensor: dimension {d!r} must be an int or a symbolic dim (T.dynamic)")
        if strides is not None:
            strides = (strides,) if isinstance(strides, (int, E.Expr)) else tuple(strides)
            if len(strides) != len(shape):
                raise CompileError(f"T.Tensor: {len(strides)} strides for {len(shape)} dimensions")
            for st in strides:
                if not (isinstance(st, int) or isinstance(st, E.Var) and st.dtype.is_int):
                    raise CompileError(f"T.Tensor: stride {st!r} must be an int or a T.dynamic symbol")
        self.shape, self.dtype, self.strides = shape, dt.dtype(dtype), strides

    @classmethod
    def __class_getitem__(cls, item):  # T.Tensor[(M, N), "float32"]
        shape, dtype = item
        return cls(shape, dtype)


Tensor = Buffer_ = TensorType


class _StridedTensor:
    """``T.StridedTensor(shape, strides, dtype)`` or ``T.StridedTensor[shape, strides, dtype]``: a global tensor
    parameter with explicit strides (in elements)."""

    def __call__(self, shape, strides, dtype="float32"):
        return TensorType(shape, dtype, strides=strides)

    def __getitem__(self, item):
        return self(*item)


StridedTensor = _StridedTensor()


def _names(names: str) -> list[str]:
    return [n for n in names.replace(",", " ").split() if n]


def dynamic(name: str, dtype="int32"):
    """A dimension bound from the arguments at call time (one compiled kernel serves every value).
    ``T.dynamic("M, N")`` gives one per name."""
    vs = tuple(E.Var(n, dt.dtype(dtype)) for n in _names(name))
    if not vs:
        raise CompileError("T.dynamic needs a name")
    _register_symbols(vs)
    return vs[0] if len(vs) == 1 else vs


def _register_symbols(vs):
    from tegula.language.builder import _state
    b = getattr(_state, "builder", None)
    if b is not None:
        b.symbol_ids.update(id(v) for v in vs)


# eager @tegula.jit functions ---------------------------------------------------------------------

def _eager_state(what: str):
    st = getattr(current(), "eager", None)
    if st is None:
        raise CompileError(f"{what} is only meaningful in an eager @tegula.jit function (whose body is the kernel "
                           "function's body, with tensor parameters annotated inside it)")
    return st


def const(names: str, dtype="int32"):
    """``M, N = T.const("M, N")`` in an eager @tegula.jit function: compile-time dimensions, each taken from the
    shape of a tensor argument whose annotation uses it directly (``A: T.Tensor((M, N), ...)``), or from a
    keyword of the call (``f.compile(M=1024, ...)``). The kernel is specialised for their values."""
    st = _eager_state("T.const")
    out = []
    for n in _names(names):
        if st.phase == 1:
            out.append(st.symbols.setdefault(n, E.Var(n, dt.dtype(dtype))))
            _register_symbols(out[-1:])
        elif n in st.values:
            out.append(st.values[n])
        else:
            raise CompileError(f"T.const {n!r} has no value: annotate a tensor parameter with it as one of its "
                               f"dimensions, or pass {n}=... to the call")
    if not out:
        raise CompileError("T.const needs a name")
    return out[0] if len(out) == 1 else tuple(out)


def empty(shape, dtype="float32"):
    """``C = T.empty((M, N), dtype)`` in an eager @tegula.jit function: an output tensor the call allocates and
    returns (when the function returns it). Its contents start undefined."""
    st = _eager_state("T.empty")
    b = current()
    shape = (shape,) if isinstance(shape, (int, E.Expr)) else tuple(shape)
    buf = Buffer(b.fresh("out_"), shape, dt.dtype(dtype), "global", b.loc)
    buf.auto_name = True
    st.outputs.append(buf)
    return buf


symbolic = dynamic


# the kernel --------------------------------------------------------------------------------------

class KernelSpec:
    """``with T.Kernel(gx, gy, gz, threads=N) as (bx, by, bz)``: a grid of blocks."""

    def __init__(self, *grid, threads=None, is_cpu=False, prelude=None, **_hints):
        if not 1 <= len(grid) <= 3:
            raise CompileError(f"T.Kernel takes 1 to 3 grid dimensions, got {len(grid)}")
        for g in grid:
            if isinstance(g, E.Expr) and not g.dtype.is_int or not isinstance(g, (int, E.Expr)):
                raise CompileError(f"T.Kernel: grid dimension {g!r} must be an integer")
        self.grid = tuple(grid)
        if threads is None:
            threads = (128,)
        self.threads = tuple(threads) if isinstance(threads, (tuple, list)) else (threads,)


Kernel = KernelSpec


def get_block_binding(dim: int = 0):
    """The block index of grid dimension ``dim`` of the enclosing T.Kernel (what ``as (bx, by)`` binds)."""
    bv = kernel_builder().block_vars
    if not 0 <= dim < len(bv):
        raise CompileError(f"T.get_block_binding({dim}): the kernel has {len(bv)} grid dimension(s)")
    return bv[dim]


def get_block_bindings():
    """All block indices of the enclosing T.Kernel."""
    return list(kernel_builder().block_vars)


# buffers ---------------------------------------------------------------------------------------

def _alloc(shape, dtype, scope: str) -> Buffer:
    b = kernel_builder()
    shape = (shape,) if isinstance(shape, (int, E.Expr)) else tuple(shape)
    for d in shape:
        if E.const_value(d) is None or isinstance(E.const_value(d), float):
            raise CompileError(f"T.alloc_{scope}: dimension {d!r} must be a compile-time integer")
        if E.const_value(d) <= 0:
            raise CompileError(f"T.alloc_{scope}: dimension {d!r} must be positive")
    buf = Buffer(b.fresh(scope + "_"), tuple(int(E.const_value(d)) for d in shape), dt.dtype(dtype), scope, b.loc)
    buf.auto_name = True
    from tegula.ir.stmt import Alloc
    b.emit(Alloc(buf))
    return buf


def alloc_shared(shape, dtype, scope="shared.dyn"):
    """A tile visible to the whole block (one per block)."""
    return _alloc(shape, dtype, "shared")


def alloc_fragment(shape, dtype, scope="local.fragment"):
    """A tile distributed over the block's threads; the program reads it as one tile."""
    return _alloc(shape, dtype, "fragment")


def alloc_local(shape, dtype, scope="local"):
    """A per-thread array."""
    return _alloc(shape, dtype, "local")


def alloc_global(shape, dtype):
    """A global-memory workspace that lives for one call of the kernel function, shared by its T.Kernel blocks
    (declared outside them): e.g. the partial results a split-K or split-KV kernel combines in a second kernel.
    Its contents start undefined."""
    b = current()
    if b.in_kernel:
        raise CompileError("T.alloc_global declares a workspace of the whole function: write it before "
                           "`with T.Kernel(...)`, not inside")
    shape = (shape,) if isinstance(shape, (int, E.Expr)) else tuple(shape)
    for d in shape:
        if not isinstance(E.const_value(d), int) or E.const_value(d) <= 0:
            raise CompileError(f"T.alloc_global: dimension {d!r} must be a positive compile-time integer")
    buf = Buffer(b.fresh("global_"), tuple(int(E.const_value(d)) for d in shape), dt.dtype(dtype), "global", b.loc)
    buf.auto_name = True
    from tegula.ir.stmt import Alloc
    b.emit(Alloc(buf))
    return buf


def alloc_buffer(shape, dtype, scope="global"):
    """TVM's ``T.alloc_buffer(shape, dtype, scope=...)``: by scope, T.alloc_global ("global", outside the kernels),
    T.alloc_shared ("shared", "shared.dyn"), T.alloc_fragment ("local.fragment") or T.alloc_local ("local")."""
    if scope == "global":
        return alloc_global(shape, dtype)
    kinds = {"shared": alloc_shared, "shared.dyn": alloc_shared, "local.fragment": alloc_fragment, "local": alloc_local}
    if scope not in kinds:
        raise CompileError(f"T.alloc_buffer: unsupported scope {scope!r}; expected one of global, {', '.join(kinds)}")
    return kinds[scope](shape, dtype)


def alloc_var(dtype, init=None, scope="local.var"):
    """A scalar variable: ``v = expr`` assigns, ``v += 1`` updates, ``v`` reads."""
    buf = _alloc((1,), dtype, "local.var")
    if init is not None:
        from tegula.language.builder import emit_store
        emit_store(buf, 0, init)
    return buf


# loops -----------------------------------------------------------------------------------------

class LoopSpec:
    """What a ``for`` iterates over: one (start, extent, step) per loop variable. With ``coords``, one loop
    runs over ``ranges[0]`` and the ``n_names`` names the ``for`` binds are ``coords(var)[0]``, the body running
    where ``coords(var)[1]`` holds."""

    def __init__(self, kind: str, ranges: list, annotations=None, coords=None, n_names=None):
        self.kind, self.ranges, self.annotations = kind, ranges, annotations or {}
        self.coords, self.n_names = coords, n_names

    def __iter__(self):
        raise CompileError("T.Parallel / T.serial / T.Pipelined ... can only be iterated by a `for` in a kernel")


def _range(kind: str, args, annotations=None) -> LoopSpec:
    if not 1 <= len(args) <= 3:
        raise CompileError(f"T.{kind}/range takes 1 to 3 arguments (stop | start, stop[, step]), got {len(args)}")
    start, stop, step = (0, args[0], 1) if len(args) == 1 else (args[0], args[1], args[2] if len(args) == 3 else 1)
    step = E.const_value(step)
    if step is None or not isinstance(step, int) or step == 0:
        raise CompileError(f"loop step must be a non-zero compile-time int, got {args[2]!r}")
    if isinstance(start, int) and isinstance(stop, int):
        extent = max(0, -((start - stop) // step)) if step > 0 else max(0, -((stop - start) // -step))
    else:
        diff = E.binop("-", stop, start)
        extent = E.binop("max", E.binop("//", E.binop("+", diff, step - (1 if step > 0 else -1)), step), 0)
    return LoopSpec(kind, [(start, extent, step)], annotations)


def serial(*args, annotations=None) -> LoopSpec:
    """A sequential loop: ``T.serial(stop)`` or ``T.serial(start, stop[, step])``."""
    return _range("serial", args, annotations)


def unroll(*args, explicit=False, unroll_factor=None) -> LoopSpec:
    """A sequential loop the compiler unrolls."""
    return _range("unroll", args)


def vectorized(*args) -> LoopSpec:
    return _range("parallel", args)


def Parallel(*extents, coalesced_width=None, loop_layout=None) -> LoopSpec:
    """An elementwise loop nest over a tile: iterations are independent; the compiler distributes and
    vectorises them."""
    if not extents:
        raise CompileError("T.Parallel needs at least one extent")
    return LoopSpec("parallel", [_range("parallel", (e,)).ranges[0] for e in extents])


def Persistent(domain, wave_size, index, group_size=8) -> LoopSpec:  # noqa: N802 (TileLang's name)
    """``for bx, by in T.Persistent([Mb, Nb], wave_size, index)``: the tiles of ``domain`` that block ``index`` of a
    wave of ``wave_size`` blocks handles, one per iteration: tile ``w * wave_size + index`` in an order that walks
    the last dimension in panels of ``group_size`` (L2-friendly). Every tile is visited once over the wave."""
    domain = list(domain)
    last = domain[-1]
    g = max(1, min(group_size, last)) if isinstance(last, int) else E.binop("max", 1, E.binop("min", group_size, last))
    grouped = [ceildiv(last, g)] + domain[:-1] + [g]
    padded = grouped[0]
    for d in grouped[1:]:
        padded = padded * d

    def coords(w):
        t = w * wave_size + index
        rem, idxs = t, [None] * len(grouped)
        for i in range(len(grouped) - 1, 0, -1):
            idxs[i], rem = rem % grouped[i], rem // grouped[i]
        last_coord = rem * g + idxs[-1]
        return idxs[1:-1] + [last_coord], E.logical("and", E.compare("<", t, padded), E.compare("<", last_coord, last))

    return LoopSpec("serial", [(0, ceildiv(padded, wave_size), 1)], coords=coords, n_names=len(domain))


def grid(*extents) -> LoopSpec:
    """Nested serial loops, one per extent."""
    return LoopSpec("serial", [_range("serial", (e,)).ranges[0] for e in extents])


def Pipelined(start, stop=None, num_stages=0, order=None, stage=None, sync=None, group=None) -> LoopSpec:
    """Semantically ``range(start, stop)`` (or ``range(start)``); copies of later iterations may
    overlap the compute of earlier ones (``num_stages`` buffers)."""
    args = (start,) if stop is None else (start, stop)
    return _range("pipelined", args, {"num_stages": int(num_stages)})


# expressions -----------------------------------------------------------------------------------

def _math(name):
    def f(*args):
        return E.call(name, *args)
    f.__name__ = name
    f.__doc__ = f"T.{name}: computed in the argument's float dtype (integers are converted to float32)."
    return f


exp, exp2, log, log2, log10, sqrt, rsqrt, sigmoid, tanh, erf, floor, ceil = (
    _math(n) for n in ("exp", "exp2", "log", "log2", "log10", "sqrt", "rsqrt", "sigmoid", "tanh", "erf", "floor",
                       "ceil"))
sin, cos, trunc, round_ = _math("sin"), _math("cos"), _math("trunc"), _math("round")
isnan, isinf = _math("isnan"), _math("isinf")


def popcount(x):
    """T.popcount(x): the number of set bits of an integer in its own width (TVM's tir.popcount); x's dtype."""
    return E.call("popcount", x)


def clz(x):
    """T.clz(x): the number of leading zero bits of an integer in its own width (TVM's tir.clz), x's dtype;
    T.clz(0) is the width (TVM leaves it undefined). With bit 31 - j standing for item j of a 32-item mask,
    ``j = T.clz(m)`` walks the set items in order: the bit-scan that stream compaction needs."""
    return E.call("clz", x)


def pow(x, y):  # noqa: A001
    return E.call("pow", x, y)


def fma(a, b, c):
    """a * b + c with one rounding (float32; narrow floats compute in float32 and round after; float64 not
    supported)."""
    out = E.call("fma", a, b, c)
    if out.dtype == dt.float64:
        raise CompileError("T.fma: float64 is not supported (float32 and narrower)")
    return out


def abs(x):  # noqa: A001
    """|x|, in x's dtype."""
    return E.call("abs", x) if isinstance(x, E.Expr) else builtins_abs(x)


def builtins_abs(x):
    return x if x >= 0 else -x


def _py_or_ir(op, a, b):
    if not isinstance(a, E.Expr) and not isinstance(b, E.Expr) and not hasattr(a, "as_expr") and not hasattr(
            b, "as_expr"):
        return (a if a >= b else b) if op == "max" else (a if a <= b else b)
    return E.binop(op, a, b)


def max(a, b, *rest):  # noqa: A001
    """The larger value (floats: IEEE maxNum, so a NaN operand gives the other one)."""
    out = _py_or_ir("max", a, b)
    for r in rest:
        out = _py_or_ir("max", out, r)
    return out


def min(a, b, *rest):  # noqa: A001
    """The smaller value (floats: IEEE minNum)."""
    out = _py_or_ir("min", a, b)
    for r in rest:
        out = _py_or_ir("min", out, r)
    return out


def clamp(x, lo, hi):
    """min(max(x, lo), hi)."""
    return min(max(x, lo), hi)


def if_then_else(cond, a, b):
    """``a`` where cond holds, else ``b``; only the chosen side is evaluated."""
    return E.select(cond, a, b)


def cast(x, dtype):
    """Convert to ``dtype`` (floats round to nearest even; float8_e4m3fn saturates to +-448 like torch)."""
    return E.cast(x, dtype)


def Cast(dtype, x):  # noqa: N802 (TVM's name and argument order)
    """``T.Cast(dtype, x)``: TVM's spelling of ``T.cast(x, dtype)`` (either argument order is accepted)."""
    if not isinstance(dtype, (str, dt.DType)) and isinstance(x, (str, dt.DType)):
        dtype, x = x, dtype
    return E.cast(x, dtype)


def ceildiv(a, b):
    """ceil(a / b) for integers."""
    if isinstance(a, int) and isinstance(b, int):
        return -(-a // b)
    return E.binop("//", E.binop("+", a, b - 1 if isinstance(b, int) else E.binop("-", b, 1)), b)


def shift_left(a, b):
    """a << b (TVM's spelling)."""
    return E.binop("<<", a, b)


def shift_right(a, b):
    """a >> b (TVM's spelling)."""
    return E.binop(">>", a, b)


def index_to_coordinates(index, shape):
    """The row-major coordinates of a flat ``index`` into ``shape``."""
    out = []
    for d in reversed(list(shape)[1:]):
        out.append(index % d)
        index = index // d
    return [index] + out[::-1]


def floordiv(a, b):
    return E.binop("//", a, b)


def floormod(a, b):
    return E.binop("%", a, b)


def truncdiv(a, b):
    return E.binop("/", a, b)


def truncmod(a, b):
    a, b = E.as_expr(a), E.as_expr(b, like=E.as_expr(a).dtype)
    return E.binop("-", a, E.binop("*", E.binop("/", a, b), b))


def infinity(dtype):
    """+inf of a float dtype."""
    d = dt.dtype(dtype)
    if not d.is_float:
        raise CompileError(f"T.infinity: {d} has no infinity")
    return E.Const(math.inf, d)


def max_value(dtype):
    """The largest finite value of ``dtype``."""
    d = dt.dtype(dtype)
    return E.Const(dt.max_value(d), d)


def min_value(dtype):
    """The smallest finite value of ``dtype`` (most negative)."""
    d = dt.dtype(dtype)
    return E.Const(dt.min_value(d), d)


# hints that only SIMT targets act on: accepted so TileLang kernels run unchanged ----------------------

def _hint(*args, **kwargs):
    current()
    return None


annotate_layout = use_swizzle = no_set_max_nreg = set_max_nreg = disable_warp_group_reg_alloc = _hint
annotate_l2_hit_ratio = sync_threads = annotate_padding = _hint


def make_swizzled_layout(*args, **kwargs):
    return None


class Layout:
    """``T.Layout(shape, forward_fn)``: a buffer layout for ``T.annotate_layout``. Only SIMT targets may act on
    one; the layout never changes what a program computes (every access goes through it), so tegula keeps
    buffers row-major and records the layout for inspection."""

    def __init__(self, shape, forward_fn=None, *args, **kwargs):
        self.shape, self.forward_fn = shape, forward_fn


class Fragment(Layout):
    """``T.Fragment(shape, forward_thread_fn=..., ...)``: a fragment's thread distribution; a layout hint."""

    def __init__(self, shape, forward_fn=None, *args, forward_thread_fn=None, forward_index_fn=None, **kwargs):
        super().__init__(shape, forward_index_fn or forward_fn)
        self.forward_thread_fn = forward_thread_fn


class GemmWarpPolicy:
    """How SIMT targets split a T.gemm over warps; a performance hint."""
    Square, FullRow, FullCol = "Square", "FullRow", "FullCol"


def reshape(buffer, shape):
    """A view of ``buffer`` with another shape (same dtype and element count, row-major): no copy."""
    b = current()
    if not isinstance(buffer, Buffer):
        raise CompileError(f"T.reshape expects a buffer, got {type(buffer).__name__}")
    shape = (shape,) if isinstance(shape, (int, E.Expr)) else tuple(shape)
    if any(not isinstance(E.const_value(d), int) for d in list(shape) + list(buffer.shape)):
        raise CompileError("T.reshape needs constant shapes")
    if buffer.strides is not None:
        raise CompileError(f"T.reshape: {buffer.name} is strided; only contiguous tensors can be viewed")
    n_old, n_new = 1, 1
    for d in buffer.shape:
        n_old *= int(E.const_value(d))
    for d in shape:
        n_new *= int(E.const_value(d))
    if n_old != n_new:
        raise CompileError(f"T.reshape: {buffer.name} has {n_old} elements, the shape {tuple(shape)} has {n_new}")
    view = Buffer(b.fresh(buffer.name + "_view"), tuple(int(E.const_value(d)) for d in shape), buffer.dtype,
                  buffer.scope, b.loc)
    view.auto_name, view.alias = True, buffer
    from tegula.ir.stmt import Alloc
    b.emit(Alloc(view))
    return view


def view(buffer, shape=None, dtype=None):
    """``T.view(buf, shape=..., dtype=...)``: a reshaped view; a dtype change is not supported."""
    if dtype is not None and dt.dtype(dtype) != buffer.dtype:
        raise CompileError("T.view with another dtype is not supported; use T.reinterpret on elements")
    return reshape(buffer, shape if shape is not None else buffer.shape)


def reinterpret(value, dtype):
    """The bits of ``value`` read as ``dtype`` (the same width): T.reinterpret(x, T.uint32) of a float32."""
    if isinstance(value, (str, dt.DType)) and not isinstance(dtype, (str, dt.DType)):
        value, dtype = dtype, value  # TVM's argument order: reinterpret(dtype, value)
    d = dt.dtype(dtype)
    v = E.as_expr(value)
    if v.dtype.bits != d.bits or v.dtype.is_bool or d.is_bool:
        raise CompileError(f"T.reinterpret: {v.dtype} and {d} have different widths")
    return v if v.dtype == d else E.Call("reinterpret", (v,), d)


def dtype(x):
    """Normalise a dtype name: T.dtype("float16") is T.float16."""
    return dt.dtype(x)


def assume(cond):
    """A fact the compiler may use; tegula ignores it."""
    return None


def device_assert(cond, msg=""):
    return None
