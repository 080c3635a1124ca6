"""Runtimes: source text -> binary -> launch. A lazy registry: a backend's module is imported the first
time it is asked for, so importing tegula touches no compiler or device. Runtimes never see the IR."""
from __future__ import annotations

import importlib

_REGISTRY = {"c": "tegula.runtime.cpu", "interp": "tegula.runtime.interp", "opencl": "tegula.runtime.opencl",
             "cuda": "tegula.runtime.cuda"}


def get(name: str):
    """The runtime module of ``name`` (``c``, ``interp``)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown runtime {name!r}; expected one of {sorted(_REGISTRY)}")
    return importlib.import_module(_REGISTRY[name])
