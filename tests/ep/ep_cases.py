"""The checks tests/ep runs inside every rank of a world (see ep_worker.py). Each case is collective: every rank
runs it, compares tegula.ep against the plain torch.distributed reference in ep_reference.py, and raises on a
mismatch."""
import os
import signal
import time

import ep_reference as ref
import torch

from tegula.ep import Buffer
from tegula.ep.shm import PeerFailure

SEGMENTS = set()  # the shared-memory names this rank's Buffers created: the parent checks none is left
H, E, K, M = 256, 16, 4, 64  # hidden, experts, top-k, low-latency max tokens per rank


def make(**kw):
    kw.setdefault("num_nvl_bytes", 8 << 20)
    kw.setdefault("num_rdma_bytes", Buffer.get_low_latency_rdma_size_hint(M, 512, kw.pop("world", 4), 4 * E))
    kw.setdefault("timeout_s", 20)
    buf = Buffer(ref.GROUP, **kw)
    shm = buf._comm.shm
    if shm is not None and buf.rank in shm.segs:
        SEGMENTS.add(shm.segs[buf.rank].path)
    return buf


def inputs(rank, tokens=None, hidden=H, experts=E, seed=0, skip_ranks=(), world=None):
    """Random tokens (a different count on every rank), their top-k experts with some -1 entries, weights."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    t = 30 + 7 * rank if tokens is None else tokens
    x = torch.randn((t, hidden), generator=g).to(torch.bfloat16)
    scores = torch.rand((t, experts), generator=g)
    for r in skip_ranks:  # nobody picks these ranks' experts
        per = experts // world
        scores[:, r * per:(r + 1) * per] = -1
    topk = scores.topk(K, dim=1).indices
    topk[::5, K - 1] = -1
    topk[::7, 0] = -1
    return x, topk, torch.rand((t, K), generator=g)


def dispatch(buf, x, topk, w, experts=E, **kw):
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, experts)
    return buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                        topk_idx=topk, topk_weights=w, **kw)


def check_dispatch(out, want, alignment=1):
    recv_x, recv_idx, recv_w, per_expert, handle, event = out
    if isinstance(recv_x, tuple):
        assert torch.equal(recv_x[0].view(torch.uint8), want["x"].view(torch.uint8))
        assert torch.equal(recv_x[1], want["scales"])
    else:
        assert torch.equal(recv_x, want["x"]), "received rows differ from the reference"
    assert torch.equal(recv_idx, want["topk_idx"]), "recv_topk_idx"
    assert torch.equal(recv_w, want["topk_weights"]), "recv_topk_weights"
    assert per_expert == [-(-c // alignment) * alignment for c in want["per_expert"]], (per_expert, want["per_expert"])
    assert torch.equal(handle[0], want["rank_prefix_matrix"]), (handle[0], want["rank_prefix_matrix"])
    assert torch.equal(handle[3], torch.tensor([t for _, t in want["src"]], dtype=torch.int32))
    event.current_stream_wait()


def roundtrip(rank, buf, **kw):
    """Dispatch, then combine expert outputs with top-k weights, one bias and two biases; all against the
    reference, combine exactly and within DeepEP's 5e-6."""
    x, topk, w = inputs(rank, **kw)
    want = ref.dispatch(x, topk, w, E)
    out = dispatch(buf, x, topk, w)
    check_dispatch(out, want)
    recv_x, _, recv_w, _, handle, _ = out
    y = (recv_x.float() * (rank + 1) + 0.25).to(torch.bfloat16)  # "expert outputs"
    combined, combined_w, _ = buf.combine(y, handle, recv_w)
    want_x, want_w = ref.combine(y, want["src"], x.shape[0], weights=want["topk_weights"])
    assert ref.calc_diff(combined, want_x) < 5e-6 and torch.equal(combined, want_x), "combine"
    assert torch.equal(combined_w, want_w), "combined top-k weights"
    g = torch.Generator().manual_seed(rank)
    b0, b1 = (torch.randn((x.shape[0], H), generator=g).to(torch.bfloat16) for _ in range(2))
    for bias in ((b0,), (b0, b1)):
        combined, combined_w, _ = buf.combine(y, handle, bias=bias[0] if len(bias) == 1 else bias)
        want_x, _ = ref.combine(y, want["src"], x.shape[0], bias=bias)
        assert torch.equal(combined, want_x) and combined_w is None, f"combine with {len(bias)} bias"
    combined, _, _ = buf.combine(recv_x, handle)  # DeepEP's own check: combining x gives x times its fan-out
    fan_out = handle[4].sum(1, keepdim=True).clamp(min=1)
    assert ref.calc_diff(combined.float() / fan_out, x.float() * (fan_out > 0)) < 5e-6
    # recv_x itself lives in the segment: the owners read it in place
    combined, combined_w, _ = buf.combine(recv_x, handle, recv_w, bias=b0)
    want_x, want_w = ref.combine(recv_x, want["src"], x.shape[0], bias=(b0,), weights=want["topk_weights"])
    assert torch.equal(combined, want_x) and torch.equal(combined_w, want_w), "combine of recv_x in place"


