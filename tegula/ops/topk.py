"""Top-k along the rows of a [batch, n] tensor, DeepSelect's ``deep_select.topk`` on tegula's kernels.

``from tegula.ops.topk import topk`` takes the arguments of ``deep_select.topk`` (names, order, defaults and the
NaN / short-row conventions; see its docstring) and runs the T.* kernels of ``_topk_kernels``: each row is
scanned once against a rising threshold into a small candidate buffer that a radix select cuts back to k. Rows
run one per core; when there are fewer rows than cores, long rows are split into segments whose top-k are merged.

Where tegula differs from DeepSelect: float16 input is accepted too, ``sorted=True`` works for every input
dtype, ``begin`` and ``hint`` must be None (as in DeepSelect today), a NaN found with
``abort_when_nan_found=True`` raises ValueError instead of aborting the process, and rows with a non-unit stride
are copied once rather than refused. Results are deterministic: values rank by their bits' order (so -0.0 below
+0.0), ties at the k-th value keep the lowest indices, unsorted output lists indices in ascending order (so
``sorted_index`` costs nothing) and ``sorted=True`` orders equal values by index.
"""
from __future__ import annotations

import functools
import math
import os
import threading

from tegula.ops import _tk
from tegula.ops import _topk_kernels as K

__all__ = ["topk", "get_stride_requirement"]

MAX_TOPK = K.KMAX
NAN_FLAG = K.NAN_FLAG
SPLIT_MIN_SEGMENT = 1 << 17   # a row is split over cores only into segments of at least this many elements
OUTPUT_BLOCK = 1 << 18        # a call's values and indices are cut from blocks of at most this many bytes,
OUTPUT_POOL = 64              # at most this many a block,
OUTPUT_POOL_MIN = 8           # where at least this many fit (else allocated one by one)
_IDX_FILL, _VALUE_FILL = 2147483647, float("-inf")   # the defaults: a call passing these very objects (as one
# leaving them out does) with every other argument at its default takes the shortest path


def get_stride_requirement() -> tuple[int, int]:
    """(input, output) row-stride alignment in bytes, as ``deep_select.get_stride_requirement()``.

    tegula's kernels take any row stride (a non-contiguous input or ``output_idx`` is copied once), so this only
    states the element alignment every bf16/fp16/fp32 input and int64 index row already has."""
    return (2, 8)


def topk(input, topk: int, sorted: bool = False, begin=None, end=None, indices_type=None,  # noqa: A002
         sorted_index: bool = False, hint=None, output_idx=None, output_idx_offset=None,
         idx_oob_fill_value: int = _IDX_FILL, value_oob_fill_value: float = _VALUE_FILL,
         return_value: bool = True, abort_when_nan_found: bool = True):
    """The ``topk`` largest values of each row of ``input`` and their column indices.

    input: (batch, n) torch CPU tensor, bfloat16 / float16 / float32. topk: 1..4096.
    sorted: values in descending order (equal values by ascending index); needs return_value.
    end: optional (batch,) int32 tensor, 0 <= end[i] <= n: row i is input[i, :end[i]].
    indices_type: torch.int64 (default) or torch.int32. sorted_index: indices in ascending order (also what
    unsorted output gives). output_idx: optional (batch, topk) tensor of indices_type to write into.
    output_idx_offset: optional (batch,) int32 tensor added to every selected index of its row.
    A row with fewer than topk elements lists them all first; the rest of its indices are
    idx_oob_fill_value (no offset added) and of its values value_oob_fill_value.
    NaN in a row longer than topk raises ValueError, or with abort_when_nan_found=False sets that row's
    indices[row, 0] to 0x3F3F3F3F (the rest of such a row is unspecified); shorter rows are not checked.
    return_value=False skips the values: the result is (None, indices).
    Runs on the target TEGULA_TARGET names, else the best available (c where a C compiler is found).
    Returns (values or None, indices), both (batch, topk). Every call's values and indices are their own memory,
    but small ones (up to 32 KiB) are cut from shared blocks of up to 256 KiB, so one kept alive keeps its block
    alive (and ``torch.save`` of it writes the block; ``.clone()`` it to keep it alone).
    """
    # the common call, topk(x, k[, output_idx=]): its plan's launch under a short key; the flags are compared by
    # identity, so 1 for True, 512.0 for 512 or an equal fill value object take the full path below (which checks)
    common = (end is None and output_idx_offset is None and sorted is False and sorted_index is False
              and return_value is True and abort_when_nan_found is True and begin is None and hint is None
              and indices_type is None and idx_oob_fill_value is _IDX_FILL and value_oob_fill_value is _VALUE_FILL
              and topk.__class__ is int)
    if common:
        try:
            launch = _LOCAL.plans[(input.shape, input.dtype, topk, _ENV.get(_TARGET_VAR), _CACHE.get("threads"))]
        except (AttributeError, KeyError, TypeError):   # not planned yet, or not a tensor (checked below)
            pass
        else:
            return launch(input, output_idx)
    try:
        key = (input.shape, input.dtype, topk, sorted, sorted_index, return_value, abort_when_nan_found,
               indices_type, idx_oob_fill_value, value_oob_fill_value, end is None, output_idx is None,
               output_idx_offset is None, _ENV.get(_TARGET_VAR), _CACHE.get("threads"))
        plan = getattr(_LOCAL, "plans", _NO_PLANS).get(key)
    except (AttributeError, TypeError):   # arguments that make no key (the checks will say why)
        key = plan = None
    # the key cannot tell 1 from True or 512.0 from 512: the types are checked here, the rest by the plan
    if (plan is None or topk.__class__ is not int or idx_oob_fill_value.__class__ is not int
            or sorted is not plan.sorted or sorted_index is not plan.sorted_index or begin is not None
            or hint is not None or return_value is not plan.return_value
            or abort_when_nan_found is not plan.abort):
        plan = _new_plan(key, input, topk, sorted, begin, end, indices_type, sorted_index, hint, output_idx,
                         output_idx_offset, idx_oob_fill_value, value_oob_fill_value, return_value,
                         abort_when_nan_found)
    if common and key is not None and plan.fast is not None:   # the short key's value is the plan's launch
        _LOCAL.plans[key[:3] + (key[13], _CACHE.get("threads"))] = plan.fast
    return plan(input, end, output_idx, output_idx_offset)


