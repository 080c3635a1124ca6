"""Buffers (global tensors and on-chip tiles) and rectangular regions of them."""
from __future__ import annotations

from tegula.errors import CompileError
from tegula.ir import expr as E
from tegula.ir.dtypes import DType
from tegula.ir.simplify import const_difference

SCOPES = ("global", "shared", "fragment", "local", "local.var")


class Buffer:
    """A multi-dimensional array: a kernel parameter (scope ``global``) or an on-chip tile.

    ``shape`` holds ints and symbolic ``Var``s (global buffers only). Row-major, contiguous.
    Indexing with scalars gives a ``Load``; with slices, a ``Region`` (for tile ops).
    """

    def __init__(self, name: str, shape, dtype: DType, scope: str, loc=None):
        if scope not in SCOPES:
            raise CompileError(f"unknown buffer scope {scope!r}; expected one of {SCOPES}")
        self.name, self.shape, self.dtype, self.scope, self.loc = name, tuple(shape), dtype, scope, loc
        self.alias: Buffer | None = None  # T.reshape: this buffer is a view of `alias`'s storage
        self.strides: tuple | None = None  # element strides of a strided global tensor (None: row-major)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def is_global(self) -> bool:
        return self.scope == "global"

    def __getitem__(self, idx):
        idx = idx if isinstance(idx, tuple) else (idx,)
        if any(i is Ellipsis for i in idx):
            k = idx.index(Ellipsis)
            idx = idx[:k] + (slice(None),) * (self.ndim - len(idx) + 1) + idx[k + 1:]
        if len(idx) != self.ndim:
            raise CompileError(f"{self.name} has {self.ndim} dimensions but is indexed with {len(idx)}")
        if any(isinstance(i, slice) for i in idx):
            return Region.from_slices(self, idx)
        return E.Load(self, tuple(E.cast(E.as_expr(i), _index_type(i)) for i in idx))

    store_hook = None  # set by the frontend: `buf[i] = v` in plain Python helpers called from a kernel

    def __setitem__(self, idx, value):
        if Buffer.store_hook is None:
            raise CompileError(f"{self.name}[...] = ... is only meaningful inside a kernel")
        Buffer.store_hook(self, idx, value)

    @property
    def data(self) -> "BufferData":
        """The buffer's storage, for ``T.Tensor(shape, dtype, buf.data)`` views."""
        return BufferData(self)

    def access_ptr(self, *args, **kwargs):
        raise CompileError("access_ptr is not supported by tegula; pass the buffer itself")

    def __repr__(self):
        return f"Buffer({self.name}, {list(self.shape)}, {self.dtype}, {self.scope})"


class BufferData:
    """``buf.data``: a handle to a buffer's storage; only useful to declare a view of it."""

    def __init__(self, buffer: Buffer):
        self.buffer = buffer


def _index_type(i):
    t = E.as_expr(i).dtype
    if not t.is_int and not t.is_bool:
        raise CompileError(f"buffer index must be an integer, got {t}")
    return t if t.bits == 64 else E.dt.int32


class Region:
    """A box of a buffer: per dimension a start and an extent; ``keep[d]`` is False where a scalar
    index dropped the dimension (``Q[b, i0:i1, h, :]`` is a 2-D tile of a 4-D tensor)."""

    def __init__(self, buffer: Buffer, starts, extents, keep):
        self.buffer, self.starts, self.extents, self.keep = buffer, tuple(starts), tuple(extents), tuple(keep)

    @staticmethod
    def full(buffer: Buffer) -> "Region":
        return Region(buffer, (0,) * buffer.ndim, buffer.shape, (True,) * buffer.ndim)

    @staticmethod
    def from_slices(buffer: Buffer, idx) -> "Region":
        starts, extents, keep = [], [], []
        for d, i in enumerate(idx):
            if isinstance(i, slice):
                if i.step not in (None, 1):
                    raise CompileError(f"{buffer.name}: slices with a step are not supported in tile regions")
                lo = 0 if i.start is None else i.start
                hi = buffer.shape[d] if i.stop is None else i.stop
                ext = const_difference(hi, lo)
                if ext is None:
                    raise CompileError(f"{buffer.name}[{lo}:{hi}]: the extent of a tile region must be a "
                                       "compile-time constant (write the start and a constant length)")
                starts.append(lo)
                extents.append(ext)
                keep.append(True)
            else:
                starts.append(i)
                extents.append(1)
                keep.append(False)
        return Region(buffer, starts, extents, keep)

    @staticmethod
    def from_start(load: E.Load, shape) -> "Region":
        """``A[i, j]`` used as a tile: the extents come from the other side, aligned to the trailing dims."""
        buf, nd = load.buffer, load.buffer.ndim
        if len(shape) > nd:
            raise CompileError(f"{buf.name} has {nd} dimensions; a {len(shape)}-D tile cannot start at one element")
        extents = (1,) * (nd - len(shape)) + tuple(shape)
        keep = (False,) * (nd - len(shape)) + (True,) * len(shape)
        return Region(buf, load.indices, extents, keep)

    @property
    def shape(self) -> tuple:
        """The tile's shape: the extents of the kept dimensions."""
        return tuple(e for e, k in zip(self.extents, self.keep) if k)

    @property
    def dtype(self) -> DType:
        return self.buffer.dtype

    def is_full(self) -> bool:
        return all(E.const_value(s) == 0 for s in self.starts) and all(
            _same(e, d) for e, d in zip(self.extents, self.buffer.shape))

    def __repr__(self):
        from tegula.ir.printer import region_str
        return region_str(self)


def _same(a, b) -> bool:
    return a is b or (E.const_value(a) is not None and E.const_value(a) == E.const_value(b))


def as_region(x, other_shape=None) -> Region:
    """A tile-op operand as a region: a buffer, a sliced region, or an element start ``A[i, j]``."""
    if isinstance(x, Region):
        return x
    if isinstance(x, Buffer):
        return Region.full(x)
    if isinstance(x, E.Load):
        return Region.from_start(x, other_shape if other_shape is not None else ())
    if hasattr(x, "buffer") and isinstance(getattr(x, "buffer"), Buffer):  # a T.alloc_var used as a tile
        return Region.full(x.buffer)
    raise CompileError(f"expected a buffer or a region of one, got {type(x).__name__} {x!r}")
