"""The Python-AST frontend: a kernel's source -> a PrimFunc.

Statements are walked here (so `if`/`for`/`while` on runtime values become IR control flow); names
resolve to kernel values first, then to the function's closure and globals, whose Python values are
compile-time constants (an `if` on one selects code). Calls run the T.* functions, which append IR.
"""
from __future__ import annotations

import ast
import builtins
import inspect
import textwrap

from tegula.errors import CompileError
from tegula.ir import dtypes as dt
from tegula.ir import expr as E
from tegula.ir import stmt as S
from tegula.ir.buffer import Buffer, Region
from tegula.ir.simplify import const_difference
from tegula.language import builder as B
from tegula.language import surface
from tegula.passes import rewrite

_BINOPS = {
    ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b,
    ast.Pow: lambda a, b: a ** b, ast.BitAnd: lambda a, b: a & b, ast.BitOr: lambda a, b: a | b,
    ast.BitXor: lambda a, b: a ^ b, ast.LShift: lambda a, b: a << b, ast.RShift: lambda a, b: a >> b,
}
_CMPOPS = {
    ast.Lt: lambda a, b: a < b, ast.LtE: lambda a, b: a <= b, ast.Gt: lambda a, b: a > b,
    ast.GtE: lambda a, b: a >= b, ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b,
    ast.Is: lambda a, b: a is b, ast.IsNot: lambda a, b: a is not b,
    ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
}
_MISSING = object()


def _is_runtime(x) -> bool:
    return isinstance(x, E.Expr)


class _Return(Exception):
    def __init__(self, value):
        self.value = value


class Source:
    """A Python function's parsed source with its file and first line."""

    def __init__(self, fn, frame_locals: dict | None = None):
        self.frame_locals = frame_locals or {}
        try:
            lines, first = inspect.getsourcelines(fn)
        except (OSError, TypeError) as e:
            raise CompileError(f"cannot read the source of {getattr(fn, '__name__', fn)!r} ({e}): kernels must be "
                               "defined in a file, since python -c and the plain REPL keep no source") from None
        self.file = inspect.getsourcefile(fn) or fn.__code__.co_filename
        tree = ast.parse(textwrap.dedent("".join(lines)))
        ast.increment_lineno(tree, first - 1)
        self.fdef = tree.body[0]
        if not isinstance(self.fdef, (ast.FunctionDef, ast.AsyncFunctionDef)):
            raise CompileError(f"{fn!r} is not a function definition")
        self.fn = fn

    def scope(self) -> dict:
        """The Python values the function can see: globals, then closure cells, then builtins."""
        env = dict(vars(builtins))
        env.update(self.fn.__globals__)
        env.update(self.frame_locals)  # the defining scope: names used only in annotations are not closure cells
        code, cells = self.fn.__code__, self.fn.__closure__ or ()
        for name, cell in zip(code.co_freevars, cells):
            try:
                env[name] = cell.cell_contents
            except ValueError:
                pass
        return env


