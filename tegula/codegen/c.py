"""The C emitter of the CPU target: the grid becomes an OpenMP loop over blocks, on-chip buffers become
per-thread aligned arrays, the innermost T.Parallel loop an ``omp simd`` loop, T.gemm a prelude call."""
from __future__ import annotations

from tegula.codegen.c_fuse import fuse
from tegula.codegen.c_fuse import key as fuse_key
from tegula.codegen.cfamily import STORAGE, CFamilyEmitter, reg_type
from tegula.errors import CompileError
from tegula.ir import dtypes as dt
from tegula.ir import expr as E
from tegula.ir import stmt as S
from tegula.ir.cpu import StreamCopy
from tegula.passes import rewrite

HEAP_THRESHOLD = 64 * 1024  # per-thread on-chip bytes above which buffers come from the heap (a block each thread
# keeps between calls: tegula_rt.h tg_scratch), not the stack


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
        d = f"&{self.nm(s.dst)}[{self.flat(s.dst, s.dst_indices)}]"
        src = f"&{self.nm(s.src)}[{self.flat(s.src, s.src_indices)}]"
        if s.src.dtype != s.dst.dtype:  # float32 -> bfloat16 (tileops/copy.py admits no other pair)
            self.w(f"tg_stream_cvt_f32_bf16({d}, {src}, (size_t){s.count});")
        else:
            self.w(f"tg_stream_copy({d}, {src}, (size_t){s.count * s.dst.dtype.itemsize});")

    def stmt_RowAddress(self, s):  # ir/cpu.py: where a row of a gathered tile lies (passes/read_gathered_rows)
        self.w(f"{self.nm(s.table)}[{self.ex(E.as_expr(s.index))}] = (int64_t)(intptr_t)"
               f"&{self.nm(s.buffer)}[{self.flat(s.buffer, s.indices)}];")

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
            "const int64_t tg_chunk", "const int tg_solo"]
        self.helpers += [f"static void {name}({', '.join(params)}) {{"] + self.lines + ["}", ""]
        self.lines, self.ind, self.outer = lines, ind, outer
        call = f"{name}({', '.join(self.args + args + ['tg_gx', 'tg_gy', 'tg_gz', '&tg_next', 'tg_chunk'])}, {{}});"
        self.w("{")
        self.ind += 1
        self.w(f"const int64_t tg_gx = {gx}, tg_gy = {gy}, tg_gz = {gz};")
        self.w("const int tg_nt = tg_threads_for(tg_gx * tg_gy * tg_gz);")
        self.w("const int64_t tg_chunk = tg_chunk_for(tg_gx * tg_gy * tg_gz, tg_nt);")
        self.w("int64_t tg_next = 0;   /* the first block not yet taken */")
        self.w("if (tg_nt == 1) {")
        self.w("  " + call.format(1))
        self.w("} else {")
        self.w("  #pragma omp parallel num_threads(tg_nt)")
        self.w("  " + call.format(0))
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
            self.w(f"char *tg_smem = (char *)tg_scratch({_round64(total)});")
        offset = 0
        for b in allocs:
            ct, n = STORAGE[b.dtype.name], _numel(b)
            if heap:
                self.w(f"{ct} *{self.restrict} {self.nm(b)} = ({ct} *)(tg_smem + {offset});")
                offset += _round64(n * b.dtype.itemsize)
            else:
                self.w(f"{ct} {self.nm(b)}[{n}] __attribute__((aligned(64)));")
        self.w("for (int64_t tg_lo, tg_hi; tg_grab(tg_next, tg_chunk, tg_nblocks, tg_solo, &tg_lo, &tg_hi);) {")
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
            self.w(f"tg_scratch_done(tg_smem, {_round64(total)});")

    # locals declared outside kernels are passed to the grids' functions: self.outer lists those in scope
    def stmt_Assign(self, s: S.Assign):
        super().stmt_Assign(s)
        if s.declare and self.outer is not None:
            self.outer.append((reg_type(s.var.dtype), self.nm(s.var), s.var))

    def stmt_For(self, s: S.For):
        if self.outer is None:
            plan = _compress_plan(s)
            if plan is not None:
                return self.compress_loop(s, plan)
            plan = _ballot_plan(s)
            if plan is not None:
                return self.ballot_loop(s, plan)
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

    def fresh(self, base: str) -> str:
        """A new C name not used elsewhere in the translation unit."""
        obj = E.Var(base, dt.int32)
        self.keep_alive = getattr(self, "keep_alive", []) + [obj]   # ids stay unique while the emitter lives
        return self.nm(obj)

    # The compress idiom (see _compress_plan): the loop runs in groups of CLANES iterations. A vector loop
    # computes each group's conditions and values into small arrays (and the masked min / max updates as omp
    # simd reductions); tg_mask16 makes the conditions a bit mask, tg_compress16_32 appends the selected values
    # of each buffer at the counter, which then grows by the mask's popcount (tegula_compress.h: vpcompressd on
    # AVX-512). The last extent % CLANES iterations run as written.
    def compress_loop(self, s: S.For, plan):
        self.uses_compress = True
        cnt, decls, cond, stores, reds = plan
        # 16-bit elements: 32 per group, their conditions in 16-bit lanes (tg_mask32_16 / tg_compress32_16)
        narrow = stores[0].buffer.dtype.bits == 16
        lanes, sel_t, mask_fn, comp_fn = ((2 * CLANES, "int16_t", "tg_mask32_16", "tg_compress32_16") if narrow else
                                          (CLANES, "int32_t", "tg_mask16", "tg_compress16_32"))
        n, v = self.nm(cnt), self.nm(s.var)
        jb, ln, end, mk, sel = (self.fresh(x) for x in ("tg_jb", "tg_l", "tg_end", "tg_mask", "tg_sel"))
        vals = [self.fresh("tg_val") for _ in stores]
        # an integer value that is the loop index plus an offset the loop does not change (_index_offset) is
        # carried as a vector of lanes, the group's values, stepped by the group size each group: gcc keeps it in
        # a register (one vpaddw), where (int16_t)(jb + l) was a broadcast of jb, two 32-bit adds and a pack per
        # group (3 of the 9 port-5 uops of top-k's dense scan; its loop 65 -> 52 us for 512K keys in L2 on an
        # Intel Xeon)
        offs = [_index_offset(st.value, s.var) if st.buffer.dtype.is_int else None for st in stores]
        iotas = [None if o is None else self.fresh("tg_iota") for o in offs]
        self.w("{")
        self.ind += 1
        start, ext = self.ex(s.start), self.ex(s.extent)
        self.w(f"const int32_t {end} = {start} + {ext};")
        self.w(f"int32_t {jb} = {start};")
        for io, st, o in zip(iotas, stores, offs):
            if io is not None:
                t = STORAGE[st.buffer.dtype.name]
                self.w(f"{t} {io}[{lanes}] __attribute__((aligned(64)));")
                self.w(f"for (int32_t {ln} = 0; {ln} < {lanes}; ++{ln}) {io}[{ln}] = ({t})({jb} + {ln} + "
                       f"{self.ex(o)});")
        self.w(f"for (; {jb} <= {end} - {lanes}; {jb} += {lanes}) {{")
        self.ind += 1
        self.w(f"{sel_t} {sel}[{lanes}] __attribute__((aligned(64)));")
        for a, st in zip(vals, stores):
            self.w(f"{STORAGE[st.buffer.dtype.name]} {a}[{lanes}] __attribute__((aligned(64)));")
        # the min / max updates as omp simd reductions: each group's lanes are combined into the scalar (kept
        # per lane across groups instead, gcc stores them to memory around the compressing stores, and the
        # next group waits for them)
        self.w("#pragma omp simd" + "".join(f" reduction({op}:{self.nm(var)})" for op, var, _ in reds))
        self.w(f"for (int32_t {ln} = 0; {ln} < {lanes}; ++{ln}) {{")
        self.ind += 1
        self.w(f"const int32_t {v} = {jb} + {ln};")
        for d in decls:
            self.stmt(d)
        c = self.fresh("tg_c")
        self.w(f"const bool {c} = {self.ex(cond)};")
        self.w(f"{sel}[{ln}] = -({sel_t}){c};")
        for a, st, io in zip(vals, stores, iotas):
            t = STORAGE[st.buffer.dtype.name]
            if io is not None:
                self.w(f"{a}[{ln}] = {io}[{ln}];")
                self.w(f"{io}[{ln}] = ({t})({io}[{ln}] + {lanes});")
            else:
                self.w(f"{a}[{ln}] = ({t})({self.store_value(st.buffer, st.value)});")
        for op, var, value in reds:
            self.w(f"{self.nm(var)} = {c} ? {self.ex(value)} : {self.nm(var)};")
        self.ind -= 1
        self.w("}")
        self.w(f"const uint32_t {mk} = {mask_fn}({sel});")
        for a, st in zip(vals, stores):
            self.w(f"{comp_fn}(&{self.nm(st.buffer)}[{self.flat(st.buffer, st.indices)}], {a}, {mk});")
        self.w(f"{n} += (int32_t)__builtin_popcount({mk});")
        self.ind -= 1
        self.w("}")
        self.w(f"for (; {jb} < {end}; ++{jb}) {{")
        self.ind += 1
        self.w(f"const int32_t {v} = {jb};")
        self.stmt(s.body)
        self.ind -= 1
        self.w("}")
        self.ind -= 1
        self.w("}")

    # The ballot idiom (see _ballot_plan): the loop's conditions go to an array of lanes in a vector loop and
    # tg_mask16 turns each 16 of them into bits (vptestmd on AVX-512), instead of shifting each condition to
    # its bit and summing the lanes horizontally.
    def ballot_loop(self, s: S.For, plan):
        self.uses_compress = True
        acc, op, cond, skip = plan
        ext = int(s.extent.value)
        v, sel = self.nm(s.var), self.fresh("tg_sel")
        # lanes as wide as the compared values where they are 16-bit (one vector compare per 32 of them)
        w16 = isinstance(cond, E.BinOp) and cond.op in ("<", "<=", ">", ">=", "==", "!=") and cond.a.dtype.bits == 16
        lane_t, mask_fn = ("int16_t", "tg_mask16_16") if w16 else ("int32_t", "tg_mask16")
        self.w("{")
        self.ind += 1
        self.w(f"{lane_t} {sel}[{ext}] __attribute__((aligned(64)));")
        self.w("#pragma omp simd")
        self.w(f"for (int32_t {v} = 0; {v} < {ext}; ++{v}) {{")
        self.ind += 1
        for t in _flat([s.body]):
            if not any(t is x for x in skip):
                self.stmt(t)
        self.w(f"{sel}[{v}] = -({lane_t})({self.ex(cond)});")
        self.ind -= 1
        self.w("}")
        ct = reg_type(acc.dtype)
        bits = " | ".join(f"(({ct}){mask_fn}({sel} + {q}) << {q})" for q in range(0, ext, 16))
        self.w(f"{self.nm(acc)} = {self.nm(acc)} {'+' if op == '+' else '|'} ({bits});")
        self.ind -= 1
        self.w("}")

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
        if getattr(self, "uses_compress", False):
            head.append('#include "tegula_compress.h"')
        body = [f"TG_EXPORT void tg_{f.name}({', '.join(self.params) or 'void'}) {{"] + self.lines + ["}"]
        return "\n".join(head + [""] + self.helpers + body) + "\n"


