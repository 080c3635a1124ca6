"""The compiled kernel object: call it with tensors; inspect its source."""
from __future__ import annotations

from tegula.jit.binding import Binder, is_torch, torch_mod


class JITKernel:
    def __init__(self, func, lowered, source: str, target, program, out_idx: list[int], symbols: list):
        self.func, self.lowered, self.source, self.target = func, lowered, source, target
        self.program, self.out_idx, self.symbols = program, out_idx, symbols
        self.binder = Binder(func.name, func.params, out_idx, symbols, device=target.device)
        self._pointer = target.args == "pointer"
        self._fast = None
        self._nargs = len(self.binder.inputs)
        if self._pointer:
            from tegula.jit.binding import make_fast_call
            self._fast = make_fast_call(self.binder, program.launch, lambda args: self._generic(args, None),
                                        getattr(program, "direct", None))

    @property
    def kernel_source(self) -> str:
        return self.source

    def get_kernel_source(self) -> str:
        """The generated source (C for ``c``, Python/numpy for ``interp``)."""
        return self.source

    def get_profiler(self, tensor_supply_type=None, **dims):
        """A profiler over generated inputs (give symbolic dims as keywords): ``.do_bench()`` -> median ms."""
        from tegula.jit.profiler import Profiler
        return Profiler(self, {**dims, "tensor_supply_type": tensor_supply_type})

    def get_ir(self) -> str:
        """The kernel's IR as text, before lowering."""
        return self.func.script()

    def __call__(self, *args, **kwargs):
        if self._fast is not None and not kwargs and len(args) == self._nargs:
            return self._fast(*args)
        return self._generic(args, kwargs)

    def bind(self, *args, vary=None):
        """A launcher for many calls on arguments shaped like ``args``, for callers that check their own inputs.

        ``args`` are checked as a call checks them (same errors; nothing is launched). The result ``launch(*ts)``
        runs the kernel with the tensors ``ts`` in the positions ``vary`` (indices into ``args``; default: every
        tensor) and ``args``' own values everywhere else: scalars, symbolic dims and the other tensors, which the
        launcher keeps alive. ``launch`` checks nothing: each tensor (torch) must have the shape, strides, element
        size and device of the one it replaces (its bits are read as the parameter's dtype); anything else is
        undefined behaviour. Kernels with ``out_idx`` outputs cannot be bound. On the ``c`` target a launch is one
        foreign call with the fixed arguments converted once (about half the time of a call's fast path);
        elsewhere it is an ordinary call on the tensors viewed as the declared dtypes."""
        if self.out_idx:
            raise ValueError(f"bind: kernel {self.func.name} creates outputs (out_idx); pass them in to bind it")
        ready = getattr(self.program, "ready", None)
        if ready is not None:
            ready()
        full, symvals, _, _ = self.binder.bind(args, None)
        tensors = [i for i, p in enumerate(self.func.params) if hasattr(p, "shape")]
        vary = tensors if vary is None else list(vary)
        if len(set(vary)) != len(vary) or any(i not in tensors for i in vary):
            raise ValueError(f"bind: vary must list distinct tensor positions of {self.func.name}'s arguments "
                             f"{tensors}, got {vary}")
        fn = getattr(self.program, "fn", None)
        lib = getattr(self.program, "lib", None)
        if not self._pointer or fn is None or lib is None or getattr(fn, "argtypes", None) is None:
            return _checked_launcher(self, full, vary)
        return _pointer_launcher(lib[fn.__name__], fn.argtypes, full + list(symvals), vary,
                                 f"<tegula bound launch {self.func.name}>", getattr(self.program, "direct", None))

    def _generic(self, args, kwargs):
        ready = getattr(self.program, "ready", None)
        if ready is not None:  # a device the kernel needs and this machine lacks: say so before anything else
            ready()
        full, symvals, outs, _ = self.binder.bind(args, kwargs)
        if self._pointer:
            self.program.launch(*[_ptr(a) for a in full], *symvals)
        else:
            self.program(*[_as_numpy(a) for a in full], *[_np_int(v) for v in symvals])
        if not outs:
            return None
        return outs[0] if len(outs) == 1 else outs

    def __repr__(self):
        return f"<tegula kernel {self.func.name} target={self.target.name}>"


