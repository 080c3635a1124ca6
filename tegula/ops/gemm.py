"""tegula.ops.gemm: DeepGEMM's API (names, argument order, numerics) on every tegula target.

    from tegula.ops import gemm as deep_gemm
    deep_gemm.fp8_gemm_nt((a_fp8, sfa), (b_fp8, sfb), d)            # d = a @ b.T, block-scaled FP8
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous(a, b, d, m_indices)   # MoE experts, rows sorted by expert

Layouts: ``nt`` means A is [M, K] and B is [N, K] (both K-major), so D = A @ B^T; ``nn`` takes B as [K, N];
``tn`` A as [K, M] (and B as [K, N]); ``tt`` A as [K, M], B as [N, K]. Like deep_gemm, the ``nt`` functions
also take a transposed view of a contiguous tensor (an MN-major operand); any other strides raise ValueError.

FP8 numerics (recipe (1, 128, 128), deep_gemm's default): A is float8_e4m3fn with one scale per row and 128
columns of K (sfa [M, ceil(K/128)]), B with one per 128 x 128 block (sfb [ceil(N/128), ceil(K/128)]); recipe
(1, 1, 128) gives B one per row and 128 columns (sfb [N, ceil(K/128)], the default for packed scales). Scales
are float32, float8_e8m0fnu, or UE8M0 exponents packed four per int32 (sf [.., ceil(ceil(K/128)/4)]), in any
layout. Each 128-wide block of K is multiplied into a fresh fp32 tile (exact products), scaled by sa * sb and
added to the fp32 accumulator; D (bf16 or fp32) is rounded once, from C + the sum when ``c`` is given (c may
be d). BF16 GEMMs accumulate in fp32 likewise. Results are bit-identical from run to run.

What differs from deep_gemm: it accepts (and ignores) ``compiled_dims`` and ``disable_ue8m0_cast`` (nothing is
cast on a CPU); gran_k must be 128 (no FP4); m-grouped contiguous layouts write 0 to padding rows (-1) of D.
The sparse-attention indexer (fp8_mqa_logits, fp8_paged_mqa_logits) lives in tegula.ops.indexer and is
re-exported here, as deep_gemm exports it at top level.
"""
from __future__ import annotations

import os

import tegula
from tegula.ops import _gemm_kernels as K_
from tegula.ops._gemm_layout import (  # noqa: F401  (deep_gemm's utils, re-exported)
    align,
    calc_diff,
    ceil_div,
    ceil_to_ue8m0,
    check_sf_shape,
    get_k_alignment_for_contiguous_layout,
    get_m_alignment_for_contiguous_layout,
    get_mk_alignment_for_contiguous_layout,
    get_mn_major_tma_aligned_packed_ue8m0_tensor,
    get_mn_major_tma_aligned_tensor,
    get_num_sms,
    get_pdl,
    get_tc_util,
    get_theoretical_mk_alignment_for_contiguous_layout,
    get_tma_aligned_size,
    pack_ue8m0_to_int,
    per_block_cast_to_fp8,
    per_channel_cast_to_fp8,
    per_custom_dims_cast_to_fp8,
    per_token_cast_to_fp8,
    set_block_size_multiple_of,
    set_ignore_compile_dims,
    set_mk_alignment_for_contiguous_layout,
    set_num_sms,
    set_pdl,
    set_tc_util,
    transform_sf_into_required_layout,
    unpack_ue8m0_from_int,
)

SF_K = K_.SF_K
_FACTORIES: dict = {}
_KERNELS: dict = {}
_TARGETS: dict = {}


def _kernel(factory, *args):
    """The compiled kernel of ``factory(*args)`` for the current target (TEGULA_TARGET, else the best one): a
    ``tegula.jit`` factory per target, its kernels also kept here under a plain tuple key (a warm call costs one
    dict lookup)."""
    env = os.environ.get("TEGULA_TARGET")
    target = _TARGETS.get(env)
    if target is None:
        from tegula.jit.targets import resolve
        target = _TARGETS[env] = resolve(None).name
    key = (factory, target) + args
    k = _KERNELS.get(key)
    if k is None:
        jf = _FACTORIES.get((factory, target))
        if jf is None:
            jf = _FACTORIES[(factory, target)] = tegula.jit(factory, target=target)
        k = _KERNELS[key] = jf(*args)
    return k


# argument checks -----------------------------------------------------------------------------------------

def _torch():
    import torch
    return torch


def _tensor(name, x, dtypes, ndim):
    torch = _torch()
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.device.type != "cpu":
        raise ValueError(f"{name}: expected a CPU tensor, got one on {x.device}")
    if x.dtype not in dtypes:
        want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name}: expected dtype {want}, got {str(x.dtype).replace('torch.', '')}")
    if x.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {tuple(x.shape)}")
    return x


