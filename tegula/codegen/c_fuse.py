"""Loop fusion for the ``c`` target: one pass over a tile instead of one per T.* statement.

A kernel written as a sequence of tile statements (T.copy in, elementwise T.Parallel loops, T.reduce_*, T.copy
out) lowers to one loop nest per statement; run as written, each nest streams the whole fragment through the
cache again, and for a memory-bound kernel those passes cost more than the DRAM traffic. Just before the C is
emitted, this module rewrites the lowered body:

1. Tile-level edge tests with the same (pure) condition, such as T.copy's fast/slow paths for the input and the
   output of the same tile, become one ``if``: the statements between them are copied into both branches, so
   the fast path is straight-line loop nests.
2. Adjacent loops over the same range (T.Parallel loops, reduction loops) become one loop whose body is the two
   bodies in order, when that cannot change what any statement reads: every buffer one of them writes and the
   other accesses is indexed, in every access of both, by the same injective function of the loop variable in
   one dimension (so iteration v of either touches only elements no other iteration touches), and no scalar one
   of them updates is used by the other. Fusion goes from the outer loops inwards; a constant scalar
   initialisation between two loops (a reduction's accumulator) moves above the first.
3. A fragment that every innermost loop touching it writes before it reads it, at one index, and that nothing
   else touches, becomes a scalar of that loop body (``sq[i, j] = x * x; acc += sq[i, j]`` keeps ``x * x`` in a
   register and allocates no ``sq``).
4. A load an innermost loop repeats at every iteration (``ss[i]`` in ``x[i, j] * ss[i]``), of a buffer the loop
   does not write, is read once before the loop: gcc cannot always prove that the loop's stores into one heap
   block of on-chip buffers leave it alone, and then keeps the loop scalar.

Nothing here changes a value: the same operations run on the same operands, in an order that keeps every
read-after-write, write-after-read and write-after-write pair of the program as written.
"""
from __future__ import annotations

import dataclasses

from tegula.ir import expr as E
from tegula.ir import stmt as S
from tegula.ir.simplify import linear
from tegula.passes import rewrite

_LOOP_KINDS = ("parallel", "serial")


def fuse(func: S.PrimFunc) -> S.PrimFunc:
    body = _stmt(func.body)
    body = _scalarize(body)
    body = _map(body, _hoist_invariant_loads)
    return dataclasses.replace(func, body=body)


# structural keys (variables by identity, not by name) -------------------------------------------------------

def key(e) -> tuple:
    if isinstance(e, (int, float, bool)):
        return ("py", e)
    if isinstance(e, E.Const):
        return ("c", e.dtype.name, repr(e.value))
    if isinstance(e, E.Var):
        return ("v", id(e))
    if isinstance(e, E.BinOp):
        return ("b", e.op, e.dtype.name, key(e.a), key(e.b))
    if isinstance(e, E.UnOp):
        return ("u", e.op, e.dtype.name, key(e.a))
    if isinstance(e, E.Call):
        return ("f", e.name, e.dtype.name) + tuple(key(a) for a in e.args)
    if isinstance(e, E.Cast):
        return ("t", e.dtype.name, key(e.value))
    if isinstance(e, E.Select):
        return ("s", key(e.cond), key(e.a), key(e.b))
    if isinstance(e, E.Load):
        return ("l", id(e.buffer)) + tuple(key(i) for i in e.indices)
    return ("?", id(e))


def _root(buf):
    while getattr(buf, "alias", None) is not None:
        buf = buf.alias
    return buf


def _flatten(items) -> list:
    out = []
    for s in items:
        if isinstance(s, S.Seq):
            out.extend(_flatten(s.body))
        elif s is not None:
            out.append(s)
    return out


def _seq(items, loc=None):
    items = _flatten(items)
    return items[0] if len(items) == 1 else S.Seq(items, loc=loc)


# the walk -----------------------------------------------------------------------------------------------------

def _stmt(s):
    if isinstance(s, S.Seq):
        items = _fuse_seq(_merge_ifs(_hoist_allocs(_flatten(s.body))))
        return S.Seq([_stmt(c) for c in items], loc=s.loc)
    if isinstance(s, (S.For, S.While, S.Kernel)):
        return dataclasses.replace(s, body=_stmt(s.body))
    if isinstance(s, S.If):
        return dataclasses.replace(s, then=_stmt(s.then), orelse=None if s.orelse is None else _stmt(s.orelse))
    return s


def _hoist_allocs(items) -> list:
    """On-chip buffers are declared by the kernel's prologue: their Alloc statements emit nothing where they stand
    and may go first, out of the way of the statements that follow."""
    free = [s for s in items if isinstance(s, S.Alloc) and s.buffer.alias is None and not s.buffer.is_global]
    return free + [s for s in items if not any(s is f for f in free)]


