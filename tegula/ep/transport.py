"""How one rank reaches every other: itself, shared memory (same machine) or torch.distributed (any machine),
and the steps every operation takes over them.

Every operation is collective and goes: exchange metadata (counts, shapes) with all ranks; write rows straight
into the regions of the ranks reached through shared memory; move the rest with one all_to_all_single over the
process group; wait until every shared-memory sender has delivered. The metadata exchange is also the "ready"
handshake: a rank enters operation n only after it has finished with operation n-1's regions.
"""
from __future__ import annotations

import os
import socket
import uuid

from tegula.ep.shm import MAX_RANKS, PeerFailure, ShmGroup, _proc_start

OP_DISPATCH, OP_COMBINE, OP_LL_DISPATCH, OP_LL_COMBINE = 1, 2, 3, 4  # every rank must be in the same one


def _host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _ordered_stores() -> bool:
    """Whether plain stores become visible in program order (x86's TSO), which the shared-memory counters rely
    on: elsewhere 'auto' keeps to torch.distributed and 'shm' must be asked for."""
    import platform
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def _requested(transport, world: int):
    """The caller's transport choice as a world x world matrix of None (auto), 'shm' or 'dist'."""
    if transport in (None, "auto"):
        return [[None] * world for _ in range(world)]
    if transport in ("shm", "dist"):
        return [[transport] * world for _ in range(world)]
    if isinstance(transport, str):
        raise ValueError(f"tegula.ep: transport must be 'auto', 'shm', 'dist' or a {world}x{world} matrix of "
                         f"them, got {transport!r}")
    m = [list(row) for row in transport]
    if len(m) != world or any(len(row) != world for row in m):
        raise ValueError(f"tegula.ep: a transport matrix must be {world}x{world}")
    for i in range(world):
        for j in range(world):
            m[i][j] = None if m[i][j] in (None, "auto") else m[i][j]
            if m[i][j] not in (None, "shm", "dist") or m[i][j] != (None if m[j][i] in (None, "auto") else m[j][i]):
                raise ValueError(f"tegula.ep: transport[{i}][{j}]={m[i][j]!r} must be 'auto', 'shm' or 'dist' and "
                                 f"equal transport[{j}][{i}]")
    return m


