"""The ``interp`` runtime: executes the Python/numpy program that codegen/python.py emits.

The helpers below are the interp target's "device library": whole-tile operations on numpy arrays with
exact dtype semantics (round to nearest even; float8_e4m3fn saturates to +-448 like torch). On-chip buffers
start as NaN (floats) so a kernel that reads a tile before writing it is caught here, not on hardware.
"""
from __future__ import annotations

import math

import numpy as np

_NP = None


def np_dtype(name: str):
    """The numpy dtype of a tegula dtype name (bf16 / fp8 from ml_dtypes)."""
    global _NP
    if _NP is None:
        import ml_dtypes
        _NP = {"bool": np.bool_, "int8": np.int8, "int16": np.int16, "int32": np.int32, "int64": np.int64,
               "uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64,
               "float16": np.float16, "float32": np.float32, "float64": np.float64,
               "bfloat16": ml_dtypes.bfloat16, "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
               "float8_e5m2": ml_dtypes.float8_e5m2, "float8_e8m0fnu": ml_dtypes.float8_e8m0fnu}
        _NP = {k: np.dtype(v) for k, v in _NP.items()}
    return _NP[name]


class InterpError(RuntimeError):
    """A kernel did something undefined while interpreted (e.g. an out-of-bounds access)."""


def _scalar(value, dtype: str):
    return np_dtype(dtype).type(value)


def _f32(x):
    return np.asarray(x).astype(np.float32) if np.ndim(x) else np.float32(x)


def _to_e8m0(x):
    # torch's float -> float8_e8m0fnu: the sign is dropped, the exponent rounds half up on the mantissa,
    # inf/NaN become NaN (0xff), zero and denormals the smallest exponent.
    bits = np.asarray(x, np.float32).view(np.uint32) & np.uint32(0x7FFFFFFF)
    e = (bits >> np.uint32(23)).astype(np.int64)
    m = bits & np.uint32(0x7FFFFF)
    up = (m > 0x400000) | ((m == 0x400000) & (e > 0))
    out = np.where(e == 255, 255, e + up).astype(np.uint8)
    return out.view(np_dtype("float8_e8m0fnu"))


def _cast(x, dtype: str):
    """Convert with tegula's (= torch's) rounding and saturation rules."""
    target = np_dtype(dtype)
    arr = np.asarray(x)
    if arr.dtype == target:
        return x
    if dtype == "float8_e4m3fn" or dtype == "float8_e8m0fnu":
        f = arr.astype(np.float32)
        if dtype == "float8_e4m3fn":
            f = np.where(np.isnan(f), f, np.clip(f, -448.0, 448.0))
            out = f.astype(target)
        else:
            out = _to_e8m0(f)
        return out if arr.ndim else out[()]
    if target.kind in "iub" and arr.dtype.kind == "f" and target != np.bool_:
        with np.errstate(invalid="ignore"):
            arr = np.trunc(arr.astype(np.float64))
            arr = np.where(np.isfinite(arr), arr, 0)
            lo, hi = np.iinfo(target).min, np.iinfo(target).max
            out = np.clip(arr, lo, hi).astype(target)
        return out if np.ndim(x) else out[()]
    if target == np.bool_:
        out = arr != 0
        return out if np.ndim(x) else out[()]
    if arr.dtype.kind in "iub" and target.kind == "f" and target.itemsize < 4:
        arr = arr.astype(np.float32)
    out = arr.astype(target)
    return out if np.ndim(x) else out[()]


def _reinterpret(x, dtype: str):
    out = np.asarray(x).view(np_dtype(dtype))
    return out if np.ndim(x) else out[()]


def _range(start, extent):
    s, n = int(start), int(extent)
    return (np.int32(s + k) for k in range(n))


def _alloc(shape, dtype: str):
    t = np_dtype(dtype)
    return np.full(shape, np.nan, t) if t.kind == "f" or dtype.startswith("float") else np.zeros(shape, t)


def _ix(buf, idx):
    for d, (i, n) in enumerate(zip(idx, buf.shape)):
        if not 0 <= i < n:
            raise InterpError(f"index {int(i)} is out of bounds for dimension {d} (size {n}) of a {buf.shape} "
                              "buffer")
    return tuple(int(i) for i in idx)


def _and(mask, cond):
    return cond if mask is None else np.logical_and(mask, cond)


def _where(c, a, b):
    out = np.where(c, a, b)
    return out if out.ndim else out[()]