def _pair(name, x):
    if not isinstance(x, (tuple, list)) or len(x) != 2:
        raise TypeError(f"{name}: expected a (tensor, scale factors) pair, got {type(x).__name__}")
    return x


def _storage(name, x):
    """(the contiguous tensor holding ``x``, whether x is its transpose): K-major or MN-major operands."""
    if x.is_contiguous():
        return x, False
    t = x.transpose(-1, -2)
    if t.is_contiguous():
        return t, True
    raise ValueError(f"{name}: expected a contiguous tensor or the transpose of one (K-major or MN-major), got "
                     f"strides {x.stride()} for shape {tuple(x.shape)}")


def _out(name, d, shape, dtypes):
    _tensor(name, d, dtypes, len(shape))
    if tuple(d.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(d.shape)}")
    if not d.is_contiguous():
        raise ValueError(f"{name}: the output must be contiguous (row-major)")
    return d


def _check_c(d, c) -> bool:
    """deep_gemm's c (checked; it may be d itself). Returns whether the kernel accumulates into d."""
    if c is None:
        return False
    _tensor("c", c, (d.dtype,), d.dim())
    if tuple(c.shape) != tuple(d.shape):
        raise ValueError(f"c: expected the shape of d {tuple(d.shape)}, got {tuple(c.shape)}")
    if c.data_ptr() == d.data_ptr() and c.stride() != d.stride():
        raise ValueError("c: shares d's memory with other strides")
    return True


def _start(d, c, k: int) -> bool:
    """After every check: d starts as c (copied unless c is d), or as zeros when K is 0. Returns whether there
    is a product to add."""
    if c is not None and c.data_ptr() != d.data_ptr():
        d.copy_(c)
    if k == 0:
        if c is None:
            d.zero_()
        return False
    return True


def _gran_k(recipe, recipe_a, recipe_b):
    """(gran_n of B or None for the default, checked) from recipe / recipe_a + recipe_b."""
    if recipe is not None and (recipe_a is not None or recipe_b is not None):
        raise ValueError("recipe: give either recipe or recipe_a and recipe_b, not both")
    if (recipe_a is None) != (recipe_b is None):
        raise ValueError("recipe_a, recipe_b: give both or neither")
    if recipe is not None:
        if len(recipe) != 3:
            raise ValueError(f"recipe: expected (gran_m, gran_n, gran_k), got {recipe!r}")
        gm, gn, gk = recipe
        gks = (gk,)
    elif recipe_a is not None:
        (gm, gka), (gn, gkb) = recipe_a, recipe_b
        gks = (gka, gkb)
    else:
        return None
    if gm != 1:
        raise ValueError(f"recipe: A's scales must be per row (gran_m 1), got {gm}")
    if gn not in (1, SF_K):
        raise ValueError(f"recipe: B's scales must be per row or per 128 rows (gran_n 1 or 128), got {gn}")
    if any(g != SF_K for g in gks):
        raise ValueError(f"recipe: gran_k must be 128 (FP4's 32 is not supported), got {gks}")
    return gn


def _scales(name, sf, mn, k, gran_mn, groups=None):
    """Scales checked and made kernel-ready: contiguous float32 or float8_e8m0fnu [(g,) rows, kb(+pad)]."""
    torch = _torch()
    check_sf_shape(name, sf, mn, k, gran_mn, SF_K, groups)
    if sf.device.type != "cpu":
        raise ValueError(f"{name}: expected a CPU tensor, got one on {sf.device}")
    sf = sf.contiguous()
    if sf.dtype == torch.int32:
        sf = sf.view(torch.uint8).view(torch.float8_e8m0fnu)
    return sf


def _match_scales(sfa, sfb):
    """One scale dtype for both operands: float8_e8m0fnu when both are UE8M0, else float32."""
    if sfa.dtype == sfb.dtype:
        return sfa, sfb
    return sfa.float().contiguous(), sfb.float().contiguous()


def _gran_n(gn, sfb, n, packed):
    """B's scale granularity: the recipe's, else deep_gemm's default by dtype, else by shape."""
    if gn is not None:
        return gn
    rows = sfb.shape[-2]
    if rows == ceil_div(n, SF_K) and not (packed and rows == n):
        return SF_K
    return 1


# block sizes ---------------------------------------------------------------------------------------------

def _block_m(m: int) -> int:
    """Rows per block: the next power of two >= m (so a decode step computes no idle rows), at most 128."""
    b = 1
    while b < min(m, 128):
        b *= 2
    return b


def _fit_n(n: int, widths: tuple) -> int:
    """The first of ``widths`` whose blocks pad n the least: a last block's columns past n are computed all the same
    (the tile GEMM runs on whole tiles), 9% of the work at n = 2112 in 256-column blocks, none in 192-column ones."""
    return min(widths, key=lambda w: ceil_div(n, w) * w)