def _pure(e) -> bool:
    return not any(isinstance(x, E.Load) for x in rewrite.sub_exprs(e))


def _merge_ifs(items) -> list:
    out: list = []
    for s in items:
        out.append(s)
        if not isinstance(s, S.If) or not _pure(s.cond):
            continue
        k = next((k for k in range(len(out) - 2, -1, -1) if isinstance(out[k], S.If)), None)
        if k is None:
            continue
        first = out[k]
        if key(first.cond) != key(s.cond) or (first.orelse is None) != (s.orelse is None):
            continue
        between = out[k + 1:-1]
        cond_vars = {id(v) for v in rewrite.sub_exprs(s.cond) if isinstance(v, E.Var)}
        if not _movable(between, cond_vars) or _assigns(first, cond_vars):  # the condition must mean the same
            continue
        then = _seq([first.then, *between, s.then], first.loc)
        if s.orelse is not None:
            orelse = _seq([first.orelse, *between, s.orelse], first.loc)
        else:  # the statements between run whether or not the condition holds
            orelse = _seq(between, first.loc) if between else None
        out[k:] = [dataclasses.replace(first, then=then, orelse=orelse)]
    return out


def _assigns(s, var_ids) -> bool:
    """Whether ``s`` assigns any of the variables ``var_ids`` (a branch that updates its own condition's variable:
    the next ``if`` on that condition reads the new value and cannot join the first)."""
    return any(isinstance(x, S.Assign) and id(x.var) in var_ids for x in S.walk(s))


def _movable(items, cond_vars) -> bool:
    """Whether ``items`` may be copied into both branches of an ``if`` whose condition reads ``cond_vars``."""
    for s in items:
        if isinstance(s, S.Assign) and s.declare:  # its scope would end with the branch
            return False
        for x in S.walk(s):
            if isinstance(x, (S.Kernel, S.Alloc)) or type(x).__module__ not in (S.__name__,):
                return False
            if isinstance(x, S.Assign) and id(x.var) in cond_vars:
                return False
    return True


def _fuse_seq(items) -> list:
    out: list = []
    for s in items:
        if (isinstance(s, S.Assign) and s.declare and isinstance(s.value, E.Const) and out
                and isinstance(out[-1], S.For)):
            out.insert(len(out) - 1, s)  # a constant initialisation: above the loop, so the next may fuse
            continue
        if isinstance(s, S.For) and out and isinstance(out[-1], S.For):
            f = _try_fuse(out[-1], s)
            if f is not None:
                out[-1] = f
                continue
        out.append(s)
    return out


# the fusion test ---------------------------------------------------------------------------------------------

_ALLOWED = (S.Seq, S.For, S.If, S.Store, S.Assign)


@dataclasses.dataclass
class _Info:
    accesses: list        # (buffer, indices, is_write)
    bound: set            # ids of variables bound inside (loop variables, declared locals)
    assigned: set         # ids of variables updated inside but declared outside
    used: set             # ids of every variable read or written


def _scan(body) -> _Info | None:
    info = _Info([], set(), set(), set())

    def loads(e):
        for x in rewrite.sub_exprs(e):
            if isinstance(x, E.Load):
                info.accesses.append((x.buffer, x.indices, False))
            elif isinstance(x, E.Var):
                info.used.add(id(x))

    for s in S.walk(body):
        if not isinstance(s, _ALLOWED):
            return None
        for e in rewrite.exprs_of(s):
            loads(e)
        if isinstance(s, S.For):
            if s.step != 1:
                return None
            info.bound.add(id(s.var))
        elif isinstance(s, S.Store):
            info.accesses.append((s.buffer, s.indices, True))
        elif isinstance(s, S.Assign):
            info.used.add(id(s.var))
            if s.declare:
                info.bound.add(id(s.var))
    for s in S.walk(body):
        if isinstance(s, S.Assign) and not s.declare and id(s.var) not in info.bound:
            info.assigned.add(id(s.var))
    return info


def _reductions(f: S.For) -> list:
    red = f.annotations.get("reduction")
    if red is None:
        return []
    return [red] if isinstance(red, tuple) and len(red) == 2 and isinstance(red[0], str) else list(red)


def _fusable_kind(f: S.For) -> bool:
    if f.kind not in _LOOP_KINDS or f.step != 1:
        return False
    extra = set(f.annotations) - {"reduction"}
    return not extra and (f.kind == "parallel" or bool(_reductions(f)))


