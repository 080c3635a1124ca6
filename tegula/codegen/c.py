"""The C emitter of the CPU target: the grid becomes an OpenMP loop over blocks, on-chip buffers become
per-thread aligned arrays, the innermost T.Parallel loop an ``omp simd`` loop, T.gemm a prelude call."""
from __future__ import annotations

from tegula.codegen.c_fuse import fuse
from tegula.codegen.cfamily import STORAGE, CFamilyEmitter, reg_type
from tegula.errors import CompileError
from tegula.ir import expr as E
from tegula.ir import stmt as S
from tegula.ir.cpu import StreamCopy

HEAP_THRESHOLD = 64 * 1024  # per-thread on-chip bytes above which buffers come from the heap, not the stack


class CEmitter(CFamilyEmitter):
    def loop_pragmas(self, s: S.For) -> list[str]:
        if s.kind == "unroll":
            return ["#pragma GCC unroll 16"]
        red = s.annotations.get("reduction")
        if red is not None and _simd_safe(s.body):
            reds = [red] if isinstance(red[0], str) else red  # loops fused by c_fuse carry several
            return ["#pragma omp simd " + " ".join(f"reduction({op}:{self.nm(var)})" for op, var in reds)]
        if s.kind == "parallel" and not isinstance(s.body, S.For) and _simd_safe(s.body):
            return ["#pragma omp simd"]
        return []

    def stmt_Alloc(self, s: S.Alloc):
        b = s.buffer
        if b.is_global and b.alias is None:  # T.alloc_global: heap workspace, freed when the function returns
            ct = STORAGE[b.dtype.name]
            self.w(f"{ct} *{self.restrict} {self.nm(b)} = ({ct} *)tg_aligned_alloc({_nbytes(b)});")
            self.workspaces.append(b)
            if self.outer is not None:
                self.outer.append((f"{ct} *{self.restrict}", self.nm(b), b))
            return
        super().stmt_Alloc(s)

    def stmt_StreamCopy(self, s):  # ir/cpu.py: a contiguous run copied with streaming stores (tegula_stream.h)
        self.uses_stream = True
        self.w(f"tg_stream_copy(&{self.nm(s.dst)}[{self.flat(s.dst, s.dst_indices)}], "
               f"&{self.nm(s.src)}[{self.flat(s.src, s.src_indices)}], (size_t){s.count * s.dst.dtype.itemsize});")

    def stmt_Prefetch(self, s):  # ir/cpu.py: a hint that the line is read soon (into L2; never faults)
        self.w(f"__builtin_prefetch(&{self.nm(s.buffer)}[{self.flat(s.buffer, s.indices)}], 0, 2);")

    # Each grid's blocks become a static function ``tg_<name>_grid<i>`` (its on-chip buffers, then a loop taking
    # chunks of blocks from a shared counter), called directly when the grid gets one thread and from an OpenMP
    # parallel region otherwise: a parallel region costs ~0.45 us even on one thread, a direct call nothing. It
    # takes the function's parameters and every local in scope outside the kernel (self.outer) by value.
    def stmt_Kernel(self, k: S.Kernel):
        name = f"tg_{self.func.name}_grid{self.ngrids}"
        self.ngrids += 1
        gx, gy, gz = (self.ex(E.as_expr(g)) for g in k.grid)
        args, ids = [n for _, n, _ in self.outer], {id(v) for _, _, v in self.outer}
        for s in S.walk(k.body):
            if isinstance(s, S.Assign) and not s.declare and id(s.var) in ids:
                raise CompileError(f"a kernel cannot assign {s.var.name}, a variable of the code around it", s.loc)
        outer, self.outer = self.outer, None   # None: inside a kernel
        lines, ind = self.lines, self.ind
        self.lines, self.ind = [], 1
        self.grid_body(k)
        params = self.params + [f"{t} {n}" for t, n, _ in outer] + [
            "const int64_t tg_gx", "const int64_t tg_gy", "const int64_t tg_gz", "int64_t *tg_next",
            "const int64_t tg_chunk"]
        self.helpers += [f"static void {name}({', '.join(params)}) {{"] + self.lines + ["}", ""]
        self.lines, self.ind, self.outer = lines, ind, outer
        call = f"{name}({', '.join(self.args + args + ['tg_gx', 'tg_gy', 'tg_gz', '&tg_next', 'tg_chunk'])});"
        self.w("{")
        self.ind += 1
        self.w(f"const int64_t tg_gx = {gx}, tg_gy = {gy}, tg_gz = {gz};")
        self.w("const int tg_nt = tg_threads_for(tg_gx * tg_gy * tg_gz);")
        self.w("const int64_t tg_chunk = tg_chunk_for(tg_gx * tg_gy * tg_gz, tg_nt);")
        self.w("int64_t tg_next = 0;   /* the first block not yet taken */")
        self.w("if (tg_nt == 1) {")
        self.w("  " + call)
        self.w("} else {")
        self.w("  #pragma omp parallel num_threads(tg_nt)")
        self.w("  " + call)
        self.w("}")
        self.ind -= 1
        self.w("}")

    def grid_body(self, k: S.Kernel):
        """The body of a grid's function: one thread's on-chip buffers and the blocks it takes."""
        allocs = [s.buffer for s in S.walk(k.body) if isinstance(s, S.Alloc) and s.buffer.alias is None]
        total = sum(_nbytes(b) for b in allocs)
        bx, by, bz = (self.nm(v) for v in k.block_vars)
        self.w("const int64_t tg_nblocks = tg_gx * tg_gy * tg_gz;")
        heap = total > HEAP_THRESHOLD
        if heap:
            self.w(f"char *tg_smem = (char *)tg_aligned_alloc({_round64(total)});")
        offset = 0
        for b in allocs:
            ct, n = STORAGE[b.dtype.name], _numel(b)
            if heap:
                self.w(f"{ct} *{self.restrict} {self.nm(b)} = ({ct} *)(tg_smem + {offset});")
                offset += _round64(n * b.dtype.itemsize)
            else:
                self.w(f"{ct} {self.nm(b)}[{n}] __attribute__((aligned(64)));")
        self.w("for (int64_t tg_lo, tg_hi; tg_grab(tg_next, tg_chunk, tg_nblocks, &tg_lo, &tg_hi);) {")
        self.w("  for (int64_t tg_b = tg_lo; tg_b < tg_hi; ++tg_b) {")
        self.ind += 2
        self.w(f"const int32_t {bx} = (int32_t)(tg_b % tg_gx);")
        self.w(f"const int32_t {by} = (int32_t)((tg_b / tg_gx) % tg_gy);")
        self.w(f"const int32_t {bz} = (int32_t)(tg_b / (tg_gx * tg_gy));")
        self.w(f"(void){bx}; (void){by}; (void){bz};")
        self.stmt(k.body)
        self.ind -= 2
        self.w("  }")
        self.w("}")
        if any(isinstance(s, StreamCopy) for s in S.walk(k.body)):
            self.w("tg_store_fence();")  # this thread's streaming stores are visible once the kernel returns
        if heap:
            self.w("free(tg_smem);")

    # locals declared outside kernels are passed to the grids' functions: self.outer lists those in scope
    def stmt_Assign(self, s: S.Assign):
        super().stmt_Assign(s)
        if s.declare and self.outer is not None:
            self.outer.append((reg_type(s.var.dtype), self.nm(s.var), s.var))

    def stmt_For(self, s: S.For):
        if self.outer is None:
            return super().stmt_For(s)
        mark = len(self.outer)
        self.outer.append(("int32_t", self.nm(s.var), s.var))
        super().stmt_For(s)
        del self.outer[mark:]

    def stmt_If(self, s: S.If):
        mark = None if self.outer is None else len(self.outer)
        super().stmt_If(s)
        if mark is not None:
            del self.outer[mark:]

    def stmt_While(self, s: S.While):
        mark = None if self.outer is None else len(self.outer)
        super().stmt_While(s)
        if mark is not None:
            del self.outer[mark:]

    def emit(self, symbols: list) -> str:
        """The translation unit: prelude includes, a static function per grid and one exported function
        ``tg_<name>``."""
        f = self.func
        self.ngrids, self.helpers, self.outer = 0, [], []
        self.nm.reserve(*(f"tg_{f.name}_grid{i}" for i in range(sum(isinstance(s, S.Kernel) for s in S.walk(f.body)))))
        self.params, self.args = [], []
        for p in list(f.params) + list(symbols):
            if isinstance(p, E.Var):
                self.params.append(f"{STORAGE[p.dtype.name]} {self.nm(p)}")
            else:
                self.params.append(f"{STORAGE[p.dtype.name]} *{self.restrict} {self.nm(p)}")
            self.args.append(self.nm(p))
        self.ind = 1
        self.workspaces = []
        self.stmt(f.body)
        for b in self.workspaces:
            self.w(f"free({self.nm(b)});")
        head = ["// generated by tegula for the c target", '#include "tegula_rt.h"']
        if self.uses_gemm:
            head.append('#include "tegula_gemm.h"')
        if getattr(self, "uses_stream", False):
            head.append('#include "tegula_stream.h"')
        body = [f"TG_EXPORT void tg_{f.name}({', '.join(self.params) or 'void'}) {{"] + self.lines + ["}"]
        return "\n".join(head + [""] + self.helpers + body) + "\n"


def _simd_safe(s) -> bool:
    return not any(isinstance(x, (S.For, S.While, S.AtomicElem, S.ExternGemm, S.Kernel)) for x in S.walk(s))


def _numel(b) -> int:
    n = 1
    for d in b.shape:
        n *= int(d)
    return n


def _nbytes(b) -> int:
    return _round64(_numel(b) * b.dtype.itemsize)


def _round64(n: int) -> int:
    return (n + 63) // 64 * 64


def emit_c(func: S.PrimFunc, symbols: list) -> str:
    """C source of ``func``; ``symbols`` are the symbolic dims passed after the parameters."""
    for s in S.walk(func.body):
        if isinstance(s, S.Alloc) and not all(isinstance(d, int) for d in s.buffer.shape):
            raise CompileError("on-chip buffers need constant shapes on the c target", s.loc)
    return CEmitter(fuse(func)).emit(symbols)
