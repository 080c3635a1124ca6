"""Timing of kernels and peers: medians over repeats, with the spread. Used by bench/, the demo and autotune."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass


@dataclass
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float
    reps: int

    @property
    def spread(self) -> float:
        """(max - min) / median: how noisy the repeats were."""
        return (self.max_ms - self.min_ms) / self.median_ms if self.median_ms else 0.0

    def __str__(self):
        return f"{self.median_ms:.4g} ms (min {self.min_ms:.4g}, max {self.max_ms:.4g}, n={self.reps})"


def do_bench(fn, warmup: int = 2, rep: int = 10, min_time_s: float = 0.05, max_time_s: float = 5.0) -> Timing:
    """Run ``fn()`` ``warmup`` times, then time repeats (at least ``rep``, and at least ``min_time_s`` in all, at
    most ``max_time_s``); each repeat is timed alone, calls batched so one sample lasts >= 1 ms."""
    for _ in range(max(1, warmup)):
        fn()
    t0 = time.perf_counter()
    fn()
    one = time.perf_counter() - t0
    inner = max(1, int(1e-3 / max(one, 1e-9)))
    samples = []
    start = time.perf_counter()
    while len(samples) < rep or time.perf_counter() - start < min_time_s:
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t) / inner * 1e3)
        if time.perf_counter() - start > max_time_s and len(samples) >= 3:
            break
    return Timing(statistics.median(samples), min(samples), max(samples), len(samples))


class TensorSupplyType:
    """What ``get_profiler(tensor_supply_type=...)`` fills input tensors with (TileLang's names).

    Auto (the default): floats uniform in [-1, 1), fp8 small integers, unsigned ints 0..2, bool 0/1, other ints
    -2..2. Integer: small integers for every dtype. Uniform: [-1, 1). Normal: N(-1, 1). Randn: N(0, 1).
    Zero / One: constants."""
    Integer, Uniform, Normal, Randn, Zero, One, Auto = "Integer", "Uniform", "Normal", "Randn", "Zero", "One", "Auto"


def supply_tensor(shape, dtype, kind="Auto"):
    """One input tensor of ``dtype`` (a tegula DType) filled as ``kind`` (a TensorSupplyType) says."""
    import torch

    from tegula.jit.binding import torch_dtype
    kind = getattr(kind, "name", kind)
    kind = str(kind).rsplit(".", 1)[-1]
    t = torch_dtype(dtype.name)
    if kind == "Zero":
        return torch.zeros(shape, dtype=t)
    if kind == "One":
        return torch.ones(shape, dtype=t)
    if dtype.is_bool:
        return torch.randint(0, 2, shape).to(t)
    if dtype.kind == "uint":
        return torch.randint(0, 3, shape).to(t)
    if dtype.is_float and dtype.bits == 8:
        return torch.randint(-128, 128, shape).float().to(t)
    if kind in ("Auto", "Uniform") and dtype.is_float:
        return torch.empty(shape).uniform_(-1.0, 1.0).to(t)
    if kind == "Normal" and dtype.is_float:
        return torch.empty(shape).normal_(-1.0, 1.0).to(t)
    if kind == "Randn" and dtype.is_float:
        return torch.randn(shape).to(t)
    if dtype.bits == 8 and kind in ("Uniform", "Normal"):
        return torch.ones(shape, dtype=t)
    return torch.randint(-2, 3, shape).to(t)


class Profiler:
    """``kernel.get_profiler(tensor_supply_type=...)``: runs and times the kernel on generated inputs of its
    declared shapes (give symbolic dims as keywords)."""

    def __init__(self, kernel, dims: dict | None = None):
        dims = dict(dims or {})
        self.supply = dims.pop("tensor_supply_type", None) or TensorSupplyType.Auto
        self.kernel, self.dims = kernel, dims
        self.func = kernel  # TileLang's name for the profiled kernel

    def inputs(self):
        from tegula.ir import expr as E
        out = []
        for i in self.kernel.binder.inputs:
            p = self.kernel.func.params[i]
            if isinstance(p, E.Var):
                raise ValueError(f"get_profiler: pass the value of scalar parameter {p.name} via do_bench(args)")
            shape = []
            for d in p.shape:
                if isinstance(d, E.Var):
                    if d.name not in self.dims:
                        raise ValueError(f"get_profiler: give the symbolic dim {d.name}, e.g. "
                                         f"kernel.get_profiler({d.name}=1024)")
                    shape.append(self.dims[d.name])
                else:
                    shape.append(int(d))
            out.append(supply_tensor(shape, p.dtype, self.supply))
        return out

    def do_bench(self, func=None, warmup: int = 2, rep: int = 10, args=None, input_tensors=None, **_hints) -> float:
        """Median milliseconds of ``func`` (default: the kernel) on ``args`` (default: generated inputs)."""
        fn = func or self.kernel
        args = args if args is not None else input_tensors
        args = list(args) if args is not None else self.inputs()
        return do_bench(lambda: fn(*args), warmup=warmup, rep=rep).median_ms

    def assert_allclose(self, ref_program, input_tensors=None, atol: float = 1e-2, rtol: float = 1e-2,
                        max_mismatched_ratio: float = 0.01, args=None) -> None:
        """Run the kernel and ``ref_program`` on the same (generated) inputs and compare every output, as
        TileLang does: at most ``max_mismatched_ratio`` of the elements may fall outside atol + rtol * |ref|;
        an output the reference gives as None is not compared."""
        import torch
        args = args if args is not None else input_tensors
        args = list(args) if args is not None else self.inputs()
        ref = ref_program(*args)
        outs = self.kernel(*args)
        outs = list(outs) if isinstance(outs, (list, tuple)) else ([] if outs is None else [outs])
        ref = list(ref) if isinstance(ref, (list, tuple)) else ([] if ref is None else [ref])
        if len(outs) != len(ref):
            raise AssertionError(f"the kernel returned {len(outs)} outputs, the reference {len(ref)}")
        for k, (o, r) in enumerate(zip(outs, ref)):
            if o is None or r is None:
                continue
            o, r = torch.as_tensor(o).float(), torch.as_tensor(r).float()
            if o.shape != r.shape:
                raise AssertionError(f"output {k}: shape {tuple(o.shape)} differs from the reference's "
                                     f"{tuple(r.shape)}")
            bad = ~torch.isclose(o, r, rtol=rtol, atol=atol, equal_nan=True)
            if bad.float().mean().item() > max_mismatched_ratio:
                torch.testing.assert_close(o, r, rtol=rtol, atol=atol, equal_nan=True,
                                           msg=lambda m: f"output {k}: {m} (more than {max_mismatched_ratio:.1%} of "
                                                         "the elements differ)")
