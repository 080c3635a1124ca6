"""The C prelude headers every compiled target includes, and the hash of them that keys the binary caches."""
from __future__ import annotations

import functools
import hashlib
import os

PRELUDE_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "codegen", "prelude")


@functools.lru_cache(maxsize=None)
def prelude_hash() -> str:
    """A short hash of every header in PRELUDE_DIR (names and bytes): a changed header means new binaries."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(PRELUDE_DIR)):
        if name.endswith(".h"):
            with open(os.path.join(PRELUDE_DIR, name), "rb") as f:
                h.update(name.encode() + f.read())
    return h.hexdigest()[:16]