def ll_roundtrip(rank, buf, tokens=None, skip_ranks=(), world=None):
    x, topk, w = inputs(rank, tokens=tokens, skip_ranks=skip_ranks, world=world)
    want_x, counts, layout_range, src_info = ref.ll_dispatch(x, topk, M, E)
    stats = torch.zeros(counts.shape, dtype=torch.int32)
    recv_x, recv_count, handle, event, hook = buf.low_latency_dispatch(
        x, topk, M, E, cumulative_local_expert_recv_stats=stats, use_fp8=False, return_recv_hook=True)
    hook()
    assert torch.equal(recv_count, counts) and torch.equal(handle[1], layout_range) and torch.equal(stats, counts)
    for j, n in enumerate(counts.tolist()):
        assert torch.equal(recv_x[j, :n], want_x[j, :n]), f"low-latency rows of local expert {j}"
        assert handle[0][j, :n].tolist() == src_info[j]
    y = (recv_x.float() * (rank + 1) - 0.5).to(torch.bfloat16)
    want = ref.ll_combine(y, topk, w, E)
    out = torch.empty((x.shape[0], H), dtype=torch.bfloat16)
    combined, event, hook = buf.low_latency_combine(y, topk, w, handle, out=out)
    hook()
    assert combined is out and torch.equal(combined, want), f"low-latency combine ({ref.calc_diff(combined, want)})"
    buf.get_next_low_latency_combine_buffer(handle).copy_(y)
    combined, _, _ = buf.low_latency_combine(y, topk, w, handle, zero_copy=True)
    assert torch.equal(combined, want), "zero-copy low-latency combine"


def case_layout(rank, world):
    buf = make(world=world)
    for experts in (E, 4 * world):
        x, topk, w = inputs(rank, experts=experts)
        per_rank, per_node, per_expert, in_rank, event = buf.get_dispatch_layout(topk, experts)
        want_rank, want_expert, want_in = ref.layout(topk, experts, world)
        assert per_rank.dtype == per_expert.dtype == torch.int32 and in_rank.dtype == torch.bool
        assert torch.equal(per_rank, want_rank) and torch.equal(per_expert, want_expert)
        assert torch.equal(in_rank, want_in) and per_node is None
        event.current_stream_wait()


def case_dispatch_combine(rank, world):
    buf = make(world=world)
    assert buf.transports == ["self" if r == rank else "shm" for r in range(world)], buf.transports
    roundtrip(rank, buf)


def case_fp8_dispatch(rank, world):
    buf = make(world=world)
    x, topk, w = inputs(rank)
    q, scales = ref.cast_to_fp8(x)
    scales_cm = scales.T.contiguous().T  # column-major scales, as DeepEP's tests pass them
    want = ref.dispatch(q.view(torch.uint8), topk, w, E, scales=scales)
    check_dispatch(dispatch(buf, (q, scales_cm), topk, w), want)


def case_alignment_cached_worst(rank, world):
    buf = make(world=world)
    x, topk, w = inputs(rank)
    want = ref.dispatch(x, topk, w, E)
    first = dispatch(buf, x, topk, w, expert_alignment=4)
    check_dispatch(first, want, alignment=4)
    cached = buf.dispatch(x * 2, handle=first[4])  # the layout is reused, only x moves
    assert cached[1:5] == (None, None, None, None)
    assert torch.equal(cached[0], want["x"] * 2), "cached dispatch"
    worst = 40 * world + 3
    padded = dispatch(buf, x, topk, w, num_worst_tokens=worst)
    n = want["x"].shape[0]
    assert padded[0].shape[0] == worst and padded[3] == [] and torch.equal(padded[0][:n], want["x"])
    assert torch.equal(padded[1][:n], want["topk_idx"]) and bool((padded[1][n:] == -1).all())
    # two alternating receive slots: a dispatch's outputs survive the next dispatch
    a = dispatch(buf, x, topk, w)
    x2, topk2, w2 = inputs(rank, seed=1)
    b = dispatch(buf, x2, topk2, w2)
    assert torch.equal(a[0], want["x"]) and torch.equal(b[0], ref.dispatch(x2, topk2, w2, E)["x"])


