"""The compile cache: a memory dict and a disk directory of built binaries.

Keys hash text only (IR text, target, options, tegula version, toolchain identity and host ISA); the disk key
adds the hash of the generated source (computed after the passes and the emitter, which are fast), so a binary
built by an older compiler from the same IR is never loaded. A binary is
written to a temporary name and renamed into place (atomic), with a sidecar of its sha256; an entry whose
binary does not match its sidecar, or does not load, is rebuilt. Two processes building one key at once both
succeed: each writes its own temporary file and the last rename wins with identical content.
"""
from __future__ import annotations

import hashlib
import os
import threading

from tegula import config

_MEMORY: dict[str, object] = {}
_LOCK = threading.Lock()


def key_of(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()


def source_hash(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()


def memory_get(key: str):
    return _MEMORY.get(key)


def memory_put(key: str, value) -> None:
    with _LOCK:
        _MEMORY[key] = value


def entry_dir(key: str) -> str:
    return os.path.join(config.get().cache_dir, "kernels", key[:2], key)


def _digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def lookup(key: str, filename: str) -> str | None:
    """The path of a valid cached binary, or None (a corrupt entry is removed)."""
    if not config.get().disk_cache:
        return None
    d = entry_dir(key)
    path, side = os.path.join(d, filename), os.path.join(d, filename + ".sha256")
    try:
        with open(side) as f:
            want = f.read().strip()
        if _digest(path) == want:
            return path
    except OSError:
        return None
    invalidate(key, filename)
    return None


def invalidate(key: str, filename: str) -> None:
    d = entry_dir(key)
    for p in (os.path.join(d, filename), os.path.join(d, filename + ".sha256")):
        try:
            os.unlink(p)
        except OSError:
            pass


def store(key: str, filename: str, build, sources: dict[str, str]) -> str:
    """Build into a temporary file with ``build(tmp_path)`` and publish it atomically; returns the path."""
    d = entry_dir(key) if config.get().disk_cache else os.path.join(config.get().cache_dir, "tmp", key)
    os.makedirs(d, exist_ok=True)
    tag = f"{os.getpid()}.{threading.get_ident()}"
    tmp = os.path.join(d, f".{filename}.{tag}.tmp")
    build(tmp)
    digest = _digest(tmp)
    for name, text in sources.items():  # the source beside the binary, for inspection
        _atomic_write(os.path.join(d, name), text, tag)
    path = os.path.join(d, filename)
    os.replace(tmp, path)
    _atomic_write(path + ".sha256", digest, tag)
    return path


def _atomic_write(path: str, text: str, tag: str) -> None:
    tmp = f"{path}.{tag}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
