"""tegula.autotune over tegula.jit on the CPU: picks a configuration, caches it on disk, rejects bad use."""
import pytest
import torch

import tegula
import tegula.language as T
from tegula.jit import cache


def _factory_calls():
    calls = []

    @tegula.autotune(configs=[{"block": 8}, {"block": 16}, {"block": 5}], warmup=1, rep=2, verbose=False)
    @tegula.jit(out_idx=[-1], target="c")
    def scale(N, block=8):
        calls.append(block)
        if N % block:
            raise ValueError(f"block {block} does not divide {N}")  # a config that cannot be built

        @T.prim_func
        def main(A: T.Tensor((N,), "float32"), B: T.Tensor((N,), "float32")):
            with T.Kernel(N // block) as bx:
                for i in T.Parallel(block):
                    B[bx * block + i] = A[bx * block + i] * 2.0
        return main
    return scale, calls


def test_autotune_picks_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("TEGULA_CACHE_DIR", str(tmp_path))
    cache._MEMORY.clear()
    scale, calls = _factory_calls()
    k = scale(64)
    assert k.config in ({"block": 8}, {"block": 16}) and k.latency > 0
    a = torch.randn(64)
    assert torch.equal(k(a), a * 2)
    assert (tmp_path / "autotune").exists()
    # a new tuner (a new process, say) reads the choice instead of timing every config again
    scale2, calls2 = _factory_calls()
    k2 = scale2(64)
    assert k2.config == k.config and calls2 == [k.config["block"]]


def test_autotune_needs_a_jit_factory_and_configs():
    with pytest.raises(TypeError, match="tegula.jit"):
        tegula.autotune(configs=[{"a": 1}])(lambda n: n)
    with pytest.raises(ValueError, match="configs"):
        tegula.autotune()


def test_autotune_all_configs_failing_is_a_compile_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TEGULA_CACHE_DIR", str(tmp_path))
    scale, _ = _factory_calls()
    with pytest.raises(tegula.CompileError, match="every configuration failed"):
        scale(7)


def test_autotune_is_skipped_when_the_call_fixes_a_tuned_parameter(tmp_path, monkeypatch):
    # TileLang compiles the given configuration directly, without timing the others
    monkeypatch.setenv("TEGULA_CACHE_DIR", str(tmp_path))
    scale, calls = _factory_calls()
    k = scale(64, block=16)
    assert calls == [16]
    a = torch.randn(64)
    assert torch.equal(k(a), a * 2)
    scale(64, 8)  # positionally too
    assert calls == [16, 8]


def test_autotune_over_an_eager_function(tmp_path, monkeypatch):
    monkeypatch.setenv("TEGULA_CACHE_DIR", str(tmp_path))

    @tegula.autotune(configs=[{"block": 8}, {"block": 16}], warmup=1, rep=2, verbose=False)
    @tegula.jit(target="c")
    def double(A, block=8):
        N = T.const("N")
        A: T.Tensor((N,), "float32")
        B = T.empty((N,), "float32")
        with T.Kernel(T.ceildiv(N, block)) as bx:
            for i in T.Parallel(block):
                B[bx * block + i] = A[bx * block + i] * 2.0
        return B

    a = torch.randn(64)
    assert torch.equal(double(a), a * 2)  # tuned on the arguments' shapes, then run
    k = double.compile(N=64)
    assert k.config in ({"block": 8}, {"block": 16}) and torch.equal(k(a), a * 2)
    assert torch.equal(double.compile(a, block=16)(a), a * 2)  # a fixed parameter: no tuning