def _new_plan(key, input, topk, sorted, begin, end, indices_type, sorted_index, hint, output_idx, output_idx_offset,
              idx_oob_fill_value, value_oob_fill_value, return_value, abort_when_nan_found):
    """Check every argument as a first call must, and build the plan for them (kept in this thread under
    ``key``; _segments may set the thread count the key holds, hence the key's last item is taken again)."""
    import torch

    spec = _specs(torch).get(input.dtype) if isinstance(input, torch.Tensor) else None
    if spec is None:
        if not isinstance(input, torch.Tensor):
            raise TypeError(f"topk: input must be a torch.Tensor, got {type(input).__name__}")
        raise TypeError(f"topk: input must be bfloat16, float16 or float32, got {input.dtype}")
    if input.dim() != 2:
        raise ValueError(f"topk: input must be 2-D (batch, n), got shape {tuple(input.shape)}")
    if not input.is_cpu:
        raise ValueError(f"topk: input is on {input.device}; tegula's topk runs on the CPU")
    if type(topk) is not int:
        raise TypeError(f"topk: topk must be an int, got {type(topk).__name__}")
    if not 1 <= topk <= MAX_TOPK:
        raise ValueError(f"topk: topk must be in [1, {MAX_TOPK}], got {topk}")
    for name, v in (("sorted", sorted), ("sorted_index", sorted_index), ("return_value", return_value),
                    ("abort_when_nan_found", abort_when_nan_found)):
        if type(v) is not bool:
            raise TypeError(f"topk: {name} must be a bool, got {type(v).__name__}")
    if sorted and not return_value:
        raise ValueError("topk: sorted=True needs return_value=True")
    if sorted and sorted_index:
        raise ValueError("topk: sorted and sorted_index cannot both be True")
    if begin is not None:
        raise ValueError("topk: begin is not supported (pass None, as DeepSelect requires)")
    if hint is not None:
        raise ValueError("topk: hint is not supported (pass None, as DeepSelect requires)")
    if indices_type is None:
        indices_type = torch.int64
    elif indices_type is not torch.int64 and indices_type is not torch.int32:
        raise TypeError(f"topk: indices_type must be torch.int32 or torch.int64, got {indices_type}")
    if type(idx_oob_fill_value) is not int or not -2**31 <= idx_oob_fill_value < 2**31:
        raise ValueError(f"topk: idx_oob_fill_value must be an int32, got {idx_oob_fill_value!r}")
    if not isinstance(value_oob_fill_value, (int, float)) or isinstance(value_oob_fill_value, bool):
        raise TypeError(f"topk: value_oob_fill_value must be a float, got {type(value_oob_fill_value).__name__}")
    batch, n = input.shape
    if n >= 2**31 - K.CHUNK:
        raise ValueError(f"topk: rows of {n} elements are too long (at most {2**31 - K.CHUNK - 1})")
    plan = _Plan(torch, input, topk, sorted, sorted_index, return_value, abort_when_nan_found, indices_type, spec,
                 idx_oob_fill_value, value_oob_fill_value, end is not None, output_idx_offset is not None)
    plans = getattr(_LOCAL, "plans", None)
    if plans is None or len(plans) >= 64:
        plans = _LOCAL.plans = {}
    if key is not None:
        plans[key[:-1] + (_CACHE.get("threads"),)] = plan
    return plan


