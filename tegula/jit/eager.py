"""Eager @tegula.jit functions: the decorated function's body is the kernel function's body.

    @tegula.jit
    def matmul(A, B, block_M: int = 64):
        M, N, K = T.const("M, N, K")
        A: T.Tensor((M, K), T.float16)
        B: T.Tensor((K, N), T.float16)
        C = T.empty((M, N), T.float32)
        with T.Kernel(...) as (bx, by):
            ...
        return C

    C = matmul(a, b)                              # compile for these shapes (cached) and run
    kernel = matmul.compile(M=1024, N=256, K=512)  # or compile only; kernel(a, b) returns C

Parameters annotated as tensors or scalars (``T.Tensor(...)``, ``T.int32``; in the signature or by a bare
annotation in the body) are the kernel's arguments; the others are compile-time values, as for a factory.
``T.const`` dimensions are matched against the arguments' shapes (or given as keywords) and the kernel is
specialised for them; ``T.dynamic`` ones stay symbolic. ``T.empty`` tensors are allocated by the call.
"""
from __future__ import annotations

import ast
import inspect

from tegula.ir import dtypes as dt
from tegula.ir import expr as E
from tegula.ir.buffer import Buffer
from tegula.language.builder import EagerState
from tegula.language.parser import Source, parse_eager
from tegula.language.surface import TensorType


def is_eager(fn) -> bool:
    """An eager function writes the kernel body itself; a factory defines a T.prim_func and returns it."""
    try:
        fdef = Source(fn).fdef
    except Exception:  # noqa: BLE001 - no source: a plain factory
        return False
    nested = [n for n in ast.walk(fdef) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n is not fdef]
    if any("prim_func" in ast.unparse(d) for n in nested for d in n.decorator_list):
        return False
    for n in ast.walk(fdef):
        if isinstance(n, ast.AnnAssign) and n.value is None:
            return True
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("const", "empty",
                                                                                             "Kernel"):
            return True
    return False


