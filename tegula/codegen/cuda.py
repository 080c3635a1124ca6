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

    def launch_bounds(self, k) -> str:
        return f"__launch_bounds__({k.nthreads}) "


def emit_cuda(func, symbols: list) -> str:
    """CUDA C++ source of the SIMT-lowered ``func``; ``symbols`` are the symbolic dims passed after the parameters."""
    return CudaEmitter(func).emit(symbols)