def _tiles(m: int, k: int, fp8: bool, grouped: bool = False, n: int = 0) -> tuple:
    """(block_m, block_n, chunk_k) for m rows: few rows take the next power of two (a decode step computes no idle
    rows), many take blocks of 512 rows where that pads m no more than 256 would (each packed panel of B then serves
    twice the rows: bf16 4096 x 7168 x 2048, 1 thread, 0.97 -> 1.0 of torch), else 256 (128-row blocks for grouped
    layouts, whose groups are aligned to 128). bf16, and fp8 in 512-row blocks, take a width that fits n (``_fit_n``;
    n = 0: unknown)."""
    bm = _block_m(m) if m < 256 or grouped else 512 if ceil_div(m, 512) * 2 <= ceil_div(m, 256) else 256
    if grouped:
        bm = min(bm, _grouped_block_m())
    kb = ceil_div(k, SF_K)
    if bm <= 16 and not grouped:
        # decode: a block's weight rows whole along K (up to 1 MiB: L2; fp8 needs whole 128-blocks of K; chunks
        # of K measured slower), 64 of them, staged (one sequential stream) or, where the gemm reads them in
        # place (elide_staging, M <= 8), side by side. 16 rows a block (16 streams the prefetchers follow) for
        # one row of A (64 in place were 40% slower) and for up to 4 rows when K >= 2048 (fp8, 2 threads: 4 x 2112
        # x 7168 1.33 -> 1.0 ms, 4 x 7168 x 2048 1.54-1.64 -> 1.32-1.60); at K = 1536, 64 rows were faster
        # (4 x 24576 x 1536: 3.6 vs 4.6 ms)
        # fp8, one row, K <= 4096: 128 rows a block (64 where that pads n less), whose prelude call
        # (fuse_gemm_scale, tg__dot_row1_scaled) reads whole rows, in address order up to K = 2048, else 8 groups
        # of 16 side by side, 8 streams of 16 x K bytes (1 thread, weights from DRAM: 1 x 24576 x 1536 4.4 -> 2.1 ms,
        # 1 x 7168 x 2048 1.33 -> 0.85)
        # fp8, 9-16 rows: the prelude holds A's rows in vector lanes and reads B in place (tileops.gemm.rows_in_lanes);
        # 128 columns a block up to K = 2048 (A is packed once per block; 1 thread, weights from DRAM, speed-up over
        # the staged kernel with 64 / 128 columns: 16 x 24576 x 1536 1.11-1.13 / 1.17x, 16 x 7168 x 2048 1.15-1.20
        # / 1.17-1.21x), 64 beyond (K = 7168: alike within noise; 2 threads share 2112 columns in 33 blocks)
        esize = 1 if fp8 else 2
        bn = _fit_n(n, (128, 64)) if bm == 1 and fp8 and k <= 4096 else \
            16 if bm == 1 or (bm <= 4 and k >= 2048) else 128 if bm == 16 and fp8 and k <= 2048 else 64
        c = max(d for d in range(1, kb + 1) if kb % d == 0 and max(bn, 64) * d * SF_K * esize <= 1 << 20)
        return bm, bn, c * SF_K
    if not fp8:
        return bm, _fit_n(n, (128, 192) if bm == 512 else (256, 192, 128) if bm == 256 else (128,)), \
            256 if k > 128 else 128
    # fp8: 128 columns, grouped too (its 128-row blocks took 256 before the fused block-scaled panel path; with it,
    # 1 thread G=4 / G=8 at 4096 x 2048: 0.91 -> 0.95 / 0.895 -> 0.91 of a dense GEMM of the same M)
    # 512-row blocks 96 columns wide where that pads n less (n = 2112: 22 blocks, none padded; 1 thread 4096 x 2112
    # x 7168, 0.91 -> 0.92-0.93 of tegula's bf16; 64 and 192 were slower)
    ck = next(c for c in ((4, 2, 1) if bm <= 64 or grouped else (2, 1)) if kb % c == 0) * SF_K
    return bm, _fit_n(n, (128, 96)) if bm == 512 and not grouped else 128, ck


_DUMMY = {}


def _dummy(shape, dtype):
    key = (shape, dtype)
    if key not in _DUMMY:
        _DUMMY[key] = _torch().zeros(shape, dtype=dtype)
    return _DUMMY[key]


# dense FP8 / BF16 ----------------------------------------------------------------------------------------

