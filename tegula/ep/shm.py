"""Shared-memory segments between the ranks of one machine: one per rank, of a fixed maximum size.

Every process maps every segment of its machine into one window of address space, rank r's at r * size, so a
row anywhere on the machine is an offset from one base (combine reads peers' rows in place through it). A
segment starts with a control block (magic, owner pid, the owner's op counter, an abort word and message, one
"done" and one "freed" counter per peer, the owner's published metadata); its data regions follow. Senders copy
rows straight into the receiver's region and then bump their done counter there.

Segments are sparse files: a writer reserves (fallocates) the bytes it is about to write, so a full /dev/shm is
an error, never a SIGBUS. Names are unlinked as soon as every rank has mapped them, so a killed rank leaks
nothing; the memory goes away with the last mapping. The counters are plain 64-bit stores and loads ordered by
the machine (x86-64 is TSO; the kernels that write the rows fence their streaming stores and join their threads
before a counter is bumped).
"""
from __future__ import annotations

import ctypes
import mmap
import os
import time

MAGIC = 0x7465_6775_6c61_6570  # "tegulaep"
CTRL_BYTES = 2 << 20  # control block: the data regions start 2 MiB in
_CHUNK = 2 << 20  # reservation granule
MAX_RANKS = 1024
_PID, _SEQ, _ABORT, _MSGLEN = 1, 2, 3, 4  # word offsets
_DONE, _FREED = 64, 64 + MAX_RANKS  # one counter per rank: rows delivered, rows finished with
_MSG_AT, _MSG_BYTES = 20480, 2048  # byte offsets
_META_AT = 24576
META_WORDS = (CTRL_BYTES - _META_AT) // 8
_MAP_FIXED, _MAP_NORESERVE = 0x10, 0x4000  # Linux


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else __import__("tempfile").gettempdir()


class PeerFailure(RuntimeError):
    """A peer rank died, hung past the timeout, or aborted the operation."""


def _libc_mmap():
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.mmap
    fn.restype = ctypes.c_void_p
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    return fn


def _reserve(fd: int, offset: int, length: int, path: str) -> None:
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as e:
        raise OSError(e.errno, f"tegula.ep: cannot reserve {length} bytes of shared memory in {path} "
                               f"({os.strerror(e.errno)}); is {shm_dir()} large enough?") from None


def _proc_start(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (tells the process apart from a later one with its pid), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, start: str | None) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0] not in ("Z", "X") and (start is None or fields[19] == start)
    except (OSError, IndexError):
        return False


