"""``tegula.ops.quant``: TileKernels' quantisation casts (names, arguments and bit-exact results), kernels in T.*.

    from tegula.ops.quant import per_token_cast, per_block_cast, per_channel_cast, cast_back

- ``per_token_cast(x, fmt, num_per_channels, x_block_size=None, use_tma_aligned_col_major_sf=False,
  round_sf=False, use_packed_ue8m0=False) -> (out, sf)``: one scale per ``num_per_channels`` consecutive channels
  of a token (16, 32, 64, 128, or the whole row). ``fmt``: 'e4m3' (float8_e4m3fn, max 448), 'e2m1' (FP4, max 6,
  two values per int8 byte, low nibble first) or 'e5m6' (see ``per_token_cast_to_e5m6``). ``x``: float32 /
  bfloat16 (num_tokens, hidden), any row stride; or an already-quantised pair ``(q, q_sf)`` (q float8_e4m3fn, or
  int8 packed e2m1) whose scales cover ``x_block_size`` = (tokens, channels) blocks: it is re-quantised.
  ``_with_sf_only`` returns the scales only; ``_with_precomputed_sf(..., sf)`` casts with the scales given.
- ``per_block_cast(x, fmt, block_size, ...)``: one scale per (tokens, channels) block, 32 or 128 each way.
- ``per_channel_cast(x, fmt, num_per_tokens, round_sf=False)``: one scale per channel per 128 tokens (e4m3).
- ``cast_back((q, sf), fmt, x_block_size, x_special_fmt=None)``: dequantise to fmt 'bf16' / 'fp32'.
- ``per_token_cast_to_e5m6`` / ``cast_back_e5m6``: the 12-bit e5m6 float (8 values in 3 uint32, returned as
  uint8 (num_tokens, hidden * 3 / 2)), one scale per token (max 65024).
- ``swiglu_forward_and_per_token_cast`` / ``swiglu_backward_and_per_token_cast``: SwiGLU fused with the cast
  (kernels in ``tegula.ops._swiglu``), exported here as TileKernels does.

Numerics (TileKernels'): amax over the group, clamped below at 1e-4 (e4m3, e5m6) or 6 * 2**-126 (e2m1);
sf = amax / max and the quantised value is x * (max / amax), both float32 divisions, the cast rounding to nearest
even and saturating. ``round_sf``: sf rounded up to a power of two (UE8M0) and x multiplied by its exact inverse.
Scale layouts: float32 (num_tokens, groups) row-major; ``use_tma_aligned_col_major_sf``: column-major with the
token dim padded to a multiple of 4 (strides (1, align(num_tokens, 4))); ``use_packed_ue8m0`` (needs both other
options): int32 (num_tokens, ceil(groups / 4)) column-major, 4 exponent bytes per word, unused bytes 0.
Differences from TileKernels: packed UE8M0 without round_sf is a ValueError (TileKernels leaves it undefined);
non-contiguous inputs are read in place; everything runs on the CPU.
"""
from __future__ import annotations

from tegula.ops import _quant_kernels as K
from tegula.ops import _quant_pairs as KP
from tegula.ops import _tk
from tegula.ops._swiglu import swiglu_backward_and_per_token_cast, swiglu_forward_and_per_token_cast
from tegula.ops._tk import ceil_div

__all__ = ["per_token_cast", "per_token_cast_with_sf_only", "per_token_cast_with_precomputed_sf", "per_block_cast",
           "per_block_cast_with_sf_only", "per_block_cast_with_precomputed_sf", "per_channel_cast", "cast_back",
           "per_token_cast_back", "per_token_cast_to_e5m6", "cast_back_e5m6", "unpack_from_e2m1fn_x2",
           "swiglu_forward_and_per_token_cast", "swiglu_backward_and_per_token_cast"]

_GROUPS = (16, 32, 64, 128)
_W = 512  # columns per block of the per-token kernels (L1-sized tiles): a multiple of every group and block width
_W_WIDE = 2048  # the widest block per_token_cast takes where one divides the row (see _width)


def _dummy_sf():
    t = _tk.torch()
    return t.zeros((1, 1), dtype=t.int32)