class _Plan:
    """Everything that depends only on the shapes, dtypes and flags of a call: the kernels, bound once to this
    thread's status words, the default ``end`` / offset vectors and the workspaces, so that a call checks only
    the tensors it is given and launches."""

    def __init__(self, torch, input, k, sorted, sorted_index, return_value, abort, indices_type, spec, idx_fill,
                 value_fill, has_end, has_off):
        self.sorted, self.sorted_index, self.return_value, self.abort = sorted, sorted_index, return_value, abort
        self.torch, self.k, self.indices_type, self.dtype = torch, k, indices_type, input.dtype
        self.batch, self.n = batch, n = input.shape
        self.shape = (batch, k)
        self.flags, self.words = _flags(torch)
        self.status = memoryview(self.words.view("int64"))   # both words at once (a Python int): nonzero when
        # either is set
        self.values = _Outputs(torch, self.shape, input.dtype)
        self.indices = _Outputs(torch, self.shape, indices_type)
        self.run = self.fast = None
        if batch == 0:
            return
        bits, inf_mag = spec
        tgt = _current_target()
        idx_name = "int64" if indices_type is torch.int64 else "int32"
        b2 = min(max(k, 512), K.B2MAX)
        fill = _fill_bits(torch, input.dtype, bits, value_fill)
        x = input if input.is_contiguous() else torch.empty((batch, n), dtype=input.dtype)
        end_t, off_t = _full(torch, batch, n), _full(torch, batch, 0)
        vals = torch.empty(self.shape, dtype=input.dtype)   # without return_value, where the kernels' values go
        idx = torch.empty(self.shape, dtype=indices_type)
        used = {"x": True, "e": has_end, "o": has_off, "v": return_value, "i": True}
        nseg = _segments(batch, n)
        if nseg == 1:
            pos = {"x": 0, "e": 1, "o": 2, "v": 3, "i": 4}
            vary = [pos[a] for a in pos if used[a]]
            rows = K.bind(K.get("rows", tgt, bits, idx_name), (x, end_t, off_t, vals, idx, self.flags, int(sorted),
                                                                b2, idx_fill, fill, inf_mag), vary)
            names = ", ".join(a for a in pos if used[a])
            self.run = eval(f"lambda x, e, o, v, i: rows({names})", {"rows": rows})
            direct = getattr(rows, "direct", None)
        else:
            seg = -(-n // nseg)
            seg = -(-seg // K.CHUNK) * K.CHUNK
            nseg = -(-n // seg)
            wk = torch.empty((batch, nseg * k), dtype=torch.int32)
            wi = torch.empty((batch, nseg * k), dtype=torch.int32)
            wm = torch.empty((batch, nseg), dtype=torch.int32)
            parts = K.bind(K.get("parts", tgt, bits), (x, end_t, wk, wi, wm, k, seg, b2),
                           [0, 1] if has_end else [0])
            pos = {"e": 3, "o": 4, "v": 5, "i": 6}
            merge = K.bind(K.get("merge", tgt, bits, idx_name), (wk, wi, wm, end_t, off_t, vals, idx, self.flags,
                                                                  n, int(sorted), b2, idx_fill, fill, inf_mag),
                           [pos[a] for a in pos if used[a]])
            names = ", ".join(a for a in pos if used[a])
            self.run = eval(f"lambda x, e, o, v, i: (parts(x{', e' if has_end else ''}), merge({names}))",
                            {"parts": parts, "merge": merge})
            direct = None
        if not (has_end or has_off) and return_value and indices_type is torch.int64:
            self.fast = self._fast_launch(torch, rows if direct is not None else None)

    def _fast_launch(self, torch, rows):
        """``launch(input, output_idx)``: the plan's call for topk's common case (every other argument at its
        default): the input checked as ``__call__`` checks it; an output_idx of the plan's dtype, shape, device and
        layout written in place, any other left to ``__call__`` (its errors, or its copy through a contiguous
        tensor); the kernel launched on the tensors' addresses (straight through the trampoline where ``rows``,
        the bound kernel, has one)."""
        env = {"plan": self, "run": self.run, "status": self.status, "words": self.words, "check": _check_status,
               "Tensor": torch.Tensor, "index_type": self.indices_type, "shape": torch.Size(self.shape),
               "vpop": self.values.pool.pop, "vnew": self.values.refill, "ipop": self.indices.pool.pop,
               "inew": self.indices.refill}
        if rows is not None:   # the varying arguments: x, v, i (positions 0, 3, 4)
            call, ints = rows.direct
            env["call"] = call
            names = iter(("input.data_ptr()", "v.data_ptr()", "i.data_ptr()"))
            launch = f"call({', '.join(next(names) if a is None else str(a) for a in ints)})"
        else:
            launch = "run(input, None, None, v, i)"
        def take(t, indent):   # a tensor from the pool, else a new block's; where not pooled, a new one
            if getattr(self, {"v": "values", "i": "indices"}[t]).count < OUTPUT_POOL_MIN:
                return f"{t} = {t}new()"
            return f"try:\n{indent}    {t} = {t}pop()\n{indent}except IndexError:\n{indent}    {t} = {t}new()"
        src = f"""def launch(input, out):
    if not input.is_cpu:
        raise ValueError(f"topk: input is on {{input.device}}; tegula's topk runs on the CPU")
    if out is None:
        {take("i", " " * 8)}
    elif (out.__class__ is Tensor and out.dtype is index_type and out.shape == shape and out.is_cpu
          and out.is_contiguous()):
        i = out
    else:
        return plan(input, None, out, None)
    if not input.is_contiguous():
        input = input.contiguous()
    {take("v", " " * 4)}
    {launch}
    if status[0]:
        check(words, i, None, {self.n}, True)
    return v, i
"""
        exec(compile(src, f"<tegula topk launch {self.shape}>", "exec"), env)
        return env["launch"]

    def __call__(self, input, end, output_idx, offset):
        torch = self.torch
        if not input.is_cpu:
            raise ValueError(f"topk: input is on {input.device}; tegula's topk runs on the CPU")
        if end is not None:
            end = _row_vector(torch, end, "end", self.batch)
        if offset is not None:
            offset = _row_vector(torch, offset, "output_idx_offset", self.batch)
        dest = None
        if output_idx is None:
            indices = self.indices.take()
        else:
            if output_idx.__class__ is not torch.Tensor and not isinstance(output_idx, torch.Tensor):
                raise TypeError(f"topk: output_idx must be a torch.Tensor, got {type(output_idx).__name__}")
            if output_idx.dtype != self.indices_type:
                raise TypeError(f"topk: output_idx has dtype {output_idx.dtype}, but indices_type is "
                                f"{self.indices_type}")
            if output_idx.shape != self.shape:
                raise ValueError(f"topk: output_idx must have shape {self.shape}, got {tuple(output_idx.shape)}")
            if not output_idx.is_cpu:
                raise ValueError(f"topk: output_idx is on {output_idx.device}; it must be on the CPU")
            indices = output_idx
            if not output_idx.is_contiguous():
                dest, indices = output_idx, self.indices.take()
        values = self.values.take() if self.return_value else None
        if self.run is None:   # no rows
            return values, (output_idx if output_idx is not None else indices)
        if not input.is_contiguous():
            input = input.contiguous()
        self.run(input, end, offset, values, indices)
        if self.status[0]:
            _check_status(self.words, indices, end, self.n, self.abort)
        if dest is not None:
            dest.copy_(indices)
            indices = dest
        return values, indices


class _Outputs:
    """A call's new (batch, k) tensors of one dtype. Where at least OUTPUT_POOL_MIN fit in OUTPUT_BLOCK bytes they
    are cut from one allocation of up to OUTPUT_POOL of them (unsafe_split_with_sizes: disjoint, contiguous, not
    views; ~0.3 us each where empty_like takes ~0.9 us); ``pool`` holds the ones not handed out yet."""

    def __init__(self, torch, shape, dtype):
        self.like = torch.empty(shape, dtype=dtype)
        nbytes = self.like.numel() * self.like.element_size()
        self.count = min(OUTPUT_POOL, OUTPUT_BLOCK // nbytes) if nbytes else 0
        self.block_shape, self.sizes = (self.count * shape[0], shape[1]), [shape[0]] * self.count
        self.torch, self.dtype, self.pool = torch, dtype, []
        if self.count < OUTPUT_POOL_MIN:
            self.refill = functools.partial(torch.empty_like, self.like)

    def refill(self):
        """The first tensor of a new block, the rest kept in ``pool``."""
        self.pool.extend(self.torch.empty(self.block_shape, dtype=self.dtype).unsafe_split_with_sizes(self.sizes))
        return self.pool.pop()

    def take(self):
        return self.pool.pop() if self.pool else self.refill()


def _check_status(status, indices, end, n, abort_when_nan_found):
    nan, bad_end = bool(status[0]), bool(status[1])
    status[:] = 0
    if bad_end:
        bad = [i for i, e in enumerate(end.tolist()) if not 0 <= e <= n]
        raise ValueError(f"topk: end[{bad[0]}] = {int(end[bad[0]])} is outside [0, {n}] (n = input.shape[1])")
    if nan and abort_when_nan_found:
        rows = (indices[:, 0] == NAN_FLAG).nonzero().flatten().tolist()
        raise ValueError(f"topk: input row {rows[0] if rows else '?'} holds NaN (abort_when_nan_found=True; pass "
                         "False to get the row flagged with indices[row, 0] = 0x3F3F3F3F instead)")


# helpers ---------------------------------------------------------------------------------------------

def _row_vector(torch, t, name, batch):
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"topk: {name} must be a torch.Tensor of int32, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"topk: {name} must have dtype torch.int32, got {t.dtype}")
    if tuple(t.shape) != (batch,):
        raise ValueError(f"topk: {name} must have shape ({batch},), got {tuple(t.shape)}")
    if t.device.type != "cpu":
        raise ValueError(f"topk: {name} is on {t.device}; it must be on the CPU")
    return t if t.is_contiguous() else t.contiguous()


_CACHE: dict = {}
_TARGETS: dict = {}
_FULL: dict = {}
_LOCAL = threading.local()   # .plans: this thread's {key: _Plan}; .flags: its status words
_NO_PLANS: dict = {}
# TEGULA_TARGET as os.environ stores it (it is part of a plan's key): its own mapping, one dict lookup
_ENV, _TARGET_VAR = getattr(os.environ, "_data", os.environ), getattr(os.environ, "encodekey", str)("TEGULA_TARGET")


def _full(torch, batch, value):
    """A cached (batch,) int32 tensor of ``value`` (the default end / offset); kernels only read it."""
    key = (batch, value)
    t = _FULL.get(key)
    if t is None:
        if len(_FULL) > 64:
            _FULL.clear()
        t = _FULL[key] = torch.full((batch,), value, dtype=torch.int32)
    return t


def _fill_bits(torch, dtype, bits, value):
    """value_oob_fill_value rounded to the input dtype, as the signed integer of its bits."""
    key = ("fill", dtype, value)
    raw = _CACHE.get(key)
    if raw is None:
        raw = _CACHE[key] = int(torch.tensor([float(value)], dtype=dtype).view(getattr(torch, f"int{bits}"))[0])
    return raw


def _flags(torch):
    """This thread's (2,) int32 status words [a NaN row was seen, an end was out of range] and their numpy view.
    Kernels only ever set them; they are zero on entry because the call that sees one set clears it."""
    f = getattr(_LOCAL, "flags", None)
    if f is None:
        t = torch.zeros(2, dtype=torch.int32)
        f = _LOCAL.flags = (t, t.numpy())
    return f


def _specs(torch):
    """{input dtype: (key width in bits, bit pattern of +inf)}."""
    s = _CACHE.get("specs")
    if s is None:
        s = _CACHE["specs"] = {torch.bfloat16: (16, 0x7F80), torch.float16: (16, 0x7C00),
                               torch.float32: (32, 0x7F800000)}
    return s


def _current_target():
    """TEGULA_TARGET's target, else the best available one (resolved once per setting)."""
    setting = os.environ.get("TEGULA_TARGET")
    t = _TARGETS.get(setting)
    if t is None:
        from tegula.jit.targets import resolve
        t = _TARGETS[setting] = resolve(None).name
    return t


def _segments(batch, n) -> int:
    """How many segments each row is split into: one block per core when rows are fewer than cores. No more:
    each segment finds its own top k (its sampled threshold is looser the shorter it is): a 1M-element row in 4
    segments took 1.6x the CPU time of 2 segments at k = 2048 (1.1-1.2x at k = 512), measured on 2 cores."""
    threads = _threads()
    if batch >= threads or n < 2 * SPLIT_MIN_SEGMENT:
        return 1
    return max(1, min(math.ceil(threads / batch), n // SPLIT_MIN_SEGMENT))


def _threads() -> int:
    t = _CACHE.get("threads")
    if t is None:
        t = _CACHE["threads"] = _tk.threads()
    return t
