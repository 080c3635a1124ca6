"""T.gemm: the dtype rules every target shares, and the CPU family's lowering to a prelude routine call."""
from __future__ import annotations

from tegula.errors import CompileError
from tegula.ir import expr as E
from tegula.ir import stmt as S
from tegula.tileops import lowers

FLOAT_INPUTS = ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")


def check_gemm_dtypes(s: S.Gemm) -> None:
    """Raise CompileError for a dtype combination no target implements."""
    a, b, c = s.a.dtype, s.b.dtype, s.c.dtype
    if a != b:
        raise CompileError(f"T.gemm: A is {a} but B is {b}; both operands must have one dtype (T.copy one of "
                           "them into a tile of the other's dtype first)", s.loc)
    if a.name in FLOAT_INPUTS and c.name != "float32":
        raise CompileError(f"T.gemm: {a} operands accumulate into a float32 C, got {c}", s.loc)
    if a.name == "int8" and c.name != "int32":
        raise CompileError(f"T.gemm: int8 operands accumulate into an int32 C, got {c}", s.loc)
    if a.name not in FLOAT_INPUTS + ("int8",):
        raise CompileError(f"T.gemm: {a} operands are not supported (float32, float16, bfloat16, float8 or int8)",
                           s.loc)


def reads_b_in_place(s: S.Gemm) -> bool:
    """Whether the c target's prelude GEMM computes ``s`` as dot products read straight from B's rows (its
    small-M path, tg__use_dot in tegula_gemm.h: B transposed, A not, M <= 8, or bf16 with M <= 16 and K >= 512)
    rather than packing B into panels first. Then staging B (or A) in an on-chip tile first is a pass over the
    data that buys nothing (elide_staging)."""
    if not s.trans_b or s.trans_a or s.a.dtype.name not in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        return False
    m, k = tile2(s.c)[0], tile2(s.a)[1]
    return m <= 8 or (s.a.dtype.name == "bfloat16" and m <= 16 and k >= 512)


def reads_in_place(s: S.Gemm) -> bool:
    """Whether the c target's prelude GEMM reads ``s``'s operands in place as well as it reads staged tiles: on the
    dot path (``reads_b_in_place``), and on the panel path for B transposed (A not) and tiles of 128 x 128 or more
    of C in bf16: every packed panel of B then serves 128 rows or more and A is read in place, so staging them
    first is a copy (from L3 / DRAM) that only adds time (256 x 256 tiles, 1 thread, generated C alternated:
    4096 x 2112 x 7168 0.89 -> 0.95 of torch, 4096 x 7168 x 2048 +3%). fp8, whose A the prelude converts in
    64-row panels, measured 3-4% slower in place (4096 x 2112 x 7168) and keeps its staged tiles."""
    if reads_b_in_place(s) or rows_in_lanes(s):
        return True
    m, n = tile2(s.c)
    return s.trans_b and not s.trans_a and s.a.dtype.name == "bfloat16" and m >= 128 and n >= 128


def scales_in_lanes(s: S.Gemm, k_total: int) -> bool:
    """Whether the c target's prelude computes a block-scaled product (tg_gemm_<dt>_bscaled) of ``s``'s tile shape,
    K = ``k_total`` in blocks of ``s``'s K, by scaling each block's dot products in their vector lanes
    (tg__gemm_bscaled's fused paths: the dot path, 2..8 rows of A and K >= 2048 or 2..4 rows and K >= 1536; one row
    and K <= 4096, whole rows of B in address order; blocks a multiple of 64 up to 256)
    rather than as a gemm per block, which one T.gemm per block already is (passes/fuse_gemm_scale)."""
    if not reads_b_in_place(s):
        return False
    m, kw = tile2(s.c)[0], tile2(s.a)[1]
    rows = 2 <= m <= 8 and (k_total >= 2048 or (m <= 4 and k_total >= 1536)) or m == 1 and k_total <= 4096
    return rows and kw % 64 == 0 and kw <= 256


def scales_on_panels(s: S.Gemm) -> bool:
    """Whether the c target's prelude computes a block-scaled product (tg_gemm_<dt>_bscaled) of ``s``'s tile shape
    on its panel path, each register block's product over one block of K scaled into C from an L1 tile
    (tg__blocks with scales): B transposed, A not, 128 rows or more (compute-bound tiles), blocks of K <= 128.
    That saves the loop's pass over a cleared block accumulator in L2, written by the gemm and read back. Tiles of
    9-16 rows of e4m3 (``rows_in_lanes``) are fused too: the prelude computes those with A's rows in lanes."""
    if s.trans_a or not s.trans_b or s.a.dtype.name not in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        return False
    return tile2(s.c)[0] >= 128 and tile2(s.a)[1] <= 128 or rows_in_lanes(s)


def rows_in_lanes(s: S.Gemm) -> bool:
    """Whether the c target's prelude computes a block-scaled product of ``s``'s tiles with A's 9-16 rows in vector
    lanes (tegula_gemm.h tg__lanes16: e4m3, B transposed, A not, blocks of K a multiple of 64 up to 256): B's
    rows are converted in place and broadcast a pair at a time, never packed into panels, so B and A are read in
    place (elide_staging) rather than copied into staged tiles first. Only a gemm of one block of a longer K (the
    block-scaled loop fuse_gemm_scale fuses: B's buffer holds several blocks) counts; a whole-K product (the
    indexer's q @ kv^T) keeps its staged tiles."""
    if s.trans_a or not s.trans_b or s.a.dtype.name != "float8_e4m3fn":
        return False
    m, kw = tile2(s.c)[0], tile2(s.a)[1]
    k_buf = E.const_value(E.as_expr(s.b.buffer.shape[-1]))
    return 8 < m <= 16 and kw % 64 == 0 and kw <= 256 and isinstance(k_buf, int) and k_buf > kw


def tile2(rg) -> tuple:
    """(rows, columns) of a gemm operand's 2-D tile: its two non-unit extents, else its last two kept dims (the
    emitters size the prelude call by it)."""
    ext = [int(E.const_value(e)) for e in rg.extents]
    big = [e for e in ext if e != 1]
    if len(big) == 2:
        return tuple(big)
    kept = [e for e, k in zip(ext, rg.keep) if k]
    return tuple(kept[-2:]) if len(kept) >= 2 else tuple([1] * (2 - len(big)) + big)


@lowers(S.Gemm, "cpu")
def lower_gemm(s: S.Gemm) -> S.Stmt:
    return S.ExternGemm(s.a, s.b, s.c, s.trans_a, s.trans_b, s.clear, loc=s.loc)