def case_receives_nothing(rank, world):
    """Rank 0 has no tokens at all and nobody picks the last rank's experts."""
    buf = make(world=world)
    t = 0 if rank == 0 else None
    roundtrip(rank, buf, tokens=t, skip_ranks=(world - 1,), world=world)
    ll_roundtrip(rank, buf, tokens=t, skip_ranks=(world - 1,), world=world)


def case_one_rank(rank, world):
    """A world of one: everything stays local."""
    buf = make(world=world)
    assert buf.transports == ["self"]
    roundtrip(rank, buf)
    ll_roundtrip(rank, buf)


def case_api(rank, world):
    """DeepEP's helpers and events; wrong arguments raise TypeError / ValueError before anything moves."""
    import tegula.ep as ep
    assert ep.topk_idx_t is torch.int64
    event = Buffer.capture()
    event.current_stream_wait()
    with event:
        pass
    assert isinstance(Buffer.get_dispatch_config(8), ep.Config) and ep.Config().get_nvl_buffer_size_hint(14336, 8) > 0
    for bad in ("bogus", [["shm"]] * 2):
        try:
            make(world=world, transport=bad)
        except ValueError:
            pass
        else:
            raise AssertionError(f"transport={bad!r} was accepted")
    x, topk, w = inputs(rank)
    calls = [lambda b: dispatch(b, x, topk.int(), w),  # top-k ids must be int64
             lambda b: dispatch(b, x, topk, w, expert_alignment=0),
             lambda b: b.dispatch(x, num_tokens_per_rank=torch.zeros(world, dtype=torch.int32)),
             lambda b: b.low_latency_dispatch(x, topk, x.shape[0] - 1, E),  # more tokens than the maximum
             lambda b: b.low_latency_dispatch(x, topk, M, E, use_fp8=True, use_ue8m0=True)]  # ue8m0 needs rounding
    for call in calls:
        try:
            call(make(world=world))
        except (TypeError, ValueError):
            pass
        else:
            raise AssertionError("a bad call was accepted")
    buf = make(world=world)
    buf.destroy()
    try:
        dispatch(buf, x, topk, w)
    except RuntimeError as e:
        assert "destroyed" in str(e)
    else:
        raise AssertionError("a destroyed Buffer accepted a call")


def case_low_latency(rank, world):
    buf = make(world=world, low_latency_mode=True)
    ll_roundtrip(rank, buf)


def case_low_latency_fp8(rank, world):
    buf = make(world=world, low_latency_mode=True)
    x, topk, w = inputs(rank, hidden=512)
    for round_scale, ue8m0 in ((False, False), (True, False), (True, True)):
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, topk, M, E, use_fp8=True, round_scale=round_scale,
                                                             use_ue8m0=ue8m0)
        q, inv = ref.cast_to_fp8(x, round_scale)
        if ue8m0:
            inv = (inv.view(torch.int32) >> 23).to(torch.uint8).view(torch.int32)
        want_q = ref.ll_dispatch(q.view(torch.uint8), topk, M, E)[0]
        want_s = ref.ll_dispatch(inv, topk, M, E)[0]
        rows = world * M
        assert recv[1].shape == want_s.shape and recv[1].stride() == (want_s.shape[2] * rows, 1, rows)
        for j, n in enumerate(count.tolist()):
            assert torch.equal(recv[0][j, :n].view(torch.uint8), want_q[j, :n]), "fp8 rows"
            assert torch.equal(recv[1][j, :n], want_s[j, :n]), "fp8 scales"
        if not round_scale:  # dequantised rows are close to the originals
            j = int(count.argmax())
            n = int(count[j])
            deq = recv[0][j, :n].float().view(n, -1, 128) * recv[1][j, :n].unsqueeze(2)
            want_x = ref.ll_dispatch(x, topk, M, E)[0][j, :n].float()
            assert ref.calc_diff(deq.view(n, -1), want_x) < 1e-3