def _fp8_gemm(a, b, d, c, recipe, recipe_a, recipe_b):
    """D (+)= A @ B^T with A logical [M, K], B logical [N, K] (each possibly an MN-major view)."""
    torch = _torch()
    a, sfa = _pair("a", a)
    b, sfb = _pair("b", b)
    _tensor("a", a, (torch.float8_e4m3fn,), 2)
    _tensor("b", b, (torch.float8_e4m3fn,), 2)
    m, k = a.shape
    n, kb_ = b.shape
    if kb_ != k:
        raise ValueError(f"b: expected K = {k} (a's), got {kb_}")
    _out("d", d, (m, n), (torch.bfloat16, torch.float32))
    gn = _gran_k(recipe, recipe_a, recipe_b)
    acc = _check_c(d, c)
    gn = _gran_n(gn, sfb, n, sfb.dtype == torch.int32) if isinstance(sfb, torch.Tensor) else SF_K
    sfa = _scales("a[1] (sfa)", sfa, m, k, 1)
    sfb = _scales("b[1] (sfb)", sfb, n, k, gn)
    a_s, ta = _storage("a", a)
    b_s, tb = _storage("b", b)
    if m == 0 or n == 0 or not _start(d, c, k):
        return
    sfa, sfb = _match_scales(sfa, sfb)
    bm, bn, ck = _tiles(m, k, True, n=n)
    kern = _kernel(K_.mk_gemm, "dense", n, k, 1, "float8_e4m3fn", ta, not tb, _dt(d.dtype), acc,
                   _dt(sfa.dtype), sfa.shape[-1], sfb.shape[0], sfb.shape[-1], bm, bn, ck)
    kern(a_s, sfa, b_s.unsqueeze(0), sfb.unsqueeze(0), d, _dummy((1,), torch.int32))


def _bf16_gemm(a, b, d, c):
    torch = _torch()
    _tensor("a", a, (torch.bfloat16,), 2)
    _tensor("b", b, (torch.bfloat16,), 2)
    m, k = a.shape
    n, kb_ = b.shape
    if kb_ != k:
        raise ValueError(f"b: expected K = {k} (a's), got {kb_}")
    _out("d", d, (m, n), (torch.bfloat16, torch.float32))
    acc = _check_c(d, c)
    a_s, ta = _storage("a", a)
    b_s, tb = _storage("b", b)
    if m == 0 or n == 0 or not _start(d, c, k):
        return
    bm, bn, ck = _tiles(m, k, False, n=n)
    kern = _kernel(K_.mk_gemm, "dense", n, k, 1, "bfloat16", ta, not tb, _dt(d.dtype), acc,
                   "float32", 1, 1, 1, bm, bn, ck)
    kern(a_s, _dummy((1, 1), torch.float32), b_s.unsqueeze(0), _dummy((1, 1, 1), torch.float32), d,
         _dummy((1,), torch.int32))


def _dt(torch_dtype) -> str:
    return str(torch_dtype).replace("torch.", "")


def _t(pair):
    """The transpose of an operand (tensor, scales) pair: deep_gemm's nn/tn/tt in terms of nt."""
    x, sf = _pair("operand", pair)
    return (x.transpose(-1, -2) if hasattr(x, "transpose") else x,
            sf.transpose(-1, -2) if hasattr(sf, "transpose") else sf)


def fp8_gemm_nt(a, b, d, c=None, recipe=None, recipe_a=None, recipe_b=None, compiled_dims="nk",
                disable_ue8m0_cast=False):
    """D = C + A @ B^T: a = (fp8 [M, K], sfa), b = (fp8 [N, K], sfb), d [M, N] bf16 or fp32."""
    _fp8_gemm(a, b, d, c, recipe, recipe_a, recipe_b)


def fp8_gemm_nn(a, b, d, c=None, recipe=None, recipe_a=None, recipe_b=None, compiled_dims="nk",
                disable_ue8m0_cast=False):
    """D = C + A @ B: a = (fp8 [M, K], sfa [M, K/128]), b = (fp8 [K, N], sfb [K/128, N/128])."""
    _fp8_gemm(a, _t(_pair("b", b)), d, c, recipe, recipe_a, recipe_b)


def fp8_gemm_tn(a, b, d, c=None, recipe=None, recipe_a=None, recipe_b=None, compiled_dims="mn",
                disable_ue8m0_cast=False):
    """D = C + A^T @ B: a = (fp8 [K, M], sfa [K/128, M]), b = (fp8 [K, N], sfb [K/128, N/128])."""
    _fp8_gemm(_t(_pair("a", a)), _t(_pair("b", b)), d, c, recipe, recipe_a, recipe_b)


def fp8_gemm_tt(a, b, d, c=None, recipe=None, recipe_a=None, recipe_b=None, compiled_dims="mn",
                disable_ue8m0_cast=False):
    """D = C + A^T @ B^T: a = (fp8 [K, M], sfa [K/128, M]), b = (fp8 [N, K], sfb [N/128, K/128])."""
    _fp8_gemm(_t(_pair("a", a)), b, d, c, recipe, recipe_a, recipe_b)


def bf16_gemm_nt(a, b, d, c=None, compiled_dims="nk"):
    """D = C + A @ B^T: a bf16 [M, K], b bf16 [N, K], d [M, N] bf16 or fp32, fp32 accumulation."""
    _bf16_gemm(a, b, d, c)


