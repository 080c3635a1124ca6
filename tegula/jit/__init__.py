"""The JIT: compile(func) -> pipeline -> source -> runtime binary, cached in memory and on disk."""
from __future__ import annotations

import importlib
import os

import tegula
from tegula import config
from tegula.errors import CompileError
from tegula.ir import expr as E
from tegula.ir.stmt import PrimFunc
from tegula.jit import cache
from tegula.jit.binding import collect_symbols
from tegula.jit.kernel import JITKernel
from tegula.jit.targets import resolve


class Lowered:
    """What ``tegula.lower`` returns: the lowered IR and the target source, not built."""

    def __init__(self, func, lowered, source, target, symbols):
        self.func, self.lowered, self.kernel_source, self.target, self.symbols = func, lowered, source, target, symbols

    def get_kernel_source(self) -> str:
        return self.kernel_source


def _normalise_out_idx(out_idx, func: PrimFunc) -> list[int]:
    n = len(func.params)
    if out_idx is None:
        return []
    idx = [out_idx] if isinstance(out_idx, int) else list(out_idx)
    out = []
    for i in idx:
        if not isinstance(i, int) or not -n <= i < n:
            raise ValueError(f"out_idx {i!r} is out of range for {func.name} with {n} parameters")
        i %= n
        if isinstance(func.params[i], E.Var):
            raise ValueError(f"out_idx {i} names the scalar parameter {func.params[i].name}; outputs must be tensors")
        if func.params[i].strides is not None:
            raise ValueError(f"out_idx {i} names the strided tensor {func.params[i].name}; the call allocates "
                             "contiguous outputs, so pass a strided output in yourself")
        out.append(i)
    return sorted(set(out))


def lower_func(func, target=None, options=None) -> Lowered:
    if not isinstance(func, PrimFunc):
        raise TypeError(f"expected a T.prim_func, got {type(func).__name__}")
    from tegula.passes.pipeline import run_pipeline
    tgt = resolve(target)
    symbols = collect_symbols(func.params)
    lowered = run_pipeline(func, tgt)
    mod, fn = tgt.emitter.split(":")
    emit = getattr(importlib.import_module(mod), fn)
    source = emit(lowered, symbols)
    _dump(func, lowered, source, tgt)
    return Lowered(func, lowered, source, tgt, symbols)


def _dump(func, lowered, source, tgt):
    d = config.get().dump_dir
    if not d:
        return
    os.makedirs(d, exist_ok=True)
    for name, text in ((f"{func.name}.ir", func.script()), (f"{func.name}.{tgt.name}.lowered.ir", lowered.script()),
                       (f"{func.name}.{tgt.source_ext}", source)):
        with open(os.path.join(d, name), "w") as f:
            f.write(text)


def _signature(func, symbols) -> list[str]:
    sig = ["p" if not isinstance(p, E.Var) else p.dtype.name for p in func.params]
    return sig + [v.dtype.name for v in symbols]


def compile_func(func, out_idx=None, target=None, options=None) -> JITKernel:
    if not isinstance(func, PrimFunc):
        raise TypeError(f"tegula.compile expects a T.prim_func, got {type(func).__name__}")
    tgt = resolve(target)
    outs = _normalise_out_idx(out_idx, func)
    from tegula import runtime
    rt = runtime.get(tgt.runtime)
    ir_text = func.script()
    ident = rt.identity() if hasattr(rt, "identity") else ""
    key = cache.key_of(ir_text, tgt.name, repr(sorted((options or {}).items())), tegula.__version__, ident)
    hit = cache.memory_get(key + repr(outs))
    if hit is not None:
        return hit
    low = lower_func(func, tgt.name, options)
    if tgt.binary:
        filename = f"{func.name}.{tgt.binary}"
        # on disk, the generated source is part of the key: a binary built before a change of the passes or the
        # emitter (same IR text, another source) is never reused
        disk_key = cache.key_of(key, cache.source_hash(low.kernel_source))
        path = cache.lookup(disk_key, filename)
        program = None
        if path is not None:
            try:
                program = rt.load(path, func.name, _signature(func, low.symbols))
            except OSError:
                cache.invalidate(disk_key, filename)  # corrupt: rebuild
        if program is None:
            def build(tmp):
                try:
                    rt.build(low.kernel_source, tmp, func.name)
                except CompileError as e:
                    raise e.with_loc(func.loc)
            path = cache.store(disk_key, filename, build, {f"{func.name}.{tgt.source_ext}": low.kernel_source})
            program = rt.load(path, func.name, _signature(func, low.symbols))
    else:
        program = rt.build(low.kernel_source, func.name)
    k = JITKernel(func, low.lowered, low.kernel_source, tgt, program, outs, low.symbols)
    cache.memory_put(key + repr(outs), k)
    return k


