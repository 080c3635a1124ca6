"""Argument binding: check a call's tensors against the kernel's parameters, bind symbolic dims, allocate
outputs. Everything is checked before anything is launched; bad input raises TypeError / ValueError."""
from __future__ import annotations

from tegula.ir import dtypes as dt
from tegula.ir import expr as E

_TORCH = None


def torch_mod():
    global _TORCH
    if _TORCH is None:
        import torch
        _TORCH = torch
    return _TORCH


def is_torch(x) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr")


def tensor_dtype(x) -> str:
    return dt.dtype(str(x.dtype)).name


def torch_dtype(name: str):
    t = torch_mod()
    return getattr(t, {"bool": "bool"}.get(name, name))


class Binder:
    """Binds the arguments of one kernel: ``params`` are Buffers and scalar Vars; ``out_idx`` positions are
    allocated by the call; ``symbols`` are the symbolic dims in the order the launch passes them."""

    def __init__(self, name: str, params: list, out_idx: list[int], symbols: list, device: str = "cpu"):
        self.name, self.params, self.out_idx, self.symbols = name, params, set(out_idx), symbols
        self.device = device  # torch device type the tensors must be on
        self.inputs = [i for i in range(len(params)) if i not in self.out_idx]
        self.sym_pos = {id(v): k for k, v in enumerate(symbols)}

    def describe(self) -> str:
        return ", ".join(getattr(self.params[i], "name", "?") for i in self.inputs)

    def bind(self, args, kwargs=None):
        """-> (arrays in parameter order, symbol values, outputs, any_torch)."""
        if kwargs:
            raise TypeError(f"kernel {self.name}() takes positional arguments only ({self.describe()})")
        if len(args) != len(self.inputs):
            raise TypeError(f"kernel {self.name}() takes {len(self.inputs)} argument(s) ({self.describe()}), "
                            f"got {len(args)}")
        values: list = [None] * len(self.symbols)
        full = [None] * len(self.params)
        any_torch = False
        for pos, a in zip(self.inputs, args):
            p = self.params[pos]
            if isinstance(p, E.Var):
                full[pos] = self._scalar(p, a)
                continue
            any_torch |= self._check_tensor(p, a, values)
            full[pos] = a
        if not any(not isinstance(self.params[i], E.Var) for i in self.inputs):
            any_torch = _torch_available()  # no tensor to take the kind from: torch, like TileLang, if present
        outs = []
        for pos in sorted(self.out_idx):
            p = self.params[pos]
            shape = []
            for d in p.shape:
                if isinstance(d, E.Var):
                    v = values[self.sym_pos[id(d)]]
                    if v is None:
                        raise ValueError(f"output {p.name}: dimension {d.name} is not bound by any input tensor")
                    shape.append(v)
                else:
                    shape.append(int(d))
            o = self._alloc(tuple(shape), p.dtype.name, any_torch)
            full[pos] = o
            outs.append(o)
        for k, v in enumerate(values):
            if v is None:
                raise ValueError(f"symbolic dimension {self.symbols[k].name} is not bound by any argument")
        return full, values, outs, any_torch

    def _scalar(self, p, a):
        if is_torch(a) or hasattr(a, "shape") and getattr(a, "shape", None) not in ((), None):
            raise TypeError(f"kernel {self.name}(): argument {p.name} is a scalar {p.dtype}, got a tensor")
        if isinstance(a, bool) or (p.dtype.is_int and not isinstance(a, int) and not hasattr(a, "__index__")):
            if not (p.dtype.is_bool and isinstance(a, bool)):
                raise TypeError(f"kernel {self.name}(): argument {p.name} must be {p.dtype}, got {type(a).__name__}")
        if not isinstance(a, (int, float)) and not hasattr(a, "item"):
            raise TypeError(f"kernel {self.name}(): argument {p.name} must be {p.dtype}, got {type(a).__name__}")
        return a.item() if hasattr(a, "item") else a

    def _check_tensor(self, p, a, values) -> bool:
        where = f"kernel {self.name}(): argument {p.name}"
        torch_in = is_torch(a)
        if not torch_in and type(a).__module__ != "numpy":
            if hasattr(a, "__dlpack__"):
                raise TypeError(f"{where}: pass a torch tensor or a numpy array (convert {type(a).__name__} with "
                                "torch.from_dlpack or np.from_dlpack)")
            raise TypeError(f"{where} must be a tensor ({p.dtype}, shape {_shape_str(p.shape)}), got "
                            f"{type(a).__name__}")
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            raise TypeError(f"{where} must be a tensor, got {type(a).__name__}")
        try:
            got = tensor_dtype(a)
        except TypeError:
            got = str(a.dtype)
        if got != p.dtype.name:
            raise TypeError(f"{where} must have dtype {p.dtype}, got {got}")
        shape = tuple(a.shape)
        if len(shape) != len(p.shape):
            raise ValueError(f"{where} must have {len(p.shape)} dims {_shape_str(p.shape)}, got shape {shape}")
        for d, (want, have) in enumerate(zip(p.shape, shape)):
            if isinstance(want, E.Var):
                k = self.sym_pos[id(want)]
                if values[k] is None:
                    values[k] = have
                elif values[k] != have:
                    raise ValueError(f"{where}: dimension {d} is {have}, but the symbolic dim {want.name} was bound to "
                                     f"{values[k]} by an earlier argument")
            elif int(want) != have:
                raise ValueError(f"{where} must have shape {_shape_str(p.shape)}, got {shape}")
        if torch_in and a.device.type != self.device:
            raise ValueError(f"{where} is on {a.device}; this target runs on the {self.device.upper()} (move it with "
                             f".{self.device}())")
        if not torch_in and self.device != "cpu":
            raise TypeError(f"{where} must be a torch {self.device} tensor, got a numpy array")
        if p.strides is not None:
            got = tuple(a.stride()) if torch_in else tuple(s // a.itemsize for s in a.strides)
            for d, (want, have) in enumerate(zip(p.strides, got)):
                if isinstance(want, E.Var):
                    k = self.sym_pos[id(want)]
                    if values[k] is None:
                        values[k] = have
                    elif values[k] != have:
                        raise ValueError(f"{where}: stride {d} is {have}, but the symbol {want.name} was bound to "
                                         f"{values[k]} by an earlier argument")
                elif int(want) != have and shape[d] != 1:
                    raise ValueError(f"{where} must have strides {_shape_str(p.strides)}, got {got}")
        elif torch_in and not a.is_contiguous():
            raise ValueError(f"{where} must be contiguous (row-major); call .contiguous() first")
        elif not torch_in and not a.flags.c_contiguous:
            raise ValueError(f"{where} must be C-contiguous; use np.ascontiguousarray first")
        return torch_in

    def _alloc(self, shape, dtype_name, any_torch):
        if any_torch:
            return torch_mod().empty(shape, dtype=torch_dtype(dtype_name), device=self.device)
        import numpy as np

        from tegula.runtime.interp import np_dtype
        return np.empty(shape, np_dtype(dtype_name))


def _torch_available() -> bool:
    try:
        torch_mod()
        return True
    except ImportError:
        return False


def _shape_str(shape) -> str:
    return "(" + ", ".join(d.name if isinstance(d, E.Var) else str(d) for d in shape) + ")"


def collect_symbols(params) -> list:
    """Symbolic dims of the parameters' shapes in order of first appearance (scalar params excluded)."""
    seen, out = set(), []
    for p in params:
        for d in tuple(getattr(p, "shape", ())) + tuple(getattr(p, "strides", None) or ()):
            if isinstance(d, E.Expr) and not isinstance(d, E.Var):
                raise ValueError(f"parameter {p.name}: a dimension must be an int or a T.dynamic symbol, got {d}")
            if isinstance(d, E.Var) and id(d) not in seen and not any(d is q for q in params):
                seen.add(id(d))
                out.append(d)
    return out


def make_fast_call(binder: Binder, launch, slow_call, direct=None):
    """A straight-line Python wrapper for the common call (contiguous CPU torch tensors of the exact dtypes and
    shapes): it checks each argument with a few attribute reads and launches; anything else goes to
    ``slow_call``, which binds generically and raises the precise error. Returns None when torch is not loaded
    (no fast path is worth building then). ``direct``: the runtime's ``(trampoline call, address)``, which
    launches instead of ``launch`` (every argument is a Python int there: the checks admit only ints for the
    integer scalars, and the trampoline serves no float ones)."""
    import sys
    torch = sys.modules.get("torch")
    if torch is None or binder.device != "cpu":
        return None
    lines, names, ptrs = [], [], []
    env = {"_launch": launch, "_slow": slow_call, "_Tensor": torch.Tensor, "_empty": torch.empty}
    sym_names = {id(v): f"s{k}" for k, v in enumerate(binder.symbols)}
    bound: set[int] = set()
    for pos in binder.inputs:
        p = binder.params[pos]
        a = f"a{pos}"
        names.append(a)
        if isinstance(p, E.Var):
            ok = "int" if p.dtype.is_int or p.dtype.is_bool else "float"
            lines.append(f"if type({a}) is not {ok}: return _slow(args)")
            ptrs.append(a)
            continue
        env[f"_td{pos}"] = torch_dtype(p.dtype.name)
        strided = p.strides is not None  # strides checked (and their symbols bound) as Binder does, after the shape
        lines.append(f"if type({a}) is not _Tensor or {a}.dtype is not _td{pos} or not {a}.is_cpu"
                     + ("" if strided else f" or not {a}.is_contiguous()") + ": return _slow(args)")
        lines.append(f"sh = {a}.shape")
        lines.append(f"if len(sh) != {len(p.shape)}: return _slow(args)")
        conds = []
        dims = [("sh", d, want) for d, want in enumerate(p.shape)]
        if strided:
            lines.append(f"st = {a}.stride()")
            dims += [("st", d, want) for d, want in enumerate(p.strides)]
        for arr, d, want in dims:
            if isinstance(want, E.Var):
                s = sym_names[id(want)]
                if id(want) in bound:
                    conds.append(f"{arr}[{d}] != {s}")
                else:
                    if conds:  # the earlier dims are checked before this one binds a symbol
                        lines.append(f"if {' or '.join(conds)}: return _slow(args)")
                        conds = []
                    lines.append(f"{s} = {arr}[{d}]")
                    bound.add(id(want))
            elif arr == "st":  # a fixed stride matters only where the dim is not 1
                conds.append(f"(st[{d}] != {int(want)} and sh[{d}] != 1)")
            else:
                conds.append(f"sh[{d}] != {int(want)}")
        if conds:
            lines.append(f"if {' or '.join(conds)}: return _slow(args)")
        ptrs.append(f"{a}.data_ptr()")
    if len(bound) != len(binder.symbols):
        return None  # symbols bound only by outputs: leave them to the generic path
    outs = []
    for pos in sorted(binder.out_idx):
        p = binder.params[pos]
        env[f"_td{pos}"] = torch_dtype(p.dtype.name)
        shape = ", ".join(sym_names[id(d)] if isinstance(d, E.Var) else str(int(d)) for d in p.shape)
        lines.append(f"o{pos} = _empty(({shape},), dtype=_td{pos})")
        outs.append(f"o{pos}")
    all_args = []
    it = iter(ptrs)
    for pos, p in enumerate(binder.params):
        all_args.append(f"o{pos}.data_ptr()" if pos in binder.out_idx else next(it))
    all_args += [sym_names[id(v)] for v in binder.symbols]
    if direct is not None:
        env["_call"], env["_address"] = direct
        lines.append(f"_call(_address, {', '.join(all_args)})")
    else:
        lines.append(f"_launch({', '.join(all_args)})")
    ret = "None" if not outs else outs[0] if len(outs) == 1 else f"[{', '.join(outs)}]"
    lines.append(f"return {ret}")
    src = f"def call({', '.join(names)}):\n    args = ({''.join(n + ', ' for n in names)})\n"
    src += "".join(f"    {ln}\n" for ln in lines)
    src = "def make():\n" + "".join("    " + ln + "\n" for ln in src.splitlines()) + "    return call\n"
    exec(compile(src, f"<tegula call {binder.name}>", "exec"), env)
    fn = env["make"]()
    fn.__tegula_source__ = src
    return fn