def bf16_gemm_nn(a, b, d, c=None, compiled_dims="nk"):
    """D = C + A @ B: a [M, K], b [K, N]."""
    _bf16_gemm(a, _transpose("b", b), d, c)


def bf16_gemm_tn(a, b, d, c=None, compiled_dims="mn"):
    """D = C + A^T @ B: a [K, M], b [K, N]."""
    _bf16_gemm(_transpose("a", a), _transpose("b", b), d, c)


def bf16_gemm_tt(a, b, d, c=None, compiled_dims="mn"):
    """D = C + A^T @ B^T: a [K, M], b [N, K]."""
    _bf16_gemm(_transpose("a", a), b, d, c)


def _transpose(name, x):
    torch = _torch()
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D tensor, got shape {tuple(x.shape)}")
    return x.transpose(0, 1)


fp8_fp4_gemm_nt, fp8_fp4_gemm_nn, fp8_fp4_gemm_tn, fp8_fp4_gemm_tt = fp8_gemm_nt, fp8_gemm_nn, fp8_gemm_tn, fp8_gemm_tt


# M-grouped (MoE) -----------------------------------------------------------------------------------------

def _row_groups(grouped_layout, m, groups, use_psum_layout, block_m):
    """The group of every row (int32 [m], -1 for padding) from deep_gemm's contiguous layout: m_indices
    (one group per row) or, with use_psum_layout, each group's end row (groups start at the previous end
    rounded up to the alignment). ValueError unless every ``block_m`` rows hold at most one group."""
    torch = _torch()
    _tensor("grouped_layout", grouped_layout, (torch.int32,), 1)
    lay = grouped_layout.contiguous()
    if use_psum_layout:
        if lay.numel() != groups:
            raise ValueError(f"grouped_layout: a psum layout has one end row per group ({groups}), got "
                             f"{lay.numel()}")
        ends = lay.long()
        starts = torch.zeros_like(ends)
        al = get_mk_alignment_for_contiguous_layout()
        starts[1:] = (ends[:-1] + al - 1) // al * al
        if groups and (bool((ends < starts).any()) or int(ends[-1]) > m):
            raise ValueError(f"grouped_layout: psum end rows must be non-decreasing (each at least the previous "
                             f"end rounded up to {al}) and at most M = {m}")
        rows = torch.arange(m)
        g = torch.searchsorted(starts, rows, right=True) - 1
        lay = torch.where(rows < ends[g.clamp(min=0)], g, -1).to(torch.int32)
    elif lay.numel() != m:
        raise ValueError(f"grouped_layout (m_indices): expected one group per row of a ({m}), got {lay.numel()}")
    if m and (int(lay.min()) < -1 or int(lay.max()) >= groups):
        raise ValueError(f"grouped_layout (m_indices): groups must lie in [0, {groups}) or be -1 (padding)")
    pad = (-m) % block_m
    v = torch.nn.functional.pad(lay, (0, pad), value=-1).view(-1, block_m)
    top = v.max(dim=1, keepdim=True).values
    if not bool(((v == top) | (v == -1)).all()):
        raise ValueError(f"grouped_layout (m_indices): every {block_m} rows must belong to one group (each group "
                         f"padded with -1 to a multiple of get_mk_alignment_for_contiguous_layout())")
    return lay


def _grouped_block_m():
    al = get_mk_alignment_for_contiguous_layout()
    b = 128
    while al % b:
        b //= 2
    return b


def _m_grouped_contiguous(a, b, d, grouped_layout, use_psum_layout, fp8, recipe=None, recipe_a=None,
                          recipe_b=None):
    torch = _torch()
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    if fp8:
        a, sfa = _pair("a", a)
        b, sfb = _pair("b", b)
    _tensor("a", a, (dtype,), 2)
    _tensor("b", b, (dtype,), 3)
    m, k = a.shape
    groups, n, kb_ = b.shape
    if kb_ != k:
        raise ValueError(f"b: expected K = {k} (a's), got {kb_}")
    if groups == 0:
        raise ValueError("b: expected at least one group")
    _out("d", d, (m, n), (torch.bfloat16,))
    bm = _grouped_block_m()
    rows = _row_groups(grouped_layout, m, groups, use_psum_layout, bm)
    if fp8:
        gn = _gran_k(recipe, recipe_a, recipe_b)
        gn = _gran_n(gn, sfb, n, sfb.dtype == torch.int32) if isinstance(sfb, torch.Tensor) else SF_K
        sfa = _scales("a[1] (sfa)", sfa, m, k, 1)
        sfb = _scales("b[1] (sfb)", sfb, n, k, gn, groups)
        sfa, sfb = _match_scales(sfa, sfb)
    if m == 0 or n == 0:
        return
    if not a.is_contiguous():
        raise ValueError("a: expected a contiguous (K-major) tensor")
    b_s, tb = _storage("b", b)
    _, bn, ck = _tiles(bm, k, fp8, grouped=True)
    if fp8:
        kern = _kernel(K_.mk_gemm, "contiguous", n, k, groups, "float8_e4m3fn", False, not tb, "bfloat16", False,
                       _dt(sfa.dtype), sfa.shape[-1], sfb.shape[-2], sfb.shape[-1], bm, bn, ck)
        kern(a, sfa, b_s, sfb, d, rows)
    else:
        kern = _kernel(K_.mk_gemm, "contiguous", n, k, groups, "bfloat16", False, not tb, "bfloat16", False,
                       "float32", 1, 1, 1, bm, bn, ck)
        kern(a, _dummy((1, 1), torch.float32), b_s, _dummy((1, 1, 1), torch.float32), d, rows)