def _tdiv(a, b):
    a64, b64 = np.asarray(a).astype(np.int64), np.asarray(b).astype(np.int64)
    safe = np.where(b64 == 0, 1, b64)
    q = np.where(b64 == 0, 0, np.abs(a64) // np.abs(safe) * np.sign(a64) * np.sign(safe))
    return _same_int(q, a)


def _fdiv(a, b):
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return np.where(np.asarray(b) == 0, np.zeros_like(a), np.floor_divide(a, np.where(np.asarray(b) == 0, 1, b))
                        )[()] if np.ndim(a) or np.ndim(b) else (a // b if b else type(a)(0))


def _fmod(a, b):
    with np.errstate(divide="ignore", invalid="ignore"):
        if np.ndim(a) or np.ndim(b):
            return np.where(np.asarray(b) == 0, np.zeros_like(a), np.mod(a, np.where(np.asarray(b) == 0, 1, b)))
        return a % b if b else type(a)(0)


def _fmod_float(a, b):
    return a - np.floor(a / b) * b


def _same_int(q, like):
    t = np.asarray(like).dtype
    q = q.astype(t)
    return q if np.ndim(q) else q[()]


def _rsqrt(x):
    return np.reciprocal(np.sqrt(x))


def _sigmoid(x):
    one = np.asarray(x).dtype.type(1)
    with np.errstate(over="ignore"):
        return one / (one + np.exp(-x))


_erf_u = np.frompyfunc(math.erf, 1, 1)


def _erf(x):
    t = np.asarray(x).dtype
    out = _erf_u(np.asarray(x, np.float64)).astype(t)
    return out if np.ndim(x) else out[()]


def _fma(a, b, c):
    """float32 a * b + c rounded once: the product is exact in float64, the float64 sum is made round-to-odd
    (its last bit set where the sum was inexact), and round-to-odd with 29 spare bits rounds to float32 exactly
    as one rounding of the exact value would."""
    a, b, c = (np.asarray(v, np.float32).astype(np.float64) for v in (a, b, c))
    p = a * b
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)  # the exact error of s (TwoSum)
    bits = s.view(np.int64)
    odd = np.where((err != 0) & ((bits & 1) == 0), np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    with np.errstate(over="ignore"):
        return odd.astype(np.float32)[()]


def _round(x):
    return np.where(x >= 0, np.floor(x + 0.5), np.ceil(x - 0.5)).astype(np.asarray(x).dtype)[()]


def _popcount(x):
    v = np.asarray(x)
    flat = np.ascontiguousarray(v.reshape(-1))   # 1-D: a 0-d array (a scalar local) cannot be viewed as bytes
    bits = np.unpackbits(flat.view(np.uint8).reshape(v.size, -1), axis=-1).sum(-1).reshape(v.shape)
    return bits.astype(v.dtype)[()]


def _clz(x):
    v = np.asarray(x)
    u = v.view(np.dtype(f"uint{v.dtype.itemsize * 8}")).astype(np.uint64)
    width = v.dtype.itemsize * 8
    length = sum((u >> np.uint64(b)) != 0 for b in range(width))  # bit length
    return (width - np.asarray(length, np.int64)).astype(v.dtype)[()]


# T.Parallel (vector mode) ------------------------------------------------------------------------

def _iota(shape, d, start):
    n = len(shape)
    r = np.arange(shape[d], dtype=np.int32) + np.int32(start)
    return r.reshape((1,) * d + (-1,) + (1,) * (n - d - 1))


def _check(buf, idx, mask):
    for d, (i, n) in enumerate(zip(idx, buf.shape)):
        bad = (i < 0) | (i >= n)
        if mask is not None:
            bad = bad & mask
        if np.any(bad):
            first = int(np.broadcast_to(i, np.shape(bad))[bad].flat[0])
            raise InterpError(f"index {first} is out of bounds for dimension {d} (size {n}) of a {buf.shape} buffer")


def _vld(buf, idx, mask):
    _check(buf, idx, mask)
    if mask is not None:
        idx = tuple(np.clip(i, 0, n - 1) for i, n in zip(idx, buf.shape))
    out = buf[tuple(np.asarray(i, np.int64) for i in idx)]
    return out if np.ndim(out) else out[()]


def _masked_points(buf, idx, value, mask, shape):
    """The (indices, values) a T.Parallel store or atomic touches: broadcast to the loop space, mask applied."""
    _check(buf, idx, mask)
    full = np.broadcast_shapes(shape, *(np.shape(i) for i in idx), np.shape(value))
    idx = [np.broadcast_to(i, full) for i in idx]
    value = np.broadcast_to(np.asarray(value), full)
    if mask is not None:
        m = np.broadcast_to(mask, full)
        idx, value = [i[m] for i in idx], value[m]
    return tuple(np.asarray(i, np.int64).ravel() for i in idx), np.ravel(value)


def _vst(buf, idx, value, mask, shape):
    idx, value = _masked_points(buf, idx, value, mask, shape)
    buf[idx] = value


_UFUNC = {"add": np.add, "max": np.fmax, "min": np.fmin}


def _vatomic(kind, buf, idx, value, mask, shape):
    idx, value = _masked_points(buf, idx, value, mask, shape)
    _UFUNC[kind].at(buf, idx, value)


# tile ops --------------------------------------------------------------------------------------

def _bounds(buf, starts, exts, glob):
    idx = [np.arange(e, dtype=np.int64) + int(s) for s, e in zip(starts, exts)]
    if glob:
        valid = [(i >= 0) & (i < n) for i, n in zip(idx, buf.shape)]
    else:
        for d, (i, n) in enumerate(zip(idx, buf.shape)):
            if len(i) and (i[0] < 0 or i[-1] >= n):
                raise InterpError(f"tile [{i[0]}, {i[-1]}] is out of bounds for dimension {d} (size {n}) of an "
                                  f"on-chip {buf.shape} buffer")
        valid = None
    return idx, valid


def _read(region, shape):
    buf, starts, exts, glob = region
    idx, valid = _bounds(buf, starts, exts, glob)
    if valid is None:
        out = buf[tuple(slice(i[0], i[-1] + 1) for i in idx)]
    else:
        out = np.zeros(tuple(exts), buf.dtype)
        sel = [np.nonzero(v)[0] for v in valid]
        if all(len(s) for s in sel):
            out[np.ix_(*sel)] = buf[np.ix_(*[i[s] for i, s in zip(idx, sel)])]
    return out.reshape(shape)


def _write(region, values):
    buf, starts, exts, glob = region
    idx, valid = _bounds(buf, starts, exts, glob)
    values = np.broadcast_to(np.asarray(values), tuple(exts)) if np.ndim(values) == 0 else values.reshape(exts)
    if valid is None:
        buf[tuple(slice(i[0], i[-1] + 1) for i in idx)] = values
        return
    sel = [np.nonzero(v)[0] for v in valid]
    if all(len(s) for s in sel):
        buf[np.ix_(*[i[s] for i, s in zip(idx, sel)])] = values[np.ix_(*sel)]


def _copy(sb, ss, se, sg, db, ds, de, dg):
    vals = _read((sb, ss, se, sg), tuple(se))
    _write((db, ds, de, dg), _cast(vals, _name(db.dtype)))


def _fill(db, ds, de, dg, value):
    _write((db, ds, de, dg), np.asarray(value, db.dtype))


def _name(npdt) -> str:
    for k in ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
              "float32", "float64", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu"):
        if np_dtype(k) == npdt:
            return k
    raise InterpError(f"unsupported dtype {npdt}")


def _gemm(a, b, c, trans_a, trans_b, clear, a_shape, b_shape):
    A = _read(a, a_shape)
    B = _read(b, b_shape)
    A = A.reshape(-1, A.shape[-1]) if A.ndim != 2 else A
    B = B.reshape(-1, B.shape[-1]) if B.ndim != 2 else B
    A, B = (A.T if trans_a else A), (B.T if trans_b else B)
    cbuf = c[0]
    if cbuf.dtype.kind in "iu":
        acc = (A.astype(np.int64) @ B.astype(np.int64))
    else:
        acc = A.astype(np.float32) @ B.astype(np.float32)
    old = 0 if clear else _read(c, (A.shape[0], B.shape[1])).astype(acc.dtype)
    _write(c, _cast(old + acc, _name(cbuf.dtype)))


def _reduce(kind, src, dst, src_shape, dim, clear):
    x = _read(src, src_shape)
    work = x.astype(np.float32) if x.dtype.kind == "f" and x.dtype.itemsize < 4 else x
    if kind in ("abssum", "absmax"):
        work = np.abs(work)
    if kind in ("sum", "abssum"):
        r = np.sum(work, axis=dim, dtype=np.int64 if work.dtype.kind in "iub" else work.dtype)
    elif kind in ("max", "absmax"):
        r = np.fmax.reduce(work, axis=dim)
    else:
        r = np.fmin.reduce(work, axis=dim)
    dname = _name(dst[0].dtype)
    if not clear:
        old = _read(dst, r.shape).astype(r.dtype)
        r = {"sum": np.add, "abssum": np.add, "max": np.fmax, "absmax": np.fmax, "min": np.fmin}[kind](old, r)
    _write(dst, _cast(r, dname))


def _atomic(kind, dst, value):
    buf, starts, exts, glob = dst
    idx, valid = _bounds(buf, starts, exts, glob)
    v = np.broadcast_to(np.asarray(value), tuple(exts)) if np.ndim(value) == 0 else np.asarray(value).reshape(exts)
    if valid is not None:
        sel = [np.nonzero(m)[0] for m in valid]
        if not all(len(s) for s in sel):
            return
        idx, v = [i[s] for i, s in zip(idx, sel)], v[np.ix_(*sel)]
    grids = np.ix_(*idx)
    cur = buf[grids]
    buf[grids] = _cast(_UFUNC[kind](cur.astype(np.float64) if cur.dtype.kind == "f" else cur, v), _name(buf.dtype))


HELPERS = {k: v for k, v in globals().items() if k.startswith("_") and callable(v) and not k.startswith("__")}


class InterpProgram:
    """A loaded interp program: call it with numpy arrays (and scalars) in parameter order."""

    def __init__(self, source: str, name: str):
        self.source, self.name = source, name
        ns = dict(HELPERS)
        ns["np"] = np
        exec(compile(source, f"<tegula interp {name}>", "exec"), ns)
        self.fn = ns[name]

    def __call__(self, *args):
        with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
            self.fn(*args)


def build(source: str, name: str) -> InterpProgram:
    return InterpProgram(source, name)
