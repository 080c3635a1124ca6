"""``import tegula.language as T``: TileLang's surface.

Nothing here knows any target. ``@T.prim_func`` parses a kernel into IR at decoration time.
"""
import sys

from tegula.ir.dtypes import (  # noqa: F401
    bfloat16,
    float8_e4m3fn,
    float8_e5m2,
    float8_e8m0fnu,
    float16,
    float32,
    float64,
    int8,
    int16,
    int32,
    int64,
    uint8,
    uint16,
    uint32,
    uint64,
)
from tegula.ir.dtypes import bool_ as bool  # noqa: F401
from tegula.language.parser import Macro, parse
from tegula.language.surface import (  # noqa: F401
    Cast,
    Fragment,
    GemmWarpPolicy,
    Kernel,
    Layout,
    Parallel,
    Persistent,
    Pipelined,
    StridedTensor,
    Tensor,
    abs,
    alloc_buffer,
    alloc_fragment,
    alloc_global,
    alloc_local,
    alloc_shared,
    alloc_var,
    annotate_l2_hit_ratio,
    annotate_layout,
    annotate_padding,
    assume,
    cast,
    ceil,
    ceildiv,
    clamp,
    clz,
    const,
    cos,
    device_assert,
    disable_warp_group_reg_alloc,
    dtype,
    dynamic,
    empty,
    erf,
    exp,
    exp2,
    floor,
    floordiv,
    floormod,
    fma,
    get_block_binding,
    get_block_bindings,
    grid,
    if_then_else,
    index_to_coordinates,
    infinity,
    isinf,
    isnan,
    log,
    log2,
    log10,
    make_swizzled_layout,
    max,
    max_value,
    min,
    min_value,
    no_set_max_nreg,
    popcount,
    pow,
    reinterpret,
    reshape,
    rsqrt,
    serial,
    set_max_nreg,
    shift_left,
    shift_right,
    sigmoid,
    sin,
    sqrt,
    symbolic,
    sync_threads,
    tanh,
    trunc,
    truncdiv,
    truncmod,
    unroll,
    use_swizzle,
    vectorized,
    view,
)
from tegula.language.tile import (  # noqa: F401
    atomic_add,
    atomic_addx2,
    atomic_addx4,
    atomic_max,
    atomic_min,
    c2d_im2col,
    clear,
    copy,
    cumsum,
    fill,
    gemm,
    im2col,
    reduce_absmax,
    reduce_abssum,
    reduce_max,
    reduce_min,
    reduce_sum,
)

float8_e4m3 = float8_e4m3fn
half = float16
float, double, int, long, short, uint, ulong = float32, float64, int32, int64, int16, uint32, uint64  # C spellings
tfloat32 = float32  # TF32 operands: stored as float32, multiplied at least as precisely
parallel = Parallel
Serial = serial
Buffer = Tensor
FP8 = float8_e4m3fn


def prim_func(fn=None, *, private=False):
    """Parse ``fn`` (annotated with ``T.Tensor`` parameters) into a kernel function (a ``PrimFunc``)."""
    caller = dict(sys._getframe(1).f_locals)
    if fn is None:
        return lambda f: parse(f, caller)
    return parse(fn, caller)


def macro(fn=None, *, hygienic=True):
    """A helper whose body is inlined at each call site inside a kernel."""
    caller = dict(sys._getframe(1).f_locals)
    if fn is None:
        return lambda f: Macro(f, caller)
    return Macro(fn, caller)
