"""Plain-Python helpers of the TileKernels-compatible ops (quant, norm, rope, moe): argument checks that raise
TypeError / ValueError naming the argument, the kernel cache per (factory, target), and TileKernels' scale-factor
layouts. torch is imported inside functions only."""
from __future__ import annotations

import os

import tegula

_FACTORIES: dict = {}


def torch():
    import torch as _torch
    return _torch


_TARGETS: dict = {}
_KERNELS: dict = {}
# TEGULA_TARGET is read at every call, as the mapping os.environ keeps it: one dict lookup (os.environ.get encodes
# the name and decodes the value, ~0.7 us, a tenth of a small op's fixed cost). ENV.get(TARGET_VAR) is the raw
# setting (bytes on POSIX), None when unset.
ENV = getattr(os.environ, "_data", os.environ)
TARGET_VAR = getattr(os.environ, "encodekey", str)("TEGULA_TARGET")


def target() -> str:
    """TEGULA_TARGET's target, else the best available (resolved once per value of the variable)."""
    env = ENV.get(TARGET_VAR)
    name = _TARGETS.get(env)
    if name is None:
        from tegula.jit.targets import resolve
        name = _TARGETS[env] = resolve(None).name
    return name


def kernel(factory, *args):
    """The compiled kernel ``factory(*args)`` for the current target, cached per argument tuple (tegula.jit
    builds it; this dict only saves the per-call lookups, a few microseconds)."""
    tgt = target()
    k = _KERNELS.get((factory, tgt, args))
    if k is None:
        jf = _FACTORIES.get((factory, tgt))
        if jf is None:
            jf = _FACTORIES[(factory, tgt)] = tegula.jit(factory, target=tgt)
        k = _KERNELS[(factory, tgt, args)] = jf(*args)
    return k


class Recycled:
    """One call site's output memory, handed out again once the caller holds none of it. An op that returns new
    tensors of a size seen before gets the memory of its last result back where every tensor (and view, numpy
    array...) of that result is gone: its storage is then referenced by this holder alone. A fresh allocation of a
    few MB comes from the system whenever glibc has trimmed its heap in between (as torch's own allocations between
    calls make it do), and every page of it faults on first touch: ~1 ms a call of get_fused_mapping at
    16384 x 8 (2.5 MB) with a few MB allocated between calls. One slot per thread (two threads never share a
    block); without torch's storage use count (a private API) nothing is reused. Results over MAX_BYTES are not
    held (the memory a slot keeps after its caller has let go stays bounded)."""

    MAX_BYTES = 1 << 26

    def __init__(self):
        import threading
        self._local = threading.local()

    def take(self, shape: tuple, dtype):
        """A contiguous tensor of ``shape`` and ``dtype``: the memory of the last one taken here (by this
        thread) where only this holder references it, else new memory. The holder keeps its own tensor and hands
        out an alias of it (a tensor of its own on the same storage), so that a caller holding the result counts
        in the storage's use count."""
        t = torch()
        b = getattr(self._local, "block", None)
        if b is None or b.shape != shape or b.dtype is not dtype or not _only_holder(t, b):
            b = t.empty(shape, dtype=dtype)
            if b.numel() * b.element_size() > self.MAX_BYTES:
                self._local.block = None
                return b
            self._local.block = b
        return b.detach()


def _only_holder(t, b) -> bool:
    """Whether nothing but ``b`` itself references its storage (2: ``b``'s and the temporary storage object's)."""
    use_count = getattr(t._C, "_storage_Use_Count", None)
    return use_count is not None and use_count(b.untyped_storage()._cdata) == 2


STREAM_MIN = 1 << 23  # norm / rope: outputs of at least this many values are written with streaming stores


def threads() -> int:
    """The threads a c kernel's grid runs on: tegula.config's num_threads (TEGULA_NUM_THREADS) where set, else the
    cores this process may use."""
    from tegula import config
    n = config.get().num_threads
    if n > 0:
        return n
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def align(a: int, b: int) -> int:
    return ceil_div(a, b) * b


# argument checks ---------------------------------------------------------------------------------------------------

