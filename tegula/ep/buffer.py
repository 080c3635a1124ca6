"""``tegula.ep.Buffer``: DeepEP's Buffer (normal and low-latency dispatch/combine) over shared memory between the
processes of one machine and torch.distributed between machines. See tegula/ep/__init__.py for the differences
from DeepEP."""
from __future__ import annotations

import contextlib

from tegula.ep import kernels, low_latency
from tegula.ep.event import Config, EventOverlap
from tegula.ep.layout import (
    Plan,
    combine_plan,
    dispatch_plan,
    dtype_code,
    exclusive,
    localise,
    send_tokens,
    token_layout,
)
from tegula.ep.shm import CTRL_BYTES
from tegula.ep.transport import OP_COMBINE, OP_DISPATCH, Comm, RowCodec

_PAGE = 4096


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class Buffer:
    """Expert-parallel communication buffers for MoE dispatch and combine, with DeepEP's ``Buffer`` API.

    ``group`` is a torch.distributed process group (None: the default group). Each rank owns one shared-memory
    segment of fixed maximum size: ``num_nvl_bytes`` for dispatch/combine (a third for each of two alternating
    dispatch receive slots, a third for combine), ``num_rdma_bytes`` for the low-latency calls. Segments are
    sparse: memory is taken only as rows land. ``transport`` picks how ranks reach each other: 'auto' (shared
    memory on one machine, torch.distributed across machines), 'shm', 'dist', or a world x world matrix of those.
    Every wait gives up after ``timeout_s`` seconds, naming the rank it waited for; a dead peer is noticed within
    about 10 ms.
    """

    num_sms: int = 20

    def __init__(self, group=None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False,
                 comm=None, *, transport=None, timeout_s: float = 60.0):
        import torch.distributed as dist
        if comm is not None:
            raise NotImplementedError("tegula.ep: an mpi4py communicator is not supported; pass a process group")
        if group is None:
            if not dist.is_initialized():
                raise ValueError("tegula.ep: Buffer needs a process group (torch.distributed is not initialized)")
            group = dist.group.WORLD
        for name, v in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"tegula.ep: {name} must be a non-negative int, got {v!r}")
        if not timeout_s > 0:
            raise ValueError(f"tegula.ep: timeout_s must be positive, got {timeout_s!r}")
        self.group, self.rank, self.group_size = group, group.rank(), group.size()
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode, self.explicitly_destroy, self.enable_shrink = low_latency_mode, explicitly_destroy, \
            enable_shrink
        self._nvl_third = num_nvl_bytes // 3 // _PAGE * _PAGE
        self._rdma_at = CTRL_BYTES + _round_up(num_nvl_bytes, _PAGE)
        size = self._rdma_at + _round_up(num_rdma_bytes, _PAGE)
        self._comm = Comm(group, transport, size, timeout_s)
        self._kinds, self._node_of = self._comm.kinds[self.rank], self._comm.node_of
        self._num_dispatches = self._num_ll_dispatches = 0
        self._zero_copy = None
        self._private = {}  # receive regions of a rank that receives outside shared memory
        self._launches = {}  # kernels bound to the window and the shapes of recent calls (kernels.dispatch_scatter)

    @property
    def transports(self) -> list[str]:
        """How this rank reaches each rank: 'self', 'shm' or 'dist'."""
        return list(self._kinds)

    def destroy(self) -> None:
        """Release the segments (views handed out keep their memory until they are dropped). Later calls raise."""
        if self._comm is not None:
            self._launches.clear()  # they hold views of the window
            self._comm.close()
            self._comm = None

    # DeepEP's static helpers ---------------------------------------------------------------------------------

    @staticmethod
    def is_sm90_compiled() -> bool:
        return False

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        if new_num_sms % 2:
            raise ValueError("the SM count must be even")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        return EventOverlap()

    def get_comm_stream(self):
        """DeepEP's communication stream: the current CUDA stream where CUDA is present (everything here runs in
        order on it), else None."""
        import torch
        return torch.cuda.current_stream() if torch.cuda.is_available() else None

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms, 6, 256, 6, 128)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms, 6, 256, 6, 128)

    @staticmethod
    def get_nvl_buffer_size_hint(num_max_tokens_per_rank: int, hidden_bytes: int, num_ranks: int,
                                 num_topk: int = 8) -> int:
        """``num_nvl_bytes`` enough for dispatch and combine of up to ``num_max_tokens_per_rank`` tokens per rank
        with rows of ``hidden_bytes`` (plus fp8 scales). Virtual: only the rows that land take memory."""
        import torch
        n = num_max_tokens_per_rank * num_ranks
        per = dispatch_plan(n, hidden_bytes + hidden_bytes // 32, torch.uint8, None, num_topk).nbytes
        return 3 * _round_up(per + _PAGE, _PAGE)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """``num_rdma_bytes`` for low-latency calls of this size: two receive slots and the combine rows."""
        slot = low_latency.slot_bytes(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)
        return 2 * slot + num_experts * num_max_dispatch_tokens_per_rank * hidden * 2

    def get_local_buffer_tensor(self, dtype, size=None, offset: int = 0, use_rdma_buffer: bool = False):
        """This rank's raw nvl (or rdma) region as a ``dtype`` tensor, from element ``offset``."""
        import torch
        if self._comm.shm is None or self.rank not in self._comm.shm.segs:
            raise RuntimeError("tegula.ep: this rank has no shared-memory segment (all its peers are remote)")
        start, nbytes = (self._rdma_at, self.num_rdma_bytes) if use_rdma_buffer else (CTRL_BYTES, self.num_nvl_bytes)
        t = self._comm.region(self.rank, start, nbytes, ((0, nbytes),)).view(dtype)[offset:]
        return t if size is None else t[:torch.Size(size).numel()].view(size)

    # layout ------------------------------------------------------------------------------------------------

    def get_dispatch_layout(self, topk_idx, num_experts: int, previous_event=None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False):
        """-> (num_tokens_per_rank [R] int32, num_tokens_per_rdma_rank [machines] int32 or None on one machine,
        num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool, event). Local; no communication."""
        self._check_topk(topk_idx, num_experts, "get_dispatch_layout")
        per_rank, per_node, per_expert, in_rank = token_layout(topk_idx, num_experts, self.group_size,
                                                               self._node_of)
        return per_rank, per_node, per_expert, in_rank, EventOverlap()

    # normal dispatch / combine -----------------------------------------------------------------------------

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config=None, previous_event=None,
                 async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Send each token to every rank that owns one of its experts.

        ``x``: [T, H] (any float dtype; DeepEP's is bf16), or (fp8 [T, H], scales [T, S]). Returns (recv_x,
        recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event). Received rows are
        grouped by source rank in rank order, in token order within a rank. recv_topk_idx holds this rank's local
        expert ids and -1 for other ranks' experts (weight 0); the per-expert counts are rounded up to
        ``expert_alignment``. ``num_worst_tokens`` > 0 pads the outputs to that many rows (-1 top-k ids) and
        returns an empty list. With ``handle`` (from an earlier dispatch) the layout is reused and only x moves:
        (recv_x, None, None, None, None, event).

        recv_x and the top-k outputs are views of this rank's segment: they stay valid until two more dispatches
        on this Buffer (DeepEP returns fresh tensors).
        """
        with self._op("dispatch"):
            return self._dispatch(x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                                  topk_weights, expert_alignment, num_worst_tokens)

    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Send each received row back to its source and sum: combined_x[t] = bias terms + the rows returned for
        token t, added in float32 in rank order and rounded once to x's dtype. ``x``: [N, H] rows in recv_x's
        order; ``topk_weights`` [N, K] are summed the same way; ``bias``: a [T, H] tensor or a pair of them.
        Returns (combined_x [T, H], combined_topk_weights [T, K] or None, event)."""
        with self._op("combine"):
            return self._combine(x, handle, topk_weights, bias)

    # low latency -------------------------------------------------------------------------------------------

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Nothing to clean: counts are exchanged every call, no buffer state carries over."""

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False):
        """Send each (token, expert) pair to the expert's rank, laid out per local expert.

        Returns (recv_x, recv_count, handle, event, hook). recv_x is [E_local, R*M, H] bf16, or with ``use_fp8``
        (fp8 [E_local, R*M, H], scales [E_local, R*M, H/128] float32 column-major; with ``use_ue8m0`` int32
        [E_local, R*M, H/512] of packed UE8M0 exponents). For local expert j the first recv_count[j] rows are
        valid: source ranks in rank order, tokens ascending within one; handle = (src_info [E_local, R*M] int32
        source token ids, layout_range [E_local, R] int64 (begin << 32 | count), M, H, E). fp8 casting is
        per token and 128 channels (amax clamped to 1e-4 maps to 448). Views of the segment, valid until two more
        low-latency dispatches. The hook has nothing to wait for; ``dispatch_wait_recv_cost_stats`` is not
        filled in.
        """
        with self._op("low_latency_dispatch"):
            return low_latency.dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                        cumulative_local_expert_recv_stats, use_fp8, round_scale, use_ue8m0)

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False, return_recv_hook: bool = False,
                            out=None, combine_wait_recv_cost_stats=None):
        """Send the expert outputs back and reduce with weights at the token's own rank: combined_x[t] =
        sum_k topk_weights[t, k] * (expert topk_idx[t, k]'s row for t), float32 in k order, rounded once to bf16
        (-1 entries add nothing). ``x``: [E_local, R*M, H] bf16 in recv_x's layout (``zero_copy``: the tensor
        from get_next_low_latency_combine_buffer instead). ``use_logfmt`` is accepted and ignored (rows move as
        bf16, exactly). Returns (combined_x [T, H], event, hook)."""
        with self._op("low_latency_combine"):
            if zero_copy:
                if self._zero_copy is None:
                    raise ValueError("tegula.ep: zero_copy=True without get_next_low_latency_combine_buffer()")
                x = self._zero_copy
            return low_latency.combine(self, x, topk_idx, topk_weights, handle, out)

    def get_next_low_latency_combine_buffer(self, handle):
        """A [E_local, R*M, H] bf16 tensor to write expert outputs into for ``low_latency_combine(zero_copy=True)``."""
        import torch
        _, _, m, hidden, num_experts = handle
        shape = (num_experts // self.group_size, self.group_size * m, hidden)
        if self._zero_copy is None or tuple(self._zero_copy.shape) != shape:
            self._zero_copy = torch.empty(shape, dtype=torch.bfloat16)
        return self._zero_copy

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False):
        raise NotImplementedError("tegula.ep: rank masking (enable_shrink) is not supported")

    low_latency_query_mask_buffer = low_latency_clean_mask_buffer = low_latency_update_mask_buffer

    # internals ---------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _op(self, what: str):
        if self._comm is None:
            raise RuntimeError("tegula.ep: the Buffer has been destroyed")
        self._comm.check(what)
        try:
            yield
        except BaseException as e:  # the peers are inside the same collective: tell them, then raise here
            self._comm.abort(what, e)
            raise

    def _check_topk(self, topk_idx, num_experts, what):
        import torch
        if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2 or topk_idx.dtype != torch.int64:
            raise TypeError(f"tegula.ep: {what}: topk_idx must be a [num_tokens, num_topk] int64 tensor")
        if not isinstance(num_experts, int) or num_experts <= 0 or num_experts % self.group_size:
            raise ValueError(f"tegula.ep: {what}: num_experts={num_experts!r} must be a positive multiple of the "
                             f"{self.group_size} ranks")
        if topk_idx.numel() and (int(topk_idx.min()) < -1 or int(topk_idx.max()) >= num_experts):
            raise ValueError(f"tegula.ep: {what}: topk_idx entries must lie in [-1, {num_experts})")

    def _exchange(self, what: str, header: list, names: tuple, extra, device):
        """Enter the operation: trade ``header`` (which every rank must agree on, field by field) and ``extra``
        (per-rank values such as counts: a list, or a 1-D numpy array). Returns the int64 matrix [ranks,
        len(header) + len(extra)]."""
        import numpy as np
        meta = np.empty(len(header) + len(extra), dtype=np.int64)
        meta[:len(header)] = header
        meta[len(header):] = extra
        m = self._comm.exchange(what, meta, device)
        differ = m[:, :len(names)] != m[self.rank, :len(names)]
        if differ.any():
            bad, c = (int(v[0]) for v in differ.T.nonzero()[::-1])  # the first field that differs, its first rank
            raise ValueError(f"tegula.ep: {what}: rank {bad} has {names[c]}={m[bad, c]} but rank {self.rank} "
                             f"has {m[self.rank, c]} (every rank must make the same call)")
        return m

    def _storage(self, rank, offset, capacity, plan: Plan, device, spans, what):
        """``rank``'s arrays of ``plan`` at ``offset`` of its segment, after reserving the byte ``spans`` about to
        be written there; or fresh tensors, for this rank when it receives outside shared memory."""
        import torch
        shm = self._comm.shm
        if device.type != "cpu" or shm is None or rank not in shm.segs:  # this rank's own, outside shared memory:
            key = (offset, str(device))  # one buffer per region, reused like the segment's
            have = self._private.get(key)
            if have is None or have.numel() < plan.nbytes:
                have = self._private[key] = torch.empty(plan.nbytes, dtype=torch.uint8, device=device)
            return plan.views(have[:plan.nbytes])
        if plan.nbytes > capacity:
            raise ValueError(f"tegula.ep: {what}: rank {rank} must receive {plan.nbytes} bytes but its region holds "
                             f"{capacity}; make the Buffer larger (see Buffer.get_nvl_buffer_size_hint and "
                             "get_low_latency_rdma_size_hint)")
        at = self._comm.place(rank, offset, plan.nbytes, spans)
        if at % 8:  # not where every array's elements can start (an offset not made by this Buffer)
            return plan.views(shm.bytes(rank, offset, plan.nbytes))
        return plan.views_in(shm.typed, at)

    def _places(self, rank, offset, capacity, plan: Plan, device, spans, what, reserve: bool = True):
        """Where ``rank``'s arrays of ``plan`` at ``offset`` begin, in bytes from the start of ``_region_of(offset,
        device)``: {name: byte offset}. As ``_storage`` (whose checks it makes, reserving ``spans`` unless told
        not to: ``_storage`` did it for this rank), without making the views."""
        shm = self._comm.shm
        at = 0  # this rank's own buffer, outside shared memory: its arrays from its start
        if device.type == "cpu" and shm is not None and rank in shm.segs:
            if plan.nbytes > capacity:
                self._storage(rank, offset, capacity, plan, device, spans, what)  # raises
            at = self._comm.place(rank, offset, plan.nbytes, spans if reserve else ())
        return {name: at + off for name, (off, _, _, _) in plan.fields.items()}

    def _region_of(self, offset, device):
        """The uint8 tensor holding every region this rank writes at ``offset``: the window of this machine's
        segments, or this rank's own buffer where it receives outside shared memory."""
        shm = self._comm.shm
        if device.type == "cpu" and shm is not None and self.rank in shm.segs:
            return shm.win
        return self._private.get((offset, str(device)))

    def _move(self, what, device, offset, capacity, plans, spans, write, fields, payload, n_send, n_recv, place,
              write_all=None):
        """One operation's data movement. Each rank r this rank shares memory with gets ``write(views, r)`` into
        its ``plans[r]`` arrays at ``offset`` (``spans(r)``: the byte ranges written there); or, if
        ``write_all({r: _places of r's arrays})`` returns True, all of them at once. Ranks reached through
        torch.distributed get ``payload(r)`` (n_send[r] rows of ``fields``) in one all_to_all_single, and the
        n_recv[s] rows from rank s go through ``place(mine, s, arrays)``. Returns this rank's arrays once every
        sender has delivered."""
        me = self.rank
        mine = self._storage(me, offset, capacity, plans[me], device, spans(me), what)
        local = self._comm.local(device)
        # the kernel writing every receiver at once needs only where their arrays are: no views of the peers' made
        if write_all is None or not write_all({r: self._places(r, offset, capacity, plans[r], device, spans(r), what,
                                                               r != me) for r in local}):
            dests = {r: mine if r == me else self._storage(r, offset, capacity, plans[r], device, spans(r), what)
                     for r in local}
            for r, views in dests.items():
                write(views, r)
        if self._comm.any_dist(device):
            far = self._comm.remote(device)
            codec = RowCodec(fields)
            recv = [int(n_recv[s]) if s in far else 0 for s in range(self.group_size)]
            got = self._comm.all_to_all(codec.pack([payload(r) for r in far], device),
                                        [int(n_send[r]) if r in far else 0 for r in range(self.group_size)], recv,
                                        codec.row_bytes)
            at = 0
            for s in far:
                if recv[s]:
                    place(mine, s, codec.unpack(got[at:at + recv[s]]))
                    at += recv[s]
        self._comm.deliver(what, device)
        return mine

    def _dispatch(self, x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                  topk_weights, expert_alignment, num_worst_tokens):
        import numpy as np
        import torch
        x, x_scales = x if isinstance(x, tuple) else (x, None)
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise TypeError("tegula.ep: dispatch: x must be a [num_tokens, hidden] tensor or (x, x_scales)")
        t, hidden = x.shape
        r_n, me = self.group_size, self.rank
        if x_scales is not None and (x_scales.dim() != 2 or x_scales.shape[0] != t or x_scales.element_size() != 4):
            raise TypeError(f"tegula.ep: dispatch: x_scales must be [{t}, S] with 4-byte elements")
        cached = handle is not None
        if cached:
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("tegula.ep: dispatch with a handle takes no topk_idx / topk_weights")
            if not isinstance(handle, tuple) or len(handle) != 6:
                raise TypeError("tegula.ep: dispatch: handle must be the 6-tuple an earlier dispatch returned")
            is_token_in_rank = handle[4]
        elif num_tokens_per_rank is None or is_token_in_rank is None or num_tokens_per_expert is None:
            raise ValueError("tegula.ep: dispatch needs num_tokens_per_rank, is_token_in_rank and "
                             "num_tokens_per_expert (from get_dispatch_layout), or a handle")
        if is_token_in_rank.dtype != torch.bool or tuple(is_token_in_rank.shape) != (t, r_n):
            raise TypeError(f"tegula.ep: dispatch: is_token_in_rank must be a [{t}, {r_n}] bool tensor")
        if cached and (not isinstance(handle[5], torch.Tensor) or handle[5].dtype != torch.int32
                       or tuple(handle[5].shape) != (t, r_n)):
            raise TypeError("tegula.ep: dispatch: the handle's send_head is not the [num_tokens, num_ranks] int32 "
                            "tensor an earlier dispatch returned")
        if (topk_idx is None) != (topk_weights is None):
            raise ValueError("tegula.ep: dispatch: pass topk_idx and topk_weights together")
        k = 0 if topk_idx is None else topk_idx.shape[-1]
        if k and (topk_idx.dtype != torch.int64 or tuple(topk_idx.shape) != (t, k)
                  or topk_weights.dtype != torch.float32 or tuple(topk_weights.shape) != (t, k)):
            raise TypeError(f"tegula.ep: dispatch: topk_idx [{t}, K] int64 and topk_weights [{t}, K] float32")
        if not isinstance(expert_alignment, int) or expert_alignment < 1:
            raise ValueError(f"tegula.ep: dispatch: expert_alignment must be a positive int, got {expert_alignment!r}")
        # where each token goes (the handle's, when repeating a layout), and how many go to each rank
        send_head, sent = (handle[5], is_token_in_rank.sum(0)) if cached else kernels.send_head(is_token_in_rank)
        if num_tokens_per_rank is not None and not torch.equal(num_tokens_per_rank.to(sent), sent):
            raise ValueError("tegula.ep: dispatch: num_tokens_per_rank does not match is_token_in_rank")
        n_exp = 0 if cached else num_tokens_per_expert.numel()
        if n_exp % r_n:
            raise ValueError(f"tegula.ep: dispatch: {n_exp} experts do not split over {r_n} ranks")
        scales = (x_scales.shape[1], x_scales.dtype) if x_scales is not None else None
        m = self._exchange("dispatch", [
            OP_DISPATCH, hidden, dtype_code(x.dtype), scales[0] if scales else 0,
            dtype_code(scales[1]) if scales else -1, k, num_worst_tokens, int(cached), n_exp],
            ("operation", "hidden", "x dtype", "scale columns", "scale dtype", "num_topk", "num_worst_tokens",
             "cached", "num_experts"),
            sent.cpu().numpy() if cached else np.concatenate((sent.cpu().numpy(), num_tokens_per_expert.cpu().numpy())),
            x.device)
        counts = m[:, 9:9 + r_n]  # counts[s, r]: the rows s sends r
        prefix = counts.cumsum(0)
        if cached and (prefix != handle[0].cpu().numpy()).any():
            raise ValueError("tegula.ep: dispatch: the handle does not match is_token_in_rank on every rank")
        recv = prefix[-1]
        if num_worst_tokens and recv.max() > num_worst_tokens:
            raise ValueError(f"tegula.ep: dispatch: rank {int(recv.argmax())} receives {int(recv.max())} tokens, more "
                             f"than num_worst_tokens={num_worst_tokens}")
        plans = [dispatch_plan(num_worst_tokens or int(n), hidden, x.dtype, scales, k) for n in recv]
        slot = self._num_dispatches % 2
        self._num_dispatches += 1

        tokens = []  # the tokens sent to each rank, only where rows are gathered (torch.distributed, no kernel)
        x_c = x.contiguous()
        s_c = x_scales.contiguous() if x_scales is not None else None
        ti_c, tw_c = (topk_idx.contiguous(), topk_weights.contiguous()) if k else (None, None)
        n_local = n_exp // r_n
        start = exclusive(prefix)  # start[s, r]: where rank s's rows begin at rank r

        def payload(r):  # what this rank sends r, row for row; (tensor, rows) pairs are gathered on the way
            if not tokens:
                tokens.extend(send_tokens(is_token_in_rank))
            tok = tokens[r]
            out = {"x": (x_c, tok), "src_idx": tok}
            if s_c is not None:
                out["x_scales"] = (s_c, tok)
            if k:
                out["topk_idx"], out["topk_weights"] = localise(topk_idx[tok], topk_weights[tok], r * n_local, n_local)
            return out

        def place(mine, s, rows):
            for f, v in rows.items():
                mine[f][start[s, me]:start[s, me] + v.shape[0]].copy_(v)

        offset = CTRL_BYTES + slot * self._nvl_third

        def write_all(dests):  # every receiver here in one pass over the tokens: rows, scales, local top-k, ids
            return kernels.dispatch_scatter(x_c, s_c, ti_c, tw_c, send_head, self._region_of(offset, x.device),
                                            {r: (p, int(start[me, r])) for r, p in dests.items()}, n_local,
                                            self._launches)

        mine = self._move(
            "dispatch", x.device, offset, self._nvl_third, plans,
            lambda r: [plans[r].span(f, start[me, r], start[me, r] + counts[me, r]) for f in plans[r].fields],
            lambda views, r: _write_rows(views, payload(r), int(start[me, r])),
            [(f, shape[1:], dtype) for f, (_, shape, dtype, _) in plans[me].fields.items()],
            payload, counts[me], counts[:, me], place, write_all)

        recv_x = mine["x"] if x_scales is None else (mine["x"], mine["x_scales"])
        if cached:
            return recv_x, None, None, None, None, EventOverlap()
        if k and num_worst_tokens:
            mine["topk_idx"][int(recv[me]):] = -1
            mine["topk_weights"][int(recv[me]):] = 0
        per_expert = [] if num_worst_tokens else (
            -(-m[:, 9 + r_n + me * n_local:9 + r_n + (me + 1) * n_local].sum(0) // expert_alignment)
            * expert_alignment).tolist()
        # one "channel": channel_prefix_matrix [R, 1] holds what this rank sends each rank, the recv one what each
        # rank sends it
        handle = (torch.from_numpy(prefix.astype("int32")), torch.from_numpy(counts[me].astype("int32").reshape(-1, 1)),
                  torch.from_numpy(counts[:, me].astype("int32").reshape(-1, 1)),
                  mine["src_idx"][:int(recv[me])].clone(), is_token_in_rank, send_head)
        return recv_x, mine.get("topk_idx"), mine.get("topk_weights"), per_expert, handle, EventOverlap()

    def _combine(self, x, handle, topk_weights, bias):
        import torch
        if not isinstance(handle, tuple) or len(handle) != 6:
            raise TypeError("tegula.ep: combine: handle must be the 6-tuple dispatch returned")
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise TypeError("tegula.ep: combine: x must be a [num_recv_tokens, hidden] tensor")
        rank_prefix, _, _, _, is_token_in_rank, send_head = handle
        r_n, me = self.group_size, self.rank
        prefix = rank_prefix.cpu().numpy().astype("int64")
        counts = prefix - exclusive(prefix)
        t, hidden = is_token_in_rank.shape[0], x.shape[1]
        if x.shape[0] < prefix[-1, me]:
            raise ValueError(f"tegula.ep: combine: x has {x.shape[0]} rows, this rank received {prefix[-1, me]}")
        k = 0
        if topk_weights is not None:
            if topk_weights.dim() != 2 or topk_weights.shape[0] < prefix[-1, me] or \
                    topk_weights.dtype != torch.float32:
                raise TypeError("tegula.ep: combine: topk_weights must be [num_recv_tokens, K] float32")
            k = topk_weights.shape[1]
        biases = () if bias is None else (bias,) if isinstance(bias, torch.Tensor) else tuple(bias)
        if len(biases) > 2 or any(tuple(b.shape) != (t, hidden) or b.dtype != x.dtype for b in biases):
            raise ValueError(f"tegula.ep: combine: bias must be one or two [{t}, {hidden}] {x.dtype} tensors")
        x_c = x.contiguous()
        w_c = topk_weights.contiguous() if k else None
        x_at = self._comm.window_offset(x_c)  # x inside this rank's segment: the owners read it there
        m = self._exchange("combine", [OP_COMBINE, hidden, dtype_code(x.dtype), k],
                           ("operation", "hidden", "x dtype", "num_topk"), [-1 if x_at is None else x_at], x.device)
        kinds = self._comm.kinds

        def in_place(r, s):  # whether rank s reads rank r's rows where they are, instead of r copying them over
            return r != s and m[r, 4] >= 0 and kinds[s][r] == "shm"

        # rank s gets back the rows of every other rank r, in rank order; block r starts at back[s][r]
        back = [[int(sum(counts[s, q] for q in range(r) if q != s)) for r in range(r_n)] for s in range(r_n)]
        plans = [combine_plan(int(counts[s].sum() - counts[s, s]), hidden, x.dtype, k) for s in range(r_n)]
        first = exclusive(prefix)  # first[s, r]: the rows rank r received from rank s begin at its x[first[s, r]]

        def payload(s):  # (tensor, rows) entries are copied by a kernel (streaming stores) or gathered
            a, n = int(first[s, me]), int(counts[s, me])
            out = {} if in_place(me, s) else {"x": (x_c, torch.arange(a, a + n, dtype=torch.int32, device=x.device))}
            if k:
                out["topk_weights"] = w_c[a:a + n]
            return out

        def spans(s):
            row0, n = back[s][me], counts[s, me]
            return [] if s == me else [plans[s].span(f, row0, row0 + n) for f in payload(s)]

        def write(views, s):
            if s != me:
                _write_rows(views, payload(s), back[s][me])

        def place(mine, r, rows):
            for f, v in rows.items():
                mine[f][back[me][r]:back[me][r] + v.shape[0]].copy_(v)

        mine = self._move("combine", x.device, CTRL_BYTES + 2 * self._nvl_third, self._nvl_third, plans, spans, write,
                          [(f, shape[1:], dtype) for f, (_, shape, dtype, _) in plans[me].fields.items()],
                          payload, counts[:, me], counts[me], place)

        # token t's rows, in rank order: its own at x[first[me, me] + send_head[t, me]], the others' where they
        # came back to, or in place in their segments; flat element offsets into the window (or what arrived)
        window = self._comm.shm.win.view(x.dtype) if self._comm.window_offset(mine["x"]) is not None else None
        flat = window if window is not None else mine["x"].view(-1)
        es, na = x.element_size(), x_c.shape[0]
        here = (self._comm.window_offset(mine["x"]) // es) if window is not None else 0
        offs = [int(first[me, me]) if r == me else
                na + int(m[r, 4]) // es + int(first[me, r]) * hidden if in_place(r, me) else
                na + here + back[me][r] * hidden for r in range(r_n)]
        scale = torch.tensor([1 if r == me else hidden for r in range(r_n)], dtype=torch.int64, device=x.device)
        head = send_head.long()
        idx = torch.where(head >= 0, head * scale + torch.tensor(offs, dtype=torch.int64, device=x.device), -1)
        combined = kernels.gather_sum(x_c, flat, idx, None, tuple(b.contiguous() for b in biases))
        combined_w = None
        if k:
            w_offs = torch.tensor([int(first[me, me]) if r == me else w_c.shape[0] + back[me][r] * k
                                   for r in range(r_n)], dtype=torch.int64, device=x.device)
            w_idx = torch.where(head >= 0, head * torch.where(scale == 1, 1, k) + w_offs, -1)
            combined_w = kernels.gather_sum(w_c, mine["topk_weights"].view(-1), w_idx)
        read_from = [r for r in range(r_n) if in_place(r, me)]
        read_by = [s for s in range(r_n) if in_place(me, s)]
        if read_from or read_by:
            self._comm.release("combine", read_from, read_by)
        return combined, combined_w, EventOverlap()


def _write_rows(views, payload, row0: int):
    """One sender's rows into a receiver's arrays from ``row0``; (tensor, rows) entries are gathered on the way."""
    import torch
    for f, v in payload.items():
        if isinstance(v, tuple):
            src, tok = v
            dst = torch.arange(row0, row0 + tok.numel(), dtype=torch.int32, device=tok.device)
            kernels.copy_rows(src, tok, dst, views[f])
        else:
            views[f][row0:row0 + v.shape[0]].copy_(v)
