"""Importing the subpackage ``tegula.jit`` (or ``tegula.autotune``) rebinds that attribute of ``tegula`` from the
decorator function to the module; making the module callable keeps ``@tegula.jit(...)`` working either way."""
from __future__ import annotations

import sys
import types


def make_module_callable(name: str, fn) -> None:
    class _CallableModule(types.ModuleType):
        def __call__(self, *args, **kwargs):
            return fn(*args, **kwargs)

    sys.modules[name].__class__ = _CallableModule