class Parser:
    def __init__(self, src: Source):
        self.src = src
        self.py = src.scope()     # compile-time Python values
        self.scopes: list[dict] = [{}]  # kernel values (Vars, Buffers) and names bound in the kernel
        self.b = B.Builder()
        self.let_defs: dict[int, E.Expr] = {}  # id(local Var) -> its defining value, while never reassigned
        self.pinned: dict[int, int] = {}       # id(local Var) -> line of a tile slice whose extent relies on it

    # helpers -----------------------------------------------------------------------------------
    def loc(self, node) -> tuple:
        return (self.src.file, getattr(node, "lineno", self.src.fdef.lineno))

    def err(self, node, msg) -> CompileError:
        return CompileError(msg, self.loc(node))

    def lookup(self, name, node):
        for sc in reversed(self.scopes):
            if name in sc:
                return sc[name]
        v = self.py.get(name, _MISSING)
        if v is _MISSING:
            raise self.err(node, f"name '{name}' is not defined")
        return v

    def bind(self, name, value):
        self.scopes[-1][name] = value

    def find_scope(self, name):
        for sc in reversed(self.scopes):
            if name in sc:
                return sc
        return None

    # entry -------------------------------------------------------------------------------------
    def parse_prim_func(self) -> S.PrimFunc:
        fdef = self.src.fdef
        prev = B.activate(self.b)
        prev_parser = _set_parser(self)
        try:
            params = []
            for arg in fdef.args.args + fdef.args.kwonlyargs:
                params.append(self.param(arg))
            if fdef.args.vararg or fdef.args.kwarg:
                raise self.err(fdef, "a T.prim_func cannot take *args or **kwargs")
            self.b.loc = self.loc(fdef)
            try:
                self.body(fdef.body)
            except _Return as r:
                if r.value is not None:
                    raise self.err(fdef, "a T.prim_func cannot return a value; write outputs into its tensors")
            body = self.b.pop()
        finally:
            B.activate(prev)
            _set_parser(prev_parser)
        return S.PrimFunc(fdef.name, params, body, loc=self.loc(fdef))

    def parse_eager(self, state, runtime: list, compile_values: dict, signature_annotations: dict):
        """Parse an eager @tegula.jit function: its body is the kernel function's body. ``runtime`` names the
        parameters that are tensors or scalars of the kernel (declared by annotations in the signature or the
        body); ``compile_values`` binds the others. Phase 1 (``state.phase == 1``) runs only the top-level
        assignments and declarations. Returns the PrimFunc (parameters: the declared ones in signature order,
        then the T.empty outputs) and the value of its ``return``."""
        fdef = self.src.fdef
        self.eager_runtime = list(runtime)
        self.py.update(compile_values)
        prev = B.activate(self.b)
        prev_parser = _set_parser(self)
        self.b.eager = state
        ret = None
        try:
            self.b.loc = self.loc(fdef)
            for name, ann in signature_annotations.items():
                self.declare_param(name, ann, fdef)
            if state.phase == 1:
                for node in fdef.body:
                    if isinstance(node, (ast.Assign, ast.AnnAssign)):
                        try:
                            self.stmt(node)
                        except CompileError:
                            pass  # a value only the full parse can compute; declarations do not need it
            else:
                try:
                    self.body(fdef.body)
                except _Return as r:
                    ret = r.value
            body = self.b.pop()
        finally:
            B.activate(prev)
            _set_parser(prev_parser)
        if state.phase == 2:
            for n in runtime:
                if n not in state.params:
                    raise self.err(fdef, f"parameter '{n}' is never declared; annotate it in the body, e.g. "
                                         f"`{n}: T.Tensor((M, N), T.float16)`")
        params = [state.params[n] for n in runtime if n in state.params] + list(state.outputs)
        return S.PrimFunc(fdef.name, params, body, loc=self.loc(fdef)), ret

    def declare_param(self, name, ann, node):
        """``A: T.Tensor(shape, dtype)`` or ``n: T.int32`` naming a parameter of an eager @tegula.jit function."""
        if name not in self.eager_runtime:
            raise self.err(node, f"'{name}' is annotated as a kernel parameter but is not a parameter of "
                                 f"{self.src.fdef.name}")
        if isinstance(ann, surface.TensorType):
            obj = Buffer(name, ann.shape, ann.dtype, "global", self.loc(node))
            obj.strides = ann.strides
        else:
            try:
                obj = E.Var(name, dt.dtype(ann))
            except TypeError:
                raise self.err(node, f"parameter '{name}': unsupported annotation {ann!r}; expected T.Tensor(shape, "
                                     "dtype) or a scalar dtype like T.int32") from None
        self.b.eager.params[name] = obj
        self.scopes[0][name] = obj

    def param(self, arg: ast.arg):
        if arg.annotation is None:
            raise self.err(arg, f"parameter '{arg.arg}' needs an annotation: T.Tensor(shape, dtype) or a scalar dtype")
        ann = self.eval(arg.annotation)
        if isinstance(ann, surface.TensorType):
            buf = Buffer(arg.arg, ann.shape, ann.dtype, "global", self.loc(arg))
            buf.strides = ann.strides
            self.bind(arg.arg, buf)
            return buf
        try:
            d = dt.dtype(ann)
        except TypeError:
            raise self.err(arg, f"parameter '{arg.arg}': unsupported annotation {ann!r}; expected T.Tensor(shape, "
                                "dtype) or a scalar dtype like T.int32") from None
        var = E.Var(arg.arg, d)
        self.bind(arg.arg, var)
        return var

    # statements --------------------------------------------------------------------------------
    def body(self, stmts):
        for s in stmts:
            self.stmt(s)

    def block(self, stmts) -> S.Stmt:
        """Parse ``stmts`` as a nested runtime block with its own scope."""
        self.b.push()
        self.scopes.append({})
        try:
            self.body(stmts)
        finally:
            self.scopes.pop()
        return self.b.pop()

    def stmt(self, node):
        self.b.loc = self.loc(node)
        method = getattr(self, "stmt_" + type(node).__name__, None)
        if method is None:
            raise self.err(node, f"unsupported Python construct in a kernel: {type(node).__name__} statement")
        try:
            method(node)
        except CompileError as e:
            raise e.with_loc(self.loc(node))
        except _Return:
            raise
        except (TypeError, ValueError, AttributeError, IndexError, KeyError, ZeroDivisionError) as e:
            raise self.err(node, f"{type(e).__name__}: {e}") from None

    def stmt_Expr(self, node):
        if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return  # docstring
        self.eval(node.value)

    def stmt_Pass(self, node):
        pass

    def stmt_Assert(self, node):
        """``assert cond, msg``: checked while compiling when cond is a compile-time value; a runtime condition is
        an assumption of the kernel, not checked (as T.device_assert)."""
        cond = _val(self.eval(node.test))
        if not _is_runtime(cond) and not cond:
            msg = self.eval(node.msg) if node.msg is not None else ast.unparse(node.test)
            raise self.err(node, f"assertion failed: {msg}")

    def stmt_Return(self, node):
        raise _Return(None if node.value is None else self.eval(node.value))

    def stmt_With(self, node):
        if len(node.items) != 1:
            raise self.err(node, "a kernel `with` takes exactly one context (T.Kernel(...))")
        item = node.items[0]
        spec = self.eval(item.context_expr)
        if not isinstance(spec, surface.KernelSpec):
            raise self.err(node, "only `with T.Kernel(...)` is supported in a kernel")
        if self.b.in_kernel:
            raise self.err(node, "T.Kernel blocks cannot be nested")
        names = []
        if item.optional_vars is not None:
            t = item.optional_vars
            elts = t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]
            for e in elts:
                if not isinstance(e, ast.Name):
                    raise self.err(node, "T.Kernel binds block indices to plain names")
                names.append(e.id)
            if len(names) > len(spec.grid) or (isinstance(t, ast.Name) and len(spec.grid) != 1):
                if not (isinstance(t, ast.Name) and len(spec.grid) > 1):
                    raise self.err(node, f"T.Kernel has {len(spec.grid)} grid dims but binds {len(names)} names")
        grid = tuple(spec.grid) + (1,) * (3 - len(spec.grid))
        bvars = tuple(E.Var(n, dt.int32) for n in ("bx", "by", "bz"))
        self.b.push()
        self.scopes.append({})
        self.b.in_kernel += 1
        self.b.block_vars = bvars[:len(spec.grid)]
        try:
            if isinstance(item.optional_vars, ast.Name) and len(spec.grid) > 1:
                self.bind(names[0], bvars[:len(spec.grid)])
            else:
                for n, v in zip(names, bvars):
                    self.bind(n, v)
            self.body(node.body)
        finally:
            self.b.in_kernel -= 1
            self.scopes.pop()
        body = self.b.pop()
        grid = tuple(E.cast(E.as_expr(g), dt.int32) for g in grid)
        self.b.emit(S.Kernel(grid, spec.threads, bvars, body, loc=self.loc(node)))

    def stmt_Assign(self, node):
        value = self.eval(node.value)
        for target in node.targets:
            self.assign(target, value, node)

    def stmt_AnnAssign(self, node):
        if node.value is None and self.b.eager is not None and isinstance(node.target, ast.Name):
            self.declare_param(node.target.id, self.eval(node.annotation), node)
            return
        if node.value is None:
            raise self.err(node, "a declaration without a value is not supported; write `x: T.float32 = 0`")
        value = self.eval(node.value)
        ann = self.eval(node.annotation)
        try:
            value = E.cast(value, dt.dtype(ann))
        except TypeError:
            pass
        self.assign(node.target, value, node)

    def assign(self, target, value, node):
        if isinstance(target, ast.Name):
            self.assign_name(target.id, value, node)
        elif isinstance(target, (ast.Tuple, ast.List)):
            if not isinstance(value, (tuple, list)) or len(value) != len(target.elts):
                raise self.err(node, "cannot unpack this value into the assignment targets")
            for t, v in zip(target.elts, value):
                self.assign(t, v, node)
        elif isinstance(target, ast.Subscript):
            obj = self.eval(target.value)
            idx = self.eval_index(target.slice)
            if isinstance(obj, Buffer):
                B.emit_store(obj, idx, value)
            elif isinstance(obj, (list, dict)):
                obj[idx] = value
            else:
                raise self.err(node, f"cannot assign into {type(obj).__name__}")
        else:
            raise self.err(node, f"unsupported assignment target {type(target).__name__}")

    def assign_name(self, name, value, node):
        sc = self.find_scope(name)
        cur = sc[name] if sc is not None else None
        if isinstance(cur, Buffer) and cur.scope == "local.var" and not isinstance(value, Buffer):
            B.emit_store(cur, 0, value)
            return
        if sc is not None and sc is not self.scopes[-1] and isinstance(cur, (bool, int, float)):
            raise self.err(node, f"'{name}' holds the compile-time value {cur!r} from outside this loop/branch; "
                                 "assigning to it here would not change it after the block. Make it a runtime "
                                 f"variable first (e.g. `{name} = T.float32({cur!r})` or T.alloc_var)")
        if isinstance(value, Buffer):
            if getattr(value, "auto_name", False):
                value.name, value.auto_name = name, False
            self.bind(name, value)
            return
        if isinstance(value, E.Var) and id(value) in self.b.symbol_ids and not (isinstance(cur, E.Var) and
                                                                               cur.is_local):
            self.bind(name, value)  # a symbolic dimension: the name is the symbol itself
            return
        if _is_runtime(value) or hasattr(value, "as_expr"):
            value = E.as_expr(value)
            if isinstance(cur, E.Var) and cur.is_local:
                self.reassigning(cur, node)
                self.b.emit(S.Assign(cur, E.cast(value, cur.dtype), False))
                return
            var = E.Var(name, value.dtype, is_local=True)
            self.b.emit(S.Assign(var, value, True))
            self.let_defs[id(var)] = value
            self.bind(name, var)
            return
        if isinstance(cur, E.Var) and cur.is_local:
            self.reassigning(cur, node)
            self.b.emit(S.Assign(cur, E.cast(E.as_expr(value, like=cur.dtype), cur.dtype), False))
            return
        self.bind(name, value)  # a compile-time Python value

    def reassigning(self, var, node):
        self.let_defs.pop(id(var), None)
        if id(var) in self.pinned:
            raise self.err(node, f"'{var.name}' is a bound of the tile slice on line {self.pinned[id(var)]}, whose "
                                 "constant extent assumes it keeps its value; assign the new value to another name")

    def slice_bounds(self, lo, hi, node):
        """``A[s:e]`` where ``s = ...; e = ...`` are locals: see through their definitions, as TileLang's let
        bindings do, so that an extent like ``e - s == block_N`` is the compile-time constant it is. The locals
        used are pinned: reassigning one later is an error."""
        if lo is None or hi is None or not (_is_runtime(lo) or _is_runtime(hi)) or const_difference(hi, lo) is not None:
            return lo, hi
        used = []

        def see_through(x):
            if isinstance(x, E.Var) and id(x) in self.let_defs:
                used.append(x)
                return self.let_defs[id(x)]
            return None
        a, b = hi, lo
        for _ in range(8):
            a2, b2 = rewrite.expr(a, see_through), rewrite.expr(b, see_through)
            if a2 is a and b2 is b:
                break
            a, b = a2, b2
            ext = const_difference(a, b)
            if ext is not None:
                for v in used:
                    self.pinned.setdefault(id(v), self.loc(node)[1])
                return lo, E.binop("+", lo, ext) if _is_runtime(lo) else lo + ext
        return lo, hi

    def stmt_AugAssign(self, node):
        op = _BINOPS.get(type(node.op))
        t = node.target
        if isinstance(t, ast.Name):
            cur = self.lookup(t.id, node)
            old = _VarRef(cur).as_expr() if isinstance(cur, Buffer) and cur.scope == "local.var" else _val(cur)
            self.assign_name(t.id, op(old, self.eval(node.value)), node)
        elif isinstance(t, ast.Subscript):
            obj = self.eval(t.value)
            idx = self.eval_index(t.slice)
            if not isinstance(obj, Buffer):
                obj[idx] = op(obj[idx], self.eval(node.value))
                return
            old = obj[idx]
            if isinstance(old, Region):
                raise self.err(node, f"`{obj.name}[...] op=` on a slice is not supported; use a T.Parallel loop")
            B.emit_store(obj, idx, op(old, self.eval(node.value)))
        else:
            raise self.err(node, "unsupported augmented assignment target")

    def stmt_If(self, node):
        cond = self.eval(node.test)
        if hasattr(cond, "as_expr"):
            cond = cond.as_expr()
        if not _is_runtime(cond):
            self.body(node.body if cond else node.orelse)
            return
        then = self.block(node.body)
        orelse = self.block(node.orelse) if node.orelse else None
        self.b.emit(S.If(E.cast(cond, dt.bool_), then, orelse))

    def stmt_While(self, node):
        if node.orelse:
            raise self.err(node, "while ... else is not supported in a kernel")
        cond = self.eval(node.test)
        if not _is_runtime(cond) and not hasattr(cond, "as_expr"):
            if cond:
                raise self.err(node, "a `while` on a compile-time true condition would never end")
            return
        self.b.push()
        self.scopes.append({})
        try:
            self.body(node.body)
        finally:
            self.scopes.pop()
        body = self.b.pop()
        self.b.emit(S.While(E.cast(E.as_expr(cond), dt.bool_), body))

    def stmt_For(self, node):
        if node.orelse:
            raise self.err(node, "for ... else is not supported in a kernel")
        it = node.iter
        if isinstance(it, ast.Call) and self.eval(it.func) is builtins.range:
            args = [self.eval(a) for a in it.args]
            spec = surface._range("serial", args)
        else:
            spec = self.eval(it)
        if not isinstance(spec, surface.LoopSpec):
            if _is_runtime(spec) or isinstance(spec, (Buffer, Region)):
                raise self.err(node, "a kernel `for` iterates over T.Parallel / T.serial / T.Pipelined / range")
            for value in spec:  # a Python iterable: unrolled at compile time
                self.assign(node.target, value, node)
                self.body(node.body)
            return
        t = node.target
        names = [e for e in t.elts] if isinstance(t, (ast.Tuple, ast.List)) else [t]
        if spec.coords is not None:
            self.coords_loop(node, spec, names)
            return
        if len(names) != len(spec.ranges) or not all(isinstance(n, ast.Name) for n in names):
            raise self.err(node, f"the loop binds {len(names)} names but iterates over {len(spec.ranges)} dims")
        loops = []
        self.scopes.append({})
        self.b.push()
        try:
            for n, (start, extent, step) in zip(names, spec.ranges):
                var = E.Var(n.id, dt.int32)
                loops.append((var, start, extent, step))
                if step == 1:
                    self.bind(n.id, E.binop("+", var, start) if E.const_value(start) != 0 else var)
                else:
                    self.bind(n.id, E.binop("+", E.binop("*", var, step), start))
            self.body(node.body)
        finally:
            self.scopes.pop()
        body = self.b.pop()
        for var, start, extent, step in reversed(loops):
            body = S.For(var, E.cast(E.as_expr(0), dt.int32), E.cast(E.as_expr(extent), dt.int32), spec.kind,
                         body, 1, dict(spec.annotations), loc=self.loc(node))
        self.b.emit(body)

    def coords_loop(self, node, spec, names):
        """A loop whose names are computed from one loop variable, under a guard (T.Persistent)."""
        if len(names) != spec.n_names or not all(isinstance(n, ast.Name) for n in names):
            raise self.err(node, f"the loop binds {len(names)} names but iterates over {spec.n_names} dims")
        start, extent, _ = spec.ranges[0]
        var = E.Var("w", dt.int32)
        values, guard = spec.coords(var)
        self.scopes.append({})
        self.b.push()
        try:
            for n, v in zip(names, values):
                self.bind(n.id, v)
            self.body(node.body)
        finally:
            self.scopes.pop()
        body = S.If(guard, self.b.pop(), loc=self.loc(node))
        self.b.emit(S.For(var, E.cast(E.as_expr(start), dt.int32), E.cast(E.as_expr(extent), dt.int32), spec.kind,
                          body, 1, dict(spec.annotations), loc=self.loc(node)))

    def stmt_FunctionDef(self, node):
        raise self.err(node, "nested function definitions are not supported inside a kernel; define a @T.macro "
                             "outside it")

    # expressions -------------------------------------------------------------------------------
    def eval(self, node):
        method = getattr(self, "expr_" + type(node).__name__, None)
        if method is None:
            raise self.err(node, f"unsupported Python construct in a kernel: {type(node).__name__} expression")
        try:
            return method(node)
        except CompileError as e:
            raise e.with_loc(self.loc(node))

    def expr_Constant(self, node):
        return node.value

    def expr_Name(self, node):
        v = self.lookup(node.id, node)
        if isinstance(v, Buffer) and v.scope == "local.var":
            return _VarRef(v)
        return v

    def expr_Attribute(self, node):
        obj = self.eval(node.value)
        if isinstance(obj, _VarRef):
            obj = obj.buffer
        try:
            return getattr(obj, node.attr)
        except AttributeError:
            owner = getattr(obj, "__name__", type(obj).__name__)
            if getattr(obj, "__name__", "").startswith("tegula.language"):
                raise self.err(node, f"T.{node.attr} is not a tegula.language construct") from None
            raise self.err(node, f"{owner} has no attribute '{node.attr}'") from None

    def expr_BinOp(self, node):
        a, b = self.eval(node.left), self.eval(node.right)
        return _BINOPS[type(node.op)](_val(a), _val(b))

    def expr_UnaryOp(self, node):
        a = _val(self.eval(node.operand))
        if isinstance(node.op, ast.Not):
            return E.unop("not", a) if _is_runtime(a) else not a
        if isinstance(node.op, ast.USub):
            return -a
        if isinstance(node.op, ast.UAdd):
            return +a
        return ~a

    def expr_BoolOp(self, node):
        op = "and" if isinstance(node.op, ast.And) else "or"
        result = _val(self.eval(node.values[0]))
        for v in node.values[1:]:
            if not _is_runtime(result):
                if (op == "and") != bool(result):
                    return result  # Python short-circuit on a compile-time value
                result = _val(self.eval(v))
                continue
            result = E.logical(op, result, _val(self.eval(v)))
        return result

    def expr_Compare(self, node):
        left = _val(self.eval(node.left))
        out = None
        for op, right_node in zip(node.ops, node.comparators):
            right = _val(self.eval(right_node))
            r = _CMPOPS[type(op)](left, right)
            out = r if out is None else (E.logical("and", out, r) if _is_runtime(out) or _is_runtime(r)
                                         else (out and r))
            if not _is_runtime(out) and not out:
                return out
            left = right
        return out

    def expr_IfExp(self, node):
        cond = _val(self.eval(node.test))
        if not _is_runtime(cond):
            return self.eval(node.body if cond else node.orelse)
        return E.select(cond, _val(self.eval(node.body)), _val(self.eval(node.orelse)))

    def expr_Tuple(self, node):
        return tuple(self.eval_starred(node.elts))

    def expr_List(self, node):
        return list(self.eval_starred(node.elts))

    def expr_Dict(self, node):
        return {self.eval(k): self.eval(v) for k, v in zip(node.keys, node.values)}

    def eval_starred(self, elts):
        out = []
        for e in elts:
            if isinstance(e, ast.Starred):
                out.extend(self.eval(e.value))
            else:
                out.append(self.eval(e))
        return out

    def expr_Subscript(self, node):
        obj = self.eval(node.value)
        if isinstance(obj, _VarRef):
            obj = obj.buffer
        idx = self.eval_index(node.slice)
        if isinstance(idx, tuple):
            idx = tuple(_val(i) for i in idx)
        else:
            idx = _val(idx)
        return obj[idx]

    def eval_index(self, node):
        if isinstance(node, ast.Slice):
            lo, hi, step = (None if p is None else _val(self.eval(p)) for p in (node.lower, node.upper, node.step))
            lo, hi = self.slice_bounds(lo, hi, node)
            return slice(lo, hi, step)
        if isinstance(node, ast.Tuple):
            return tuple(self.eval_index(e) for e in node.elts)
        return _val(self.eval(node))

    def expr_Call(self, node):
        fn = self.eval(node.func)
        args = self.eval_starred(node.args)
        kwargs = {}
        for kw in node.keywords:
            if kw.arg is None:
                kwargs.update(self.eval(kw.value))
            else:
                kwargs[kw.arg] = self.eval(kw.value)
        if isinstance(fn, Macro):
            return self.inline_macro(fn, args, kwargs, node)
        if fn in _BUILTIN_TO_T and any(_is_runtime(_val(a)) for a in args):
            fn = _BUILTIN_TO_T[fn]
        if fn is builtins.range:
            raise self.err(node, "range(...) is only allowed as the iterable of a `for` loop in a kernel")
        args = [_val(a) if not isinstance(a, _VarRef) or _wants_region(fn) is False else a.buffer for a in args]
        try:
            return fn(*args, **kwargs)
        except CompileError as e:
            raise e.with_loc(self.loc(node))
        except TypeError as e:
            name = getattr(fn, "__name__", repr(fn))
            raise self.err(node, f"bad call of {name}: {e}") from None

    def expr_Lambda(self, node):
        """A lambda (a layout's index map, say) is a compile-time function: calling it evaluates its body with
        the arguments bound, in the scope where it was written."""
        a = node.args
        if a.vararg or a.kwarg or a.kwonlyargs or a.defaults:
            raise self.err(node, "a lambda in a kernel takes plain positional parameters only")
        names, scopes = [p.arg for p in a.posonlyargs + a.args], list(self.scopes)

        def fn(*args):
            if len(args) != len(names):
                raise CompileError(f"the lambda on line {node.lineno} takes {len(names)} arguments, got {len(args)}")
            saved = self.scopes
            self.scopes = scopes + [dict(zip(names, args))]
            try:
                return self.eval(node.body)
            finally:
                self.scopes = saved
        return fn

    def comprehension(self, node, make):
        """A comprehension over compile-time iterables, evaluated while parsing (``sum(n // 4 for n in sizes)``)."""
        out = []

        def loop(k):
            if k == len(node.generators):
                out.append(make())
                return
            g = node.generators[k]
            if isinstance(g.iter, ast.Call) and self.eval(g.iter.func) is builtins.range:
                it = range(*(_val(self.eval(a)) for a in g.iter.args))  # a runtime bound fails here, in Python
            else:
                it = self.eval(g.iter)
            if _is_runtime(it) or isinstance(it, (Buffer, Region, surface.LoopSpec)):
                raise self.err(node, "a comprehension in a kernel iterates over compile-time values only")
            for value in it:
                self.assign(g.target, value, node)
                if all(_truthy(self, c, node) for c in g.ifs):
                    loop(k + 1)

        self.scopes.append({})
        try:
            loop(0)
        finally:
            self.scopes.pop()
        return out

    def expr_ListComp(self, node):
        return self.comprehension(node, lambda: self.eval(node.elt))

    expr_GeneratorExp = expr_ListComp

    def expr_SetComp(self, node):
        return set(self.comprehension(node, lambda: self.eval(node.elt)))

    def expr_DictComp(self, node):
        return dict(self.comprehension(node, lambda: (self.eval(node.key), self.eval(node.value))))

    def expr_JoinedStr(self, node):
        return "".join(str(self.eval(v)) if not isinstance(v, ast.Constant) else v.value for v in node.values)

    def expr_FormattedValue(self, node):
        return self.eval(node.value)

    # macros ------------------------------------------------------------------------------------
    def inline_macro(self, macro, args, kwargs, node):
        src = macro.source()
        sig = inspect.signature(macro.fn)
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as e:
            raise self.err(node, f"bad call of macro {macro.fn.__name__}: {e}") from None
        bound.apply_defaults()
        saved = (self.src, self.py, self.scopes)
        self.src, self.py = src, src.scope()
        self.scopes = [dict(bound.arguments)]
        try:
            self.body(src.fdef.body)
        except _Return as r:
            return r.value
        finally:
            self.src, self.py, self.scopes = saved
        return None