def _pinned(var, accesses, bound) -> bool:
    """Whether some dimension indexes every access by one injective function of ``var`` (the same expression
    in all), its other terms invariant in the loop."""
    ndim = len(accesses[0][1])
    if any(len(idx) != ndim for _, idx, _ in accesses):
        return False
    for d in range(ndim):
        k0 = key(accesses[0][1][d])
        if any(key(idx[d]) != k0 for _, idx, _ in accesses[1:]):
            continue
        lin = linear(accesses[0][1][d])
        if lin is None:
            continue
        coef, ok = 0, True
        for atom, c in lin[0].values():
            if atom is var:
                coef = c
            elif not isinstance(atom, E.Var) or id(atom) in bound:
                ok = False
        if ok and coef != 0:
            return True
    return False


def _try_fuse(a: S.For, b: S.For) -> S.For | None:
    if not (_fusable_kind(a) and _fusable_kind(b)):
        return None
    if not (isinstance(a.extent, E.Const) and key(a.extent) == key(b.extent) and key(a.start) == key(b.start)):
        return None
    body_b = rewrite.stmt(b.body, fe=lambda x: a.var if x is b.var else None)
    ia, ib = _scan(a.body), _scan(body_b)
    if ia is None or ib is None:
        return None
    if ia.assigned & ib.used or ib.assigned & ia.used:
        return None
    bound = ia.bound | ib.bound | ia.assigned | ib.assigned
    by_root: dict = {}
    for side, info in ((0, ia), (1, ib)):
        for buf, idx, w in info.accesses:
            by_root.setdefault(id(_root(buf)), []).append((side, buf, idx, w))
    for acc in by_root.values():
        sides = {x[0] for x in acc}
        writes = {x[0] for x in acc if x[3]}
        if len(sides) < 2 or not writes:
            continue  # touched by one loop only, or only read
        if len({id(x[1]) for x in acc}) != 1:
            return None  # two views of one buffer: indices are not comparable
        if not _pinned(a.var, [(x[1], x[2], x[3]) for x in acc], bound):
            return None
    reds = _reductions(a) + _reductions(b)
    body = _seq([a.body, body_b], a.loc)
    if reds:
        return dataclasses.replace(a, kind="serial", body=body,
                                   annotations={"reduction": reds[0] if len(reds) == 1 else reds})
    return dataclasses.replace(a, body=body)


# fragments as scalars ----------------------------------------------------------------------------------------

def _map(s, fn):
    """``s`` rebuilt with ``fn(node)`` (called on the original nodes, outermost first) replacing the nodes it
    returns something for."""
    r = fn(s)
    if r is not None:
        return r
    if isinstance(s, S.Seq):
        return S.Seq([_map(c, fn) for c in s.body], loc=s.loc)
    if isinstance(s, (S.For, S.While, S.Kernel)):
        return dataclasses.replace(s, body=_map(s.body, fn))
    if isinstance(s, S.If):
        return dataclasses.replace(s, then=_map(s.then, fn), orelse=None if s.orelse is None else _map(s.orelse, fn))
    return s


def _scalarize(root):
    return _map(root, lambda s: _scalarize_kernel(s) if isinstance(s, S.Kernel) else None)


def _accesses_in_order(s):
    """(buffer, indices, is_write, statement) of ``s`` in execution order (a store's operands before it)."""
    out = []
    for x in S.walk(s):
        for e in rewrite.exprs_of(x):
            for y in rewrite.sub_exprs(e):
                if isinstance(y, E.Load):
                    out.append((y.buffer, y.indices, False, x))
        if isinstance(x, (S.Store, S.AtomicElem)):
            out.append((x.buffer, x.indices, True, x))
            if isinstance(x, S.AtomicElem):
                out.append((x.buffer, x.indices, False, x))
    return out


