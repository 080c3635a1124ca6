"""The compile cache: keys of text, atomic writes, corrupt entries rebuilt, concurrent builders, ISA in the key."""
import glob
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import tegula
import tegula.language as T
from tegula.jit import cache
from tegula.runtime import cpu

pytestmark = pytest.mark.skipif(not cpu.available()[0], reason="no C compiler")


def scale_kernel(N, factor):
    @T.prim_func
    def main(A: T.Tensor((N,), "float32"), B: T.Tensor((N,), "float32")):
        with T.Kernel(1):
            for i in T.Parallel(N):
                B[i] = A[i] * factor
    return main


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TEGULA_CACHE_DIR", str(tmp_path))
    cache._MEMORY.clear()
    yield tmp_path
    cache._MEMORY.clear()


def test_warm_compile_is_a_memory_hit(fresh_cache):
    f = scale_kernel(8, 2.0)
    k1 = tegula.compile(f, out_idx=[-1], target="c")
    k2 = tegula.compile(scale_kernel(8, 2.0), out_idx=[-1], target="c")
    assert k1 is k2  # same IR text -> same kernel object
    k3 = tegula.compile(scale_kernel(8, 3.0), out_idx=[-1], target="c")
    assert k3 is not k1
    np.testing.assert_array_equal(k3(np.ones(8, np.float32)), np.full(8, 3.0, np.float32))


def test_disk_entry_is_reused_and_corrupt_entry_rebuilt(fresh_cache):
    tegula.compile(scale_kernel(16, 2.0), out_idx=[-1], target="c")
    libs = glob.glob(os.path.join(str(fresh_cache), "kernels", "*", "*", "main.so"))
    assert len(libs) == 1
    mtime = os.path.getmtime(libs[0])
    cache._MEMORY.clear()
    tegula.compile(scale_kernel(16, 2.0), out_idx=[-1], target="c")
    assert os.path.getmtime(libs[0]) == mtime  # loaded from disk, not rebuilt
    with open(libs[0], "rb") as f:  # corrupt it (a new file: the old one is still mapped in this process)
        head = f.read(100)
    with open(libs[0] + ".bad", "wb") as f:
        f.write(head)
    os.replace(libs[0] + ".bad", libs[0])
    cache._MEMORY.clear()
    k = tegula.compile(scale_kernel(16, 2.0), out_idx=[-1], target="c")
    np.testing.assert_array_equal(k(np.ones(16, np.float32)), np.full(16, 2.0, np.float32))
    assert os.path.getsize(libs[0]) > 100


def test_key_includes_host_isa(fresh_cache, monkeypatch):
    f = scale_kernel(8, 5.0)
    tegula.compile(f, out_idx=[-1], target="c")
    cache._MEMORY.clear()
    monkeypatch.setattr(cpu, "host_isa", lambda: "another-machine")
    tegula.compile(f, out_idx=[-1], target="c")
    assert len(glob.glob(os.path.join(str(fresh_cache), "kernels", "*", "*", "main.so"))) == 2


def test_vector_width_follows_the_host_and_yields_to_tegula_cflags(monkeypatch):
    monkeypatch.setattr(cpu, "_host_flags", lambda: frozenset({"avx2", "avx512f", "avx512bw"}))
    assert "-mprefer-vector-width=512" in cpu.flags()
    monkeypatch.setattr(cpu, "_host_flags", lambda: frozenset({"avx2", "fma"}))
    assert not any(f.startswith("-mprefer-vector-width") for f in cpu.flags())
    monkeypatch.setattr(cpu, "_host_flags", lambda: frozenset({"avx512f"}))
    monkeypatch.setenv("TEGULA_CFLAGS", "-mprefer-vector-width=256")
    fl = cpu.flags()   # gcc and clang take the last of repeated -m options: the user's
    assert fl.index("-mprefer-vector-width=256") > fl.index("-mprefer-vector-width=512")


def test_block_move_width_only_where_the_compiler_takes_it(monkeypatch):
    monkeypatch.setattr(cpu, "_host_flags", lambda: frozenset({"avx2", "avx512f", "avx512bw"}))
    monkeypatch.setattr(cpu, "_accepts", lambda cc, opts: False)
    assert "-mmove-max=512" not in cpu.flags() and "-mprefer-vector-width=512" in cpu.flags()
    monkeypatch.setattr(cpu, "_accepts", lambda cc, opts: True)
    assert "-mmove-max=512" in cpu.flags() and "-mstore-max=512" in cpu.flags()
    monkeypatch.setattr(cpu, "_host_flags", lambda: frozenset({"avx2", "fma"}))
    assert "-mmove-max=512" not in cpu.flags()


def test_option_probe_rejects_what_the_compiler_does_not_know():
    cc = cpu.compiler()
    assert not cpu._accepts(cc, ("-mno-such-option-tegula",))
    assert cpu._accepts(cc, ("-O2",))


