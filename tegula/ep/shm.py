"""Shared-memory segments between the ranks of one machine: one per rank, of a fixed maximum size, mapped by
every rank of the machine.

A segment starts with a control block (owner pid, the owner's op counter, an abort word and message, one "done"
counter per sender, the owner's published metadata) followed by its data regions. Senders copy rows straight
into the receiver's region and then bump their done counter there; the receiver hands its region out as views.
Segments are sparse files: a writer reserves (fallocates) the bytes it is about to write, so a full /dev/shm is
an error, never a SIGBUS. Names are unlinked as soon as every rank has mapped them, so a killed rank leaks
nothing; the memory goes away with the last mapping.

The counters are plain 64-bit stores and loads ordered by the machine (x86-64 is TSO; the kernels that write
the rows join their threads before the counter is bumped).
"""
from __future__ import annotations

import mmap
import os
import time

MAGIC = 0x7465_6775_6c61_6570  # "tegulaep"
CTRL_BYTES = 2 << 20  # control block: the data regions start 2 MiB in
_CHUNK = 2 << 20  # reservation granule
_MSG_AT, _MSG_BYTES = 4096, 2048
_META_AT = 8192
META_WORDS = (CTRL_BYTES - _META_AT) // 8
_PID, _SEQ, _ABORT, _MSGLEN, _DONE = 1, 2, 3, 4, 16  # word offsets; done counters from word 16, one per rank


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else __import__("tempfile").gettempdir()


class PeerFailure(RuntimeError):
    """A peer rank died, hung past the timeout, or aborted the operation."""