def m_grouped_fp8_gemm_nt_contiguous(a, b, d, grouped_layout=None, recipe=None, recipe_a=None, recipe_b=None,
                                     compiled_dims="nk", disable_ue8m0_cast=False, use_psum_layout=False,
                                     ensure_zero_padding=True, expected_m_for_psum_layout=None, m_indices=None):
    """MoE experts over rows sorted by expert: d[i] = a[i] @ b[g_i]^T with a = (fp8 [M, K], sfa [M, K/128]),
    b = (fp8 [G, N, K], sfb [G, N/128, K/128]), d [M, N] bf16. grouped_layout (alias m_indices) is int32 [M],
    each row's group or -1 for padding, every group padded to get_mk_alignment_for_contiguous_layout() rows;
    with use_psum_layout it is int32 [G], each group's end row. Padding rows of d are written as 0."""
    _m_grouped_contiguous(a, b, d, _layout_arg(grouped_layout, m_indices), use_psum_layout, True, recipe,
                          recipe_a, recipe_b)


def m_grouped_fp8_gemm_nn_contiguous(a, b, d, grouped_layout=None, recipe=None, recipe_a=None, recipe_b=None,
                                     compiled_dims="nk", disable_ue8m0_cast=False, use_psum_layout=False,
                                     ensure_zero_padding=True, m_indices=None):
    """As m_grouped_fp8_gemm_nt_contiguous with b = (fp8 [G, K, N], sfb [G, K/128, N/128])."""
    b, sfb = _pair("b", b)
    _m_grouped_contiguous(a, (_transpose3("b", b), _transpose3("b[1] (sfb)", sfb)), d,
                          _layout_arg(grouped_layout, m_indices), use_psum_layout, True, recipe, recipe_a, recipe_b)


def m_grouped_bf16_gemm_nt_contiguous(a, b, d, grouped_layout=None, compiled_dims="nk", use_psum_layout=False,
                                      ensure_zero_padding=True, expected_m_for_psum_layout=None, m_indices=None):
    """m_grouped_fp8_gemm_nt_contiguous for bf16 a [M, K] and b [G, N, K], fp32 accumulation."""
    _m_grouped_contiguous(a, b, d, _layout_arg(grouped_layout, m_indices), use_psum_layout, False)


def m_grouped_bf16_gemm_nn_contiguous(a, b, d, grouped_layout=None, compiled_dims="nk", use_psum_layout=False,
                                      ensure_zero_padding=True, m_indices=None):
    """m_grouped_bf16_gemm_nt_contiguous with b [G, K, N]."""
    _m_grouped_contiguous(a, _transpose3("b", b), d, _layout_arg(grouped_layout, m_indices), use_psum_layout,
                          False)


def _layout_arg(grouped_layout, m_indices):
    if (grouped_layout is None) == (m_indices is None):
        raise TypeError("grouped_layout: give it (or its old name m_indices) exactly once")
    return grouped_layout if grouped_layout is not None else m_indices


def _transpose3(name, x):
    torch = _torch()
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(f"{name}: expected a 3-D tensor, got shape {tuple(x.shape)}")
    return x.transpose(1, 2)


