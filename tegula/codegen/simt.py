"""The emitter shared by the SIMT targets (OpenCL C, CUDA C++): one kernel function per PrimFunc, its body the
program of one thread (passes/distribute_threads.py), shared buffers at kernel scope, register fragments and
locals as per-thread arrays.

The first line of the source is the launch description the runtime reads (runtimes never see the IR):

    // tegula-launch {"kernels": [{"name", "grid", "threads", "smem"}, ...], "params": [...], "writes": [...],
    //                "workspaces": [{"dtype", "numel"}, ...]}

A function's T.Kernel blocks are launched in order, each with its ``grid`` (Python expressions over ``v[k]``,
the k-th launch argument: the function's parameters, then its symbolic dims), ``threads`` per block and
``smem`` bytes of shared memory. ``params`` gives each argument's kind ("p:<dtype>" for a tensor, else the
scalar dtype); ``writes`` lists the tensors the kernels may write; ``workspaces`` are the T.alloc_global
buffers the runtime allocates for a call and passes after the arguments.
"""
from __future__ import annotations

import json
import math

from tegula.codegen.cfamily import STORAGE, SUFFIX, CFamilyEmitter, reg_type
from tegula.errors import CompileError
from tegula.ir import expr as E
from tegula.ir import simt as X
from tegula.ir import stmt as S

LAUNCH_TAG = "// tegula-launch "
_PY_OPS = {"+": "+", "-": "-", "*": "*", "//": "//", "%": "%", "<": "<", "<=": "<=", ">": ">", ">=": ">=",
           "==": "==", "!=": "!=", "&": "&", "|": "|", "^": "^", "<<": "<<", ">>": ">>", "and": "and", "or": "or"}


def host_expr(e, names: dict) -> str:
    """An integer IR expression over scalar parameters as Python source (for the launch grid)."""
    if isinstance(e, int):
        return str(e)
    if isinstance(e, E.Const):
        return str(int(e.value))
    if isinstance(e, E.Var) and id(e) in names:
        return names[id(e)]
    if isinstance(e, E.Cast) and (e.dtype.is_int or e.dtype.is_bool):
        return host_expr(e.value, names) if e.value.dtype.is_int else f"int({host_expr(e.value, names)})"
    if isinstance(e, E.BinOp) and e.op in ("min", "max"):
        return f"{e.op}({host_expr(e.a, names)}, {host_expr(e.b, names)})"
    if isinstance(e, E.BinOp) and e.op == "/" and e.dtype.is_int:
        a, b = host_expr(e.a, names), host_expr(e.b, names)
        return f"_tdiv({a}, {b})"
    if isinstance(e, E.BinOp) and e.op in _PY_OPS:
        return f"({host_expr(e.a, names)} {_PY_OPS[e.op]} {host_expr(e.b, names)})"
    if isinstance(e, E.Select):
        return f"({host_expr(e.a, names)} if {host_expr(e.cond, names)} else {host_expr(e.b, names)})"
    raise CompileError(f"the grid size {e} must be computable from the kernel's scalar arguments and dimensions "
                       "on the SIMT targets")