def _truthy(parser, cond_node, node) -> bool:
    c = _val(parser.eval(cond_node))
    if _is_runtime(c):
        raise parser.err(node, "a comprehension's condition must be a compile-time value")
    return bool(c)


class _VarRef:
    """A T.alloc_var read by name: behaves as its value in expressions."""

    def __init__(self, buffer):
        self.buffer = buffer

    def as_expr(self):
        return E.Load(self.buffer, (E.Const(0, dt.int32),))


def _val(x):
    return x.as_expr() if isinstance(x, _VarRef) else x


def _wants_region(fn) -> bool:
    mod = getattr(fn, "__module__", "") or ""
    return mod.startswith("tegula.language.tile")


_BUILTIN_TO_T = {builtins.max: surface.max, builtins.min: surface.min, builtins.abs: surface.abs,
                 builtins.float: lambda x: E.cast(x, dt.float32), builtins.int: lambda x: E.cast(x, dt.int32),
                 builtins.bool: lambda x: E.cast(x, dt.bool_)}


class Macro:
    """``@T.macro``: a helper whose body is inlined at each call site inside a kernel."""

    def __init__(self, fn, frame_locals=None):
        self.fn = fn
        self.frame_locals = frame_locals
        self._src = None
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__

    def source(self) -> Source:
        if self._src is None:
            self._src = Source(self.fn, self.frame_locals)
        return self._src

    def __call__(self, *args, **kwargs):
        p = _current_parser()
        if p is None:
            raise CompileError(f"macro {self.fn.__name__} can only be called inside a kernel")
        return p.inline_macro(self, args, kwargs, p.src.fdef)


_parser_state = {"current": None}


def _set_parser(p):
    prev = _parser_state["current"]
    _parser_state["current"] = p
    return prev


def _current_parser():
    return _parser_state["current"]


def parse_eager(fn, state, runtime, compile_values, signature_annotations, frame_locals=None):
    """An eager @tegula.jit function -> (PrimFunc, returned value); see ``Parser.parse_eager``."""
    return Parser(Source(fn, frame_locals)).parse_eager(state, runtime, compile_values, signature_annotations)


def parse(fn, frame_locals: dict | None = None) -> S.PrimFunc:
    """Parse a Python function written in the tile language into a PrimFunc; ``frame_locals`` are the
    defining scope's local values (annotations may use names the body does not)."""
    return Parser(Source(fn, frame_locals)).parse_prim_func()