def _ptr(a):
    if is_torch(a):
        return a.data_ptr()
    if hasattr(a, "ctypes"):
        return a.ctypes.data
    return a  # a scalar


def _np_int(v):
    import numpy as np
    return np.int32(v)


def _as_numpy(a):
    if is_torch(a):
        torch = torch_mod()
        from tegula.runtime.interp import np_dtype
        t = a.detach()
        name = str(t.dtype).replace("torch.", "")
        if name in ("bfloat16", "float16"):
            return t.view(torch.int16).numpy().view(np_dtype(name))
        if name.startswith("float8"):
            return t.view(torch.uint8).numpy().view(np_dtype(name))
        return t.numpy()
    if hasattr(a, "shape") or not isinstance(a, (int, float, bool)):
        return a
    return a


def _checked_launcher(kernel, full, vary):
    """Bound launches through an ordinary call; tensors of another dtype of the same width are viewed as the
    declared one (as a pointer launch reads their bits)."""
    from tegula.jit.binding import torch_dtype
    full = [None if i in vary else a for i, a in enumerate(full)]   # hold no varying tensor
    dtypes = [torch_dtype(kernel.func.params[i].dtype.name) for i in vary]

    def launch(*ts):
        args = list(full)
        for i, t, d in zip(vary, ts, dtypes):
            args[i] = t.view(d) if is_torch(t) and t.dtype != d else t
        return kernel(*args)
    return launch


def _pointer_launcher(raw, argtypes, values, vary, name, direct=None):
    """A generated ``launch(t0, t1, ...)`` calling the foreign function ``raw`` (no argtypes: each argument goes
    as it is, so fixed ones are converted here, once) with the tensors' addresses in the ``vary`` positions.
    With ``direct`` (the runtime's ``(trampoline call, address)``), every argument goes as a Python int through
    the trampoline instead (~0.5 us less per launch)."""
    import ctypes
    if direct is not None:
        call, address = direct
        env, ints = {"_call": call, "_raw": raw}, [address]   # (_raw: the library stays loaded)
        for i, (t, v) in enumerate(zip(argtypes, values)):
            if i in vary:
                ints.append(None)
            elif t is ctypes.c_void_p:
                env[f"_k{i}"] = v   # the tensor must outlive the launcher
                ints.append(_ptr(v))
            else:
                ints.append(int(t(v).value))   # the C type's value (an int narrowed as ctypes narrows it)
        params = ", ".join(f"t{j}" for j in range(len(vary)))
        parts = [f"t{vary.index(i - 1)}.data_ptr()" if a is None else str(a) for i, a in enumerate(ints)]
        src = f"def launch({params}):\n    _call({', '.join(parts)})\n"
        exec(compile(src, name, "exec"), env)
        launch = env["launch"]
        # for a caller that generates its own call (while it holds ``launch``, which keeps the fixed tensors
        # alive): ``call(*ints)`` runs the kernel, ints[0] being its address and ints[1 + p] the argument at
        # position p, None where p is in ``vary`` (the caller puts that tensor's address there)
        launch.direct = (call, tuple(ints))
        return launch
    env, parts = {"_raw": raw, "_vp": ctypes.c_void_p}, []
    for i, (t, v) in enumerate(zip(argtypes, values)):
        if i in vary:
            parts.append(f"_vp(t{vary.index(i)}.data_ptr())")
        elif t is ctypes.c_void_p:
            env[f"_k{i}"] = (v, ctypes.c_void_p(_ptr(v)))   # the tensor too: it must outlive the launcher
            parts.append(f"_k{i}[1]")
        elif t is ctypes.c_int32 and type(v) is int:
            parts.append(str(v))   # a plain int goes as a C int
        else:
            env[f"_k{i}"] = t(v)
            parts.append(f"_k{i}")
    params = ", ".join(f"t{j}" for j in range(len(vary)))
    src = f"def launch({params}):\n    _raw({', '.join(parts)})\n"
    exec(compile(src, name, "exec"), env)
    return env["launch"]
