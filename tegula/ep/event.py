"""DeepEP's event and config objects, so code written for DeepEP runs unchanged. tegula.ep's operations finish
before they return, so every event is already complete and every hook has nothing left to do."""
from __future__ import annotations


class EventOverlap:
    """A completed event: ``current_stream_wait()`` returns at once; ``with event:`` is a no-op scope."""

    def __init__(self, event=None, extra_tensors=None):
        self.event, self.extra_tensors = event, extra_tensors
        self.hook_after_wait = None

    def current_stream_wait(self, release_handle: bool = False) -> None:
        if self.hook_after_wait is not None:
            hook, self.hook_after_wait = self.hook_after_wait, None
            hook()

    def register_hook_after_wait(self, hook) -> None:
        if self.hook_after_wait is not None:
            raise RuntimeError("a hook is already registered on this EventOverlap")
        self.hook_after_wait = hook

    def __call__(self, release_handle: bool = False) -> "EventOverlap":
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.current_stream_wait()


def completed_hook() -> None:
    """The receive hook of a low-latency call: the data is already there."""


class Config:
    """DeepEP's tuning config (SMs and chunk sizes). Accepted and kept; the CPU transports have nothing to tune."""

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256):
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """DeepEP's sizing call. tegula.ep's regions hold a whole dispatch, so this assumes up to 8192 tokens per
        rank and top-8; Buffer.get_nvl_buffer_size_hint takes the real numbers. (Sparse: costs address space.)"""
        from tegula.ep.buffer import Buffer
        return Buffer.get_nvl_buffer_size_hint(8192, hidden_bytes, num_ranks)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Normal-mode dispatch between machines needs no rdma region here."""
        return 0

    def __repr__(self):
        return (f"Config(num_sms={self.num_sms}, nvl=({self.num_max_nvl_chunked_send_tokens}, "
                f"{self.num_max_nvl_chunked_recv_tokens}), rdma=({self.num_max_rdma_chunked_send_tokens}, "
                f"{self.num_max_rdma_chunked_recv_tokens}))")
