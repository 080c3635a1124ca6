"""Plain torch references for the tegula.ops quantisation tests (TileKernels' numerics, written from their
definitions), and the checks the tests share: bit-exact equality with strides, and the rounding-bias check."""
from __future__ import annotations

import math

import torch

MAX = {"e4m3": 448.0, "e2m1": 6.0, "e5m6": 65024.0}
CLAMP = {"e4m3": 1e-4, "e2m1": 6.0 * 2.0 ** -126, "e5m6": 1e-4}
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def ceil_div(a, b):
    return -(-a // b)


def align(a, b):
    return ceil_div(a, b) * b


def assert_equal(x, y):
    """Same dtype, shape, strides (when non-empty) and bytes."""
    assert x.dtype == y.dtype, (x.dtype, y.dtype)
    assert x.shape == y.shape, (x.shape, y.shape)
    assert x.numel() == 0 or x.stride() == y.stride(), (x.stride(), y.stride())
    xb = x.contiguous().flatten().view(torch.uint8)
    yb = y.contiguous().flatten().view(torch.uint8)
    if not torch.equal(xb, yb):
        bad = (xb != yb).nonzero().flatten()[:8]
        raise AssertionError(f"{bad.numel()}+ bytes differ, first at byte offsets {bad.tolist()}: "
                             f"{xb[bad].tolist()} vs {yb[bad].tolist()}")


def check_bias(x, ref):
    """Rounding to nearest is unbiased: the share of values below the original is 0.5 +- 10 / sqrt(n)."""
    n = x.numel()
    if n == 0:
        return
    less = (x < ref).sum().item() + (x == ref).sum().item() / 2
    assert abs(less / n - 0.5) < 10 / math.sqrt(n), (less / n, n)


# encodings ---------------------------------------------------------------------------------------------------------

def e2m1_encode(v):
    """float32 -> 4-bit codes: round to nearest (ties to the even code) on the e2m1 grid, saturating at 6; the
    grid's spacing is 0.5 below 2, 1 below 4 and 2 above; NaN -> 7; sign in bit 3."""
    a = v.double().abs()
    rne = torch.round  # half to even
    mag = torch.where(a < 2, rne(a * 2), torch.where(a < 4, 4 + rne(a - 2), 6 + rne((a - 4) / 2)))
    mag = torch.where(a.isnan(), torch.full_like(a, 7), mag.clamp(max=7)).long()
    sign = (v.view(torch.int32) < 0).long() << 3
    return (mag | sign).to(torch.uint8)


def e2m1_pack(codes):
    c = codes.view(*codes.shape[:-1], codes.shape[-1] // 2, 2).to(torch.int32)
    return (c[..., 0] | (c[..., 1] << 4)).to(torch.uint8).view(torch.int8)


def e2m1_decode(packed):
    b = packed.view(torch.uint8).to(torch.int64)
    codes = torch.stack([b & 15, b >> 4], dim=-1).reshape(*b.shape[:-1], b.shape[-1] * 2)
    mag = E2M1_VALUES.float()[codes & 7]
    return torch.where(codes >= 8, -mag, mag)


def e5m6_encode(v):
    """float32 -> 12-bit e5m6 codes: float16 rounded toward zero, its top 12 bits, then round-to-nearest-even on
    the float32 bits below the kept mantissa (TileKernels' definition)."""
    b = v.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    sign = (b >> 16) & 0x8000
    e = (b >> 23) & 0xFF
    m = b & 0x7FFFFF
    h = torch.where(e < 103, sign, sign | ((m | 0x800000) >> (126 - e).clamp(0, 31)))
    h = torch.where((e >= 113) & (e <= 142), sign | ((e - 112) << 10) | (m >> 13), h)
    h = torch.where(e > 142, sign | torch.where((e == 255) & (m != 0), 0x7FFF, 0x7C00), h)
    c = h >> 4
    return (c + ((c & 1) + (b & 0x1FFFF) > 0x10000).long()) & 0xFFF


def e5m6_pack(codes):
    h = codes.view(codes.shape[0], -1, 8)
    w0 = (h[..., 0] << 20) | (h[..., 1] << 8) | (h[..., 2] >> 4)
    w1 = (h[..., 2] << 28) | (h[..., 3] << 16) | (h[..., 4] << 4) | (h[..., 5] >> 8)
    w2 = (h[..., 5] << 24) | (h[..., 6] << 12) | h[..., 7]
    w = torch.stack([w0, w1, w2], -1) & 0xFFFFFFFF
    w = torch.where(w >= 2 ** 31, w - 2 ** 32, w).to(torch.int32)
    return w.view(codes.shape[0], -1).view(torch.uint8)


def e5m6_decode(q):
    w = q.view(torch.int32).to(torch.int64).view(q.shape[0], -1, 3) & 0xFFFFFFFF
    w0, w1, w2 = w[..., 0], w[..., 1], w[..., 2]
    parts = [w0 >> 16, w0 >> 4, (w0 << 8) | (w1 >> 24), w1 >> 12, w1, (w1 << 12) | (w2 >> 20), w2 >> 8, w2 << 4]
    h = torch.stack([p & 0xFFF0 for p in parts], -1).view(q.shape[0], -1)
    h = torch.where(h >= 2 ** 15, h - 2 ** 16, h).to(torch.int16)
    return h.view(torch.float16).float()


# scales --------------------------------------------------------------------------------------------------------

def scales(amax, fmt, round_sf):
    """(sf, inv) float32 from the block amax: amax clamped, sf = amax / max, inv = max / amax (tensor division,
    not Python-scalar division, which torch turns into a reciprocal and a product); round_sf: powers of two."""
    a = amax.clamp(min=CLAMP[fmt])
    mx = torch.full_like(a, MAX[fmt])
    sf, inv = a / mx, mx / a
    if round_sf:
        eb = ((sf.view(torch.int32) - 1) >> 23) + 1
        sf, inv = (eb << 23).view(torch.float32), ((254 - eb) << 23).view(torch.float32)
    return sf, inv


def expand(s, block, shape):
    return s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:shape[0], :shape[1]]


def block_amax(x, block):
    t, h = x.shape
    bt, bc = block
    p = torch.nn.functional.pad(x.abs(), (0, align(h, bc) - h, 0, align(t, bt) - t))
    return p.view(align(t, bt) // bt, bt, align(h, bc) // bc, bc).amax(dim=(1, 3))


def layout(sf, col_major=False, packed=False):
    """TileKernels' scale layouts of a float32 (m, k) scale tensor."""
    m, k = sf.shape
    if packed:
        eb = ((sf.view(torch.int32) >> 23) & 255).to(torch.uint8)
        eb = torch.nn.functional.pad(eb, (0, align(k, 4) - k)).contiguous().view(torch.int32)
        store = torch.zeros((eb.shape[1], align(m, 4)), dtype=torch.int32)
        store[:, :m] = eb.T
        return store[:, :m].T
    if col_major:
        store = torch.zeros((k, align(m, 4)), dtype=torch.float32)
        store[:, :m] = sf.T
        return store[:, :m].T
    return sf.contiguous()


def sf_to_float(sf, cols):
    if sf.dtype == torch.float32:
        return sf
    b = sf.contiguous().reshape(-1).view(torch.uint8).view(sf.shape[0], sf.shape[1] * 4)[:, :cols].int()
    return (b << 23).view(torch.float32)


def decode(q):
    return e2m1_decode(q) if q.dtype in (torch.int8, torch.uint8) else q.float()


def ref_cast(x, fmt, block, x_block=None, round_sf=False, col_major=False, packed=False, sf=None):
    """TileKernels' cast: ``x`` float32 / bf16, or a pair (q, q_sf) over ``x_block`` blocks (re-quantised as
    q * (q_sf * inv)); ``sf`` given: cast with inv = 1 / sf. Returns (out, sf in its layout)."""
    if isinstance(x, tuple):
        q, qs = x
        qf = decode(q)
        xs = expand(sf_to_float(qs, ceil_div(qf.shape[1], x_block[1])), x_block, qf.shape)
        xv = qf * xs
    else:
        qf = xv = x.float()
    if sf is None:
        s, inv = scales(block_amax(xv, block), fmt, round_sf)
    else:
        s, inv = sf, sf.reciprocal()
    inv_e = expand(inv, block, xv.shape)
    v = qf * (xs * inv_e) if isinstance(x, tuple) else xv * inv_e
    if fmt == "e4m3":
        out = v.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    elif fmt == "e2m1":
        out = e2m1_pack(e2m1_encode(v))
    else:
        out = e5m6_pack(e5m6_encode(v))
    return out, layout(s, col_major, packed)


def ref_cast_back(q, sf, block, fmt, e5m6=False):
    qf = e5m6_decode(q) if e5m6 else decode(q)
    cols = ceil_div(qf.shape[1], block[1])
    s = expand(sf_to_float(sf, cols), block, qf.shape)
    return (qf * s).to(torch.bfloat16 if fmt == "bf16" else torch.float32)


# transcendental references -------------------------------------------------------------------------------------

def _vectorised(fn, x):
    """``fn(x)`` computed by torch's vectorised CPU path for every element: torch finishes a chunk of an
    elementwise loop whose length is not a multiple of 32 with a scalar libm tail, whose exp differs from the
    vectorised (SLEEF) one; one thread and a length padded to a multiple of 32 avoid that."""
    flat = x.reshape(-1)
    n = flat.numel()
    padded = torch.nn.functional.pad(flat, (0, align(max(n, 1), 32) - n))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = fn(padded)
    finally:
        torch.set_num_threads(threads)
    return out[:n].view(x.shape)


def silu(x):
    return _vectorised(torch.nn.functional.silu, x)


def sigmoid(x):
    return _vectorised(torch.sigmoid, x)


def fma(a, b, c):
    """a * b + c rounded once to float32: the float64 product is exact, the float64 sum is made round-to-odd
    (last bit set where it was inexact), which then rounds to float32 as the exact value would."""
    a, b, c = torch.broadcast_tensors(a.double(), b.double(), c.double())
    p = a * b
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)
    even = (s.view(torch.int64) & 1) == 0
    away = torch.nextafter(s, torch.where(err > 0, torch.full_like(s, float("inf")), torch.full_like(s, -float("inf"))))
    return torch.where((err != 0) & even, away, s).float()


def lane_sum(p, lanes=32):
    """Row sums of p (n, h) in the kernels' order: lane l accumulates columns l, l + 32, ... in order, then the
    lanes fold pairwise (l + 16 into l, then 8, 4, 2, 1)."""
    n, h = p.shape
    v = p.float().view(n, h // lanes, lanes)
    acc = torch.zeros(n, lanes)
    for c in range(h // lanes):
        acc = acc + v[:, c]
    half = lanes // 2
    while half:
        acc = torch.cat([acc[:, :half] + acc[:, half:2 * half], acc[:, half:]], 1)
        half //= 2
    return acc[:, 0]