def test_changed_emitted_source_misses_the_disk_cache(fresh_cache, monkeypatch):
    # same IR text, toolchain and prelude, but the emitter now writes another source (a compiler change): the binary
    # built from the old source must not be loaded
    f = scale_kernel(8, 2.0)
    k = tegula.compile(f, out_idx=[-1], target="c")
    np.testing.assert_array_equal(k(np.ones(8, np.float32)), np.full(8, 2.0, np.float32))
    from tegula.codegen import c as cgen
    emit = cgen.emit_c

    def changed(func, symbols):  # what a changed emitter might write: the kernel now multiplies by 3
        src = emit(func, symbols)
        assert "0x1.0000000000000p+1f" in src  # 2.0f, printed exactly
        return src.replace("0x1.0000000000000p+1f", "0x1.8000000000000p+1f")

    monkeypatch.setattr(cgen, "emit_c", changed)
    cache._MEMORY.clear()
    k = tegula.compile(scale_kernel(8, 2.0), out_idx=[-1], target="c")
    np.testing.assert_array_equal(k(np.ones(8, np.float32)), np.full(8, 3.0, np.float32))
    assert len(glob.glob(os.path.join(str(fresh_cache), "kernels", "*", "*", "main.so"))) == 2
    monkeypatch.setattr(cgen, "emit_c", emit)  # and the unchanged source still hits its own entry
    cache._MEMORY.clear()
    k = tegula.compile(scale_kernel(8, 2.0), out_idx=[-1], target="c")
    np.testing.assert_array_equal(k(np.ones(8, np.float32)), np.full(8, 2.0, np.float32))
    assert len(glob.glob(os.path.join(str(fresh_cache), "kernels", "*", "*", "main.so"))) == 2


def gemm_kernel(n):
    @T.prim_func
    def main(A: T.Tensor((n, n), "float32"), B: T.Tensor((n, n), "float32"), C: T.Tensor((n, n), "float32")):
        with T.Kernel(1):
            A_s = T.alloc_shared((n, n), "float32")
            B_s = T.alloc_shared((n, n), "float32")
            C_l = T.alloc_fragment((n, n), "float32")
            T.copy(A, A_s)
            T.copy(B, B_s)
            T.gemm(A_s, B_s, C_l, clear_accum=True)
            T.copy(C_l, C)
    return main


def _gch(root):
    return glob.glob(os.path.join(str(root), "pch", "*", "tg_prelude.h.gch"))


def _check_gemm(n):
    a, b = np.random.rand(n, n).astype(np.float32), np.random.rand(n, n).astype(np.float32)
    np.testing.assert_allclose(tegula.compile(gemm_kernel(n), out_idx=[-1], target="c")(a, b), a @ b, rtol=1e-5)


@pytest.mark.skipif("clang" in cpu._compiler_info(cpu.compiler())[0].lower(), reason="the .gch is gcc's")
def test_gemm_kernels_share_one_precompiled_prelude(fresh_cache):
    _check_gemm(16)
    (gch,) = _gch(fresh_cache)
    mtime = os.path.getmtime(gch)
    _check_gemm(24)  # another GEMM kernel reuses it
    assert _gch(fresh_cache) == [gch] and os.path.getmtime(gch) == mtime
    tegula.compile(scale_kernel(8, 2.0), out_idx=[-1], target="c")  # no GEMM headers: none needed
    assert _gch(fresh_cache) == [gch]
    src = tegula.lower(gemm_kernel(16), target="c").kernel_source
    assert cpu.precompiled_header(src) == gch[:-4]
    assert cpu.precompiled_header(tegula.lower(scale_kernel(8, 2.0), target="c").kernel_source) is None


def test_unusable_or_unbuildable_precompiled_header_falls_back(fresh_cache):
    _check_gemm(16)
    for gch in _gch(fresh_cache):  # a .gch gcc cannot use: it reads the headers instead
        with open(gch, "wb") as f:
            f.write(b"not a precompiled header")
    _check_gemm(20)
    cache._MEMORY.clear()
    cpu._PCH_FAILED.clear()
    with open(os.path.join(str(fresh_cache), "pch2"), "w"):
        pass
    os.rename(os.path.join(str(fresh_cache), "pch"), os.path.join(str(fresh_cache), "pch.old"))
    os.rename(os.path.join(str(fresh_cache), "pch2"), os.path.join(str(fresh_cache), "pch"))  # a file: cannot build
    _check_gemm(28)
    assert cpu._PCH_FAILED
    cpu._PCH_FAILED.clear()


def test_two_processes_compiling_at_once_both_succeed(fresh_cache):
    script = textwrap.dedent("""
        import numpy as np, tegula, tegula.language as T
        def k(N):
            @T.prim_func
            def main(A: T.Tensor((N,), "float32"), B: T.Tensor((N,), "float32")):
                with T.Kernel(4) as bx:
                    for i in T.Parallel(N // 4):
                        B[bx * (N // 4) + i] = A[bx * (N // 4) + i] + 7.0
            return main
        kern = tegula.compile(k(64), out_idx=[-1], target="c")
        out = kern(np.zeros(64, np.float32))
        assert (out == 7.0).all()
        print("ok")
    """)
    path = fresh_cache / "race.py"
    path.write_text(script)
    env = dict(os.environ, TEGULA_CACHE_DIR=str(fresh_cache))
    procs = [subprocess.Popen([sys.executable, str(path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(3)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        assert out.strip() == "ok"
    assert not glob.glob(os.path.join(str(fresh_cache), "kernels", "*", "*", "*.tmp"))


def test_c_compiler_failure_is_attached_under_our_message(fresh_cache, monkeypatch):
    monkeypatch.setenv("TEGULA_CFLAGS", "-DTG_FORCE_ERROR -include /nonexistent/header.h")
    with pytest.raises(tegula.CompileError) as e:
        tegula.compile(scale_kernel(8, 11.0), out_idx=[-1], target="c")
    msg = str(e.value)
    assert "C compiler failed" in msg and "--- details ---" in msg and "nonexistent" in msg
    assert "test_cache.py" in msg  # points at the user's kernel


def test_missing_compiler_is_a_clear_error(fresh_cache, monkeypatch):
    monkeypatch.setenv("TEGULA_CC", "no-such-cc-xyz")
    with pytest.raises(tegula.CompileError, match="no-such-cc-xyz"):
        tegula.compile(scale_kernel(8, 13.0), out_idx=[-1], target="c")
