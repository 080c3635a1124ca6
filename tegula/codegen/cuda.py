"""The CUDA C++ emitter: blocks and threads as CUDA has them; shared memory is one dynamic ``extern __shared__``
array carved into the block's buffers (so a block may use more than the 48 KiB a static array is allowed);
cross-thread reductions inside a warp are ``__shfl_xor_sync`` butterflies.
"""
from __future__ import annotations

from tegula.codegen.cfamily import reg_type
from tegula.codegen.simt import SimtEmitter
from tegula.ir import expr as E
from tegula.ir import simt as X

_SHFL_OP = {"sum": "+", "max": "max", "min": "min"}


class CudaEmitter(SimtEmitter):
    target = "cuda"
    kernel_prefix = 'extern "C" __global__'
    barrier = "__syncthreads();"
    block_index = ("blockIdx.x", "blockIdx.y", "blockIdx.z")
    thread_index = "threadIdx.x"
    unroll_pragma = "#pragma unroll"

    def __init__(self, func):
        super().__init__(func)
        self.smem_offset = 0

    def begin_kernel(self) -> None:
        self.smem_offset = 0

    def declare(self, b) -> None:
        if b.scope != "shared":
            return super().declare(b)
        if self.smem_offset == 0:
            self.w("extern __shared__ __align__(16) unsigned char tg_smem[];")
        t = self.ctype(b.dtype)
        self.w(f"{t} *__restrict__ {self.nm(b)} = ({t} *)(tg_smem + {self.smem_offset});")
        n = 1
        for d in b.shape:
            n *= int(d)
        self.smem_offset += (n * b.dtype.itemsize + 15) // 16 * 16

    def stmt_WarpAllReduce(self, s: X.WarpAllReduce):
        v = self.nm(s.var)
        other = E.Var("tg_lane", s.var.dtype)
        self.w("#pragma unroll")
        self.w(f"for (int tg_off = {s.count // 2 * s.stride}; tg_off >= {s.stride}; tg_off >>= 1) {{")
        self.w(f"  {reg_type(s.var.dtype)} {self.nm(other)} = __shfl_xor_sync(0xffffffffu, {v}, tg_off);")
        self.w(f"  {v} = {self.ex(E.binop(_SHFL_OP[s.kind], s.var, other))};")
        self.w("}")

    def stmt_MmaSync(self, s: X.MmaSync):
        """Per 16-deep step of K, per 16-row tile of the warp's rows, per 8-column tile: gather the A and B
        fragments (pairs of 16-bit elements along K), then one mma.sync into four of the thread's accumulators.

        mma.sync m16n8k16 fragments, per lane l (g = l / 4, q = l % 4): A regs {0,1,2,3} hold rows
        (g, g+8, g, g+8) at columns (2q, 2q, 2q+8, 2q+8) (+1 in the high half); B regs {0,1} hold rows 2q and
        2q+8 (+1) of column g; C regs {0,1,2,3} are rows (g, g, g+8, g+8), columns (2q, 2q+1, 2q, 2q+1). The
        tile's 8 columns are read in the order c(p) = 4 * (p % 2) + p / 2, so that the lane's C columns 2q + e are
        the tile's columns q + 4e: a plain cyclic layout (infer_layouts.mma_layout)."""
        self.uses_mma = True
        warps = self.kernel.nthreads // 32
        tid, c, nm = self.nm(s.tid), self.nm(s.c), self.nm
        r, kv, nv = nm(s.r), nm(s.kv), nm(s.nv)
        mt, nt, cols = s.m // (16 * warps), s.n // 8, s.n // 4
        kind = {"float16": "f16", "bfloat16": "bf16"}[s.dtype]
        raw = lambda e: f"{self.nm(e.buffer)}[{self.flat(e.buffer, e.indices)}]"  # noqa: E731 (the bits, unconverted)
        self.w("{")
        self.ind += 1
        self.w(f"const int32_t tg_row = {tid} >> 2, tg_q = {tid} & 3;")
        self.w("const int32_t tg_bcol = ((tg_row & 1) << 2) | ((tg_row & 7) >> 1);")
        self.w(f"for (int32_t tg_k0 = 0; tg_k0 < {s.k}; tg_k0 += 16) {{")
        self.ind += 1
        self.w("#pragma unroll")
        self.w(f"for (int32_t tg_mt = 0; tg_mt < {mt}; ++tg_mt) {{")
        self.ind += 1
        self.w("uint32_t tg_a[4];")
        self.w("#pragma unroll")
        self.w("for (int32_t tg_h = 0; tg_h < 4; ++tg_h) {")
        self.w(f"  const int32_t {r} = (2 * tg_mt + (tg_h & 1)) * {8 * warps} + tg_row;")
        self.w(f"  const int32_t {kv} = tg_k0 + (tg_h >> 1) * 8 + 2 * tg_q;")
        self.w(f"  tg_a[tg_h] = tg_pack_b16({raw(s.a_lo)}, {raw(s.a_hi)});")
        self.w("}")
        self.w("#pragma unroll")
        self.w(f"for (int32_t tg_nt = 0; tg_nt < {nt}; ++tg_nt) {{")
        self.ind += 1
        self.w(f"const int32_t {nv} = tg_nt * 8 + tg_bcol;")
        self.w("uint32_t tg_b[2];")
        self.w("#pragma unroll")
        self.w("for (int32_t tg_h = 0; tg_h < 2; ++tg_h) {")
        self.w(f"  const int32_t {kv} = tg_k0 + tg_h * 8 + 2 * tg_q;")
        self.w(f"  tg_b[tg_h] = tg_pack_b16({raw(s.b_lo)}, {raw(s.b_hi)});")
        self.w("}")
        c0, c1 = f"(2 * tg_mt) * {cols} + 2 * tg_nt", f"(2 * tg_mt + 1) * {cols} + 2 * tg_nt"
        self.w(f'asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32 {{%0, %1, %2, %3}}, '
               '{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"')
        self.w(f'    : "+f"({c}[{c0}]), "+f"({c}[{c0} + 1]), "+f"({c}[{c1}]), "+f"({c}[{c1} + 1])')
        self.w('    : "r"(tg_a[0]), "r"(tg_a[1]), "r"(tg_a[2]), "r"(tg_a[3]), "r"(tg_b[0]), "r"(tg_b[1]));')
        for _ in range(3):
            self.ind -= 1
            self.w("}")
        self.ind -= 1
        self.w("}")

    def emit(self, symbols: list) -> str:
        self.uses_mma = False
        src = super().emit(symbols)
        if not self.uses_mma:
            return src
        guard = ('#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800\n#error "this kernel\'s T.gemm uses mma.sync '
                 'm16n8k16: build for sm_80 or newer (TEGULA_CUDA_ARCH)"\n#endif\n')
        head, _, rest = src.partition('#include "tegula_simt.h"\n')
        return head + '#include "tegula_simt.h"\n' + guard + rest

    def launch_bounds(self, k) -> str:
        return f"__launch_bounds__({k.nthreads}) "


def emit_cuda(func, symbols: list) -> str:
    """CUDA C++ source of the SIMT-lowered ``func``; ``symbols`` are the symbolic dims passed after the parameters."""
    return CudaEmitter(func).emit(symbols)