def _m_grouped_masked(a, b, d, masked_m, expected_m, fp8, recipe=None, recipe_a=None, recipe_b=None):
    torch = _torch()
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    if fp8:
        a, sfa = _pair("a", a)
        b, sfb = _pair("b", b)
    _tensor("a", a, (dtype,), 3)
    _tensor("b", b, (dtype,), 3)
    groups, m, k = a.shape
    gb, n, kb_ = b.shape
    if gb != groups:
        raise ValueError(f"b: expected {groups} groups (a's), got {gb}")
    if kb_ != k:
        raise ValueError(f"b: expected K = {k} (a's), got {kb_}")
    _out("d", d, (groups, m, n), (torch.bfloat16,))
    _tensor("masked_m", masked_m, (torch.int32,), 1)
    if masked_m.numel() != groups:
        raise ValueError(f"masked_m: expected one count per group ({groups}), got {masked_m.numel()}")
    if not isinstance(expected_m, int) or isinstance(expected_m, bool) or expected_m <= 0:
        raise ValueError(f"expected_m: expected a positive int, got {expected_m!r}")
    masked_m = masked_m.contiguous()
    if groups and (int(masked_m.min()) < 0 or int(masked_m.max()) > m):
        raise ValueError(f"masked_m: counts must lie in [0, {m}] (a's rows per group)")
    if fp8:
        gn = _gran_k(recipe, recipe_a, recipe_b)
        gn = _gran_n(gn, sfb, n, sfb.dtype == torch.int32) if isinstance(sfb, torch.Tensor) else SF_K
        sfa = _scales("a[1] (sfa)", sfa, m, k, 1, groups)
        sfb = _scales("b[1] (sfb)", sfb, n, k, gn, groups)
        sfa, sfb = _match_scales(sfa, sfb)
    if groups == 0 or m == 0 or n == 0:
        return
    for name, x in (("a", a), ("b", b)):
        if not x.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous (K-major) tensor")
    # counts vary around expected_m: blocks of at most 64 rows waste fewer of them
    bm, bn, ck = _tiles(min(expected_m, m, 64), k, fp8)
    if fp8:
        kern = _kernel(K_.mk_gemm, "masked", n, k, groups, "float8_e4m3fn", False, True, "bfloat16", False,
                       _dt(sfa.dtype), sfa.shape[-1], sfb.shape[-2], sfb.shape[-1], bm, bn, ck)
        kern(a, sfa, b, sfb, d, masked_m)
    else:
        kern = _kernel(K_.mk_gemm, "masked", n, k, groups, "bfloat16", False, True, "bfloat16", False,
                       "float32", 1, 1, 1, bm, bn, ck)
        kern(a, _dummy((1, 1), torch.float32), b, _dummy((1, 1, 1), torch.float32), d, masked_m)


def m_grouped_fp8_gemm_nt_masked(a, b, d, masked_m, expected_m, recipe=None, recipe_a=None, recipe_b=None,
                                 compiled_dims="nk", disable_ue8m0_cast=False):
    """Per-expert batches of fixed capacity: d[g, :masked_m[g]] = a[g, :masked_m[g]] @ b[g]^T with
    a = (fp8 [G, M, K], sfa [G, M, K/128]), b = (fp8 [G, N, K], sfb [G, N/128, K/128]), d [G, M, N] bf16;
    rows of d at or past masked_m[g] are left as they are. expected_m (a typical count) picks the block size."""
    _m_grouped_masked(a, b, d, masked_m, expected_m, True, recipe, recipe_a, recipe_b)


def m_grouped_bf16_gemm_nt_masked(a, b, d, masked_m, expected_m, compiled_dims="nk"):
    """m_grouped_fp8_gemm_nt_masked for bf16 a [G, M, K] and b [G, N, K]."""
    _m_grouped_masked(a, b, d, masked_m, expected_m, False)


fp8_m_grouped_gemm_nt_masked = m_grouped_fp8_gemm_nt_masked
bf16_m_grouped_gemm_nt_masked = m_grouped_bf16_gemm_nt_masked
m_grouped_fp8_fp4_gemm_nt_contiguous = m_grouped_fp8_gemm_nt_contiguous
m_grouped_fp8_fp4_gemm_nn_contiguous = m_grouped_fp8_gemm_nn_contiguous
m_grouped_fp8_fp4_gemm_nt_masked = m_grouped_fp8_gemm_nt_masked


# K-grouped (weight gradients) ----------------------------------------------------------------------------

def _k_groups(ks_cpu, grouped_layout, groups, total_k, use_psum_layout):
    """(start, end, first scale row) per group, int32 [G, 3], from ks_cpu / grouped_layout."""
    torch = _torch()
    _tensor("grouped_layout", grouped_layout, (torch.int32,), 1)
    if grouped_layout.numel() != groups:
        raise ValueError(f"grouped_layout: expected one entry per group of d ({groups}), got "
                         f"{grouped_layout.numel()}")
    lay = [int(x) for x in grouped_layout.tolist()]
    al = get_mk_alignment_for_contiguous_layout()
    info, pos, srow = [], 0, 0
    if use_psum_layout:
        prev = 0
        for g, end in enumerate(lay):
            start = align(prev, al)
            if end < start or end > total_k:
                raise ValueError(f"grouped_layout: psum end {end} of group {g} must lie in [{start}, {total_k}]")
            info.append((start, end, srow))
            srow += ceil_div(end - start, SF_K)
            prev = end
        return info, srow
    if ks_cpu is None or len(ks_cpu) == 0:
        raise ValueError("ks_cpu: give each group's K (or use_psum_layout=True)")
    if len(ks_cpu) != groups:
        raise ValueError(f"ks_cpu: expected one K per group ({groups}), got {len(ks_cpu)}")
    if list(ks_cpu) != lay:
        raise ValueError("grouped_layout: must hold the same K per group as ks_cpu")
    for g, k in enumerate(ks_cpu):
        if not isinstance(k, int) or k < 0 or k % al:
            raise ValueError(f"ks_cpu: group {g} has K = {k!r}; each K must be a non-negative multiple of "
                             f"get_mk_alignment_for_contiguous_layout() ({al})")
        info.append((pos, pos + k, srow))
        pos += k
        srow += ceil_div(k, SF_K)
    if pos != total_k:
        raise ValueError(f"ks_cpu: the groups' K sum to {pos}, but a and b have {total_k} rows")
    return info, srow


