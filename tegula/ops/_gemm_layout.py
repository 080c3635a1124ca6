"""DeepGEMM's host-side helpers, with its names and numerics: the reference FP8 quantisers, UE8M0 scale
packing, scale-factor layouts, contiguous-layout alignment and ``calc_diff``. Plain torch, re-exported by
tegula.ops.gemm; the GEMMs themselves accept any scale layout, so the layout helpers only reproduce the
shapes and strides deep_gemm returns for code that inspects them."""
from __future__ import annotations

FP8_MAX = 448.0
AMAX_FLOOR = 1e-4
TMA_ALIGN_BYTES = 16

_state = {"mk_alignment": 128, "num_sms": None}


def ceil_div(x: int, y: int) -> int:
    return (x + y - 1) // y


def align(x: int, y: int) -> int:
    return ceil_div(x, y) * y


# alignment of the contiguous (M- or K-grouped) layouts ------------------------------------------------

def get_mk_alignment_for_contiguous_layout() -> int:
    """Rows (M-grouped) or K elements (K-grouped) every group is padded to in a contiguous layout (128)."""
    return _state["mk_alignment"]


def set_mk_alignment_for_contiguous_layout(new_value: int) -> None:
    """Set the contiguous-layout alignment: a multiple of 32 that divides or is a multiple of 128."""
    if not isinstance(new_value, int) or isinstance(new_value, bool) or new_value <= 0 or new_value % 32:
        raise ValueError(f"new_value: the contiguous-layout alignment must be a positive multiple of 32, "
                         f"got {new_value!r}")
    _state["mk_alignment"] = new_value


def get_theoretical_mk_alignment_for_contiguous_layout(expected_m: int | None = None) -> int:
    """The alignment this machine's kernels prefer: 128 (one M-block of the grouped kernels)."""
    return 128


get_m_alignment_for_contiguous_layout = get_mk_alignment_for_contiguous_layout
get_k_alignment_for_contiguous_layout = get_mk_alignment_for_contiguous_layout


def get_num_sms() -> int:
    """The parallel workers a kernel's grid is spread over: the CPU cores this process may use."""
    if _state["num_sms"] is None:
        import os
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return _state["num_sms"]


def set_num_sms(new_num_sms: int) -> None:
    if not isinstance(new_num_sms, int) or new_num_sms <= 0:
        raise ValueError(f"new_num_sms must be a positive int, got {new_num_sms!r}")
    _state["num_sms"] = new_num_sms


# deep_gemm's GPU tuning knobs: accepted so that code calling them runs; nothing on these targets depends on them
def set_tc_util(new_tc_util: int) -> None:
    _state["tc_util"] = int(new_tc_util)


def get_tc_util() -> int:
    return _state.get("tc_util", 100)


def set_pdl(new_enable_pdl: bool) -> None:
    _state["pdl"] = bool(new_enable_pdl)


def get_pdl() -> bool:
    return _state.get("pdl", False)


def set_ignore_compile_dims(new_value: bool) -> None:
    _state["ignore_compile_dims"] = bool(new_value)


def set_block_size_multiple_of(new_value: int) -> None:
    _state["block_size_multiple_of"] = int(new_value)


# UE8M0 scales ---------------------------------------------------------------------------------------

def ceil_to_ue8m0(x):
    """|x| rounded up to a power of two (UE8M0: an 8-bit exponent, no mantissa), as float32; exponents clamp
    to [1, 254] so the result is a normal, finite float."""
    import torch
    bits = x.abs().float().view(torch.int32)
    exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).int()
    return (exp.clamp(1, 254) << 23).view(torch.float32)


def pack_ue8m0_to_int(x):
    """Float32 powers of two (last dim a multiple of 4) -> their exponent bytes, four per int32 (little endian:
    byte j of word w is element 4w + j)."""
    import torch
    if x.dtype != torch.float32 or x.size(-1) % 4:
        raise ValueError(f"x: expected float32 with a last dim divisible by 4, got {x.dtype} {tuple(x.shape)}")
    bits = x.contiguous().view(torch.int32)
    if bool(((bits < 0) | ((bits & 0x7FFFFF) != 0)).any()):
        raise ValueError("x: every scale must be a non-negative power of two (see ceil_to_ue8m0)")
    return (bits >> 23).to(torch.uint8).view(torch.int32)


def unpack_ue8m0_from_int(packed_sf):
    """The inverse of pack_ue8m0_to_int: float32 powers of two, four per int32."""
    import torch
    return (packed_sf.contiguous().view(torch.uint8).to(torch.int32) << 23).view(torch.float32)


# reference quantisers ---------------------------------------------------------------------------------

def _scale(amax, use_ue8m0: bool):
    sf = amax.clamp(min=AMAX_FLOOR) / FP8_MAX
    return ceil_to_ue8m0(sf) if use_ue8m0 else sf


