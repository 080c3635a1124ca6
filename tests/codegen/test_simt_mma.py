"""T.gemm on CUDA tensor cores (mma.sync m16n8k16), checked without a GPU: the emitted MMA loop nest is run in
Python, thread by thread (its index arithmetic is C that Python reads the same way), each mma.sync is computed
from the 32 lanes' registers as PTX defines the m16n8k16 fragments, and the threads' accumulators, placed by the
layout the compiler claims for them, must equal A @ B.
"""
import re

import numpy as np
import pytest
import torch

import tegula
import tegula.language as T
from tegula.passes.infer_layouts import mma_layout


def gemm_kernel(M, N, K, trans_A, trans_B, dtype, threads):
    a_shape = (K, M) if trans_A else (M, K)
    b_shape = (N, K) if trans_B else (K, N)

    @T.prim_func
    def main(A: T.Tensor(a_shape, dtype), B: T.Tensor(b_shape, dtype), C: T.Tensor((M, N), "float32")):
        with T.Kernel(1, threads=threads):
            a = T.alloc_shared(a_shape, dtype)
            b = T.alloc_shared(b_shape, dtype)
            c = T.alloc_fragment((M, N), "float32")
            T.copy(A, a)
            T.copy(B, b)
            T.gemm(a, b, c, transpose_A=trans_A, transpose_B=trans_B, clear_accum=True)
            T.copy(c, C)

    return main


def mma_block_as_python(source):
    """The emitted MMA loop nest (from `tg_row` to its closing brace) as Python source; mma.sync becomes a call
    of record(k0, mt, nt, tid, [C slots], a registers, b registers)."""
    lines = source.splitlines()
    start = next(k for k, ln in enumerate(lines) if "const int32_t tg_row" in ln)
    depth, out, k = 0, [], start
    while True:
        ln = lines[k].strip()
        k += 1
        pad = "    " * depth
        if ln.startswith("#pragma"):
            continue
        if ln == "}":
            depth -= 1
            if depth < 0:
                break
            continue
        m = re.match(r"for \(int32_t (\w+) = (.+); \1 < (.+); (?:\+\+\1|\1 \+= (\d+))\) \{", ln)
        if m:
            out.append(f"{pad}for {m[1]} in range({m[2]}, {m[3]}, {m[4] or 1}):")
            depth += 1
            continue
        if ln.startswith("const int32_t"):
            for decl in ln[len("const int32_t "):-1].split(", "):
                out.append(pad + decl)
            continue
        m = re.match(r"uint32_t (\w+)\[(\d+)\];", ln)
        if m:
            out.append(f"{pad}{m[1]} = [0] * {m[2]}")
            continue
        if ln.startswith("tg_"):
            out.append(pad + ln.rstrip(";").replace("tg_pack_b16", "pack"))
            continue
        if ln.startswith("asm volatile"):
            slots = re.findall(r'"\+f"\(\w+\[(.+?)\]\)', lines[k].strip())
            k += 2
            out.append(f"{pad}record(tg_k0, tg_mt, tg_nt, tid, [{', '.join(slots)}], list(tg_a), list(tg_b))")
            continue
        raise AssertionError(f"unexpected line in the MMA nest: {ln}")
    return "\n".join(out)


def warp_mma(lanes):
    """D = A @ B of one m16n8k16 from the 32 lanes' (a, b) registers, as PTX lays the fragments out; returns
    each lane's four accumulator contributions."""
    def halves(x):
        return [x & 0xFFFF, x >> 16]
    a_t = np.zeros((16, 16), np.uint16)
    b_t = np.zeros((16, 8), np.uint16)
    for lane, (a, b) in enumerate(lanes):
        g, q = lane >> 2, lane & 3
        for reg, (row, col) in enumerate([(g, 2 * q), (g + 8, 2 * q), (g, 2 * q + 8), (g + 8, 2 * q + 8)]):
            a_t[row, col:col + 2] = halves(a[reg])
        for reg, krow in enumerate([2 * q, 2 * q + 8]):
            b_t[krow:krow + 2, g] = halves(b[reg])
    return a_t, b_t


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("trans_A, trans_B", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("M, N, K, threads", [(64, 32, 32, 128), (128, 64, 16, 256)])
def test_emitted_mma_nest_computes_a_times_b(M, N, K, threads, trans_A, trans_B, dtype):
    src = tegula.lower(gemm_kernel(M, N, K, trans_A, trans_B, dtype, threads), target="cuda").kernel_source
    assert "mma.sync.aligned.m16n8k16.row.col.f32" in src
    code = compile(mma_block_as_python(src), "<mma nest>", "exec")
    tdt = getattr(torch, dtype)
    a = torch.randn((K, M) if trans_A else (M, K)).to(tdt)
    b = torch.randn((N, K) if trans_B else (K, N)).to(tdt)
    bits = {name: t.view(torch.int16).numpy().view(np.uint16).ravel() for name, t in (("a", a), ("b", b))}

    def to_float(t):
        return torch.from_numpy(t.astype(np.int16)).view(tdt).float().numpy()

    records = {}

    def record(k0, mt, nt, tid, slots, ra, rb):
        records.setdefault((tid // 32, k0, mt, nt), {})[tid % 32] = (slots, ra, rb)

    for tid in range(threads):
        exec(code, {"tid": tid, "pack": lambda lo, hi: int(lo) | int(hi) << 16, "record": record, **bits})
    acc = np.zeros((threads, mma_layout(M, N, threads).slots), np.float32)
    for key, lanes in records.items():
        assert sorted(lanes) == list(range(32)), key
        a_t, b_t = warp_mma([(lanes[k][1], lanes[k][2]) for k in range(32)])
        d = to_float(a_t) @ to_float(b_t)
        for lane, (slots, _, _) in lanes.items():
            g, q = lane >> 2, lane & 3
            tid = key[0] * 32 + lane
            for slot, value in zip(slots, [d[g, 2 * q], d[g, 2 * q + 1], d[g + 8, 2 * q], d[g + 8, 2 * q + 1]]):
                acc[tid, slot] += value
    # place every thread's accumulators where the layout says they are
    lay = mma_layout(M, N, threads)
    (rs, rc), (cs, cc) = lay.dims
    c = np.full((M, N), np.nan, np.float32)
    for tid in range(threads):
        for sa in range(lay.slot_shape[0]):
            for sb in range(lay.slot_shape[1]):
                c[sa * rc + (tid // rs) % rc, sb * cc + (tid // cs) % cc] = acc[tid, sa * lay.slot_shape[1] + sb]
    a_ref = a.float().T if trans_A else a.float()
    b_ref = b.float().T if trans_B else b.float()
    np.testing.assert_allclose(c, (a_ref @ b_ref).numpy(), rtol=1e-4, atol=1e-4)


def test_small_or_fp32_gemms_keep_the_portable_path():
    src = tegula.lower(gemm_kernel(32, 16, 64, False, False, "float16", 128), target="cuda").kernel_source
    assert "mma.sync" not in src and "fmaf(" in src  # 32 rows cannot give each of 4 warps a 16-row tile
    src = tegula.lower(gemm_kernel(64, 32, 32, False, False, "float32", 128), target="cuda").kernel_source
    assert "mma.sync" not in src