class Segment:
    """One rank's segment, as mapped in this process."""

    def __init__(self, path: str, size: int, create: bool):
        import numpy as np
        import torch
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        self.fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(self.fd, size)
                _reserve(self.fd, 0, CTRL_BYTES, path)
            elif os.fstat(self.fd).st_size != size:
                raise OSError(f"{path}: size {os.fstat(self.fd).st_size}, expected {size}")
            self.mm = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(self.fd)
            raise
        self.path, self.size = path, size
        self.words = np.frombuffer(self.mm, dtype=np.int64, count=CTRL_BYTES // 8)
        self.bytes = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.chunks = np.zeros(-(-size // _CHUNK), dtype=bool)  # which 2 MiB chunks are known to be backed
        self.chunks[:CTRL_BYTES // _CHUNK] = True

    def reserve(self, start: int, end: int) -> None:
        """Back bytes [start, end) with memory before they are written: a full /dev/shm raises OSError here
        instead of killing the process with SIGBUS on first touch."""
        lo, hi = start // _CHUNK, -(-end // _CHUNK)
        if end <= start or self.chunks[lo:hi].all():
            return
        _reserve(self.fd, lo * _CHUNK, min(hi * _CHUNK, self.size) - lo * _CHUNK, self.path)
        self.chunks[lo:hi] = True

    def close(self) -> None:
        self.words = self.bytes = None
        try:
            self.mm.close()
        except BufferError:  # views handed out still hold the mapping; it goes with them
            pass
        os.close(self.fd)


def _reserve(fd: int, offset: int, length: int, path: str) -> None:
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as e:
        raise OSError(e.errno, f"tegula.ep: cannot reserve {length} bytes of shared memory in {path} "
                               f"({os.strerror(e.errno)}); is {shm_dir()} large enough?") from None


def _proc_start(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (identifies the process across pid reuse), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return stat.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, start: str | None) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0] not in ("Z", "X") and (start is None or fields[19] == start)
    except (OSError, IndexError):
        return False


class ShmGroup:
    """The segments of this machine's ranks, as seen by ``rank``: ``segs[r]`` for every rank r mapped here."""

    def __init__(self, rank: int, world: int, timeout_s: float):
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.segs: dict[int, Segment] = {}
        self.pids: dict[int, tuple[int, str | None]] = {}
        self.seq = 0

    # setup -------------------------------------------------------------------------------------------------

    @staticmethod
    def path(prefix: str, rank: int) -> str:
        return os.path.join(shm_dir(), f"tegula-ep-{prefix}-{rank}")

    def create(self, prefix: str, size: int) -> None:
        seg = Segment(self.path(prefix, self.rank), size, create=True)
        seg.words[_PID] = os.getpid()
        seg.words[0] = MAGIC
        self.segs[self.rank] = seg

    def attach(self, prefix: str, rank: int, size: int, pid: int, start: str | None) -> bool:
        """Map ``rank``'s segment; False when it cannot be opened from here (another machine or namespace)."""
        try:
            seg = Segment(self.path(prefix, rank), size, create=False)
        except OSError:
            return False
        if int(seg.words[0]) != MAGIC or int(seg.words[_PID]) != pid:
            seg.close()
            return False
        self.segs[rank] = seg
        # the pid is only meaningful if this process sees the same process under it
        self.pids[rank] = (pid, start) if start is not None and _proc_start(pid) == start else (None, None)
        return True

    def close(self) -> None:
        for seg in self.segs.values():
            seg.close()
        self.segs.clear()

    # the per-operation protocol ----------------------------------------------------------------------------

    def publish(self, meta) -> None:
        """Enter the next operation: publish this rank's metadata (int64 values) and bump its op counter."""
        own = self.segs[self.rank].words
        if len(meta) > META_WORDS:
            raise ValueError(f"tegula.ep: {len(meta)} metadata words exceed the control block ({META_WORDS})")
        self.seq += 1
        own[_META_AT // 8:_META_AT // 8 + len(meta)] = meta
        own[_SEQ] = self.seq

    def read_meta(self, rank: int, n: int):
        return self.segs[rank].words[_META_AT // 8:_META_AT // 8 + n].copy()

    def signal_done(self, ranks) -> None:
        """Tell each receiver in ``ranks`` that this rank's rows for the current operation are in place."""
        for r in ranks:
            self.segs[r].words[_DONE + self.rank] = self.seq

    def wait_entered(self, ranks, what: str) -> None:
        """Wait until every rank in ``ranks`` has entered the current operation."""
        self._wait(ranks, lambda r: self.segs[r].words[_SEQ], what, "to enter it")

    def wait_done(self, ranks, what: str) -> None:
        """Wait until every rank in ``ranks`` has written its rows for the current operation here."""
        own = self.segs[self.rank].words
        self._wait(ranks, lambda r: own[_DONE + r], what, "to deliver its rows")

    def abort(self, message: str) -> None:
        """Tell the peers this rank has given up on the current operation (they raise instead of waiting)."""
        seg = self.segs.get(self.rank)
        if seg is None or seg.words is None:
            return
        data = message.encode()[:_MSG_BYTES]
        seg.mm[_MSG_AT:_MSG_AT + len(data)] = data
        seg.words[_MSGLEN] = len(data)
        seg.words[_ABORT] = 1

    def _check_peers(self, what: str) -> None:
        for r, seg in self.segs.items():
            if r != self.rank and seg.words[_ABORT]:
                n = int(seg.words[_MSGLEN])
                msg = seg.mm[_MSG_AT:_MSG_AT + n].decode(errors="replace")
                raise PeerFailure(f"tegula.ep: {what}: rank {r} aborted: {msg}")

    def _wait(self, ranks, value, what: str, goal: str) -> None:
        pending = [r for r in ranks if value(r) < self.seq]
        if not pending:
            return
        start = time.monotonic()
        next_check, polls = start + 0.01, 0
        while pending:
            pending = [r for r in pending if value(r) < self.seq]
            if not pending:
                return
            polls += 1
            if polls < 64:
                continue
            now = time.monotonic()
            if now >= next_check:
                next_check = now + 0.01
                self._check_peers(what)
                for r in pending:
                    pid, st = self.pids.get(r, (None, None))
                    if pid is not None and not _alive(pid, st):
                        raise PeerFailure(f"tegula.ep: {what}: rank {r} (pid {pid}) exited while this rank "
                                          f"(rank {self.rank}) waited for it {goal}")
                if now - start > self.timeout_s:
                    raise PeerFailure(f"tegula.ep: {what}: timed out after {self.timeout_s:g} s waiting for rank "
                                      f"{pending[0]} {goal} (rank {self.rank}, operation {self.seq})")
            time.sleep(0 if now - start < 2e-3 else 1e-4)