def per_token_cast_to_fp8(x, use_ue8m0: bool, gran_k: int = 128, use_packed_ue8m0: bool = False):
    """(fp8 [m, n], scales [m, ceil(n / gran_k)]): one scale per row and gran_k columns, amax / 448 with amax
    floored at 1e-4 (rounded up to a power of two with use_ue8m0; packed four per int32 with use_packed_ue8m0),
    values multiplied by 1 / scale in float32 and rounded to float8_e4m3fn. Bit-exact with deep_gemm."""
    import torch
    if x.dim() != 2:
        raise ValueError(f"x: expected a 2-D tensor, got shape {tuple(x.shape)}")
    m, n = x.shape
    padded = torch.zeros((m, align(n, gran_k)), dtype=x.dtype, device=x.device)
    padded[:, :n] = x
    blocks = padded.view(m, -1, gran_k)
    sf = _scale(blocks.abs().float().amax(dim=2), use_ue8m0)
    q = (blocks * (1.0 / sf.unsqueeze(2))).to(torch.float8_e4m3fn).view(m, -1)[:, :n].contiguous()
    if use_packed_ue8m0:
        if not use_ue8m0:
            raise ValueError("use_packed_ue8m0 needs use_ue8m0=True (only powers of two pack)")
        if sf.size(-1) % 4:
            sf = torch.nn.functional.pad(sf, (0, 4 - sf.size(-1) % 4), value=1.0)
        return q, pack_ue8m0_to_int(sf)
    return q, sf


def per_channel_cast_to_fp8(x, use_ue8m0: bool, gran_k: int = 128):
    """(fp8 [m, n], scales [m / gran_k, n]): one scale per column and gran_k rows (m a multiple of gran_k)."""
    import torch
    if x.dim() != 2 or x.size(0) % gran_k:
        raise ValueError(f"x: expected a 2-D tensor with rows a multiple of {gran_k}, got {tuple(x.shape)}")
    m, n = x.shape
    blocks = x.view(-1, gran_k, n)
    sf = _scale(blocks.abs().float().amax(dim=1), use_ue8m0)
    return (blocks * (1.0 / sf.unsqueeze(1))).to(torch.float8_e4m3fn).view(m, n), sf


