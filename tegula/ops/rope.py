"""``tegula.ops.rope``: rotary position embedding applied in place, kernels in T.*.

    from tegula.ops.rope import apply_rotary

``apply_rotary(query, cos_sin_cache, key=None, positions=None, interleaved=False, conjugate=False,
seqlen_offset=0) -> (query, key)``:

- query / key: (num_tokens, num_heads, head_dim) or (batch, seqlen, num_heads, head_dim), float32 / bfloat16 /
  float16, last dim contiguous (any token / head strides: a slice of a fused qkv tensor is rotated where it lies);
  key may have another number of heads. Both are rotated in place and returned.
- cos_sin_cache: (max_position, rot_dim), rot_dim even and <= head_dim: cos in the first rot_dim / 2 columns, sin in
  the rest (vLLM's layout). Only the first rot_dim dims of each head rotate.
- positions: int tensor of query.shape[:-2] (a position per token); None: the token's index in its sequence plus
  ``seqlen_offset`` (3-D input: one sequence).
- interleaved=False: NeoX pairing, dim i with dim i + rot_dim / 2; True: GPT-J pairing, dims 2i and 2i + 1. Pair i
  uses cos / sin column i.
- conjugate: rotate by -angle (the inverse rotation, for a backward pass).

Numerics: float32, x1' = x1 * cos - x2 * sin, x2' = x2 * cos + x1 * sin (two products, one sum each), rounded once
to the tensor's dtype.
"""
from __future__ import annotations

import tegula.language as T
from tegula.ops import _tk
from tegula.runtime import cpu

__all__ = ["apply_rotary"]

_DT = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}
STREAM_MIN = _tk.STREAM_MIN  # calls rotating at least this many values write them back with streaming stores


# hosts whose cores write a rotated run back better without streaming stores (by /proc/cpuinfo's vendor_id); every
# other host streams. Intel: a streaming store to a line the tile has just read (in place: always) first evicts that
# line, and on an Intel Xeon (2 cores, KVM) the streamed kernel took 1.37x the plain one's time (1 thread CPU time,
# 33.3 / 33.3 / 33.7 against 24.2 / 24.2 / 26.7 ms; 2 threads wall 16.2-17.4 against 12.3-13.0 ms; 18688 x 7168
# bf16 as (tokens, 16, 128), NeoX over 64 dims). On a Zen 4 the streaming copy came with the prefetch of da2cfdc
# (together 0.53x) and stays.
NO_STREAMING_IN_PLACE = frozenset({"GenuineIntel"})


def streams_in_place() -> bool:
    """Whether this host writes a rotated run back with streaming stores (see rope_kernel and
    NO_STREAMING_IN_PLACE)."""
    return cpu.host_vendor() not in NO_STREAMING_IN_PLACE


def rope_kernel(dtype, cache_dtype, D, R, interleaved, conjugate, use_pos, streaming=True, BT=16, HB=4):
    """X (tokens, heads, D) rotated in place in its first R dims; a block takes BT tokens, all heads (their cos / sin
    rows gathered once), token by token in tiles of HB heads. The token loop is pipelined: each tile's read is
    preceded by a prefetch of the next token's (a head's rotated dims are a few lines of its row, which the
    hardware prefetchers follow poorly). With ``streaming`` (the op passes streams_in_place()), where the rotated
    values of a call reach STREAM_MIN (bfloat16 / float32), each head's run is written back by a streaming copy
    (bfloat16: the prelude's converting copy)."""
    NTOK, NH = T.dynamic("num_tokens"), T.dynamic("num_heads")
    streams = streaming and dtype in ("bfloat16", "float32")
    ST, SH = T.dynamic("tok_stride"), T.dynamic("head_stride")
    NP, MAXP = T.dynamic("num_positions"), T.dynamic("max_position")
    R2 = R // 2
    sgn = -1.0 if conjugate else 1.0

    @T.prim_func
    def rope(X: T.StridedTensor((NTOK, NH, D), (ST, SH, 1), dtype), P: T.Tensor((NP,), "int32"),
             CS: T.Tensor((MAXP, R), cache_dtype), seqlen: T.int32, offset: T.int32):
        with T.Kernel(T.ceildiv(NTOK, BT)) as bt:
            t0 = bt * BT
            pos = T.alloc_fragment((BT,), "int32")
            cs = T.alloc_fragment((BT, R), "float32")
            x = T.alloc_fragment((HB, R), "float32")
            y = T.alloc_fragment((HB, R), "float32")
            for t in T.Parallel(BT):
                tok = T.min(t0 + t, NTOK - 1)
                p = P[T.min(tok, NP - 1)] if use_pos else tok % seqlen + offset
                pos[t] = T.clamp(p, 0, MAXP - 1)
            for t, i in T.Parallel(BT, R):
                cs[t, i] = CS[pos[t], i]
            stream = streams and NTOK >= (STREAM_MIN + NH * R - 1) // (NH * R)
            for t in T.Pipelined(BT, num_stages=2):  # token by token, HB heads a tile: the rows run along memory
                for hc in T.serial(T.ceildiv(NH, HB)):  # (a tile of BT tokens of one head strides by a token)
                    T.copy(X[t0 + t, hc * HB:hc * HB + HB, 0:R], x)
                    for hh, i in T.Parallel(HB, R2):
                        c = cs[t, i]
                        s = cs[t, R2 + i] * sgn
                        if interleaved:
                            x1, x2 = x[hh, 2 * i], x[hh, 2 * i + 1]
                            y[hh, 2 * i] = x1 * c - x2 * s
                            y[hh, 2 * i + 1] = x2 * c + x1 * s
                        else:
                            x1, x2 = x[hh, i], x[hh, R2 + i]
                            y[hh, i] = x1 * c - x2 * s
                            y[hh, R2 + i] = x2 * c + x1 * s
                    if stream:
                        for hh in T.serial(HB):
                            T.copy(y[hh, 0:R], X[t0 + t, hc * HB + hh, 0:R], eviction_policy="evict_first")
                    else:
                        T.copy(y, X[t0 + t, hc * HB:hc * HB + HB, 0:R])
    return rope


