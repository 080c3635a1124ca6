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
            self._fast = make_fast_call(self.binder, program.launch, lambda args: self._generic(args, None))

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