def per_block_cast_to_fp8(x, use_ue8m0: bool, gran_k: int = 128):
    """(fp8 [m, n], scales [ceil(m / gran_k), ceil(n / gran_k)]): one scale per gran_k x gran_k block."""
    import torch
    if x.dim() != 2:
        raise ValueError(f"x: expected a 2-D tensor, got shape {tuple(x.shape)}")
    m, n = x.shape
    padded = torch.zeros((align(m, gran_k), align(n, gran_k)), dtype=x.dtype, device=x.device)
    padded[:m, :n] = x
    blocks = padded.view(-1, gran_k, padded.size(1) // gran_k, gran_k)
    sf = _scale(blocks.abs().float().amax(dim=(1, 3), keepdim=True), use_ue8m0)
    q = (blocks * (1.0 / sf)).to(torch.float8_e4m3fn).view_as(padded)[:m, :n].contiguous()
    return q, sf.view(blocks.size(0), blocks.size(2))


def per_custom_dims_cast_to_fp8(x, dims, use_ue8m0: bool):
    """One scale per index of ``dims`` (amax over the other dims): (fp8 like x, scales squeezed)."""
    import torch
    keep = set(dims)
    reduce = tuple(i for i in range(x.dim()) if i not in keep)
    sf = _scale(x.abs().float().amax(dim=reduce, keepdim=True), use_ue8m0)
    return (x * (1.0 / sf)).to(torch.float8_e4m3fn), sf.squeeze()


# scale-factor layouts ---------------------------------------------------------------------------------

def get_tma_aligned_size(x: int, element_size: int) -> int:
    """x rounded up to a whole number of 16-byte units of ``element_size``-byte elements."""
    if TMA_ALIGN_BYTES % element_size:
        raise ValueError(f"element_size: must divide {TMA_ALIGN_BYTES}, got {element_size}")
    return align(x, TMA_ALIGN_BYTES // element_size)


def get_mn_major_tma_aligned_tensor(sf):
    """The same float32 scales [(g,) mn, k] in deep_gemm's MN-major layout: stride 1 along mn, mn padded to
    16 bytes; returned as is when already so."""
    import torch
    if sf.dim() not in (2, 3) or sf.dtype != torch.float32:
        raise ValueError(f"sf: expected a 2-D or 3-D float32 tensor, got {sf.dtype} {tuple(sf.shape)}")
    b = sf.unsqueeze(0) if sf.dim() == 2 else sf
    g, mn, k = b.shape
    amn = get_tma_aligned_size(mn, 4)
    if (sf.dim() == 2 or b.stride(0) == amn * k) and b.stride(1) == 1 and b.stride(2) == amn:
        return sf
    out = torch.empty_strided((g, mn, k), (amn * k, 1, amn), dtype=sf.dtype, device=sf.device)
    out.copy_(b)
    return out.squeeze(0) if sf.dim() == 2 else out


def get_mn_major_tma_aligned_packed_ue8m0_tensor(sf, psum_layout=None):
    """Float32 power-of-two scales [(g,) mn, k] -> int32 [(g,) mn, ceil(k / 4)], four exponent bytes per word,
    MN-major with mn padded to 16 bytes (the rows past each group's end in a psum layout are copied too)."""
    import torch
    if sf.dim() not in (2, 3) or sf.dtype != torch.float32:
        raise ValueError(f"sf: expected a 2-D or 3-D float32 tensor, got {sf.dtype} {tuple(sf.shape)}")
    b = sf.unsqueeze(0) if sf.dim() == 2 else sf
    g, mn, k = b.shape
    amn, ak = get_tma_aligned_size(mn, 4), align(k, 4)
    exps = torch.zeros((g, amn, ak), dtype=torch.uint8, device=sf.device)
    exps[:, :mn, :k] = (b.contiguous().view(torch.int32) >> 23).to(torch.uint8)
    words = exps.view(-1).view(torch.int32).view(g, amn, ak // 4)
    out = torch.empty_strided((g, amn, ak // 4), (amn * (ak // 4), 1, amn), dtype=torch.int32, device=sf.device)
    out = out.copy_(words)[:, :mn]
    return out.squeeze(0) if sf.dim() == 2 else out


def transform_sf_into_required_layout(sf, mn: int, k: int, recipe, num_groups: int | None = None,
                                      is_sfa: bool | None = None, disable_ue8m0_cast: bool = False,
                                      psum_layout=None):
    """Check scales against (mn, k, recipe) and return them in the layout deep_gemm's SM90 kernels take:
    float32 per-row scales MN-major and TMA-aligned, float32 128 x 128 block scales and packed int32 UE8M0
    scales unchanged. ``recipe`` is (gran_m, gran_n, gran_k) with ``is_sfa``, or (gran_mn, gran_k). The
    tegula GEMMs accept every one of these layouts (and plain row-major ones) directly."""
    import torch
    if len(recipe) == 3:
        if is_sfa is None:
            raise ValueError("is_sfa: a 3-element recipe needs is_sfa to pick its M or N granularity")
        gran_mn, gran_k = (recipe[0] if is_sfa else recipe[1]), recipe[2]
    elif len(recipe) == 2:
        if is_sfa is not None:
            raise ValueError("is_sfa: give it only with a 3-element recipe")
        gran_mn, gran_k = recipe
    else:
        raise ValueError(f"recipe: expected (gran_m, gran_n, gran_k) or (gran_mn, gran_k), got {recipe!r}")
    check_sf_shape("sf", sf, mn, k, gran_mn, gran_k, num_groups)
    if sf.dtype == torch.float32 and gran_mn == 1:
        return get_mn_major_tma_aligned_tensor(sf)
    return sf


def check_sf_shape(name: str, sf, mn: int, k: int, gran_mn: int, gran_k: int, num_groups: int | None = None):
    """ValueError unless ``sf`` holds one scale per (gran_mn x gran_k) block of an (mn x k) operand: float32 or
    float8_e8m0fnu [(g,) ceil(mn / gran_mn), ceil(k / gran_k)], or int32 with four packed UE8M0 per word."""
    import torch
    if not isinstance(sf, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor of scale factors, got {type(sf).__name__}")
    if sf.dtype not in (torch.float32, torch.float8_e8m0fnu, torch.int32):
        raise ValueError(f"{name}: scale factors must be float32, float8_e8m0fnu or packed int32 UE8M0, "
                         f"got {sf.dtype}")
    per_word = 4 if sf.dtype == torch.int32 else 1
    want = ((num_groups,) if num_groups is not None else ()) + (ceil_div(mn, gran_mn), ceil_div(k, gran_k * per_word))
    if tuple(sf.shape) != want:
        raise ValueError(f"{name}: expected scale factors of shape {want} for {mn} x {k} with {gran_mn} x {gran_k} "
                         f"blocks{' (4 per int32)' if per_word == 4 else ''}, got {tuple(sf.shape)}")


# accuracy ----------------------------------------------------------------------------------------------

def calc_diff(x, y) -> float:
    """1 - 2 sum(x y) / sum(x^2 + y^2) in float64: 0 for identical tensors (and for two all-zero ones)."""
    x, y = x.double(), y.double()
    denominator = (x * x + y * y).sum()
    if denominator == 0:
        return 0.0
    return float(1 - 2 * (x * y).sum() / denominator)