def _as_tokens(x, name):
    """(a (tokens, heads, head_dim) view of x to rotate, the tensor to copy it back into or None, seqlen)."""
    t = _tk.torch()
    _tk.check_tensor(x, name, (t.float32, t.bfloat16, t.float16), (3, 4))
    if x.stride(-1) != 1:
        raise ValueError(f"{name}: the last dim must be contiguous (stride 1), got strides {tuple(x.stride())}")
    if x.dim() == 3:
        return x, None, x.shape[0]
    b, s, nh, d = x.shape
    if b == 1 or s == 1 or x.stride(0) == s * x.stride(1):
        return x.as_strided((b * s, nh, d), (x.stride(1) if s > 1 else x.stride(0), x.stride(2), 1)), None, s
    tmp = x.contiguous()
    return tmp.view(b * s, nh, d), x, s


def _rotate(x, name, cs, pos, interleaved, conjugate, offset):
    xt, back, seqlen = _as_tokens(x, name)
    n, _, d = xt.shape
    if cs.shape[1] > d:
        raise ValueError(f"cos_sin_cache: rot_dim {cs.shape[1]} is larger than {name}'s head_dim {d}")
    if pos is not None and pos.shape[0] != n:
        raise ValueError(f"positions must have {n} entries (one per token of {name}), got {pos.shape[0]}")
    if xt.numel():
        t = _tk.torch()
        p = pos if pos is not None else t.zeros(1, dtype=t.int32)
        k = _tk.kernel(rope_kernel, _DT[str(x.dtype)], _DT[str(cs.dtype)], d, cs.shape[1], bool(interleaved),
                       bool(conjugate), pos is not None, streams_in_place())
        k(xt, p, cs, seqlen, offset)
    if back is not None:
        back.copy_(xt.view(back.shape))


def apply_rotary(query, cos_sin_cache, key=None, positions=None, interleaved: bool = False, conjugate: bool = False,
                 seqlen_offset: int = 0):
    """Rotate ``query`` (and ``key``) in place by the angles of ``cos_sin_cache`` at each token's position;
    returns ``(query, key)``. See the module docstring."""
    t = _tk.torch()
    _tk.check_tensor(cos_sin_cache, "cos_sin_cache", (t.float32, t.bfloat16, t.float16), 2)
    if cos_sin_cache.shape[1] % 2 or cos_sin_cache.shape[1] == 0:
        raise ValueError(f"cos_sin_cache: rot_dim must be even and positive, got {cos_sin_cache.shape[1]}")
    for v, n in ((interleaved, "interleaved"), (conjugate, "conjugate")):
        if not isinstance(v, bool):
            raise TypeError(f"{n} must be a bool, got {type(v).__name__}")
    offset = _tk.check_int(seqlen_offset, "seqlen_offset", lo=0)
    cs = cos_sin_cache.contiguous()
    _tk.check_tensor(query, "query", (t.float32, t.bfloat16, t.float16), (3, 4))
    if key is not None:
        _tk.check_tensor(key, "key", (t.float32, t.bfloat16, t.float16), (3, 4))
        if key.shape[:-2] != query.shape[:-2] or key.shape[-1] != query.shape[-1]:
            raise ValueError(f"key {tuple(key.shape)} must match query {tuple(query.shape)} but for the heads")
    pos = None
    if positions is not None:
        _tk.check_tensor(positions, "positions", (t.int32, t.int64))
        if tuple(positions.shape) != tuple(query.shape[:-2]):
            raise ValueError(f"positions must have shape {tuple(query.shape[:-2])}, got {tuple(positions.shape)}")
        if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= cs.shape[0]):
            raise ValueError(f"positions must lie in [0, {cs.shape[0]}) (cos_sin_cache's rows)")
        pos = positions.reshape(-1).to(t.int32).contiguous()
    elif query.numel():
        seqlen = query.shape[-3]
        if offset + seqlen > cs.shape[0]:
            raise ValueError(f"seqlen_offset + seqlen = {offset + seqlen} exceeds cos_sin_cache's {cs.shape[0]} rows")
    _rotate(query, "query", cs, pos, interleaved, conjugate, offset)
    if key is not None:
        _rotate(key, "key", cs, pos, interleaved, conjugate, offset)
    return query, key
