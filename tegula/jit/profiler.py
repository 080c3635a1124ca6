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


class Profiler:
    """``kernel.get_profiler()``: times the kernel on random inputs of its declared shapes."""

    def __init__(self, kernel, dims: dict | None = None):
        dims = dict(dims or {})
        dims.pop("tensor_supply_type", None)  # TileLang's knob; tegula always supplies random normal data
        self.kernel, self.dims = kernel, dims

    def inputs(self):
        import torch

        from tegula.ir import expr as E
        from tegula.jit.binding import torch_dtype
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
            t = torch_dtype(p.dtype.name)
            if p.dtype.is_float:
                out.append(torch.randn(shape).to(t))
            elif p.dtype.is_bool:
                out.append(torch.zeros(shape, dtype=t))
            else:
                out.append(torch.randint(0, 8, shape).to(t))
        return out

    def do_bench(self, func=None, warmup: int = 2, rep: int = 10, args=None) -> float:
        """Median milliseconds of ``func`` (default: the kernel) on ``args`` (default: random inputs)."""
        fn = func or self.kernel
        args = list(args) if args is not None else self.inputs()
        return do_bench(lambda: fn(*args), warmup=warmup, rep=rep).median_ms

    def assert_allclose(self, ref_program, rtol: float = 1e-2, atol: float = 1e-2, args=None) -> None:
        """Run the kernel and ``ref_program`` on the same (random) inputs and compare every output."""
        import torch
        args = list(args) if args is not None else self.inputs()
        outs = self.kernel(*args)
        ref = ref_program(*args)
        outs = outs if isinstance(outs, (list, tuple)) else [outs]
        ref = ref if isinstance(ref, (list, tuple)) else [ref]
        if len(outs) != len(ref):
            raise AssertionError(f"the kernel returned {len(outs)} outputs, the reference {len(ref)}")
        for o, r in zip(outs, ref):
            torch.testing.assert_close(torch.as_tensor(o).float(), torch.as_tensor(r).float(), rtol=rtol, atol=atol)