class Comm:
    """This rank's view of the group: ``kinds[i][j]`` is how rank i reaches rank j ('self', 'shm', 'dist')."""

    def __init__(self, group, transport, segment_bytes: int, timeout_s: float):
        self.group, self.timeout_s = group, timeout_s
        self.rank, self.world = group.rank(), group.size()
        if self.world > MAX_RANKS:
            raise ValueError(f"tegula.ep: at most {MAX_RANKS} ranks, the group has {self.world}")
        self.shm: ShmGroup | None = None
        self.failed: str | None = None
        pid = os.getpid()
        infos = self._gather({"host": _host_id(), "pid": pid, "start": _proc_start(pid), "prefix": uuid.uuid4().hex,
                              "size": segment_bytes})
        sizes = {i["size"] for i in infos}
        if len(sizes) > 1:
            raise ValueError(f"tegula.ep: the ranks asked for different buffer sizes ({sorted(sizes)} bytes); every "
                             "rank must pass the same num_nvl_bytes and num_rdma_bytes")
        hosts = [i["host"] for i in infos]
        self.node_of = [sorted(set(hosts), key=hosts.index).index(h) for h in hosts]
        req = _requested(transport, self.world)
        kinds = [["self" if i == j else "dist" for j in range(self.world)] for i in range(self.world)]
        for i in range(self.world):
            for j in range(self.world):
                if i == j:
                    continue
                if req[i][j] == "shm" and hosts[i] != hosts[j]:
                    raise ValueError(f"tegula.ep: transport 'shm' between ranks {i} and {j}, which are on different "
                                     f"machines ({hosts[i]} and {hosts[j]})")
                if (req[i][j] == "shm" or req[i][j] is None and _ordered_stores()) and hosts[i] == hosts[j]:
                    kinds[i][j] = "shm"
        if any(k == "shm" for row in kinds for k in row):
            kinds = self._map_segments(infos, kinds, req, segment_bytes)
        self.kinds = kinds

    def _gather(self, obj):
        import torch.distributed as dist
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _map_segments(self, infos, kinds, req, size):
        """Create this rank's segment, map the peers' ones, then unlink every name: from here on nothing can
        leak. A pair that cannot map each other falls back to 'dist' (or fails, if 'shm' was forced)."""
        prefix = infos[0]["prefix"]
        same_host = [r for r in range(self.world) if infos[r]["host"] == infos[self.rank]["host"]]
        needs = [any(kinds[r][j] == "shm" for j in range(self.world)) for r in range(self.world)]
        self.shm = ShmGroup(self.rank, self.world, size, self.timeout_s)
        try:
            err = None
            if needs[self.rank]:
                try:
                    self.shm.create(prefix)
                except OSError as e:
                    err = str(e)
            errs = self._gather(err)
            bad = [(r, e) for r, e in enumerate(errs) if e]
            if bad:
                raise OSError(f"tegula.ep: rank {bad[0][0]} could not create its shared-memory segment: {bad[0][1]}")
            ok = {r: self.shm.attach(prefix, r, infos[r]["pid"], infos[r]["start"])
                  for r in range(self.world) if kinds[self.rank][r] == "shm"}
            oks = self._gather(ok)
        finally:
            for r in same_host:  # every rank of the host removes every name it may know of
                try:
                    os.unlink(ShmGroup.path(prefix, r))
                except OSError:
                    pass
        for i in range(self.world):
            for j, good in oks[i].items():
                if not (good and oks[j].get(i, False)):
                    if req[i][j] == "shm":
                        raise OSError(f"tegula.ep: ranks {i} and {j} cannot map each other's shared memory")
                    kinds[i][j] = kinds[j][i] = "dist"
        return kinds

    # what each operation asks ---------------------------------------------------------------------------------

    def local(self, device) -> list[int]:
        """Ranks whose regions this rank writes directly (itself and, for CPU tensors, its shm peers)."""
        if device.type != "cpu" or self.shm is None or self.rank not in self.shm.segs:
            return [self.rank]
        return [r for r in range(self.world) if self.kinds[self.rank][r] in ("self", "shm")]

    def remote(self, device) -> list[int]:
        """Ranks this rank exchanges rows with through torch.distributed, for tensors on ``device``."""
        near = self.local(device)
        return [r for r in range(self.world) if r not in near]

    def any_dist(self, device) -> bool:
        """Whether some pair in the group moves through torch.distributed for tensors on ``device``."""
        if device.type != "cpu" or self.shm is None:
            return self.world > 1
        return any(k == "dist" for row in self.kinds for k in row)

    def check(self, what: str) -> None:
        if self.failed:
            raise PeerFailure(f"tegula.ep: {what}: this Buffer is unusable after an earlier failure ({self.failed})")

    def exchange(self, what: str, meta, device):
        """Enter the next operation and trade metadata (int64 values: a list or a 1-D numpy array): returns an
        int64 numpy array [world, len(meta)]."""
        import numpy as np
        self.check(what)
        if self.any_dist(device):
            import torch
            import torch.distributed as dist
            if self.shm is not None and self.rank in self.shm.segs:
                self.shm.publish(meta)  # keep the counters in step; the all_gather is the handshake
            t = torch.tensor(meta, dtype=torch.int64, device=device)
            out = [torch.empty_like(t) for _ in range(self.world)]
            dist.all_gather(out, t, group=self.group)
            return torch.stack(out).cpu().numpy()
        if self.world == 1:
            return np.asarray([meta], dtype=np.int64)
        peers = [r for r in self.local(device) if r != self.rank]
        self.shm.publish(meta)
        self.shm.wait_entered(peers, what)
        rows = [np.asarray(meta, dtype=np.int64)] * self.world
        for r in peers:
            rows[r] = self.shm.read_meta(r, len(meta))
        return np.stack(rows)

    def region(self, rank: int, offset: int, nbytes: int, reserve=()):
        """Bytes [offset, offset+nbytes) of ``rank``'s segment as a uint8 tensor, after reserving the byte
        ranges in ``reserve`` (relative to ``offset``) that are about to be written."""
        self.place(rank, offset, nbytes, reserve)
        return self.shm.bytes(rank, offset, nbytes)

    def place(self, rank: int, offset: int, nbytes: int, reserve=()) -> int:
        """Where ``region`` would begin in the window of this machine's segments (bytes), after the same checks
        and reservation; no tensor made."""
        if offset + nbytes > self.shm.size:
            raise ValueError(f"tegula.ep: region [{offset}, {offset + nbytes}) is past the segment "
                             f"({self.shm.size} B)")
        if reserve:
            self.shm.reserve(rank, [(offset + a, offset + b) for a, b in reserve])
        return rank * self.shm.size + offset

    def window_offset(self, t) -> int | None:
        """Where tensor ``t`` starts in the window of this machine's segments (bytes), if it lies in this rank's
        segment; else None."""
        if self.shm is None or self.rank not in self.shm.segs or t.device.type != "cpu":
            return None
        at = t.data_ptr() - self.shm.win.data_ptr()
        lo = self.rank * self.shm.size
        return at if lo <= at and at + t.numel() * t.element_size() <= lo + self.shm.size else None

    def all_to_all(self, send, send_rows, recv_rows, row_bytes: int):
        """One all_to_all_single of uint8 rows: ``send`` [sum(send_rows), row_bytes] ordered by destination;
        returns [sum(recv_rows), row_bytes] ordered by source."""
        import torch
        import torch.distributed as dist
        out = torch.empty((sum(recv_rows), row_bytes), dtype=torch.uint8, device=send.device)
        dist.all_to_all_single(out.view(-1), send.reshape(-1), [n * row_bytes for n in recv_rows],
                               [n * row_bytes for n in send_rows], group=self.group)
        return out

    def deliver(self, what: str, device) -> None:
        """This rank's shared-memory writes for the operation are done: tell those receivers, and wait for
        this rank's own senders."""
        peers = [r for r in self.local(device) if r != self.rank]
        if peers:
            self.shm.signal(peers)
            self.shm.wait_signals(peers, what)

    def release(self, what: str, read_from, read_by) -> None:
        """This rank has finished reading the rows of ``read_from`` in place: tell them, and wait until the ranks
        in ``read_by`` have finished reading this rank's."""
        self.shm.signal(read_from, freed=True)
        self.shm.wait_signals(read_by, what, freed=True)

    def abort(self, what: str, err: BaseException) -> None:
        self.failed = f"{what}: {type(err).__name__}: {err}"
        if self.shm is not None:
            self.shm.abort(self.failed)

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None