def _freeze(x):
    if isinstance(x, (list, tuple)):
        return tuple(_freeze(i) for i in x)
    if isinstance(x, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in x.items()))
    try:
        hash(x)
        return x
    except TypeError:
        return repr(x)


class JitFactory:
    """``@tegula.jit`` on a factory of prim_funcs: one compiled kernel per tuple of compile-time arguments. On an
    eager function (whose body is the kernel's body: see tegula/jit/eager.py), a call compiles and runs."""

    def __init__(self, fn, out_idx=None, target=None, options=None, frame_locals=None):
        self.fn, self.out_idx, self.target, self.options = fn, out_idx, target, options or {}
        self.kernels: dict = {}
        self.frame_locals = frame_locals
        self._eager = None  # None: not decided yet; False: a factory; else the EagerFunction
        self.__name__, self.__doc__, self.__wrapped__ = fn.__name__, fn.__doc__, fn

    def eager(self):
        if self._eager is None:
            from tegula.jit.eager import EagerFunction, is_eager
            self._eager = is_eager(self.fn) and EagerFunction(self.fn, self.frame_locals)
            if self._eager and self.out_idx is not None:
                raise ValueError(f"@tegula.jit(out_idx=...) on {self.fn.__name__}: an eager function declares its "
                                 "outputs with T.empty instead")
        return self._eager

    def _compile(self, func, out_idx):
        return compile_func(func, out_idx, self.target, self.options)

    def compile(self, *args, **kwargs):
        """The compiled kernel for these arguments (an eager function takes tensors or T.const keywords)."""
        ef = self.eager()
        return ef.compile(self._compile, *args, **kwargs) if ef else self(*args, **kwargs)

    def get_kernel_source(self, *args, **kwargs) -> str:
        """The generated source of the kernel these arguments compile to."""
        return self.compile(*args, **kwargs).get_kernel_source()

    def par_compile(self, configs, **_ignored):
        """Compile each configuration (a dict of keyword arguments, or a tuple of positional ones)."""
        return [self.compile(*c) if isinstance(c, tuple) else self.compile(**c) for c in configs]

    def __call__(self, *args, **kwargs):
        ef = self.eager()
        if ef:
            return ef(self._compile, *args, **kwargs)
        key = (_freeze(args), _freeze(kwargs))
        k = self.kernels.get(key)
        if k is None:
            func = self.fn(*args, **kwargs)
            if not isinstance(func, PrimFunc):
                raise TypeError(f"@tegula.jit factory {self.fn.__name__} must return a T.prim_func, got "
                                f"{type(func).__name__}")
            k = compile_func(func, self.out_idx, self.target, self.options)
            self.kernels[key] = k
        return k

    def get_tir(self, *args, **kwargs):
        ef = self.eager()
        return ef.get_tir(*args, **kwargs) if ef else self.fn(*args, **kwargs)


def _user_locals() -> dict:
    """The local names of the frame that applied the decorator (an eager body's annotations may use them)."""
    import sys
    f = sys._getframe(1)
    while f is not None and f.f_globals.get("__name__", "").startswith("tegula"):
        f = f.f_back
    return dict(f.f_locals) if f is not None and f.f_locals is not f.f_globals else {}


def jit(fn=None, *, out_idx=None, target=None, **options):
    """``@tegula.jit(out_idx=...)``: see ``tegula.jit``'s docstring in tegula/__init__.py."""
    frame_locals = _user_locals()
    if fn is None:
        return lambda f: JitFactory(f, out_idx=out_idx, target=target, options=options, frame_locals=frame_locals)
    return JitFactory(fn, out_idx=out_idx, target=target, options=options, frame_locals=frame_locals)


from tegula._callable import make_module_callable  # noqa: E402

make_module_callable(__name__, jit)