def case_transport_dist(rank, world):
    buf = make(world=world, transport="dist")
    assert buf.transports == ["self" if r == rank else "dist" for r in range(world)], buf.transports
    roundtrip(rank, buf)
    ll_roundtrip(rank, buf)
    x, topk, w = inputs(rank)
    q, scales = ref.cast_to_fp8(x)
    check_dispatch(dispatch(buf, (q, scales), topk, w), ref.dispatch(q.view(torch.uint8), topk, w, E, scales=scales))


def case_torch_fallback(rank, world):
    """The torch versions of the kernels (what tensors off the CPU run), over shared memory and over gloo."""
    from tegula.ep import kernels
    saved = kernels._COMPILED.get("c")
    kernels._COMPILED["c"] = False
    try:
        for transport in ("shm", "dist"):
            buf = make(world=world, transport=transport)
            roundtrip(rank, buf)
            ll_roundtrip(rank, buf)
    finally:
        kernels._COMPILED["c"] = saved


def case_transport_mixed(rank, world):
    """Ranks {0, 1} and {2, 3} share memory, the pairs across talk through gloo: how two machines look."""
    matrix = [["shm" if i // 2 == j // 2 else "dist" for j in range(world)] for i in range(world)]
    buf = make(world=world, transport=matrix)
    assert buf.transports == ["self" if r == rank else matrix[rank][r] for r in range(world)], buf.transports
    roundtrip(rank, buf)
    ll_roundtrip(rank, buf)


def case_mismatch(rank, world):
    """Ranks disagreeing on a shape all raise, naming the rank; the Buffer then refuses further calls."""
    buf = make(world=world)
    x, topk, w = inputs(rank)
    if rank == 0:
        x = x[:, :128]
    try:
        dispatch(buf, x, topk, w)
    except (ValueError, PeerFailure) as e:
        assert "rank" in str(e) and ("hidden" in str(e) or "aborted" in str(e)), str(e)
    else:
        raise AssertionError("a dispatch with mismatched hidden sizes returned")
    try:
        dispatch(buf, x, topk, w)
    except PeerFailure as e:
        assert "unusable" in str(e), str(e)
    else:
        raise AssertionError("a failed Buffer accepted another call")


def case_killed(rank, world):
    """Rank 1 dies in the middle of a dispatch (after writing its first rows): the others raise within the timeout,
    naming it."""
    buf = make(world=world, timeout_s=30)
    x, topk, w = inputs(rank)
    check_dispatch(dispatch(buf, x, topk, w), ref.dispatch(x, topk, w, E))
    if rank == 1:  # the rows go through the fused kernel, or gathered first where it does not serve
        import tegula.ep.buffer as impl
        import tegula.ep.kernels as kernels
        fused, write = kernels.dispatch_scatter, impl._write_rows

        def fused_then_die(*args):
            if fused(*args):
                os.kill(os.getpid(), signal.SIGKILL)
            return False

        def write_then_die(*args):
            write(*args)
            os.kill(os.getpid(), signal.SIGKILL)
        kernels.dispatch_scatter, impl._write_rows = fused_then_die, write_then_die
    t0 = time.monotonic()
    try:
        dispatch(buf, x, topk, w)
    except PeerFailure as e:
        assert "rank 1" in str(e) and time.monotonic() - t0 < 10, (time.monotonic() - t0, str(e))
    else:
        raise AssertionError("dispatch returned although rank 1 died")


def case_hung(rank, world):
    """Rank 1 arrives late: rank 0 times out naming it; rank 1 then learns rank 0 gave up."""
    buf = make(world=world, timeout_s=1.5)
    x, topk, w = inputs(rank)
    if rank == 1:
        time.sleep(4)
    t0 = time.monotonic()
    try:
        dispatch(buf, x, topk, w)
    except PeerFailure as e:
        took = time.monotonic() - t0
        if rank == 0:
            assert "timed out" in str(e) and "rank 1" in str(e) and 1.4 < took < 4, (took, str(e))
        else:
            assert "rank 0" in str(e) and "aborted" in str(e) and took < 2, (took, str(e))
    else:
        raise AssertionError("dispatch returned although a rank never came")


def case_killed_in_setup(rank, world):
    """A rank dies while the segments are being mapped: the survivor raises and no name is left behind."""
    from tegula.ep.shm import ShmGroup
    if rank == 1:
        ShmGroup.attach = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    try:
        make(world=world)
    except Exception:
        pass
    else:
        raise AssertionError("the Buffer was built although rank 1 died")