class SimtEmitter(CFamilyEmitter):
    """Spellings are class attributes; subclasses (codegen/opencl.py, codegen/cuda.py) set them."""
    target = "simt"
    kernel_prefix = ""            # before ``void``
    global_space = ""             # address space of tensor pointers
    shared_decl = "{t} {name}[{n}];"
    barrier = ""
    block_index = ("", "", "")    # expressions of the block's grid coordinates
    thread_index = ""
    unroll_pragma = None
    atomic_suffix = {"global": "", "shared": ""}
    storage = {}                  # overrides of cfamily.STORAGE for parameters and buffers
    spaces = {}                   # address-space words of pointers into a buffer, by scope
    prelude = "tegula_simt.h"

    def __init__(self, func: S.PrimFunc):
        super().__init__(func)
        self.kernel = None

    def ctype(self, d) -> str:
        return self.storage.get(d.name, STORAGE[d.name])

    # expressions ---------------------------------------------------------------------------
    def ex(self, e) -> str:
        if isinstance(e, X.ThreadIdx):
            return f"((int32_t){self.thread_index})"
        return super().ex(e)

    def call(self, e: E.Call) -> str:
        if e.name == "fma" and not e.dtype.is_narrow_float:  # one rounding: the portable GEMM's multiply-add
            a, b, c = (self.ex(x) for x in e.args)
            return f"fmaf({a}, {b}, {c})" if e.dtype.bits == 32 else f"fma({a}, {b}, {c})"
        if e.name == "popcount":  # in the argument's own width, as cfamily's; the builtin is the prelude's
            w = e.args[0].dtype.bits
            return f"(({reg_type(e.dtype)})tg_popcount64((uint64_t)(uint{w}_t){self.ex(e.args[0])}))"
        return super().call(e)

    # statements ----------------------------------------------------------------------------
    def loop_pragmas(self, s: S.For) -> list[str]:
        return [self.unroll_pragma] if s.kind == "unroll" and self.unroll_pragma else []

    def stmt_ThreadNest(self, s):
        self.stmt_Seq(s)

    def stmt_Barrier(self, s):
        self.w(self.barrier)

    def stmt_WarpAllReduce(self, s):
        raise CompileError(f"the {self.target} target has no warp shuffles", s.loc)

    def stmt_AtomicElem(self, s: S.AtomicElem):
        t = s.buffer.dtype
        if t.is_float:
            suffix = SUFFIX.get(t.name, "f32" if t.bits == 32 else "f64")
        else:
            suffix = ("i" if t.kind == "int" else "u") + str(t.bits)
        ptr = f"&{self.nm(s.buffer)}[{self.flat(s.buffer, s.indices)}]"
        space = self.atomic_suffix.get(s.buffer.scope, "")
        self.w(f"tg_atomic_{s.kind}_{suffix}{space}({ptr}, {self.ex(s.value)});")

    def address_space(self, buf) -> str:
        return self.spaces.get(buf.scope, "")

    def stmt_ExternGemm(self, s):
        raise CompileError("internal: T.gemm reached the SIMT emitter unlowered", s.loc)

    def stmt_SimtKernel(self, k: X.SimtKernel):
        self.kernel = k
        self.begin_kernel()
        for v, idx in zip(k.block_vars, self.block_index):
            self.w(f"const int32_t {self.nm(v)} = (int32_t){idx};")
        self.w(" ".join(f"(void){self.nm(v)};" for v in k.block_vars))
        for s in S.walk(k.body):
            if isinstance(s, S.Alloc) and s.buffer.alias is None:  # views are pointers, made where they appear
                self.declare(s.buffer)
        self.stmt(k.body)

    def begin_kernel(self) -> None:
        """Hook: per-kernel state of a subclass (a function may hold several kernels)."""

    def declare(self, b) -> None:
        n = math.prod(int(d) for d in b.shape)
        if b.scope == "shared":
            self.w(self.shared_decl.format(t=self.ctype(b.dtype), name=self.nm(b), n=n,
                                           align=max(b.dtype.itemsize, 16)))
        elif b.scope in ("local", "local.var"):
            self.w(f"{self.ctype(b.dtype)} {self.nm(b)}[{n}];")
        else:
            raise CompileError(f"internal: buffer {b.name} of scope {b.scope} reached the SIMT emitter", b.loc)

    def shared_bytes(self) -> int:
        total = 0
        for s in S.walk(self.kernel.body):
            if isinstance(s, S.Alloc) and s.buffer.scope == "shared" and s.buffer.alias is None:
                total += _round16(math.prod(int(d) for d in s.buffer.shape) * s.buffer.dtype.itemsize)
        return total

    # the translation unit ------------------------------------------------------------------
    def param_decl(self, p) -> str:
        if isinstance(p, E.Var):
            return f"{self.ctype(p.dtype)} {self.nm(p)}"
        return f"{self.global_space}{self.ctype(p.dtype)} *{self.restrict} {self.nm(p)}"

    def emit(self, symbols: list) -> str:
        f = self.func
        top = f.body.body if isinstance(f.body, S.Seq) else [f.body]
        kernels = [k for k in top if isinstance(k, X.SimtKernel)]
        if not kernels:
            raise CompileError(f"the {self.target} target needs a T.Kernel in {f.name}", f.loc)
        workspaces = [s.buffer for s in top if isinstance(s, S.Alloc) and s.buffer.is_global]
        args = list(f.params) + list(symbols) + workspaces
        names = {id(p): f"v[{k}]" for k, p in enumerate(args) if isinstance(p, E.Var)}
        params = ", ".join(self.param_decl(p) for p in args) or "void"
        out, launches, written = [], [], set()
        for i, k in enumerate(kernels):
            self.lines, self.ind = [], 1
            self.stmt(k)
            name = f"tg_{f.name}" + (f"_{i}" if i else "")
            try:
                grid = [host_expr(E.as_expr(g), names) for g in k.grid] + ["1"] * (3 - len(k.grid))
            except CompileError as e:
                raise e.with_loc(k.loc)
            launches.append({"name": name, "grid": grid, "threads": k.nthreads, "smem": self.shared_bytes()})
            written |= {id(_storage(s.buffer)) for s in S.walk(k.body) if isinstance(s, (S.Store, S.AtomicElem))}
            out += ["", f"{self.kernel_prefix} void {self.launch_bounds(k)}{name}({params}) {{"] + self.lines + ["}"]
        try:
            spaces = [{"dtype": b.dtype.name, "numel": host_expr(_numel(b), names)} for b in workspaces]
        except CompileError as e:
            raise e.with_loc(workspaces[0].loc)
        meta = {
            "kernels": launches,
            "params": [p.dtype.name if isinstance(p, E.Var) else f"p:{p.dtype.name}" for p in args[:len(args) -
                                                                                                  len(workspaces)]],
            "writes": [i for i, p in enumerate(f.params) if not isinstance(p, E.Var) and id(p) in written],
            "workspaces": spaces,
        }
        head = [LAUNCH_TAG + json.dumps(meta, separators=(",", ":")),
                f"// generated by tegula for the {self.target} target", f'#include "{self.prelude}"']
        return "\n".join(head + out) + "\n"

    def launch_bounds(self, k) -> str:
        return ""


def _storage(b):
    """The buffer whose storage ``b`` is: a T.reshape / T.Tensor(..., x.data) view writes into its parameter."""
    while b.alias is not None:
        b = b.alias
    return b


def _numel(b):
    n = E.Const(1, E.dt.int64)
    for d in b.shape:
        n = E.binop("*", n, E.cast(E.as_expr(d), E.dt.int64))
    return n


def _round16(n: int) -> int:
    return (n + 15) // 16 * 16