def _scalarize_kernel(k: S.Kernel) -> S.Kernel:
    allocs = [s.buffer for s in S.walk(k.body) if isinstance(s, S.Alloc)]
    aliased = {id(_root(b)) for b in allocs if b.alias is not None}
    cands = {id(b): b for b in allocs if b.alias is None and not b.is_global and id(b) not in aliased
             and not b.dtype.is_narrow_float}
    for x in S.walk(k.body):  # a buffer some other statement uses as a whole (T.gemm's operands, a prefetch)
        if not isinstance(x, (S.Seq, S.For, S.While, S.If, S.Store, S.Assign, S.Alloc)):
            for f in dataclasses.fields(x):
                v = getattr(x, f.name)
                for b in (v if isinstance(v, (list, tuple)) else [v]):
                    b = getattr(b, "buffer", b)
                    cands.pop(id(_root(b)), None)
                    cands.pop(id(b), None)
    if not cands:
        return k
    total: dict = {}
    for buf, _, _, _ in _accesses_in_order(k.body):
        total[id(buf)] = total.get(id(buf), 0) + 1
    inner = [s for s in S.walk(k.body) if isinstance(s, S.For)
             and not any(isinstance(x, (S.For, S.While)) for x in S.walk(s.body))]
    seen: dict = {}
    ok: dict = {}
    for f in inner:
        top = _flatten([f.body])
        acc = _accesses_in_order(f.body)
        for bid in {id(x[0]) for x in acc if id(x[0]) in cands}:
            mine = [x for x in acc if id(x[0]) == bid]
            seen[bid] = seen.get(bid, 0) + len(mine)
            good = (mine[0][2] and len({key_idx(x[1]) for x in mine}) == 1
                    and all(any(x[3] is t for t in top) and isinstance(x[3], (S.Store, S.Assign)) for x in mine))
            ok[bid] = ok.get(bid, True) and good
    chosen = {bid for bid in cands if ok.get(bid) and seen.get(bid) == total.get(bid)}
    if not chosen:
        return k

    def per_loop(f):
        if not any(f is g for g in inner):
            return None
        top = _flatten([f.body])
        vars_: dict = {}
        out = []
        for s in top:
            def fe(x):
                if isinstance(x, E.Load) and id(x.buffer) in chosen:
                    return vars_[id(x.buffer)]
                return None
            if isinstance(s, S.Store) and id(s.buffer) in chosen:
                value = rewrite.expr(s.value, fe)
                if value.dtype != s.buffer.dtype:
                    value = E.Cast(value, s.buffer.dtype)
                declare = id(s.buffer) not in vars_
                if declare:
                    v = E.Var(s.buffer.name, s.buffer.dtype, is_local=True)
                    vars_[id(s.buffer)] = v
                out.append(S.Assign(vars_[id(s.buffer)], value, declare, loc=s.loc))
            else:
                out.append(rewrite.stmt(s, fe=fe))
        return dataclasses.replace(f, body=_seq(out, f.loc))

    def drop(s):
        if isinstance(s, S.Alloc) and id(s.buffer) in chosen:
            return S.Seq([])
        return per_loop(s) if isinstance(s, S.For) else None

    return dataclasses.replace(k, body=_map(k.body, drop))


def key_idx(indices) -> tuple:
    return tuple(key(i) for i in indices)


# loop-invariant loads ----------------------------------------------------------------------------------------

def _hoist_invariant_loads(f):
    """``f`` (an innermost loop with a constant positive trip count) with its invariant, unconditional loads
    of buffers it does not write read once before it; None when there is nothing to do."""
    if not isinstance(f, S.For) or any(isinstance(x, (S.For, S.While)) for x in S.walk(f.body)):
        return None
    if not (isinstance(f.extent, E.Const) and f.extent.value >= 1):
        return None
    top = _flatten([f.body])
    if not all(isinstance(t, (S.Store, S.Assign, S.If)) for t in top):
        return None
    written = {id(_root(x.buffer)) for x in S.walk(f.body) if isinstance(x, (S.Store, S.AtomicElem))}
    local = {id(f.var)} | {id(x.var) for x in S.walk(f.body) if isinstance(x, S.Assign)}
    found: dict = {}

    def visit(e):  # unconditionally evaluated sub-expressions only (not a Select's branches)
        if isinstance(e, E.Select):
            visit(e.cond)
            return
        if isinstance(e, E.Load) and id(_root(e.buffer)) not in written and not any(
                isinstance(v, (E.Var, E.Load)) and (id(v) in local or isinstance(v, E.Load))
                for i in e.indices for v in rewrite.sub_exprs(i)):
            found.setdefault(key(e), e)
            return
        for c in _children(e):
            visit(c)

    for t in top:
        if isinstance(t, S.If):
            visit(t.cond)
            continue
        for e in rewrite.exprs_of(t):
            visit(e)
    if not found:
        return None
    pre, mapping = [], {}
    for k, ld in found.items():
        v = E.Var(f"{ld.buffer.name}_inv", ld.dtype, is_local=True)
        v.is_local = True
        pre.append(S.Assign(v, ld, True, loc=f.loc))
        mapping[k] = v
    body = rewrite.stmt(f.body, fe=lambda x: mapping.get(key(x)) if isinstance(x, E.Load) else None)
    return S.Seq([*pre, dataclasses.replace(f, body=body)], loc=f.loc)


def _children(e) -> list:
    if isinstance(e, E.BinOp):
        return [e.a, e.b]
    if isinstance(e, E.UnOp):
        return [e.a]
    if isinstance(e, E.Call):
        return list(e.args)
    if isinstance(e, E.Cast):
        return [e.value]
    if isinstance(e, E.Load):
        return list(e.indices)
    return []