def _k_grouped(a, b, d, ks_cpu, grouped_layout, c, use_psum_layout, fp8, recipe=(1, 1, SF_K)):
    torch = _torch()
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    if fp8:
        a, sfa = _pair("a", a)
        b, sfb = _pair("b", b)
        if tuple(recipe) != (1, 1, SF_K):
            raise ValueError(f"recipe: K-grouped FP8 GEMMs take per-channel scales, recipe (1, 1, 128), got "
                             f"{recipe!r}")
    _tensor("a", a, (dtype,), 2)
    _tensor("b", b, (dtype,), 2)
    _tensor("d", d, (torch.float32,), 3)
    groups, m, n = d.shape
    total_k = a.shape[0]
    if tuple(a.shape) != (total_k, m):
        raise ValueError(f"a: expected shape (sum_k, {m}), got {tuple(a.shape)}")
    if tuple(b.shape) != (total_k, n):
        raise ValueError(f"b: expected shape ({total_k}, {n}) (a's sum_k, d's N), got {tuple(b.shape)}")
    _out("d", d, (groups, m, n), (torch.float32,))
    for name, x in (("a", a), ("b", b)):
        if not x.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous (MN-major) tensor")
    info, n_sf = _k_groups(ks_cpu, grouped_layout, groups, total_k, use_psum_layout)
    if fp8:
        for name, sf, mn in (("a[1] (sfa)", sfa, m), ("b[1] (sfb)", sfb, n)):
            _tensor(name, sf, (torch.float32,), 2)
            if tuple(sf.shape) != (n_sf, mn):
                raise ValueError(f"{name}: expected per-channel scales of shape ({n_sf}, {mn}) (one row per "
                                 f"128 rows of each group), got {tuple(sf.shape)}")
        sfa, sfb = sfa.contiguous(), sfb.contiguous()
    _check_c(d, c)
    if groups == 0 or m == 0 or n == 0 or not _start(d, c, total_k):
        return
    if c is None:
        d.zero_()
    info_t = torch.tensor(info, dtype=torch.int32).view(groups, 3)
    bm = 128 if m > 64 else _block_m(m)
    kern = _kernel(K_.mk_k_grouped_gemm, m, n, groups, _dt(dtype), bm, 128)
    if fp8:
        kern(a, sfa, b, sfb, d, info_t)
    else:
        kern(a, _dummy((1, 1), torch.float32), b, _dummy((1, 1), torch.float32), d, info_t)


def k_grouped_fp8_gemm_tn_contiguous(a, b, d, ks_cpu, grouped_layout, c=None, recipe=(1, 1, SF_K),
                                     compiled_dims="mn", use_psum_layout=False):
    """Weight gradients: d[g] = c[g] + A_g^T @ B_g with a = (fp8 [sum_k, M], sfa [sum_kb, M]) and
    b = (fp8 [sum_k, N], sfb [sum_kb, N]) holding the groups' K ranges one after another, ks_cpu (and
    grouped_layout, int32 [G]) each group's K, d [G, M, N] fp32. Scales are per column and 128 rows of each
    group (per_channel_cast_to_fp8 of each group). With use_psum_layout, grouped_layout holds each group's end
    row instead (groups start at the previous end rounded up to the alignment)."""
    _k_grouped(a, b, d, ks_cpu, grouped_layout, c, use_psum_layout, True, recipe)


def k_grouped_bf16_gemm_tn_contiguous(a, b, d, ks_cpu, grouped_layout, c=None, compiled_dims="mn",
                                      use_psum_layout=False):
    """k_grouped_fp8_gemm_tn_contiguous for bf16 a [sum_k, M] and b [sum_k, N]."""
    _k_grouped(a, b, d, ks_cpu, grouped_layout, c, use_psum_layout, False)


from tegula.ops.indexer import (  # noqa: E402, F401  (deep_gemm exports the indexer at top level)
    fp8_fp4_mqa_logits,
    fp8_fp4_paged_mqa_logits,
    fp8_mqa_logits,
    fp8_paged_mqa_logits,
    get_paged_mqa_logits_metadata,
)