def check_tensor(x, name: str, dtypes=None, ndim=None):
    """``x`` must be a CPU torch tensor of one of ``dtypes`` with ``ndim`` dims; returns it."""
    t = torch()
    if not isinstance(x, t.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if dtypes is not None and x.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {' or '.join(str(d) for d in dtypes)}, got {x.dtype}")
    if ndim is not None and x.dim() not in (ndim if isinstance(ndim, tuple) else (ndim,)):
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(x.shape)}")
    if x.device.type != "cpu":
        raise ValueError(f"{name} is on {x.device}; tegula.ops run on the CPU here (move it with .cpu())")
    return x


def check_shape(x, name: str, shape):
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")


def check_choice(value, name: str, choices):
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(repr(c) for c in choices)}, got {value!r}")
    return value


def check_int(value, name: str, lo=None, choices=None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if choices is not None and value not in choices:
        raise ValueError(f"{name} must be one of {sorted(choices)}, got {value}")
    return value


def check_float(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    return float(value)


def check_block(value, name: str) -> tuple[int, int]:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError(f"{name} must be a pair (num_per_tokens, num_per_channels), got {value!r}")
    return check_int(value[0], f"{name}[0]", lo=1), check_int(value[1], f"{name}[1]", lo=1)


def rows_stride1(x):
    """``x`` if its last dim is contiguous (any row stride: the kernels take it), else a contiguous copy."""
    return x if x.dim() < 2 or x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous()


# TileKernels' scale-factor layouts ------------------------------------------------------------------------------

def alloc_sf(rows: int, groups: int, col_major: bool, packed: bool):
    """(the scale tensor returned to the caller, its int32 view the kernels write) for ``rows`` x ``groups``
    scales: float32 row-major (rows, groups); float32 column-major (rows, groups) with the row dim padded to a
    multiple of 4 (strides (1, align(rows, 4))); or packed UE8M0: int32 (rows, ceil(groups / 4)) column-major,
    4 exponent bytes of consecutive groups per word."""
    t = torch()
    if packed:
        store = t.empty((ceil_div(groups, 4), align(rows, 4)), dtype=t.int32)
        sf = store[:, :rows].T
        return sf, sf
    if col_major:
        store = t.empty((groups, align(rows, 4)), dtype=t.float32)
        sf = store[:, :rows].T
    else:
        sf = t.empty((rows, groups), dtype=t.float32)
    return sf, sf.view(t.int32)


def check_sf_flags(use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0) -> int:
    """The kernels' ``flags`` for these options (ROUND_SF = 1, PACKED_SF = 2), after checking them."""
    for v, n in ((use_tma_aligned_col_major_sf, "use_tma_aligned_col_major_sf"), (round_sf, "round_sf"),
                 (use_packed_ue8m0, "use_packed_ue8m0")):
        if not isinstance(v, bool):
            raise TypeError(f"{n} must be a bool, got {type(v).__name__}")
    if use_packed_ue8m0 and not (round_sf and use_tma_aligned_col_major_sf):
        raise ValueError("use_packed_ue8m0 needs round_sf=True and use_tma_aligned_col_major_sf=True (UE8M0 scales "
                         "are powers of two, stored column-major)")
    return (1 if round_sf else 0) | (2 if use_packed_ue8m0 else 0)


def sf_words(sf, name: str, rows: int, cols: int):
    """The int32 view of a float32 (any strides) or packed-UE8M0 int32 scale tensor of ``rows`` x ``cols``
    scales, and whether it is packed."""
    t = torch()
    check_tensor(sf, name, (t.float32, t.int32), 2)
    packed = sf.dtype == t.int32
    want = (rows, ceil_div(cols, 4) if packed else cols)
    if tuple(sf.shape) != want:
        raise ValueError(f"{name} must have shape {want} ({'packed UE8M0 ' if packed else ''}scales), got "
                         f"{tuple(sf.shape)}")
    return (sf if packed else sf.view(t.int32)), packed


def pair_words(x):
    """bfloat16 ``x`` (rows, columns) viewed as uint32 words of two elements (tegula.ops._bf16_pairs), or None where
    no such view exists: an odd column count or row stride, or a start that is not 4-byte aligned (a view into a
    larger tensor). Those take the element-wise kernel."""
    if x.shape[1] % 2 or x.stride(1) != 1 or x.stride(0) % 2 or x.data_ptr() % 4:
        return None
    return x.view(torch().uint32)
