"""tegula.ep: expert-parallel dispatch and combine with DeepEP's ``Buffer`` API (V1 semantics).

``Buffer(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode)`` over a torch.distributed process group;
``get_dispatch_layout``, ``dispatch`` (bf16, or (fp8, scales)), ``combine``, ``low_latency_dispatch`` and
``low_latency_combine`` follow DeepEP's names, argument order, return tuples and layouts. Between the processes of
one machine rows move through shared memory: senders copy them straight into the receiver's segment and the
receiver gets views (one copy in all). Between machines they move with torch.distributed's all_to_all_single
(gloo for CPU tensors, NCCL for GPU tensors). The transport per pair of ranks is chosen automatically and can be
forced (``Buffer(..., transport='shm' | 'dist' | matrix)``).

Where it differs from DeepEP:
- every call finishes before it returns: events are complete, hooks have nothing to wait for, ``async_finish``,
  ``previous_event``, ``config`` and ``allocate_on_comm_stream`` are accepted and have no effect;
- received tensors are views of the receiver's segment, valid until two more dispatches (normal and low-latency
  each alternate between two slots), where DeepEP's normal dispatch returns fresh tensors;
- ``num_nvl_bytes`` must hold a whole dispatch (no chunked ring buffer): see ``Buffer.get_nvl_buffer_size_hint``;
  segments are sparse, so a generous size costs only address space;
- the handle is DeepEP's intranode 6-tuple on every transport (one "channel"), internode included;
- low-latency fp8 scales, ``round_scale`` and UE8M0 packing follow DeepEP; ``use_logfmt`` moves exact bf16;
  rank masking (``enable_shrink``) and the wait-cost statistics are not implemented.
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
