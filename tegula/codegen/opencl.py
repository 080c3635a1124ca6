"""The OpenCL C emitter: work-groups are blocks, work-items threads; ``__local`` memory is shared memory.

OpenCL C has no bf16/fp8 (nor, portably, fp16 storage) types: narrow floats are raw bits converted by the same
prelude code as the c target's (tegula_types.h, through tegula_simt.h). Kernel arguments cannot be ``bool``,
so bool tensors and scalars travel as ``uchar``.
"""
from __future__ import annotations

from tegula.codegen.simt import SimtEmitter
from tegula.ir import expr as E
from tegula.ir import stmt as S


class OpenCLEmitter(SimtEmitter):
    target = "opencl"
    kernel_prefix = "__kernel"
    global_space = "__global "
    restrict = "restrict"
    shared_decl = "__local {t} {name}[{n}];"
    barrier = "barrier(CLK_LOCAL_MEM_FENCE | CLK_GLOBAL_MEM_FENCE);"
    block_index = ("get_group_id(0)", "get_group_id(1)", "get_group_id(2)")
    thread_index = "get_local_id(0)"
    atomic_suffix = {"global": "", "shared": "_local"}
    storage = {"bool": "uchar"}
    spaces = {"global": "__global ", "shared": "__local "}

    def loop_pragmas(self, s) -> list[str]:
        # PoCL runs a work-group as a loop over its work-items around the code between barriers, and vectorises
        # that loop when it is innermost: unroll small nests of per-thread slot loops so that nothing is inside it
        return ["#pragma unroll"] if s.kind == "unroll" and _unrolled_trips(s) <= 64 else []

    def launch_bounds(self, k) -> str:
        return f"__attribute__((reqd_work_group_size({k.nthreads}, 1, 1))) "


def emit_opencl(func, symbols: list) -> str:
    """OpenCL C source of the SIMT-lowered ``func``; ``symbols`` are the symbolic dims passed after the parameters."""
    return OpenCLEmitter(func).emit(symbols)


def _unrolled_trips(s) -> float:
    """Iterations of the loop nest ``s`` when every loop in it is an unroll loop of constant extent, else inf."""
    trips = 1
    for x in S.walk(s):
        if isinstance(x, (S.While,)):
            return float("inf")
        if isinstance(x, S.For):
            n = E.const_value(x.extent)
            if x.kind != "unroll" or not isinstance(n, int):
                return float("inf")
            trips *= n
    return trips