def _width(hidden: int, unit: int) -> int:
    """Columns per block of per_token_cast on a float32 / bfloat16 input: the widest multiple of ``unit`` (128,
    every group width; 4 groups with packed UE8M0 scales, whose words hold 4 groups) in [512, 2048] that divides
    the row, else _W (512; the last block of a row is then partial). A block
    waits once for its groups' absmax -> scale chain before its cast can start, so wider blocks spread that over
    more values; past ~2048 columns the float32 tile (8 KB at 2048) and the streams around it outgrow L1 and the
    kernel slows again. 1 thread CPU time, bf16 e4m3 /128, 0.25 GiB: 7168 wide 512 -> 1792 columns 0.253 -> 0.223
    ns/value (3584: 0.266), 4096 wide 512 -> 2048 0.248 -> 0.221."""
    return _widest(hidden, unit, _W_WIDE)


def _widest(hidden: int, unit: int, hi: int) -> int:
    for w in range(hi // unit * unit, _W - 1, -unit):
        if hidden % w == 0:
            return w
    return _W


def _pairs_width(hidden: int, fmt: str, G: int, packed: bool) -> int:
    """Columns per block of per_token_pairs: _width's, but at most 1024 for e2m1, whose codes are staged as words
    beside X's tile (1 thread CPU time, 18688 x 7168 bf16 -> e2m1 /32 against the element kernel: 1792 / 1024 / 896
    / 512 columns 0.860 / 0.750 / 0.785 / 0.885; e4m3 /128 1792 / 1024 0.814 / 0.897)."""
    unit = max(128, 4 * G) if packed else 128
    return _widest(hidden, unit, 1024) if fmt == "e2m1" else _width(hidden, unit)


def _pairs_shape(hidden: int, fmt: str, G: int, col_major: bool, packed: bool):
    """(W, RB) of KP.per_token_pairs: column-major scales (packed too) take blocks of 16 rows that write their
    scales at the end (a row's written per tile are lines 75 KB apart at 18688 tokens: 2x slower); packed scales
    written per tile (rows longer than KP.staged_groups) need whole words a tile."""
    W = _pairs_width(hidden, fmt, G, False)
    if not col_major:
        return W, 0
    if packed and ceil_div(hidden, G) > KP.staged_groups(G, W):
        W = _pairs_width(hidden, fmt, G, True)
    return W, 16


def _split_input(x, x_block_size):
    """(x, its kind, its scales' int32 view or None, packed scales?, (bt, bc), logical hidden) of a cast input."""
    t = _tk.torch()
    if isinstance(x, tuple):
        if len(x) != 2:
            raise TypeError(f"x must be a tensor or a pair (q, sf), got a tuple of {len(x)}")
        if x_block_size is None:
            raise ValueError("x_block_size is required with a quantised input (q, sf)")
        bt, bc = _tk.check_block(x_block_size, "x_block_size")
        q, sf = x
        _tk.check_tensor(q, "x[0]", (t.float8_e4m3fn, t.int8, t.uint8), 2)
        kind = "e4m3" if q.dtype == t.float8_e4m3fn else "e2m1"
        if kind == "e2m1":
            q = q.view(t.uint8)
        hidden = q.shape[1] * (2 if kind == "e2m1" else 1)
        if bc not in (1,) and _W % bc != 0:
            raise ValueError(f"x_block_size[1] must divide {_W}, got {bc}")
        words, packed = _tk.sf_words(sf, "x[1]", ceil_div(q.shape[0], bt), ceil_div(hidden, bc))
        return _tk.rows_stride1(q), kind, words, packed, (bt, bc), hidden
    _tk.check_tensor(x, "x", (t.float32, t.bfloat16), 2)
    if x_block_size is not None:
        raise ValueError("x_block_size is only for a quantised input (q, sf)")
    return _tk.rows_stride1(x), ("float32" if x.dtype == t.float32 else "bfloat16"), None, False, (1, 1), x.shape[1]


def _out(num_tokens, hidden, fmt):
    t = _tk.torch()
    if fmt == "e4m3":
        out = t.empty((num_tokens, hidden), dtype=t.float8_e4m3fn)
        return out, out
    out = t.empty((num_tokens, hidden // 2), dtype=t.int8)
    return out, out.view(t.uint8)


def _per_token(x, fmt, num_per_channels, x_block_size, col_major, round_sf, packed, mode, sf=None):
    _tk.check_choice(fmt, "fmt", ("e4m3", "e2m1", "e5m6") if mode == "cast" else ("e4m3", "e2m1"))
    flags = _tk.check_sf_flags(col_major, round_sf, packed)
    if fmt == "e5m6":
        if x_block_size is not None or isinstance(x, tuple):
            raise ValueError("fmt='e5m6' takes a float32 / bfloat16 tensor only")
        return per_token_cast_to_e5m6(x, num_per_channels, col_major, round_sf, packed)
    xin, kind, xs, in_packed, xb, hidden = _split_input(x, x_block_size)
    G = _tk.check_int(num_per_channels, "num_per_channels", lo=1)
    if G not in _GROUPS and G != hidden:
        raise ValueError(f"num_per_channels must be 16, 32, 64, 128 or hidden ({hidden}), got {G}")
    if fmt == "e2m1" and hidden % 2:
        raise ValueError(f"fmt='e2m1' packs two values per byte: hidden must be even, got {hidden}")
    row = G not in _GROUPS
    if row and (kind not in ("float32", "bfloat16") or mode != "cast"):
        raise ValueError("num_per_channels == hidden supports plain per_token_cast of a float32 / bfloat16 input")
    num_tokens = xin.shape[0]
    groups = ceil_div(hidden, G)
    if mode == "with_sf":
        t = _tk.torch()
        _tk.check_tensor(sf, "sf", (t.float32,), 2)
        _tk.check_shape(sf, "sf", (num_tokens, groups))
        sf_user, sf_k = sf, sf.view(t.int32)
    else:
        sf_user, sf_k = _tk.alloc_sf(num_tokens, groups, col_major, packed)
    out, out_k = _out(num_tokens, hidden, fmt) if mode != "sf_only" else (None, None)
    if num_tokens > 0:
        q_arg = out_k if out_k is not None else _out(1, 2, fmt)[1]
        words = _tk.pair_words(xin) if kind == "bfloat16" and mode == "cast" and not row else None
        if row:
            _tk.kernel(K.per_row_cast, kind, fmt)(xin, q_arg, sf_k, hidden, flags)
        elif words is not None:  # bf16 read as words of two elements (_bf16_pairs)
            q_words = q_arg.view(_tk.torch().uint16) if fmt == "e4m3" else q_arg
            k = _tk.kernel(KP.per_token_pairs, fmt, G, *_pairs_shape(hidden, fmt, G, col_major, packed))
            k(words, q_words, sf_k, hidden, flags)
        else:
            W = _width(hidden, max(128, 4 * G) if packed else 128) if kind in ("float32", "bfloat16") else _W
            k = _tk.kernel(K.per_token_cast, kind, fmt, G, mode, xb, in_packed, W)
            k(xin, xs if xs is not None else _dummy_sf(), q_arg, sf_k, hidden, flags)
    if mode == "sf_only":
        return sf_user
    if mode == "with_sf":
        return out
    return out, sf_user


def per_token_cast(x, fmt: str, num_per_channels: int, x_block_size=None, use_tma_aligned_col_major_sf: bool = False,
                   round_sf: bool = False, use_packed_ue8m0: bool = False):
    """Cast (num_tokens, hidden) to ``fmt`` with one scale per ``num_per_channels`` channels of each token:
    returns ``(out, sf)`` with x ~= out * sf (see the module docstring for formats, layouts and numerics)."""
    return _per_token(x, fmt, num_per_channels, x_block_size, use_tma_aligned_col_major_sf, round_sf,
                      use_packed_ue8m0, "cast")


def per_token_cast_with_sf_only(x, fmt: str, num_per_channels: int, x_block_size=None,
                                use_tma_aligned_col_major_sf: bool = False, round_sf: bool = False,
                                use_packed_ue8m0: bool = False):
    """The scales ``per_token_cast`` would return, without the cast values."""
    return _per_token(x, fmt, num_per_channels, x_block_size, use_tma_aligned_col_major_sf, round_sf,
                      use_packed_ue8m0, "sf_only")


def per_token_cast_with_precomputed_sf(x, fmt: str, num_per_channels: int, sf, x_block_size=None,
                                       use_tma_aligned_col_major_sf: bool = False, round_sf: bool = False,
                                       use_packed_ue8m0: bool = False):
    """Cast with the float32 scales ``sf`` (num_tokens, groups) given: out = x * (1 / sf)."""
    if x_block_size is not None or isinstance(x, tuple):
        raise ValueError("per_token_cast_with_precomputed_sf takes a float32 / bfloat16 tensor x")
    return _per_token(x, fmt, num_per_channels, None, False, False, False, "with_sf", sf)


# per-block and per-channel -----------------------------------------------------------------------------------------

def _per_block(x, fmt, block_size, col_major, round_sf, packed, mode, sf=None):
    t = _tk.torch()
    _tk.check_choice(fmt, "fmt", ("e4m3", "e2m1"))
    flags = _tk.check_sf_flags(col_major, round_sf, packed)
    _tk.check_tensor(x, "x", (t.float32, t.bfloat16), 2)
    bt, bc = _tk.check_block(block_size, "block_size")
    if bt not in (32, 128) or bc not in (32, 128):
        raise ValueError(f"block_size must have 32 or 128 in each place, got {tuple(block_size)}")
    x = x.contiguous()
    num_tokens, hidden = x.shape
    if fmt == "e2m1" and hidden % 2:
        raise ValueError(f"fmt='e2m1' packs two values per byte: hidden must be even, got {hidden}")
    rows, groups = ceil_div(num_tokens, bt), ceil_div(hidden, bc)
    if mode == "with_sf":
        _tk.check_tensor(sf, "sf", (t.float32,), 2)
        _tk.check_shape(sf, "sf", (rows, groups))
        sf_user, sf_k = sf, sf.view(t.int32)
    else:
        sf_user, sf_k = _tk.alloc_sf(rows, groups, col_major, packed)
    out, out_k = _out(num_tokens, hidden, fmt) if mode != "sf_only" else (None, _out(1, 2, fmt)[1])
    if num_tokens > 0:
        kind = "float32" if x.dtype == t.float32 else "bfloat16"
        HP = _tk.align(hidden, max(bc, 64))
        words = _tk.pair_words(x) if kind == "bfloat16" and fmt == "e4m3" and mode == "cast" else None
        if words is not None:  # bf16 read as words of two elements (_bf16_pairs)
            _tk.kernel(KP.per_block_pairs, bt, bc, HP)(words, out_k.view(t.uint16), sf_k, hidden, flags)
        else:
            _tk.kernel(K.per_block_cast, kind, fmt, bt, bc, HP, mode)(x, out_k, sf_k, hidden, flags)
    if mode == "sf_only":
        return sf_user
    if mode == "with_sf":
        return out
    return out, sf_user


def per_block_cast(x, fmt: str, block_size, use_tma_aligned_col_major_sf: bool = False, round_sf: bool = False,
                   use_packed_ue8m0: bool = False):
    """Cast (num_tokens, hidden) with one scale per ``block_size`` = (tokens, channels) block: ``(out, sf)``."""
    return _per_block(x, fmt, block_size, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0, "cast")


def per_block_cast_with_sf_only(x, fmt: str, block_size, use_tma_aligned_col_major_sf: bool = False,
                                round_sf: bool = False, use_packed_ue8m0: bool = False):
    """The scales ``per_block_cast`` would return."""
    return _per_block(x, fmt, block_size, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0, "sf_only")


def per_block_cast_with_precomputed_sf(x, fmt: str, block_size, sf, use_tma_aligned_col_major_sf: bool = False,
                                       round_sf: bool = False, use_packed_ue8m0: bool = False):
    """Cast with the float32 per-block scales ``sf`` given."""
    return _per_block(x, fmt, block_size, False, False, False, "with_sf", sf)


def per_channel_cast(x, fmt: str, num_per_tokens: int, round_sf: bool = False):
    """Cast (num_tokens, hidden), num_tokens a multiple of 128, to e4m3 with one scale per channel per
    ``num_per_tokens`` (= 128) tokens: ``(out, sf)``, sf float32 (num_tokens / 128, hidden)."""
    t = _tk.torch()
    _tk.check_choice(fmt, "fmt", ("e4m3",))
    _tk.check_int(num_per_tokens, "num_per_tokens", choices=(128,))
    flags = _tk.check_sf_flags(False, round_sf, False)
    _tk.check_tensor(x, "x", (t.float32, t.bfloat16), 2)
    x = x.contiguous()
    num_tokens, hidden = x.shape
    if num_tokens % 128:
        raise ValueError(f"x: num_tokens must be a multiple of 128, got {num_tokens}")
    out = t.empty((num_tokens, hidden), dtype=t.float8_e4m3fn)
    sf = t.empty((num_tokens // 128, hidden), dtype=t.float32)
    if num_tokens > 0 and hidden > 0:
        kind = "float32" if x.dtype == t.float32 else "bfloat16"
        words = _tk.pair_words(x) if kind == "bfloat16" and hidden % 64 == 0 else None
        if words is not None:  # bf16 read as words of two elements (_bf16_pairs)
            _tk.kernel(KP.per_channel_pairs, hidden)(words, out.view(t.uint16), sf.view(t.int32), flags)
        else:
            _tk.kernel(K.per_channel_cast, kind, _tk.align(hidden, 64))(x, out, sf.view(t.int32), flags)
    return out, sf


# back to floats -------------------------------------------------------------------------------------------------

def cast_back(x, fmt: str, x_block_size, x_special_fmt=None):
    """Dequantise ``x = (q, sf)`` (q float8_e4m3fn, or int8 packed e2m1; sf float32 any strides, or packed UE8M0
    int32) whose scales cover ``x_block_size`` = (tokens, channels) blocks: q * sf in fmt 'bf16' or 'fp32'."""
    t = _tk.torch()
    _tk.check_choice(fmt, "fmt", ("bf16", "fp32"))
    if x_special_fmt == "e5m6":
        return cast_back_e5m6(x, fmt, x_block_size)
    if x_special_fmt is not None:
        raise ValueError(f"x_special_fmt must be None or 'e5m6', got {x_special_fmt!r}")
    if not isinstance(x, tuple) or len(x) != 2:
        raise TypeError("x must be a pair (q, sf)")
    q, sf = x
    _tk.check_tensor(q, "x[0]", (t.float8_e4m3fn, t.int8, t.uint8), 2)
    bt, bc = _tk.check_block(x_block_size, "x_block_size")
    in_fmt = "e4m3" if q.dtype == t.float8_e4m3fn else "e2m1"
    q = (q.view(t.uint8) if in_fmt == "e2m1" else q).contiguous()
    num_tokens = q.shape[0]
    hidden = q.shape[1] * (2 if in_fmt == "e2m1" else 1)
    row = bc >= hidden
    if not row and bc != 1 and _W % bc:
        raise ValueError(f"x_block_size[1] must divide {_W} (or cover the row), got {bc}")
    words, packed = _tk.sf_words(sf, "x[1]", ceil_div(num_tokens, bt), 1 if row else ceil_div(hidden, bc))
    out_dtype = t.bfloat16 if fmt == "bf16" else t.float32
    out = t.empty((num_tokens, hidden), dtype=out_dtype)
    if num_tokens > 0 and hidden > 0:
        k = _tk.kernel(K.cast_back, in_fmt, "bfloat16" if fmt == "bf16" else "float32", bt, 0 if row else bc,
                       packed, _W)
        k(q, words, out, hidden)
    return out


def per_token_cast_back(x, fmt: str, num_per_channels: int, x_special_fmt=None):
    """``cast_back(x, fmt, (1, num_per_channels), x_special_fmt)``."""
    return cast_back(x, fmt, (1, num_per_channels), x_special_fmt=x_special_fmt)


def per_token_cast_to_e5m6(x, num_per_channels: int, use_tma_aligned_col_major_sf: bool = False,
                           round_sf: bool = False, use_packed_ue8m0: bool = False):
    """Cast float32 / bfloat16 (num_tokens, hidden), hidden a multiple of 8, to e5m6 with one scale per token
    (``num_per_channels`` must equal hidden; max 65024): returns (uint8 (num_tokens, hidden * 3 / 2), sf)."""
    t = _tk.torch()
    flags = _tk.check_sf_flags(use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0)
    _tk.check_tensor(x, "x", (t.float32, t.bfloat16), 2)
    x = _tk.rows_stride1(x)
    num_tokens, hidden = x.shape
    if hidden % 8:
        raise ValueError(f"x: hidden must be a multiple of 8 for e5m6, got {hidden}")
    if _tk.check_int(num_per_channels, "num_per_channels") != hidden:
        raise ValueError(f"num_per_channels must equal hidden ({hidden}) for e5m6, got {num_per_channels}")
    out = t.empty((num_tokens, hidden // 8 * 3), dtype=t.uint32)
    sf_user, sf_k = _tk.alloc_sf(num_tokens, 1, use_tma_aligned_col_major_sf, use_packed_ue8m0)
    if num_tokens > 0:
        from tegula.ops import _e5m6_kernels as E5
        word = t.uint32 if x.dtype == t.bfloat16 else t.int64  # two elements a word
        if x.stride(0) % 2 or x.data_ptr() % word.itemsize:  # no such view: a fresh copy has one
            x = x.clone(memory_format=t.contiguous_format)
        kind = "float32" if x.dtype == t.float32 else "bfloat16"
        _tk.kernel(E5.per_row_cast_e5m6, kind, *E5.widths(hidden))(x, x.view(word), out, sf_k, hidden, flags)
    return out.view(t.uint8), sf_user


def cast_back_e5m6(x, fmt: str, x_block_size):
    """Dequantise ``(q, sf)`` from ``per_token_cast_to_e5m6`` (uint8 (num_tokens, hidden * 3 / 2)) to fmt 'bf16' or
    'fp32'; ``x_block_size`` = (tokens per scale, hidden)."""
    t = _tk.torch()
    _tk.check_choice(fmt, "fmt", ("bf16", "fp32"))
    if not isinstance(x, tuple) or len(x) != 2:
        raise TypeError("x must be a pair (q, sf)")
    q, sf = x
    _tk.check_tensor(q, "x[0]", (t.uint8,), 2)
    if q.shape[1] % 12:
        raise ValueError(f"x[0]: e5m6 rows are 12-byte groups of 8 values, got {q.shape[1]} bytes")
    q = q.contiguous() if q.data_ptr() % 4 == 0 else q.clone(memory_format=t.contiguous_format)  # uint32 words
    num_tokens, hidden = q.shape[0], q.shape[1] * 2 // 3
    bt, bc = _tk.check_block(x_block_size, "x_block_size")
    if bc != hidden:
        raise ValueError(f"x_block_size[1] must be hidden ({hidden}) for e5m6, got {bc}")
    words, packed = _tk.sf_words(sf, "x[1]", ceil_div(num_tokens, bt), 1)
    out = t.empty((num_tokens, hidden), dtype=t.bfloat16 if fmt == "bf16" else t.float32)
    if num_tokens > 0 and hidden > 0:
        from tegula.ops import _e5m6_kernels as E5
        k = _tk.kernel(E5.cast_back_e5m6, "bfloat16" if fmt == "bf16" else "float32", bt, packed,
                       E5.widths(hidden)[0])
        k(q.view(t.uint32), words, out.view(t.uint32 if fmt == "bf16" else t.int64), hidden)  # pair words
    return out


def unpack_from_e2m1fn_x2(x, out_dtype=None):
    """Decode packed e2m1 bytes (..., K) (low nibble first) to (..., 2K) values in ``out_dtype`` (float32)."""
    t = _tk.torch()
    _tk.check_tensor(x, "x", (t.int8, t.uint8))
    if x.dim() == 0:
        raise ValueError("x must have at least 1 dimension")
    out_dtype = t.float32 if out_dtype is None else out_dtype
    flat = x.reshape(-1, x.shape[-1]).view(t.uint8).contiguous()
    out = t.empty((flat.shape[0], flat.shape[1] * 2), dtype=t.float32)
    if out.numel():
        _tk.kernel(K.e2m1_unpack, _W)(flat, out)
    return out.reshape(*x.shape[:-1], x.shape[-1] * 2).to(out_dtype)