def _index_offset(value: E.Expr, var: E.Var) -> E.Expr | None:
    """Where ``value`` is the loop index ``var`` plus a constant or a variable the loop cannot change (a
    parameter, a block index), possibly cast to an integer type, that offset (a value the compress idiom carries
    as a vector of lanes); else None."""
    if isinstance(value, E.Cast) and value.dtype.is_int and value.value.dtype.is_int:
        value = value.value
    if value is var:
        return E.Const(0, var.dtype)
    if isinstance(value, E.BinOp) and value.op == "+":
        for a, b in ((value.a, value.b), (value.b, value.a)):
            if a is var and (isinstance(b, E.Const) or isinstance(b, E.Var) and not b.is_local and b is not var):
                return b
    return None


CLANES = 16   # iterations per group of the compress idiom (tg_mask16 / tg_compress16_32)


def _compress_plan(s: S.For):
    """(counter, declarations, condition, stores, reductions) when ``s`` is a serial loop of the form

        for j in T.serial(n):
            x = ...                      # locals declared in the loop, any number
            if cond:
                buf[cnt] = value         # one or more 1-D buffers of 32-bit (or all 16-bit integer) elements,
                                         # indexed by cnt alone
                acc = T.max(acc, e)      # optional min / max updates of integer scalars declared outside
                cnt = cnt + 1

    (each buffer stored once, before the increment; cnt, the accumulators and the stored buffers used nowhere
    else in the loop; the stored values and updates free of integer division and of loads that the
    declarations or the condition do not make anyway, since they are computed for every iteration); else None.
    Such a loop appends the values that pass, in order, at cnt: a compressing store, what ``compress_loop``
    emits. Buffers of 16-bit integers (all of one width) go 32 iterations at a time (vpcompressw)."""
    if s.kind != "serial" or s.step != 1 or s.annotations:
        return None
    items = _flat([s.body])
    if not items or not isinstance(items[-1], S.If) or items[-1].orelse is not None:
        return None
    decls, last = items[:-1], items[-1]
    if not all(isinstance(d, S.Assign) and d.declare for d in decls):
        return None
    then = _flat([last.then])
    cnt, stores, reds, seen = None, [], [], set()
    for t in then:
        if isinstance(t, S.Store):
            b = t.buffer
            if cnt is not None or len(t.indices) != 1 or b.dtype.is_float and b.dtype != dt.float32 or \
                    b.dtype.bits not in (16, 32) or not isinstance(t.indices[0], E.Var) or id(_root(b)) in seen or \
                    stores and stores[0].buffer.dtype.bits != b.dtype.bits:
                return None
            seen.add(id(_root(b)))
            stores.append(t)
        elif isinstance(t, S.Assign) and not t.declare:
            e = t.value
            if isinstance(e, E.BinOp) and e.op == "+" and e.a is t.var and isinstance(e.b, E.Const) \
                    and e.b.value == 1 and t.var.dtype == dt.int32 and cnt is None:
                cnt = t.var
            elif isinstance(e, E.BinOp) and e.op in ("min", "max") and e.a is t.var and \
                    not t.var.dtype.is_float and all(t.var is not r[1] for r in reds):
                # integers only: OpenMP combines a float min / max reduction with its own compare, which does not
                # follow T.max's NaN rule (a NaN accumulator would stay NaN)
                reds.append((e.op, t.var, e))
            else:
                return None
        else:
            return None
    if cnt is None or not stores or any(st.indices[0] is not cnt for st in stores):
        return None
    special = {id(cnt)} | {id(r[1]) for r in reds}
    locals_ = {id(d.var) for d in decls}
    if special & locals_:
        return None
    # the stored values and updates are computed for every lane, also where cond fails: they may not trap
    # (integer division) nor read memory that cond may guard, so their loads must be ones that run anyway
    ran = {fuse_key(x) for e in [last.cond] + [d.value for d in decls] for x in rewrite.sub_exprs(e)
           if isinstance(x, E.Load)}
    for e in [st.value for st in stores] + [r[2].b for r in reds]:
        for x in rewrite.sub_exprs(e):
            if isinstance(x, E.Load) and fuse_key(x) not in ran:
                return None
            if isinstance(x, E.BinOp) and x.op in ("/", "//", "%") and not x.dtype.is_float:
                return None
    others = [last.cond] + [d.value for d in decls] + [st.value for st in stores] + [r[2].b for r in reds]
    for e in others:
        for x in rewrite.sub_exprs(e):
            if isinstance(x, E.Var) and id(x) in special:
                return None
            if isinstance(x, E.Load) and id(_root(x.buffer)) in seen:
                return None
    return cnt, decls, last.cond, stores, reds