class Segment:
    """One rank's segment as mapped here: its file and which 2 MiB chunks are known to be backed."""

    def __init__(self, fd: int, path: str, size: int):
        import numpy as np
        self.fd, self.path, self.size = fd, path, size
        self.chunks = np.zeros(-(-size // _CHUNK), dtype=bool)
        self.chunks[:CTRL_BYTES // _CHUNK] = True

    def reserve(self, spans) -> None:
        """Back the byte ranges ``spans`` ([(start, end), ...]) with memory before they are written: a full
        /dev/shm raises OSError here instead of killing the process with SIGBUS on first touch."""
        import numpy as np
        spans = [(a, b) for a, b in spans if b > a]
        if not spans:
            return
        lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
        if self.chunks[lo // _CHUNK:-(-hi // _CHUNK)].all():  # the usual case: backed by an earlier call
            return
        se = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
        edges = np.zeros(len(self.chunks) + 1, dtype=np.int64)
        np.add.at(edges, se[:, 0] // _CHUNK, 1)
        np.add.at(edges, -(-se[:, 1] // _CHUNK), -1)
        missing = (np.cumsum(edges)[:-1] > 0) & ~self.chunks
        if not missing.any():
            return
        flips = np.flatnonzero(np.diff(np.concatenate(([0], missing.astype(np.int8), [0]))))
        for lo, hi in zip(flips[::2], flips[1::2]):  # each run of missing chunks, in one call
            _reserve(self.fd, int(lo) * _CHUNK, min(int(hi) * _CHUNK, self.size) - int(lo) * _CHUNK, self.path)
        self.chunks |= missing


class ShmGroup:
    """The segments of this machine's ranks as seen by ``rank``: ``segs[r]`` for every rank r mapped here, its
    bytes at ``win[r * size:(r + 1) * size]``."""

    def __init__(self, rank: int, world: int, size: int, timeout_s: float):
        import numpy as np
        import torch
        self.rank, self.world, self.size, self.timeout_s = rank, world, size, timeout_s
        self.window = mmap.mmap(-1, world * size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
        self.win = torch.frombuffer(self.window, dtype=torch.uint8)
        self._typed = {}  # the window as other dtypes (typed)
        self._words = np.frombuffer(self.window, dtype=np.int64)
        self.segs: dict[int, Segment] = {}
        self.pids: dict[int, tuple[int | None, str | None]] = {}
        self.seq = 0
        self.waited_s = 0.0  # time spent in waits for peers, in all (benchmarks read it)

    @staticmethod
    def path(prefix: str, rank: int) -> str:
        return os.path.join(shm_dir(), f"tegula-ep-{prefix}-{rank}")

    def words(self, rank: int):
        """``rank``'s control block as int64 words."""
        at = rank * self.size // 8
        return self._words[at:at + CTRL_BYTES // 8]

    def bytes(self, rank: int, offset: int, nbytes: int):
        return self.win[rank * self.size + offset:rank * self.size + offset + nbytes]

    def typed(self, dtype):
        """The whole window as a 1-D ``dtype`` tensor (made once per dtype)."""
        t = self._typed.get(dtype)
        if t is None:
            t = self._typed[dtype] = self.win.view(dtype)
        return t

    def _map(self, rank: int, path: str, create: bool) -> None:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, self.size)
                _reserve(fd, 0, CTRL_BYTES, path)
            elif os.fstat(fd).st_size != self.size:
                raise OSError(f"{path}: size {os.fstat(fd).st_size}, expected {self.size}")
            want = self.win.data_ptr() + rank * self.size
            got = _libc_mmap()(want, self.size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_FIXED, fd, 0)
            if got != want:
                raise OSError(ctypes.get_errno(), f"{path}: mmap at a fixed address failed")
        except BaseException:
            os.close(fd)
            raise
        self.segs[rank] = Segment(fd, path, self.size)

    def create(self, prefix: str) -> None:
        self._map(self.rank, self.path(prefix, self.rank), create=True)
        w = self.words(self.rank)
        w[_PID] = os.getpid()
        w[0] = MAGIC

    def attach(self, prefix: str, rank: int, pid: int, start: str | None) -> bool:
        """Map ``rank``'s segment; False when it cannot be opened from here (another machine or namespace)."""
        try:
            self._map(rank, self.path(prefix, rank), create=False)
        except OSError:
            return False
        w = self.words(rank)
        if int(w[0]) != MAGIC or int(w[_PID]) != pid:
            return False
        # the pid only means something if this process sees that same process under it
        self.pids[rank] = (pid, start) if start is not None and _proc_start(pid) == start else (None, None)
        return True

    def reserve(self, rank: int, spans) -> None:
        self.segs[rank].reserve(spans)

    def close(self) -> None:
        for seg in self.segs.values():
            os.close(seg.fd)
        self.segs.clear()
        self._words = self.win = None
        self._typed.clear()
        try:
            self.window.close()
        except BufferError:  # views handed out still hold the window; it is unmapped with the last of them
            pass

    # the per-operation protocol ----------------------------------------------------------------------------

    def publish(self, meta) -> None:
        """Enter the next operation: publish this rank's metadata (int64 values) and bump its op counter."""
        if len(meta) > META_WORDS:
            raise ValueError(f"tegula.ep: {len(meta)} metadata words exceed the control block ({META_WORDS})")
        own = self.words(self.rank)
        self.seq += 1
        own[_META_AT // 8:_META_AT // 8 + len(meta)] = meta
        own[_SEQ] = self.seq

    def read_meta(self, rank: int, n: int):
        return self.words(rank)[_META_AT // 8:_META_AT // 8 + n].copy()

    def signal(self, ranks, freed: bool = False) -> None:
        """Tell each rank in ``ranks`` that this rank's rows for the current operation are in place (or, with
        ``freed``, that this rank has finished reading theirs)."""
        at = (_FREED if freed else _DONE) + self.rank
        for r in ranks:
            self.words(r)[at] = self.seq

    def wait_entered(self, ranks, what: str) -> None:
        """Wait until every rank in ``ranks`` has entered the current operation."""
        self._wait(ranks, lambda r: self.words(r)[_SEQ], what, "to enter it")

    def wait_signals(self, ranks, what: str, freed: bool = False) -> None:
        """Wait for the signal of every rank in ``ranks`` (see ``signal``)."""
        own, base = self.words(self.rank), _FREED if freed else _DONE
        self._wait(ranks, lambda r: own[base + r], what, "to finish reading" if freed else "to deliver its rows")

    def abort(self, message: str) -> None:
        """Tell the peers this rank has given up on the current operation (they raise instead of waiting)."""
        if self.rank not in self.segs or self.win is None:
            return
        data = message.encode()[:_MSG_BYTES]
        self.window[self.rank * self.size + _MSG_AT:self.rank * self.size + _MSG_AT + len(data)] = data
        w = self.words(self.rank)
        w[_MSGLEN] = len(data)
        w[_ABORT] = 1

    def _check_peers(self, what: str) -> None:
        for r in self.segs:
            w = self.words(r)
            if r != self.rank and w[_ABORT]:
                at = r * self.size + _MSG_AT
                msg = self.window[at:at + int(w[_MSGLEN])].decode(errors="replace")
                raise PeerFailure(f"tegula.ep: {what}: rank {r} aborted: {msg}")

    def _wait(self, ranks, value, what: str, goal: str) -> None:
        pending = [r for r in ranks if value(r) < self.seq]
        if not pending:
            return
        start = time.monotonic()
        try:
            self._poll(pending, value, what, goal, start)
        finally:
            self.waited_s += time.monotonic() - start

    def _poll(self, pending, value, what, goal, start) -> None:
        next_check, polls = start + 0.01, 0
        while pending:
            polls += 1
            if polls > 64:  # spin briefly, then yield the core
                now = time.monotonic()
                if now >= next_check:
                    next_check = now + 0.01
                    self._check_peers(what)
                    for r in pending:
                        pid, st = self.pids.get(r, (None, None))
                        if pid is not None and not _alive(pid, st):
                            raise PeerFailure(f"tegula.ep: {what}: rank {r} (pid {pid}) exited while rank {self.rank} "
                                              f"waited for it {goal}")
                    if now - start > self.timeout_s:
                        raise PeerFailure(f"tegula.ep: {what}: timed out after {self.timeout_s:g} s waiting for rank "
                                          f"{pending[0]} {goal} (rank {self.rank}, operation {self.seq})")
                time.sleep(0 if now - start < 2e-4 else 5e-5)
            pending = [r for r in pending if value(r) < self.seq]
