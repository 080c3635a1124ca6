"""infer_layouts: give every fragment a distribution over the block's threads, or move it to shared memory.

A layout gives each dimension d of a fragment a thread digit ``t_d = (tid // stride_d) % count_d``: thread
``tid`` holds the elements whose index ``i_d`` is ``t_d`` modulo ``count_d`` in every dimension, in registers
(``slot = row-major(i_d // count_d)``); threads that differ only in digits no dimension uses hold copies. A
T.Parallel nest runs each iteration on the threads that hold its elements, so every fragment a nest touches must
have, in each dimension, the digit of the loop variable that indexes it (a fragment indexed by fewer variables
is replicated over the others' digits; one indexed by a constant has count 1 there).

Layouts are found as TileLang finds them: the C of each T.gemm first (the per-thread micro-tile of the portable
GEMM), then, repeatedly, from nests that touch a fragment with a layout to the other fragments they touch; when
nothing more follows, the first nest left picks a default (threads to the innermost dimensions first, and to a
reduction's dimension before all). A fragment that cannot have a register layout lives in shared memory instead,
which every thread can read: one read or written outside a T.Parallel nest (serial code runs on every thread),
indexed by anything but a nest's loop variable or a constant, used as an A or B operand of T.gemm, or whose
accesses ask for two different layouts. That fallback is always correct; it costs shared memory and barriers.

Invariant established: no buffer of scope ``fragment`` remains without a ``layout``; each register fragment is a
new Buffer carrying ``layout`` (a ``Layout``), each demoted one a new Buffer of scope ``shared``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from tegula.errors import CompileError
from tegula.ir import expr as E
from tegula.ir import stmt as S
from tegula.ir.buffer import Buffer
from tegula.passes import rewrite

MAX_SLOTS = 256  # registers per thread per fragment above which a fragment goes to shared memory


@dataclass(frozen=True)
class Layout:
    """A fragment's distribution: ``dims[d] = (stride, count)`` (see the module docstring)."""
    shape: tuple
    dims: tuple

    @property
    def slot_shape(self) -> tuple:
        return tuple(n // c for n, (_, c) in zip(self.shape, self.dims))

    @property
    def slots(self) -> int:
        return math.prod(self.slot_shape)


class Nest:
    """A T.Parallel nest at the block level: its loop variables, their extents (ints, or None when not
    constant), the reduction loop inside it (if any) and every fragment access of its body."""

    def __init__(self, loops: list, body, red):
        self.loops, self.body, self.red = loops, body, red
        self.vars = [f.var for f in loops]
        self.extents = [_const(f.extent) if _const(f.start) == 0 else None for f in loops]
        self.accesses: list = []  # (buffer, indices)

    def all_vars(self) -> list:
        """(var, extent) of the nest's loops, innermost first, and its reduction loop's before all."""
        out = [(f.var, _const(f.extent)) for f in ([self.red] if self.red is not None else [])]
        return out + list(zip(reversed(self.vars), reversed(self.extents)))


def _const(e):
    v = E.const_value(e)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def is_fragment(buf) -> bool:
    return isinstance(buf, Buffer) and buf.scope == "fragment"


def collect_nest(f: S.For) -> Nest:
    """The nest rooted at the parallel loop ``f``, with every fragment access of its body."""
    loops = [f]
    while isinstance(loops[-1].body, S.For) and loops[-1].body.kind == "parallel":
        loops.append(loops[-1].body)
    body = loops[-1].body
    red = None
    for c in (body.body if isinstance(body, S.Seq) else [body]):
        if isinstance(c, S.For) and "reduction" in c.annotations:
            red = c
    n = Nest(loops, body, red)
    for x in S.walk(body):
        for e in rewrite.exprs_of(x):
            for sub in rewrite.sub_exprs(e):
                if isinstance(sub, E.Load) and is_fragment(sub.buffer):
                    n.accesses.append((sub.buffer, sub.indices))
        if isinstance(x, (S.Store, S.AtomicElem)) and is_fragment(x.buffer):
            n.accesses.append((x.buffer, x.indices))
        if isinstance(x, S.ExternGemm):
            raise CompileError("T.gemm cannot be inside a T.Parallel loop", x.loc)
    return n


class Program:
    """What layout inference needs of a kernel: its nests, its gemms and the fragments that cannot be registers."""

    def __init__(self, kernel: S.Kernel, mma_dtypes=()):
        self.nthreads = math.prod(int(t) for t in kernel.threads)
        self.mma_dtypes = mma_dtypes
        self.nests: list[Nest] = []
        self.gemms: list[S.ExternGemm] = []
        self.demoted: dict = {}  # fragment -> why (for the docs of a dump)
        self._uniform(kernel.body)

    def _demote_reads(self, exprs, why):
        for e in exprs:
            for x in rewrite.sub_exprs(e):
                if isinstance(x, E.Load) and is_fragment(x.buffer):
                    self.demoted.setdefault(x.buffer, why)

    def _uniform(self, s):
        if isinstance(s, S.For) and s.kind == "parallel":
            self.nests.append(collect_nest(s))
            return
        self._demote_reads(rewrite.exprs_of(s), "read outside a T.Parallel nest")
        if isinstance(s, (S.Store, S.AtomicElem)) and is_fragment(s.buffer):
            self.demoted.setdefault(s.buffer, "written outside a T.Parallel nest")
        if isinstance(s, S.Alloc) and s.buffer.alias is not None:  # a T.reshape view shares its storage
            for b in (s.buffer, s.buffer.alias):
                if is_fragment(b):
                    self.demoted.setdefault(b, "viewed with T.reshape / T.view")
        if isinstance(s, S.ExternGemm):
            self.gemms.append(s)
            for rg in (s.a, s.b):
                if is_fragment(rg.buffer):
                    self.demoted.setdefault(rg.buffer, "a T.gemm operand (read by whole rows and columns)")
            if is_fragment(s.c.buffer) and not s.c.is_full():
                self.demoted.setdefault(s.c.buffer, "a partial T.gemm accumulator")
        for c in S.children(s):
            self._uniform(c)


# thread digits ---------------------------------------------------------------------------------

def _gaps(used, nthreads):
    """Free (stride, count) ranges of the thread index, lowest stride first, given the used digits."""
    out, g = [], 1
    for s, c in sorted(u for u in used if u[1] > 1):
        if s > g and s % g == 0:
            out.append((g, s // g))
        g = max(g, s * c)
    if nthreads > g and nthreads % g == 0:
        out.append((g, nthreads // g))
    return out


def _overlap(a, b) -> bool:
    (s1, c1), (s2, c2) = a, b
    return c1 > 1 and c2 > 1 and not (s1 * c1 <= s2 or s2 * c2 <= s1)


def reduction_threads(target) -> int:
    """How many threads a reduction with a free choice spreads its range over: a warp where the target has warp
    shuffles, else 16."""
    return getattr(target, "warp_size", None) or 16


def gemm_layout(m: int, n: int, nthreads: int) -> Layout:
    """C's layout for the per-thread micro-tile GEMM: rows over the high thread digits (a function of m and the
    thread count only, so that row vectors line up with every accumulator of the same height), columns over the
    low ones."""
    tx_pref = 1 << (max(nthreads.bit_length() - 1, 0) // 2)
    ty = math.gcd(m, max(nthreads // tx_pref, 1))
    rows = (nthreads // ty, ty)
    tx = math.gcd(n, nthreads // ty)
    return Layout((m, n), (_norm(rows), _norm((1, tx))))


def _norm(d):
    return d if d[1] > 1 else (1, 1)


def mma_layout(m: int, n: int, nthreads: int) -> Layout:
    """C's layout for warp MMA (m16n8k16): a thread holds rows ``(tid >> 2) + 8 * warps * a`` and columns
    ``(tid & 3) + 4 * b``. The warps split the rows only, and each 8-wide MMA column tile is read in the order
    that puts a lane's two accumulator columns 4 apart (see distribute_threads.MmaSync), so both dimensions are
    plain cyclic digits like every other layout."""
    return Layout((m, n), ((4, 8 * (nthreads // 32)), (1, 4)))


def tile_dims(rg) -> list:
    """The two buffer dimensions a 2-D T.gemm operand spans."""
    kept = [d for d, k in enumerate(rg.keep) if k]
    if len(kept) > 2:
        kept = [d for d in kept if E.const_value(rg.extents[d]) != 1]
    if len(kept) != 2:
        raise CompileError(f"T.gemm: the operand {rg.buffer.name} must be a 2-D tile")
    return kept


def gemm_mnk(g) -> tuple:
    """(M, N, K) of a T.gemm."""
    ce = [int(E.const_value(g.c.extents[d])) for d in tile_dims(g.c)]
    ae = [int(E.const_value(g.a.extents[d])) for d in tile_dims(g.a)]
    return ce[0], ce[1], ae[0] if g.trans_a else ae[1]


def uses_mma(g, nthreads: int, mma_dtypes) -> bool:
    """Whether a T.gemm runs on the target's warp MMA: fp16/bf16 operands (as the target lists), an fp32 C, whole
    warps, and M a multiple of 16 rows per warp, N of 8, K of 16."""
    if g.a.dtype.name not in mma_dtypes or g.c.dtype.name != "float32" or nthreads % 32:
        return False
    m, n, k = gemm_mnk(g)
    return m % (16 * (nthreads // 32)) == 0 and n % 8 == 0 and k % 16 == 0


class Conflict(Exception):
    def __init__(self, buf, why):
        self.buf, self.why = buf, why


def derive(nest: Nest, layouts: dict, nthreads: int, assign: bool, red_cap: int = 16):
    """The thread digit of each loop variable of ``nest`` -> {id(var): (stride, count)}, and (when ``assign``)
    layouts for the fragments of the nest that have none yet. Raises Conflict naming a fragment to demote.

    Variables no fragment constrains take free thread digits, lowest first: a reduction's variable first but on
    at most ``red_cap`` threads (a warp, where partial results combine by shuffles), then the innermost loops."""
    var_ids = {id(v): k for k, (v, _) in enumerate(nest.all_vars())}
    mapping: dict = {}
    for buf, idx in nest.accesses:
        lay = layouts.get(buf)
        if lay is None:
            continue
        for d, ix in enumerate(idx):
            dig = lay.dims[d]
            if isinstance(ix, E.Var) and id(ix) in var_ids:
                old = mapping.get(id(ix))
                if old is not None and old != dig:
                    raise Conflict(buf, "two layouts meet in one T.Parallel nest")
                mapping[id(ix)] = dig
            elif dig[1] != 1 or not isinstance(ix, E.Const):
                raise Conflict(buf, "indexed by a constant where its layout is distributed")
    digs = list(mapping.values())
    for i in range(len(digs)):
        for j in range(i):
            if _overlap(digs[i], digs[j]):
                raise Conflict(nest.accesses[-1][0], "two loop variables would share threads")
    for v, ext in nest.all_vars():
        if id(v) in mapping:
            if ext is None or ext % mapping[id(v)][1]:
                raise Conflict(_first_access(nest, v), "the loop's extent does not split over the layout")
            continue
        if ext is None:
            mapping[id(v)] = (1, 1)
            continue
        dig = (1, 1)
        cap = red_cap if nest.red is not None and v is nest.red.var else nthreads
        for g, cnt in _gaps(list(mapping.values()), nthreads):
            c = math.gcd(math.gcd(ext, cnt), cap)
            if c > 1:
                dig = (g, c)
                break
        mapping[id(v)] = dig
    if not assign:
        return mapping, {}
    new: dict = {}
    for buf, idx in nest.accesses:
        if buf in layouts:
            continue
        if any(v is None for v in nest.extents):
            raise Conflict(buf, "a T.Parallel nest with a runtime extent")
        seen = [id(ix) for ix in idx if isinstance(ix, E.Var)]
        if len(seen) != len(set(seen)):
            raise Conflict(buf, "one loop variable indexes two of its dimensions")
        dims = []
        for d, ix in enumerate(idx):
            dig = mapping[id(ix)] if isinstance(ix, E.Var) else (1, 1)
            if buf.shape[d] % dig[1]:
                raise Conflict(buf, "its extent does not split over the threads")
            dims.append(dig)
        lay = Layout(tuple(buf.shape), tuple(dims))
        if new.get(buf, lay) != lay:
            raise Conflict(buf, "two layouts meet in one T.Parallel nest")
        new[buf] = lay
    return mapping, new


def _first_access(nest, v):
    for buf, idx in nest.accesses:
        if any(ix is v for ix in idx):
            return buf
    return nest.accesses[0][0]


def _pure(nest: Nest, buf, idx) -> bool:
    ids = {id(v) for v, _ in nest.all_vars()}
    return all(isinstance(ix, E.Const) or (isinstance(ix, E.Var) and id(ix) in ids) for ix in idx)


def solve(prog: Program, red_cap: int = 16) -> dict:
    """fragment -> Layout for the register fragments (the rest are in ``prog.demoted``)."""
    for n in prog.nests:
        for buf, idx in n.accesses:
            if not _pure(n, buf, idx):
                prog.demoted.setdefault(buf, "indexed by something other than a T.Parallel loop variable")
    while True:
        try:
            return _solve_once(prog, red_cap)
        except Conflict as c:
            prog.demoted.setdefault(c.buf, c.why)


def _solve_once(prog: Program, red_cap: int) -> dict:
    T = prog.nthreads
    layouts: dict = {}
    for g in prog.gemms:
        c = g.c.buffer
        if is_fragment(c) and c not in prog.demoted and c.ndim == 2:
            mma = uses_mma(g, T, prog.mma_dtypes)
            lay = (mma_layout if mma else gemm_layout)(c.shape[0], c.shape[1], T)
            if layouts.setdefault(c, lay) != lay:
                raise Conflict(c, "two T.gemm shapes")
    nests = [_without(n, prog.demoted) for n in prog.nests]
    while True:
        progress = False
        for n in nests:
            touched = [b for b, _ in n.accesses]
            if any(b in layouts for b in touched) and any(b not in layouts for b in touched):
                layouts.update(derive(n, layouts, T, True, red_cap)[1])
                progress = True
        if progress:
            continue
        rest = [n for n in nests if any(b not in layouts for b, _ in n.accesses)]
        if not rest:
            break
        # a reduction decides first: its layout keeps the reduced dimension on few threads
        first = next((n for n in rest if n.red is not None), rest[0])
        layouts.update(derive(first, layouts, T, True, red_cap)[1])
    for n in nests:  # every nest must agree with the final layouts
        derive(n, layouts, T, False, red_cap)
    for buf, lay in layouts.items():
        if lay.slots > MAX_SLOTS:
            raise Conflict(buf, f"{lay.slots} elements per thread is more than registers hold")
    return layouts


def _without(n: Nest, demoted) -> Nest:
    m = Nest(n.loops, n.body, n.red)
    m.accesses = [(b, i) for b, i in n.accesses if b not in demoted]
    return m


def run(func: S.PrimFunc, target) -> S.PrimFunc:
    new: dict = {}
    for kernel in (s for s in S.walk(func.body) if isinstance(s, S.Kernel)):  # each kernel on its own
        layouts = solve(Program(kernel, getattr(target, "mma", ())), reduction_threads(target))
        for s in S.walk(kernel.body):
            if isinstance(s, S.Alloc) and is_fragment(s.buffer):
                b = s.buffer
                if b in layouts:
                    nb = Buffer(b.name, b.shape, b.dtype, "fragment", b.loc)
                    nb.layout = layouts[b]
                else:
                    nb = Buffer(b.name, b.shape, b.dtype, "shared", b.loc)
                nb.alias = new.get(b.alias, b.alias)
                new[b] = nb
    return _replace_buffers(func, new) if new else func


def _replace_buffers(func: S.PrimFunc, new: dict) -> S.PrimFunc:
    import dataclasses

    def fe(e):
        if isinstance(e, E.Load) and e.buffer in new:
            return E.Load(new[e.buffer], e.indices)
        return None

    def fs(s):
        if isinstance(s, (S.Store, S.AtomicElem, S.Alloc)) and s.buffer in new:
            return dataclasses.replace(s, buffer=new[s.buffer])
        if isinstance(s, S.ExternGemm):
            rg = {k: getattr(s, k) for k in ("a", "b", "c")}
            rg = {k: r if r.buffer not in new else type(r)(new[r.buffer], r.starts, r.extents, r.keep)
                  for k, r in rg.items()}
            return dataclasses.replace(s, **rg)
        return None

    return dataclasses.replace(func, body=rewrite.stmt(func.body, fe, fs))