def _ballot_plan(s: S.For):
    """(acc, op, condition, statements to leave out) when ``s`` is an innermost loop ``for j in range(E)``,
    E in {16, 32, 48, 64} and at most acc's width in bits, whose last statement is the reduction
    ``acc = acc + (T.cast(cond, u) << T.cast(j, u))`` (or ``|``; the shifted term possibly through a local
    declared in the loop and used nowhere else), acc unsigned and used nowhere else in the loop: the bits are
    distinct, so acc gains the mask of the iterations whose cond holds (a ballot). Else None."""
    red = s.annotations.get("reduction")
    if red is None or not isinstance(red[0], str) or set(s.annotations) != {"reduction"}:
        return None
    op, acc = red
    if op not in ("+", "|") or not isinstance(acc, E.Var) or acc.dtype not in (dt.uint32, dt.uint64):
        return None
    if s.step != 1 or not (isinstance(s.start, E.Const) and s.start.value == 0):
        return None
    if not (isinstance(s.extent, E.Const) and s.extent.value in (16, 32, 48, 64) and s.extent.value <= acc.dtype.bits):
        return None
    items = _flat([s.body])
    if any(not isinstance(t, (S.Assign, S.Store, S.If)) for t in items) or not _simd_safe(s.body):
        return None
    last = items[-1]
    if not (isinstance(last, S.Assign) and not last.declare and last.var is acc and isinstance(last.value, E.BinOp)
            and last.value.op == op and last.value.a is acc):
        return None
    term, skip = last.value.b, [last]
    if isinstance(term, E.Var):
        decl = [t for t in items if isinstance(t, S.Assign) and t.var is term]
        if len(decl) != 1 or not decl[0].declare:
            return None
        skip.append(decl[0])
        term = decl[0].value
    if not (isinstance(term, E.BinOp) and term.op == "<<" and isinstance(term.a, E.Cast) and term.a.value.dtype.is_bool
            and isinstance(term.b, E.Cast) and term.b.value is s.var and term.a.dtype == acc.dtype):
        return None
    cond = term.a.value
    rest = [t for t in items if not any(t is x for x in skip)]
    hidden = {id(acc)} | ({id(last.value.b)} if isinstance(last.value.b, E.Var) else set())
    for t in rest:
        for x in S.walk(t):
            if isinstance(x, S.Assign) and id(x.var) in hidden:
                return None
            for e in rewrite.exprs_of(x):
                if any(isinstance(y, E.Var) and id(y) in hidden for y in rewrite.sub_exprs(e)):
                    return None
    if any(isinstance(y, E.Var) and id(y) in hidden for y in rewrite.sub_exprs(cond)):
        return None
    return acc, op, cond, skip


def _flat(items) -> list:
    out = []
    for x in items:
        out.extend(_flat(x.body) if isinstance(x, S.Seq) else [x])
    return out


def _root(b):
    while getattr(b, "alias", None) is not None:
        b = b.alias
    return b


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
