"""``@tegula.autotune(configs=...)`` over ``@tegula.jit``: try each configuration of a kernel factory on this
machine, keep the fastest, and remember the choice on disk keyed by the factory, its arguments, the target and
the host. Works on the CPU (no device is needed to tune)."""
from __future__ import annotations

import hashlib
import inspect
import json
import os
import sys

from tegula import config
from tegula.errors import CompileError
from tegula.jit import JitFactory, _freeze
from tegula.jit.profiler import Profiler, do_bench


def _source_hash(fn) -> str:
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError):
        src = fn.__qualname__
    return hashlib.sha256(src.encode()).hexdigest()[:16]


class AutoTuner:
    """Calling it with the factory's fixed arguments returns the fastest kernel over ``configs``."""

    def __init__(self, factory: JitFactory, configs, warmup: int = 3, rep: int = 20, verbose: bool = True,
                 dims: dict | None = None):
        if not isinstance(factory, JitFactory):
            raise TypeError("@tegula.autotune must decorate a @tegula.jit factory (put @tegula.autotune above "
                            "@tegula.jit)")
        self.factory, self.configs_arg, self.warmup, self.rep, self.verbose = factory, configs, warmup, rep, verbose
        self.dims = dims or {}
        self.best: dict = {}
        self.__name__ = factory.__name__
        self.__doc__ = factory.__doc__

    def configs(self, *args, **kwargs) -> list[dict]:
        cfgs = self.configs_arg(*args, **kwargs) if callable(self.configs_arg) else self.configs_arg
        cfgs = list(cfgs)
        if not cfgs or not all(isinstance(c, dict) for c in cfgs):
            raise ValueError("autotune: configs must be a non-empty list of dicts of factory keyword arguments")
        return cfgs

    def _key(self, args, kwargs, cfgs) -> str:
        from tegula import __version__, runtime
        from tegula.jit.targets import resolve
        tgt = resolve(self.factory.target)
        rt = runtime.get(tgt.runtime)
        ident = rt.identity() if hasattr(rt, "identity") else ""
        text = repr((self.factory.fn.__module__, self.factory.fn.__qualname__, _source_hash(self.factory.fn),
                     _freeze(args), _freeze(kwargs), _freeze(cfgs), tgt.name, ident, __version__))
        return hashlib.sha256(text.encode()).hexdigest()

    def _path(self, key: str) -> str:
        return os.path.join(config.get().cache_dir, "autotune", key[:2], key + ".json")

    def _given(self, args, kwargs, cfgs) -> bool:
        """Whether the call already fixes a tuned parameter (by keyword or position): then nothing is tuned."""
        try:
            names = list(inspect.signature(self.factory.fn).parameters)
        except (TypeError, ValueError):
            names = []
        given = set(kwargs) | set(names[:len(args)])
        return any(k in given for k in cfgs[0])

    def __call__(self, *args, **kwargs):
        """The fastest kernel for these arguments; on an eager @tegula.jit function (which takes tensors and
        runs), the call runs it with the fastest configuration."""
        if not self.factory.eager():
            return self.compile(*args, **kwargs)
        kernel = self.compile(*args, **kwargs)
        return self.factory(*args, **kwargs, **(getattr(kernel, "config", None) or {}))

    def compile(self, *args, **kwargs):
        """The chosen kernel for these arguments, tuned on first use (TileLang's ``tuned.compile(...)``)."""
        cfgs = self.configs(*args, **kwargs)
        if self._given(args, kwargs, cfgs):
            return self.factory.compile(*args, **kwargs)
        key = self._key(_shapes(args), _shapes(kwargs), cfgs)
        if key in self.best:
            return self.best[key]
        path = self._path(key)
        chosen = _read_choice(path, cfgs)
        if chosen is not None:
            kernel = self.factory.compile(*args, **kwargs, **chosen["config"])
            kernel.config, kernel.latency = chosen["config"], chosen["latency_ms"]
            self.best[key] = kernel
            return kernel
        kernel = self._tune(args, kwargs, cfgs)
        if config.get().disk_cache:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump({"config": kernel.config, "latency_ms": kernel.latency}, f)
            os.replace(tmp, path)
        self.best[key] = kernel
        return kernel

    def _tune(self, args, kwargs, cfgs):
        best, best_ms, failures, inputs = None, float("inf"), [], None
        name = self.factory.__name__
        for n, cfg in enumerate(cfgs, 1):
            try:
                kernel = self.factory.compile(*args, **kwargs, **cfg)
                if inputs is None:
                    inputs = Profiler(kernel, self.dims).inputs()
                ms = do_bench(lambda: kernel(*inputs), warmup=self.warmup, rep=self.rep).median_ms
            except (CompileError, ValueError, TypeError) as e:
                failures.append((cfg, f"{type(e).__name__}: {str(e).splitlines()[0]}"))
                ms = None
            if ms is not None and ms < best_ms:
                best, best_ms = (kernel, cfg), ms
            if self.verbose:
                shown = f"{ms:.3f} ms" if ms is not None else "failed"
                print(f"\rautotune {name}: {n}/{len(cfgs)} configs, this {shown}, best {best_ms:.3f} ms   ",
                      end="" if n < len(cfgs) else "\n", file=sys.stderr, flush=True)
        if best is None:
            detail = "\n".join(f"  {c}: {why}" for c, why in failures)
            raise CompileError(f"autotune {name}: every configuration failed", detail=detail)
        kernel, cfg = best
        kernel.config, kernel.latency = cfg, best_ms
        return kernel


def _shapes(x):
    """Arguments with tensors replaced by their shape and dtype (what a tuned choice depends on)."""
    if isinstance(x, dict):
        return {k: _shapes(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_shapes(v) for v in x)
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return ("tensor", tuple(x.shape), str(x.dtype))
    return x


def _read_choice(path: str, cfgs: list[dict]):
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("config") not in cfgs:
        return None  # stale or corrupt: tune again
    return data


def autotune(configs=None, warmup: int = 3, rep: int = 20, verbose: bool = True, dims: dict | None = None, **_ignored):
    """Decorator over a ``@tegula.jit`` factory: ``configs`` is a list of dicts (or a callable of the factory's
    fixed arguments returning one) of keyword arguments to try. The fastest is chosen by timing random inputs
    (``dims`` gives values for symbolic dims) and cached on disk."""
    if configs is None:
        raise ValueError("autotune: give configs=[{...}, ...]")

    def deco(factory):
        return AutoTuner(factory, configs, warmup=warmup, rep=rep, verbose=verbose, dims=dims)
    return deco


from tegula._callable import make_module_callable  # noqa: E402

make_module_callable(__name__, autotune)
