"""tegula: a hardware-neutral tile language and compiler for the operators of large MoE models.

``import tegula.language as T`` gives TileLang's surface; ``tegula.compile`` / ``tegula.jit`` build kernels for
a target (``c``: the CPU; ``interp``: the numpy reference). Importing tegula touches no compiler or device.
"""
from tegula.errors import CompileError

__version__ = "0.1.0"


def compile(func, out_idx=None, target=None, execution_backend=None, pass_configs=None, **options):  # noqa: A001
    """Compile a ``T.prim_func`` for ``target`` (default: TEGULA_TARGET, else the best usable one).

    ``out_idx`` (an int or a list; negative counts from the end) names the parameters the call allocates and
    returns. Returns a callable kernel taking torch tensors or numpy arrays.
    """
    from tegula.jit import compile_func
    return compile_func(func, out_idx=out_idx, target=target, options=options)


def lower(func, target=None, **options):
    """Run the compiler up to source text without building it: the result has ``.kernel_source``."""
    from tegula.jit import lower_func
    return lower_func(func, target=target, options=options)


def jit(fn=None, *, out_idx=None, target=None, **options):
    """``@tegula.jit(out_idx=...)`` on a factory: its arguments are compile-time parameters and it returns a
    ``T.prim_func``; calling the decorated factory returns the compiled kernel, cached per argument tuple."""
    from tegula.jit import jit as _jit
    return _jit(fn, out_idx=out_idx, target=target, **options)


def autotune(configs=None, warmup: int = 3, rep: int = 20, **kwargs):
    """``@tegula.autotune(configs=[{...}, ...])`` above ``@tegula.jit``: compile each configuration, time it on
    random inputs, keep the fastest; the choice is cached on disk per factory, arguments, target and host."""
    from tegula.autotune import autotune as _autotune
    return _autotune(configs=configs, warmup=warmup, rep=rep, **kwargs)


class _AnyKey(type):
    def __getattr__(cls, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return "tl." + name[3:].lower() if name.startswith("TL_") else name


class PassConfigKey(metaclass=_AnyKey):
    """TileLang's compiler-pass options (``pass_configs={tegula.PassConfigKey.TL_ENABLE_FAST_MATH: True}``):
    every key is accepted and ignored, since tegula's passes take no such options."""


def __getattr__(name):
    if name == "TensorSupplyType":  # lazily: these import the JIT
        from tegula.jit.profiler import TensorSupplyType
        return TensorSupplyType
    if name == "JITKernel":
        from tegula.jit.kernel import JITKernel
        return JITKernel
    raise AttributeError(f"module 'tegula' has no attribute {name!r}")


from tegula.math import cdiv, next_power_of_2  # noqa: E402

__all__ = ["autotune", "CompileError", "compile", "jit", "lower", "__version__", "PassConfigKey", "cdiv",
           "next_power_of_2"]