class RowCodec:
    """Rows of several arrays packed side by side into one uint8 row (widest elements first, 8-byte aligned), for
    the all_to_all_single between machines."""

    def __init__(self, fields):
        import torch
        sized = []
        for name, shape, dtype in fields:
            n = 1
            for d in shape:
                n *= d
            sized.append((name, tuple(shape), dtype, n * torch.empty((), dtype=dtype).element_size(),
                          torch.empty((), dtype=dtype).element_size()))
        sized.sort(key=lambda f: -f[4])
        self.fields, off = [], 0
        for name, shape, dtype, nbytes, _ in sized:
            self.fields.append((name, shape, dtype, off, nbytes))
            off += nbytes
        self.row_bytes = -(-max(off, 1) // 8) * 8

    def pack(self, parts, device):
        """``parts``: per destination, {name: tensor rows, or (tensor, row indices) to gather}."""
        import torch
        n = sum(_rows_of(p) for p in parts)
        out = torch.zeros((n, self.row_bytes), dtype=torch.uint8, device=device)
        at = 0
        for p in parts:
            k = _rows_of(p)
            for name, shape, dtype, off, nbytes in self.fields:
                v = p[name]
                if isinstance(v, tuple):
                    v = v[0].index_select(0, v[1].long())
                out[at:at + k, off:off + nbytes] = v.contiguous().view(torch.uint8).reshape(k, nbytes)
            at += k
        return out

    def unpack(self, rows):
        """The arrays of packed ``rows``: {name: tensor [n, ...]}."""
        n = rows.shape[0]
        return {name: rows[:, off:off + nbytes].contiguous().view(dtype).view((n,) + shape)
                for name, shape, dtype, off, nbytes in self.fields}


def _rows_of(part) -> int:
    v = next(iter(part.values()))
    return v[1].numel() if isinstance(v, tuple) else v.shape[0]