class EagerFunction:
    def __init__(self, fn, frame_locals: dict | None = None):
        self.fn, self.frame_locals = fn, frame_locals or {}
        self.sig = inspect.signature(fn)
        src = Source(fn, self.frame_locals)
        env = src.scope()
        self.sig_anns = {}
        for name, p in self.sig.parameters.items():
            ann = p.annotation
            if isinstance(ann, str):
                try:
                    ann = eval(ann, env)  # noqa: S307 - the user's own annotation text
                except Exception:  # noqa: BLE001
                    continue
            if isinstance(ann, (TensorType, dt.DType)):
                self.sig_anns[name] = ann
        declared = {n.target.id for n in ast.walk(src.fdef)
                    if isinstance(n, ast.AnnAssign) and n.value is None and isinstance(n.target, ast.Name)}
        self.runtime = [n for n in self.sig.parameters if n in self.sig_anns or n in declared]
        self.decls: dict = {}
        self.kernels: dict = {}

    # arguments ---------------------------------------------------------------------------------
    def split(self, args, kwargs):
        """-> (runtime values, compile-time values, extra keywords: T.const values)."""
        params = self.sig.parameters
        extras = {k: v for k, v in kwargs.items() if k not in params}
        bound = self.sig.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in params})
        bound.apply_defaults()
        runtime = {n: bound.arguments[n] for n in self.runtime if n in bound.arguments}
        compile_values = {n: v for n, v in bound.arguments.items() if n not in self.runtime}
        missing = [n for n in params if n not in self.runtime and n not in compile_values]
        if missing:
            raise TypeError(f"{self.fn.__name__}() missing compile-time argument(s): {', '.join(missing)}")
        return runtime, compile_values, extras

    def declarations(self, compile_values):
        from tegula.jit import _freeze
        key = _freeze(compile_values)
        if key not in self.decls:
            st = EagerState(1)
            parse_eager(self.fn, st, self.runtime, compile_values, self.sig_anns, self.frame_locals)
            self.decls[key] = st
        return self.decls[key]

    def const_values(self, st, runtime, extras) -> dict:
        values = {}
        for n, v in extras.items():
            if n not in st.symbols:
                raise TypeError(f"{self.fn.__name__}() got an unexpected keyword argument {n!r}")
            values[n] = int(v)
        for name, decl in st.params.items():
            if not isinstance(decl, Buffer) or name not in runtime:
                continue
            shape = getattr(runtime[name], "shape", None)
            if shape is None:
                continue
            shape = tuple(shape)
            if len(shape) != len(decl.shape):
                raise ValueError(f"{self.fn.__name__}: argument {name} has {len(shape)} dimensions, its annotation "
                                 f"{len(decl.shape)}")
            for d, n in zip(decl.shape, shape):
                if isinstance(d, E.Var) and st.symbols.get(d.name) is d:
                    n = int(n)
                    if values.setdefault(d.name, n) != n:
                        raise ValueError(f"{self.fn.__name__}: T.const {d.name} is {values[d.name]} by one argument "
                                         f"and {n} by {name}")
        missing = [n for n in st.symbols if n not in values]
        if missing:
            raise TypeError(f"{self.fn.__name__}: no value for T.const {', '.join(missing)}: pass a tensor whose "
                            "annotation uses it as a dimension, or give it as a keyword")
        return values

    # compile and call --------------------------------------------------------------------------
    def get_tir(self, *args, **kwargs):
        return self._build(*self.split(args, kwargs))[0]

    def _build(self, runtime, compile_values, extras):
        values = self.const_values(self.declarations(compile_values), runtime, extras)
        st = EagerState(2, values)
        func, ret = parse_eager(self.fn, st, self.runtime, compile_values, self.sig_anns, self.frame_locals)
        return func, ret, st, values

    def compile(self, jit_compile, *args, **kwargs):
        """The compiled kernel for these arguments (tensors, or shapes as keywords); ``jit_compile(func, out_idx)``
        builds one."""
        from tegula.jit import _freeze
        runtime, compile_values, extras = self.split(args, kwargs)
        st1 = self.declarations(compile_values)
        key = (_freeze(compile_values), tuple(sorted(self.const_values(st1, runtime, extras).items())))
        k = self.kernels.get(key)
        if k is None:
            func, ret, st, _ = self._build(runtime, compile_values, extras)
            n_in = len(func.params) - len(st.outputs)
            k = jit_compile(func, list(range(n_in, len(func.params))))
            k.eager_return = _return_spec(ret, st, func)
            self.kernels[key] = k
        return k

    def __call__(self, jit_compile, *args, **kwargs):
        k = self.compile(jit_compile, *args, **kwargs)
        runtime, _, _ = self.split(args, kwargs)
        inputs = []
        for n in self.runtime:
            if n not in runtime:
                raise TypeError(f"{self.fn.__name__}() missing argument {n!r}")
            inputs.append(runtime[n])
        outs = k(*inputs)
        outs = [] if outs is None else (list(outs) if isinstance(outs, (list, tuple)) else [outs])
        spec, single = k.eager_return
        got = [outs[i] if kind == "out" else runtime[i] for kind, i in spec]
        if single:
            return got[0] if got else None
        return tuple(got)


def _return_spec(ret, st, func):
    """How the call's result is made of the kernel's outputs and arguments: ([(kind, index/name)], single)."""
    if ret is None:
        return [], True
    items = list(ret) if isinstance(ret, (tuple, list)) else [ret]
    spec = []
    for x in items:
        if any(x is o for o in st.outputs):
            spec.append(("out", next(i for i, o in enumerate(st.outputs) if o is x)))
        elif isinstance(x, Buffer) and any(x is p for p in func.params):
            spec.append(("arg", x.name))
        else:
            raise TypeError(f"{func.name} returns {x!r}; an eager @tegula.jit function returns T.empty tensors or "
                            "its tensor arguments")
    return spec, not isinstance(ret, (tuple, list))
