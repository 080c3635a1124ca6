"""tegula.ep: expert-parallel dispatch and combine with DeepEP's ``Buffer`` API (V1 semantics).

``Buffer(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode)`` over a torch.distributed process group;
``get_dispatch_layout``, ``dispatch`` (bf16, or (fp8, scales)), ``combine``, ``low_latency_dispatch`` and
``low_latency_combine`` follow DeepEP's names, argument order, return tuples and layouts.

Transports. Between the processes of one machine rows move through shared memory: every rank owns one segment of
fixed maximum size (sparse: memory is taken as rows land), every process maps all of its machine's segments, and
senders copy rows straight into the receiver's region; the receiver's outputs are views of it (one copy in all).
combine reads a peer's rows in place when the peer's x already lies in its segment (recv_x itself, or a tensor
from ``get_local_buffer_tensor``), and copies them over otherwise. Between machines rows move with one
torch.distributed all_to_all_single per operation (gloo for CPU tensors, NCCL for GPU tensors). The transport of
each pair is chosen automatically (same machine: shared memory) and can be forced with
``Buffer(..., transport='shm' | 'dist' | a world x world matrix)``. Every shared-memory wait gives up after
``timeout_s`` (naming the rank it waited for) and notices a dead peer within about 10 ms; a rank that fails tells
the others, which raise instead of waiting. Waits inside torch.distributed use the process group's timeout.

Where it differs from DeepEP:
- every call finishes before it returns: events are complete, hooks have nothing to wait for, ``async_finish``,
  ``previous_event``, ``config`` and ``allocate_on_comm_stream`` are accepted and have no effect;
- received tensors are views of the receiver's segment, valid until two more dispatches (normal and low-latency
  each alternate between two slots), where DeepEP's normal dispatch returns fresh tensors;
- ``num_nvl_bytes`` must hold a whole dispatch (no chunked ring buffer; a third each for two receive slots and
  for combine): see ``Buffer.get_nvl_buffer_size_hint``; a generous size costs only address space;
- the handle is DeepEP's intranode 6-tuple on every transport (one "channel"), internode included; handle tensors
  stay on the CPU;
- low-latency fp8 scales, ``round_scale`` and UE8M0 packing follow DeepEP, with the scale 448 / amax computed as one
  float32 division; ``use_logfmt`` moves exact bf16; rank masking (``enable_shrink``), the wait-cost statistics,
  the mpi4py ``comm`` and the ``internode_*`` entry points are not implemented.

Requirements: Linux (/dev/shm or a tmpfs temp dir, /proc) for the shared-memory transport. Its counters rely on x86's
store order, so off x86 'auto' uses torch.distributed between all ranks.
"""
from tegula.ep.event import Config, EventOverlap

__all__ = ["Buffer", "Config", "EventOverlap", "topk_idx_t"]


def __getattr__(name):
    if name == "Buffer":
        from tegula.ep.buffer import Buffer
        return Buffer
    if name == "topk_idx_t":
        import torch
        return torch.int64
    raise AttributeError(f"module 'tegula.ep' has no attribute {name!r}")
